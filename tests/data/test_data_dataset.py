"""AudioDataset, collate_audio and AudioBatch."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from data.connected_digits import ConnectedDigitsDataset
from data.dataset import AudioBatch, AudioDataset, PadToBuckets, collate_audio
from data.errors import DataError
from data.fsdd import FSDD_SPEAKERS
from data.manifest import Utterance
from data.sampler import DurationBatchSampler
from data.text import CharTokenizer


@pytest.fixture(params=["audio_files", "connected_digits"])
def dataset(request, fsdd_utts, small_connected_plans, small_bank) -> AudioDataset:
    """Both kinds give the same items: FSDD files named by utterances, connected digits."""
    if request.param == "audio_files":
        return AudioDataset(fsdd_utts[::150], 8000, CharTokenizer(), FSDD_SPEAKERS)
    return ConnectedDigitsDataset(
        small_connected_plans["train"], small_bank, CharTokenizer(), FSDD_SPEAKERS
    )


def test_item(dataset: AudioDataset) -> None:
    item = dataset[0]
    utt = dataset.utterances[0]
    assert item["id"] == utt.id and item["transcript"] == utt.transcript
    assert item["wav"].dtype == torch.float32 and item["wav"].numel() == round(utt.duration * 8000)
    assert CharTokenizer().decode(item["tokens"].tolist()) == utt.transcript
    assert FSDD_SPEAKERS[item["speaker"]] == utt.speaker
    assert dataset.durations == [u.duration for u in dataset.utterances]


def test_collate_shapes_and_padding(dataset: AudioDataset) -> None:
    items = [dataset[i] for i in range(4)]
    batch = collate_audio(items)
    assert len(batch) == 4 and batch.ids == [item["id"] for item in items]
    longest = max(item["wav"].numel() for item in items)
    assert batch.wavs.shape == (4, longest) and batch.wavs.dtype == torch.float32
    longest_tokens = max(item["tokens"].numel() for item in items)
    assert batch.tokens.shape == (4, longest_tokens) and batch.tokens.dtype == torch.int64
    for dtype_field in ("wav_lens", "token_lens", "speakers"):
        assert getattr(batch, dtype_field).dtype == torch.int64
    assert batch.durations.dtype == torch.float32
    for row, item in enumerate(items):
        n, m = item["wav"].numel(), item["tokens"].numel()
        assert batch.wav_lens[row] == n and batch.token_lens[row] == m
        torch.testing.assert_close(batch.wavs[row, :n], item["wav"])
        assert not batch.wavs[row, n:].any() and not batch.tokens[row, m:].any()
        assert torch.equal(batch.tokens[row, :m], item["tokens"])


def test_dataloader_with_sampler(dataset: AudioDataset) -> None:
    sampler = DurationBatchSampler(dataset.durations, max_batch_seconds=20.0, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_audio)
    batches = list(loader)
    assert len(batches) == len(sampler)
    assert sum(len(b) for b in batches) == len(dataset)
    moved = batches[0].to("cpu", non_blocking=True)
    assert isinstance(moved, AudioBatch) and torch.equal(moved.wavs, batches[0].wavs)


def test_bad_transcript_names_utterance(tmp_path: Path) -> None:
    utts = [Utterance("utt-42", str(tmp_path / "a.wav"), 1.0, "seven 7", "theo")]
    with pytest.raises(DataError, match="utt-42.*'7'"):
        AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)


def test_a_transcript_is_scored_as_it_is_trained_lower_case_single_spaces(fsdd_utts) -> None:
    """A manifest's "SEVEN" was trained as "seven" (the tokenizer lower-cases) but scored
    against "SEVEN": a model without an error scored CER 47 %, WER 100 %."""
    utt = fsdd_utts[0]
    utts = [
        Utterance("a", utt.path, utt.duration, "SEVEN", utt.speaker),
        Utterance("b", utt.path, utt.duration, " Seven  Two ", utt.speaker),
    ]
    dataset = AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)
    batch = collate_audio([dataset[0], dataset[1]])
    assert batch.transcripts == ["seven", "seven two"]
    tokenizer = CharTokenizer()
    trained = [
        tokenizer.decode(t[:n].tolist())
        for t, n in zip(batch.tokens, batch.token_lens, strict=True)
    ]
    assert trained == batch.transcripts


def test_unknown_speaker(tmp_path: Path) -> None:
    utts = [Utterance("utt-1", str(tmp_path / "a.wav"), 1.0, "one", "alice")]
    with pytest.raises(DataError, match="utt-1.*'alice'"):
        AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)


def test_defaults_without_tokenizer_or_speakers(tmp_path: Path) -> None:
    utts = [
        Utterance("a", str(tmp_path / "a.wav"), 1.0, "anything 123", "theo"),
        Utterance("b", str(tmp_path / "b.wav"), 1.0, "", "george"),
    ]
    data = AudioDataset(utts, 8000)
    assert data.speakers == ("george", "theo") and data.speaker_ids == [1, 0]
    assert data.tokens == [[], []]


# ------------------------------------------------------------ audio held in memory


def test_cached_audio_gives_the_same_items_without_reading_files(fsdd_utts, monkeypatch) -> None:
    """``cache_audio`` decodes once; items are then the same, and no file is read again."""
    utts = fsdd_utts[::100]
    from_files = AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)
    cached = AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)
    held = cached.cache_audio()
    assert cached.audio_cached and not from_files.audio_cached
    assert held == 4 * sum(round(u.duration * 8000) for u in utts)
    expected = [from_files[i] for i in range(len(utts))]

    def no_reading(*args, **kwargs):
        raise AssertionError("a cached dataset read a file")

    monkeypatch.setattr("data.dataset.load_audio", no_reading)
    for index, item in enumerate(expected):
        got = cached[index]
        assert torch.equal(got["wav"], item["wav"]) and got["id"] == item["id"]
    got = cached[0]["wav"]
    got.zero_()  # a caller's changes never reach the cache
    assert torch.equal(cached[0]["wav"], expected[0]["wav"])


def test_forked_workers_serve_the_cached_audio(fsdd_utts) -> None:
    """Workers (forked after the cache was filled) give the batches the files give."""
    utts = fsdd_utts[::60]
    from_files = AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)
    cached = AudioDataset(utts, 8000, CharTokenizer(), FSDD_SPEAKERS)
    cached.cache_audio()

    def batches(dataset: AudioDataset, workers: int) -> list[AudioBatch]:
        sampler = DurationBatchSampler(dataset.durations, max_batch_seconds=4, seed=3)
        loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_audio, num_workers=workers
        )
        return list(loader)

    for a, b in zip(batches(from_files, 0), batches(cached, 2), strict=True):
        assert a.ids == b.ids and torch.equal(a.wavs, b.wavs)


def test_pad_to_buckets_warns_once_about_items_past_the_last_edge(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An item longer than the last edge (its duration understated the audio) gets a batch
    shape of its own: another compile/capture, which must not go unnoticed."""
    collate = PadToBuckets([0.5, 1.0], sample_rate=8000)
    with caplog.at_level(logging.WARNING, logger="data.dataset"):
        assert collate.length_for(8000) == 8000
        assert not caplog.records  # at the edge: no warning
        assert collate.length_for(8100) == 8100
        assert collate.length_for(9000) == 9000
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "8100 samples is longer than the last bucket edge (8000 samples)" in record.getMessage()
