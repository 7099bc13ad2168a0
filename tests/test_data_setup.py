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


def test_ascending_epochs_reach_the_training_sampler_only(fsdd_root, prepared_digits) -> None:
    """``data.ascending_epochs`` (SortaGrad) orders the training epochs; evaluation keeps
    its fixed order; the default (0) leaves every epoch random."""
    with _data(fsdd_root, prepared_digits, "data.ascending_epochs=1") as data:
        samplers = {name: getattr(data, name).batch_sampler for name in ("train", "valid", "test")}
        assert samplers["train"].ascending_epochs == 1
        assert {samplers["valid"].ascending_epochs, samplers["test"].ascending_epochs} == {0}
        train = samplers["train"]
        bucket_of = {i: b for b, bucket in enumerate(train._buckets()) for i in bucket}
        train.set_epoch(1)
        buckets = [bucket_of[batch[0]] for batch in train]
        assert buckets == sorted(buckets)  # the buckets in turn, shortest first
    with _data(fsdd_root, prepared_digits) as data:
        assert data.train.batch_sampler.ascending_epochs == 0
