"""Connected-digit generation: determinism, content, split hygiene and the re-run stamp."""

from __future__ import annotations

from pathlib import Path

import pytest
import soundfile

from data import connected_digits
from data.connected_digits import prepare_connected_digits
from data.errors import DataError
from data.fsdd import parse_fsdd_name
from data.manifest import read_manifest
from data.text import DIGIT_WORDS


def test_manifests_content(
    small_connected: dict[str, Path], small_num_utterances: dict[str, int]
) -> None:
    assert sorted(small_connected) == ["test", "train", "valid"]
    for split, path in small_connected.items():
        utts = read_manifest(path)
        assert len(utts) == small_num_utterances[split]
        for utt in utts:
            words = utt.transcript.split(" ")
            assert 2 <= len(words) <= 7 and set(words) <= set(DIGIT_WORDS)
            assert Path(utt.path).parent == path.parent / "wavs" / split
            info = soundfile.info(utt.path)
            assert info.samplerate == 8000 and info.subtype == "PCM_16"
            assert info.frames / info.samplerate == pytest.approx(utt.duration, abs=1e-9)


def test_deterministic_across_runs(
    fsdd_root: Path,
    small_connected: dict[str, Path],
    small_num_utterances: dict[str, int],
    tmp_path: Path,
) -> None:
    again = prepare_connected_digits(
        fsdd_root, tmp_path, num_utterances=small_num_utterances, download=False
    )
    for split, path in small_connected.items():
        assert again[split].read_text() == path.read_text()
    first = read_manifest(small_connected["test"])[0]
    rebuilt = read_manifest(again["test"])[0]
    assert Path(first.path).read_bytes() == Path(rebuilt.path).read_bytes()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_speaker_one_split(
    fsdd_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    loaded: list[str] = []
    real_load = connected_digits.load_audio

    def spy(path, sample_rate):
        loaded.append(str(path))
        return real_load(path, sample_rate)

    monkeypatch.setattr(connected_digits, "load_audio", spy)
    paths = prepare_connected_digits(
        fsdd_root, tmp_path, num_utterances={"test": 1}, seed=seed, download=False
    )
    assert sorted(paths) == ["test"]
    (utt,) = read_manifest(paths["test"])
    sources = [parse_fsdd_name(p) for p in loaded]
    assert {speaker for _, speaker, _ in sources} == {utt.speaker}
    assert {index for _, _, index in sources} <= set(range(5))
    # Sources are cached, so the distinct digits loaded are the distinct words said.
    assert {DIGIT_WORDS[digit] for digit, _, _ in sources} == set(utt.transcript.split())


def test_stamp_skips_rerun_and_changes_regenerate(
    fsdd_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = {"num_utterances": {"valid": 2}, "download": False}
    first = prepare_connected_digits(fsdd_root, tmp_path, **params)
    assert (tmp_path / ".done").is_file()

    def fail(*args, **kwargs):
        raise AssertionError("regenerated although the stamp matches")

    with monkeypatch.context() as patch:
        patch.setattr(connected_digits, "ensure_fsdd", fail)
        assert prepare_connected_digits(fsdd_root, tmp_path, **params) == first

    before = first["valid"].read_text()
    prepare_connected_digits(fsdd_root, tmp_path, seed=99, **params)
    assert first["valid"].read_text() != before
    assert len(list((tmp_path / "wavs" / "valid").glob("*.wav"))) == 2


def test_bad_parameters(fsdd_root: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="min_digits"):
        prepare_connected_digits(fsdd_root, tmp_path, min_digits=5, max_digits=2)
    with pytest.raises(DataError, match="unknown split"):
        prepare_connected_digits(fsdd_root, tmp_path, num_utterances={"dev": 3})
