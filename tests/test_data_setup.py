"""build_data's choice to hold audio files in memory (``data.cache_audio_mb``)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from data.fsdd import prepare_fsdd_digits
from data.manifest import read_manifest
from data.text import DIGIT_WORDS
from recipes.config import ConfigError, validate_config
from recipes.data_setup import build_data, load_utterances, shared_audio
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


def _write_manifest(path, wavs) -> None:
    """A manifest of FSDD files ``wavs`` (ids may repeat a file under another name)."""
    words = DIGIT_WORDS
    lines = ["id,path,duration,transcript,speaker"]
    for number, wav in enumerate(wavs):
        lines.append(f"u{number}_{wav.stem},{wav},0.5,{words[int(wav.name[0])]},theo")
    path.write_text("\n".join(lines) + "\n")


def test_test_audio_that_is_also_trained_on_is_warned_about(
    tmp_path, fsdd_recordings, caplog
) -> None:
    """A user's manifests whose test split holds training audio (or one file twice) gave
    test figures on audio the run had learned from, or counted twice, without a word."""
    wavs = sorted(fsdd_recordings.glob("*_theo_2*.wav"))[:8]
    splits = {"train": wavs[:4], "valid": wavs[4:6], "test": [wavs[6], wavs[7], wavs[7], wavs[1]]}
    manifests = {}
    for split, files in splits.items():
        manifests[split] = tmp_path / f"{split}.csv"
        _write_manifest(manifests[split], files)
    with caplog.at_level(logging.WARNING, logger="recipes.data_setup"):
        load_utterances(manifests, skip_bad_files=False)
    assert "1 audio file(s) of the test split are also in the train split" in caplog.text
    assert wavs[1].name in caplog.text
    assert "1 audio file(s) of the test split are listed twice in it" in caplog.text
    assert "valid split are also" not in caplog.text and "test split are also in the valid" not in (
        caplog.text
    )


def test_the_fsdd_splits_share_no_audio(fsdd_root, prepared_digits, tmp_path) -> None:
    """The official split (test: index 0-4, valid: 5-9, train: 10-49) and a held-out
    speaker's split, recomputed here from the file names, and disjoint."""
    for held_out in ([], ["lucas"]):
        paths = prepare_fsdd_digits(fsdd_root, tmp_path, download=False, test_speakers=held_out)
        utterances = {split: read_manifest(path) for split, path in paths.items()}
        assert shared_audio(utterances) == {}
        for split, utts in utterances.items():
            for utt in utts:
                _, speaker, index = Path(utt.path).stem.split("_")
                if held_out:
                    expected = (
                        "test" if speaker in held_out else "valid" if int(index) < 10 else "train"
                    )
                else:
                    expected = "test" if int(index) < 5 else "valid" if int(index) < 10 else "train"
                assert split == expected, utt.path
        sizes = {split: len(utts) for split, utts in utterances.items()}
        assert sizes == (
            {"train": 2400, "valid": 300, "test": 300}
            if not held_out
            else {"train": 2000, "valid": 500, "test": 500}
        )
