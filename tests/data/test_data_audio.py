"""Audio loading, resampling and bad-file errors."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from data.audio import audio_info, check_audio_files, load_audio
from data.dataset import PadToBuckets
from data.errors import AudioError
from data.fsdd import fsdd_utterances, split_fsdd
from data.manifest import Utterance, read_manifest, write_manifest
from data.sampler import DurationBatchSampler


def test_load_real_fsdd_file(fsdd_recordings: Path) -> None:
    path = fsdd_recordings / "7_jackson_32.wav"
    wav = load_audio(path, 8000)
    frames, rate = audio_info(path)
    assert rate == 8000
    assert wav.dtype == torch.float32 and wav.dim() == 1 and wav.numel() == frames
    assert wav.abs().max() <= 1.0 and wav.abs().max() > 0.01


def test_stereo_16k_is_downmixed_and_resampled(tmp_path: Path) -> None:
    t = np.arange(16000) / 16000
    left = 0.5 * np.sin(2 * np.pi * 440 * t)
    stereo = np.stack([left, np.zeros_like(left)], axis=1).astype(np.float32)
    path = tmp_path / "stereo16k.wav"
    soundfile.write(path, stereo, 16000, subtype="FLOAT")

    native = load_audio(path, 16000)
    assert native.shape == (16000,)
    torch.testing.assert_close(native, torch.from_numpy(left.astype(np.float32)) / 2)

    resampled = load_audio(path, 8000)
    assert resampled.shape == (8000,) and resampled.dtype == torch.float32
    assert audio_info(path) == (16000, 16000)


def _make_bad_file(kind: str, tmp_path: Path, real: Path) -> Path:
    path = tmp_path / f"{kind}.wav"
    if kind == "zero_byte":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("this is not audio\n")
    elif kind == "truncated_data":
        path.write_bytes(real.read_bytes()[:1000])
    elif kind == "truncated_header":
        path.write_bytes(real.read_bytes()[:30])
    elif kind == "no_samples":
        soundfile.write(path, np.zeros((0, 1), dtype=np.float32), 8000, subtype="PCM_16")
    elif kind != "missing":
        raise AssertionError(kind)
    return path


BAD_KINDS = ["missing", "zero_byte", "text", "truncated_data", "truncated_header", "no_samples"]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("reader", [audio_info, lambda p: load_audio(p, 8000)])
def test_bad_audio_raises_naming_file(
    kind: str, reader, tmp_path: Path, fsdd_recordings: Path
) -> None:
    path = _make_bad_file(kind, tmp_path, fsdd_recordings / "0_george_0.wav")
    with pytest.raises(AudioError, match="Fix:") as info:
        reader(path)
    assert str(path) in str(info.value)


def test_check_audio_files_skips_or_raises(tmp_path: Path, fsdd_recordings: Path) -> None:
    def utt(path: Path) -> Utterance:
        return Utterance(path.stem, str(path), 1.0, "zero", "george")

    good = [utt(fsdd_recordings / f"0_george_{i}.wav") for i in range(3)]
    bad = [
        utt(_make_bad_file(kind, tmp_path, fsdd_recordings / "0_george_0.wav"))
        for kind in ("text", "missing")
    ]
    kept, skipped = check_audio_files([*good, *bad], skip_bad_files=True)
    assert [u.path for u in kept] == [u.path for u in good]
    assert [path for path, _ in skipped] == [u.path for u in bad]
    assert all(reason for _, reason in skipped)

    with pytest.raises(AudioError, match="data.skip_bad_files=true") as info:
        check_audio_files([*good, *bad], skip_bad_files=False)
    assert bad[0].path in str(info.value)


def test_check_audio_files_uses_the_headers_exact_durations(
    fsdd_recordings: Path, caplog: pytest.LogCaptureFixture
) -> None:
    paths = [fsdd_recordings / f"3_theo_{i}.wav" for i in range(4)]
    exact = [frames / rate for frames, rate in map(audio_info, paths)]
    manifest = [round(exact[0], 2), round(exact[1], 2), exact[2], exact[3] + 0.5 / 8000]
    utts = [
        Utterance(p.stem, str(p), d, "three", "theo") for p, d in zip(paths, manifest, strict=True)
    ]
    with caplog.at_level(logging.INFO, logger="data.audio"):
        kept, _ = check_audio_files(utts, skip_bad_files=False)
    assert [u.duration for u in kept] == exact
    assert [(u.id, u.path, u.transcript, u.speaker) for u in kept] == [
        (u.id, u.path, u.transcript, u.speaker) for u in utts
    ]
    # the two rounded ones differ by more than a sample; half a sample is not counted
    [message] = [r.getMessage() for r in caplog.records if "manifest durations" in r.message]
    assert message.startswith("2 of 4 manifest durations differ")


def test_rounded_manifest_durations_keep_batches_in_budget_and_buckets(
    fsdd_recordings: Path, tmp_path: Path
) -> None:
    """A manifest with durations rounded to 0.01 s must not put utterances past their
    bucket's edge: the collate pads to the real sample count, so a batch would go over
    the budget and take a shape outside the buckets (another compile/CUDA-graph capture)."""
    train = split_fsdd(fsdd_utterances(fsdd_recordings))["train"]
    rounded = [
        Utterance(u.id, u.path, round(u.duration, 2), u.transcript, u.speaker) for u in train
    ]
    write_manifest(tmp_path / "train.csv", rounded)
    utts, _ = check_audio_files(read_manifest(tmp_path / "train.csv"), skip_bad_files=False)
    rate, budget = 8000, 30.0
    samples = [audio_info(u.path)[0] for u in utts]  # what load_audio gives at 8 kHz
    sampler = DurationBatchSampler(
        [u.duration for u in utts], budget, num_buckets=10, pad_to_buckets=True,
        pad_quantum=64 / rate, drop_last=True,
    )  # fmt: skip
    collate = PadToBuckets(sampler.bucket_edges(), rate)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        for batch in sampler:
            length = collate.length_for(max(samples[i] for i in batch))
            assert length in collate.edges
            assert len(batch) * length <= budget * rate
