"""Reading audio files: mono float32 at a requested sample rate, with clear errors.

All decoding goes through soundfile; resampling through torchaudio. Every failure (missing,
empty, truncated or undecodable file) becomes one ``AudioError`` that names the file, so a
bad file in a 3000-file dataset is found in seconds, not from a stack trace.
"""

from __future__ import annotations

import dataclasses
import logging
import struct
from collections.abc import Sequence
from pathlib import Path

import soundfile
import torch
import torchaudio

from data.errors import AudioError
from data.manifest import Utterance

logger = logging.getLogger(__name__)

_SKIP_HINT = "or set data.skip_bad_files=true to skip bad files"


def _bad_file(path: Path, problem: str) -> AudioError:
    what = f"Bad audio file {path}: {problem}"
    return AudioError(
        f"{what}. Fix: replace or remove the file and re-run data preparation, {_SKIP_HINT}.",
        problem=what,
    )


def _check_exists(path: Path) -> None:
    if path.is_dir():  # was reported as "Audio file not found", though it is there
        raise _bad_file(path, "it is a folder, not an audio file")
    if not path.is_file():
        what = f"Audio file not found: {path}"
        raise AudioError(
            f"{what}. Fix: re-run data preparation or check data.root if the data was moved, "
            f"{_SKIP_HINT}.",
            problem=what,
        )
    if path.stat().st_size == 0:
        raise _bad_file(path, "the file is empty (0 bytes)")


def _wav_truncation(path: Path) -> str | None:
    """Describe how a RIFF/WAVE file is truncated, or ``None`` if it is complete.

    libsndfile silently decodes the part of a truncated wav that is present, so a file cut
    off by an interrupted copy would train on a fragment; the data chunk's declared size
    reveals it. Non-wav formats are left to libsndfile.
    """
    size = path.stat().st_size
    with path.open("rb") as file:
        header = file.read(12)
        if len(header) < 12 or header[:4] != b"RIFF" or header[8:12] != b"WAVE":
            return None
        offset = 12
        while offset + 8 <= size:
            file.seek(offset)
            chunk_id, chunk_size = struct.unpack("<4sI", file.read(8))
            if chunk_id == b"data":
                # 0 and 0xFFFFFFFF mark streamed files whose length is unknown.
                if chunk_size in (0, 0xFFFFFFFF):
                    return None
                present = size - offset - 8
                if present < chunk_size:
                    return f"truncated: the data chunk holds {present} of {chunk_size} bytes"
                return None
            offset += 8 + chunk_size + (chunk_size & 1)
    return None


def audio_info(path: str | Path) -> tuple[int, int]:
    """Number of frames and sample rate of an audio file, read from its header.

    Args:
        path: the audio file.

    Returns:
        ``(frames, sample_rate)``.

    Raises:
        AudioError: if the file is missing, empty, truncated, not decodable or holds no
            samples; the message names the file.
    """
    path = Path(path)
    _check_exists(path)
    try:
        info = soundfile.info(str(path))
    except (soundfile.SoundFileError, RuntimeError) as err:
        raise _bad_file(path, f"cannot be decoded as audio ({err})") from None
    truncation = _wav_truncation(path)
    if truncation:
        raise _bad_file(path, truncation)
    if info.frames <= 0:
        raise _bad_file(path, "it holds no audio samples")
    return info.frames, info.samplerate


def load_audio(path: str | Path, sample_rate: int) -> torch.Tensor:
    """Load an audio file as mono float32 in [-1, 1] at ``sample_rate``.

    Multi-channel audio is averaged to mono; a file at another rate is resampled.

    Args:
        path: the audio file (any format libsndfile reads).
        sample_rate: the rate the caller's model expects, in Hz.

    Returns:
        1-D float32 tensor of samples.

    Raises:
        AudioError: if the file is missing, empty, truncated, not decodable or holds no
            samples; the message names the file.
    """
    path = Path(path)
    _check_exists(path)
    truncation = _wav_truncation(path)
    if truncation:
        raise _bad_file(path, truncation)
    try:
        samples, file_rate = soundfile.read(str(path), always_2d=True, dtype="float32")
    except (soundfile.SoundFileError, RuntimeError) as err:
        raise _bad_file(path, f"cannot be decoded as audio ({err})") from None
    if samples.shape[0] == 0:
        raise _bad_file(path, "it holds no audio samples")
    wav = torch.from_numpy(samples).mean(dim=1)
    if file_rate != sample_rate:
        wav = torchaudio.functional.resample(wav, orig_freq=file_rate, new_freq=sample_rate)
    return wav.contiguous()


def check_audio_files(
    utterances: Sequence[Utterance], skip_bad_files: bool
) -> tuple[list[Utterance], list[tuple[str, str]]]:
    """Validate the header of every utterance's audio file before training starts.

    A bad file found mid-epoch would crash a run hours in; reading headers up front costs
    a second for thousands of files. The headers also give each utterance's exact
    duration (frames / sample rate), which replaces the manifest's: the collate pads to
    the real sample count, so a rounded manifest duration (0.01 s) would put an utterance
    past its bucket's edge (a batch over the budget, one more padded shape to compile).

    Args:
        utterances: the utterances to check.
        skip_bad_files: if True, drop bad files and report them; if False, raise on the
            first bad file.

    Returns:
        ``(good_utterances, skipped)`` where ``good_utterances`` carry the durations read
        from their headers and ``skipped`` lists ``(path, reason)`` pairs.

    Raises:
        AudioError: on the first bad file when ``skip_bad_files`` is False.
    """
    good: list[Utterance] = []
    skipped: list[tuple[str, str]] = []
    differed = 0
    for utt in utterances:
        try:
            frames, sample_rate = audio_info(utt.path)
        except AudioError as err:
            if not skip_bad_files:
                raise
            skipped.append((utt.path, str(err)))
            continue
        duration = frames / sample_rate
        if abs(utt.duration - duration) > 1 / sample_rate:  # more than one sample off
            differed += 1
        good.append(dataclasses.replace(utt, duration=duration))
    if differed:
        logger.info(
            "%d of %d manifest durations differ from their audio files' headers by more than "
            "a sample (rounded?); the headers' exact durations are used.",
            differed,
            len(good),
        )
    return good, skipped
