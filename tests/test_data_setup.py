"""build_data's choice to hold audio files in memory (``data.cache_audio_mb``)."""

from __future__ import annotations

import logging

import pytest
import torch

from data.fsdd import prepare_fsdd_digits
from recipes.config import ConfigError, validate_config
from recipes.data_setup import build_data
from tests.recipe_helpers import compose_config


@pytest.fixture(scope="module")
def prepared_digits(fsdd_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared_digits")
    prepare_fsdd_digits(fsdd_root, out, download=False)
    return out


def _data(fsdd_root, prepared_digits, *extra: str):
    cfg = compose_config(
        [f"data.root={fsdd_root}", f"data.prepared_dir={prepared_digits}", "device=cpu", *extra]
    )
    return build_data(cfg, torch.device("cpu"))


def _cached(data) -> set[bool]:
    return {loader.dataset.audio_cached for loader in (data.train, data.valid, data.test)}


def test_fsdd_audio_is_held_in_memory_by_default(fsdd_root, prepared_digits, caplog) -> None:
    """FSDD's 3,000 recordings come to ~40 MiB, well under the default 1024."""
    with caplog.at_level(logging.INFO, logger="recipes.data_setup"):
        data = _data(fsdd_root, prepared_digits)
    assert _cached(data) == {True}
    assert "Audio of 3000 utterances held in memory" in caplog.text


@pytest.mark.parametrize(("limit", "says"), [("10", "more than data.cache_audio_mb=10"), ("0", "")])
def test_audio_over_the_limit_or_at_0_is_read_from_files(
    fsdd_root, prepared_digits, caplog, limit, says
) -> None:
    with caplog.at_level(logging.INFO, logger="recipes.data_setup"):
        data = _data(fsdd_root, prepared_digits, f"data.cache_audio_mb={limit}")
    assert _cached(data) == {False}
    assert "held in memory" not in caplog.text and says in caplog.text


def test_a_negative_cache_size_is_a_config_error() -> None:
    cfg = compose_config(["data.cache_audio_mb=-1"])
    with pytest.raises(ConfigError, match=r"data.cache_audio_mb=-1(\.0)? is not valid.*>= 0"):
        validate_config(cfg)
