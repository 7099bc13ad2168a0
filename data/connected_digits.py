"""Connected-digit utterances ("three one four") built on the fly from FSDD recordings.

Each utterance joins 2-7 recordings of one speaker from one FSDD split with short random
silences, so the test set only ever contains test recordings (no leakage) and the task
needs a sequence model (CTC), not a classifier.

Preparation writes no audio: per split it writes a *plan*, ``{split}.plan.jsonl``, one line
per utterance with its id, the source recording ids in order, the silence lengths in
samples, the transcript, the speaker and the exact length. ``ConnectedDigitsDataset``
builds each waveform when it is asked for it, from the source recordings held once in
memory (``RecordingBank``: all 3000 recordings are ~25 MB as int16). Tens of hours of
utterances thus cost a few megabytes of plan and seconds of preparation, where writing
them as wavs took gigabytes and minutes.

Generation is seeded and deterministic: the same parameters give the same plans and the
same audio on every host, run and DataLoader worker. The plans of one parameter set live
in their own folder, named after a hash of the parameters, where a ``.done`` stamp makes
re-runs free.

The audio is quantised to 16 bits in memory exactly as the wav files of generator
version 1 were: by libsndfile's own float-to-PCM_16 conversion (through soundfile), so an
utterance is bit-for-bit the audio those files held. At FSDD's 8 kHz (no resampling) the
samples are FSDD's own 16-bit samples (with the libsndfile 1.2 that soundfile bundles); at
other rates they are the resampled recordings as a 16-bit wav of them holds them.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import soundfile
import torch

from amp_utils.atomic import atomic_write_text
from data.audio import audio_info, load_audio
from data.dataset import AudioDataset
from data.errors import AudioError, DataError
from data.fsdd import (
    FSDD_VERSION,
    ensure_fsdd,
    find_fsdd_recordings,
    fsdd_utterances,
    split_fsdd,
)
from data.manifest import Utterance
from data.text import CharTokenizer

#: Default number of utterances per split.
DEFAULT_NUM_UTTERANCES: Mapping[str, int] = MappingProxyType(
    {"train": 2400, "valid": 200, "test": 300}
)
#: Bump when the generated data changes, so old stamps no longer match.
#: 1: wav files and CSV manifests. 2: plans, audio built on the fly; the same utterances
#: and audio as 1 (same random draws), but a version-1 folder must be converted.
GENERATOR_VERSION = 2
SPLITS = ("train", "valid", "test")
PLAN_SUFFIX = ".plan.jsonl"
#: Hex digits of the parameters' hash in the name of their plans' folder (``plans-<hash>``).
PLAN_DIR_HASH_CHARS = 16
#: Full scale of 16-bit audio: samples are ``int16 / 32768`` as float32 (libsndfile's reading).
_PCM16_SCALE = 32768.0


@dataclass(frozen=True)
class ConnectedUtterance:
    """One connected-digit utterance as a plan: how to build its audio, and its labels.

    The audio is ``sources[0]``, ``silences[0]`` zero samples, ``sources[1]``, ... .

    Attributes:
        id: unique name, ``{split}_{number:05d}_{speaker}``.
        sources: FSDD recording ids (file stems such as ``"3_theo_12"``), in spoken order.
        silences: zero samples between consecutive sources (``len(sources) - 1`` values).
        num_samples: length of the audio at the plan's sample rate.
        duration: ``num_samples / sample_rate`` in seconds.
        transcript: the digits' words (``"three one four"``).
        speaker: the speaker of every source.
    """

    id: str
    sources: tuple[str, ...]
    silences: tuple[int, ...]
    num_samples: int
    duration: float
    transcript: str
    speaker: str


def plan_sources(utterances: Iterable[ConnectedUtterance]) -> list[str]:
    """The distinct source recording ids of ``utterances``, sorted."""
    return sorted({source for utt in utterances for source in utt.sources})


def quantize_pcm16(wav: np.ndarray) -> np.ndarray:
    """Float audio in [-1, 1] to int16 exactly as a 16-bit wav written by soundfile holds it.

    The conversion is libsndfile's (measured with 1.2.2: ``floor(x * 32768)``, clipped to
    the int16 range; other releases may differ): writing an in-memory RAW file with it,
    rather than our own arithmetic, keeps the samples identical to the wav files the
    generator used to write, and FSDD's own 16-bit samples unchanged.
    """
    buffer = io.BytesIO()
    samples = np.ascontiguousarray(wav, dtype=np.float32)
    # The sample rate is required by the RAW format but plays no part in the conversion.
    soundfile.write(buffer, samples, 8000, format="RAW", subtype="PCM_16", endian="LITTLE")
    return np.frombuffer(buffer.getvalue(), dtype="<i2").astype(np.int16)


class RecordingBank:
    """Source recordings held in memory as 16-bit samples at one sample rate.

    All samples live in one int16 tensor (one storage: forked DataLoader workers share it
    copy-on-write, and it pickles as one block), indexed by recording id.

    Args:
        samples: 1-D int16 tensor, the recordings one after another.
        spans: ``recording id -> (start, length)`` in ``samples``.
        sample_rate: rate of the samples in Hz.
    """

    def __init__(
        self, samples: torch.Tensor, spans: Mapping[str, tuple[int, int]], sample_rate: int
    ) -> None:
        self.samples = samples
        self.spans = dict(spans)
        self.sample_rate = sample_rate

    @classmethod
    def load(
        cls, recordings_dir: str | Path, recording_ids: Iterable[str], sample_rate: int
    ) -> RecordingBank:
        """Read the recordings ``{id}.wav`` of ``recordings_dir`` once, at ``sample_rate``.

        Each recording is resampled if needed, clipped to [-1, 1] and quantised to 16 bits
        (``quantize_pcm16``).

        Raises:
            AudioError: if a recording is missing or unreadable; the message names it.
        """
        recordings_dir = Path(recordings_dir)
        spans: dict[str, tuple[int, int]] = {}
        pieces: list[torch.Tensor] = []
        start = 0
        for recording_id in sorted(set(recording_ids)):
            wav = load_audio(recordings_dir / f"{recording_id}.wav", sample_rate)
            spans[recording_id] = (start, wav.numel())
            start += wav.numel()
            pieces.append(wav.clamp(-1.0, 1.0))
        joined = torch.cat(pieces).numpy() if pieces else np.zeros(0, np.float32)
        return cls(torch.from_numpy(quantize_pcm16(joined)), spans, sample_rate)

    def __contains__(self, recording_id: object) -> bool:
        return recording_id in self.spans

    def length(self, recording_id: str) -> int:
        """Samples of one recording."""
        return self.spans[recording_id][1]

    def planned_length(self, utt: ConnectedUtterance) -> int:
        """Samples of ``utt``'s audio built from these recordings."""
        return sum(self.length(source) for source in utt.sources) + sum(utt.silences)

    def render(self, utt: ConnectedUtterance) -> torch.Tensor:
        """The audio of ``utt``: 1-D float32 ``int16 / 32768``, as a 16-bit wav reads."""
        # numpy: small copies without torch's per-op overhead (no thread pool involved).
        samples = self.samples.numpy()
        out = np.zeros(utt.num_samples, dtype=np.int16)
        position = 0
        for number, source in enumerate(utt.sources):
            if number:
                position += utt.silences[number - 1]
            start, length = self.spans[source]
            out[position : position + length] = samples[start : start + length]
            position += length
        wav = out.astype(np.float32)
        wav *= np.float32(1.0 / _PCM16_SCALE)  # a power of two: exact
        return torch.from_numpy(wav)


class ConnectedDigitsDataset(AudioDataset):
    """``AudioDataset`` over connected-digit plans: the same items, audio built in memory.

    Args:
        utterances: the plans (e.g. from ``read_plan``).
        bank: the source recordings, at the rate the plans were made for.
        tokenizer: encodes transcripts; ``None`` gives empty token tensors.
        speakers: speaker names in index order (see ``AudioDataset``).

    Raises:
        DataError: if a plan names a recording missing from ``bank`` or its length does not
            match the recordings (a plan made for another sample rate or FSDD copy).
    """

    def __init__(
        self,
        utterances: Sequence[ConnectedUtterance],
        bank: RecordingBank,
        tokenizer: CharTokenizer | None = None,
        speakers: Sequence[str] | None = None,
    ) -> None:
        for utt in utterances:  # checked here, not in a DataLoader worker mid-epoch
            missing = [source for source in utt.sources if source not in bank]
            if missing or bank.planned_length(utt) != utt.num_samples:
                problem = (
                    f"names recordings {missing} that are not loaded"
                    if missing
                    else f"has {utt.num_samples} samples but its recordings give "
                    f"{bank.planned_length(utt)} at {bank.sample_rate} Hz"
                )
                raise DataError(
                    f"Connected-digit utterance {utt.id!r} {problem}. Fix: delete the prepared "
                    "folder (data.prepared_dir) and re-run to prepare the plans again."
                )
        super().__init__(utterances, bank.sample_rate, tokenizer, speakers)
        self.bank = bank

    def load_wav(self, index: int) -> torch.Tensor:
        """The audio of utterance ``index``, built from the in-memory recordings."""
        return self.bank.render(self.utterances[index])


def _check_params(
    num_utterances: Mapping[str, int],
    min_digits: int,
    max_digits: int,
    silence_seconds: tuple[float, float],
    sample_rate: int,
) -> None:
    unknown = sorted(set(num_utterances) - set(SPLITS))
    if unknown:
        raise DataError(
            f"num_utterances has unknown split(s) {unknown}. Fix: use only {list(SPLITS)}, "
            'e.g. {"train": 2400, "valid": 200, "test": 300}.'
        )
    if any(int(n) < 0 for n in num_utterances.values()):
        raise DataError(
            f"num_utterances must not be negative, got {dict(num_utterances)}. "
            "Fix: give a count >= 0 per split."
        )
    if not 1 <= min_digits <= max_digits:
        raise DataError(
            f"Need 1 <= min_digits <= max_digits, got min_digits={min_digits}, "
            f"max_digits={max_digits}. Fix: e.g. min_digits=2 max_digits=7."
        )
    if len(silence_seconds) != 2 or not 0 <= silence_seconds[0] <= silence_seconds[1]:
        raise DataError(
            f"silence_seconds must be (min, max) with 0 <= min <= max, got "
            f"{silence_seconds}. Fix: e.g. silence_seconds=[0.05,0.25]."
        )
    if sample_rate <= 0:
        raise DataError(f"sample_rate must be positive, got {sample_rate}. Fix: e.g. 8000.")


def _remove_flat_layout(out_dir: Path) -> None:
    """Delete what earlier generators left in ``out_dir`` itself: version 1's wavs
    (gigabytes at scale) and manifests, and the plans and stamp that version 2 wrote there
    before plans had a subfolder per parameter set."""
    shutil.rmtree(out_dir / "wavs", ignore_errors=True)
    (out_dir / ".done").unlink(missing_ok=True)
    for split in SPLITS:
        (out_dir / f"{split}.csv").unlink(missing_ok=True)
        (out_dir / f"{split}{PLAN_SUFFIX}").unlink(missing_ok=True)


def _params_hash(params: dict) -> str:
    text = json.dumps(params, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _plan_split(
    split: str,
    recordings: Sequence[Utterance],
    count: int,
    min_digits: int,
    max_digits: int,
    silence_seconds: tuple[float, float],
    seed: int,
    bank: RecordingBank,
) -> list[ConnectedUtterance]:
    by_speaker: dict[str, list[str]] = {}
    words: dict[str, str] = {}
    for utt in sorted(recordings, key=lambda u: u.id):
        by_speaker.setdefault(utt.speaker, []).append(utt.id)
        words[utt.id] = utt.transcript  # a recording's transcript is its digit's word
    speakers = sorted(by_speaker)
    if count and not speakers:
        raise DataError(f"FSDD split {split!r} has no recordings. Fix: check data.root.")
    # A string seed is hashed with sha512 by random.Random: stable across runs and hosts.
    # The draws (speaker, count, recordings, then silences) are those of version 1.
    rng = random.Random(f"{seed}-{split}")
    utterances = []
    for number in range(count):
        speaker = rng.choice(speakers)
        pool = by_speaker[speaker]
        num_digits = rng.randint(min_digits, max_digits)
        sources = tuple(rng.choice(pool) for _ in range(num_digits))
        silences = tuple(
            round(rng.uniform(*silence_seconds) * bank.sample_rate) for _ in sources[1:]
        )
        num_samples = sum(bank.length(source) for source in sources) + sum(silences)
        utterances.append(
            ConnectedUtterance(
                id=f"{split}_{number:05d}_{speaker}",
                sources=sources,
                silences=silences,
                num_samples=num_samples,
                duration=num_samples / bank.sample_rate,
                transcript=" ".join(words[source] for source in sources),
                speaker=speaker,
            )
        )
    return utterances


def write_plan(path: str | Path, utterances: Iterable[ConnectedUtterance]) -> None:
    """Write plans as JSON Lines, one utterance per line, atomically."""
    names = [f.name for f in fields(ConnectedUtterance)]
    lines = (
        json.dumps({name: getattr(utt, name) for name in names}, separators=(",", ":")) + "\n"
        for utt in utterances
    )
    atomic_write_text(Path(path), "".join(lines))


def read_plan(path: str | Path) -> list[ConnectedUtterance]:
    """Read a plan written by ``prepare_connected_digits``.

    Raises:
        DataError: if the file is missing or a line is not a valid plan; names the line.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(
            f"Connected-digit plan not found: {path}. Fix: re-run data preparation "
            "(recipes/train.py data=fsdd_connected prepares it)."
        )
    utterances = []
    for line_num, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            row: dict[str, Any] = json.loads(line)
            utt = ConnectedUtterance(
                id=str(row["id"]),
                sources=tuple(str(s) for s in row["sources"]),
                silences=tuple(int(s) for s in row["silences"]),
                num_samples=int(row["num_samples"]),
                duration=float(row["duration"]),
                transcript=str(row["transcript"]),
                speaker=str(row["speaker"]),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(
                f"Connected-digit plan {path}, line {line_num}: not a valid plan ({err!r}). "
                "Fix: delete the prepared folder (data.prepared_dir) and re-run."
            ) from None
        if len(utt.silences) != max(len(utt.sources) - 1, 0) or not utt.sources:
            raise DataError(
                f"Connected-digit plan {path}, line {line_num}: {len(utt.sources)} sources "
                f"need {max(len(utt.sources) - 1, 0)} silences, got {len(utt.silences)}. "
                "Fix: delete the prepared folder (data.prepared_dir) and re-run."
            )
        utterances.append(utt)
    return utterances


def check_sources(
    splits: Mapping[str, Sequence[ConnectedUtterance]],
    recordings_dir: str | Path,
    skip_bad_files: bool,
) -> tuple[dict[str, list[ConnectedUtterance]], list[tuple[str, str]]]:
    """Check the header of every source recording the plans use, before training starts.

    Args:
        splits: plans per split.
        recordings_dir: FSDD's recordings folder.
        skip_bad_files: drop the utterances that use a bad recording and report the
            recording, instead of raising.

    Returns:
        ``(plans per split without the dropped ones, [(path, reason), ...])``.

    Raises:
        AudioError: on the first bad recording when ``skip_bad_files`` is False.
    """
    bad: dict[str, tuple[str, str]] = {}
    for source in plan_sources(utt for plans in splits.values() for utt in plans):
        path = Path(recordings_dir) / f"{source}.wav"
        try:
            audio_info(path)
        except AudioError as err:
            if not skip_bad_files:
                raise
            bad[source] = (str(path), str(err))
    kept = {
        split: [utt for utt in plans if not bad.keys() & set(utt.sources)]
        for split, plans in splits.items()
    }
    return kept, list(bad.values())


def prepare_connected_digits(
    root: str | Path,
    out_dir: str | Path,
    num_utterances: Mapping[str, int] = DEFAULT_NUM_UTTERANCES,
    min_digits: int = 2,
    max_digits: int = 7,
    silence_seconds: tuple[float, float] = (0.05, 0.25),
    seed: int = 1234,
    sample_rate: int = 8000,
    download: bool = True,
) -> dict[str, Path]:
    """Plan connected-digit utterances: write ``{split}.plan.jsonl`` files, no audio.

    Every utterance joins ``min_digits``-``max_digits`` recordings of a single speaker,
    drawn from the same FSDD split (see ``split_fsdd``), separated by silences of a random
    length in ``silence_seconds``. ``ConnectedDigitsDataset`` builds the audio from a plan.

    The plans go to a subfolder of ``out_dir`` named after a hash of the parameters
    (``plans-<hash>``, with a ``params.json`` saying what they are), so runs with other
    parameters (a sweep's points running at once, or a later run) never delete or replace
    the plans another run reads. Safe to re-run and to run at once with the same
    parameters: if the subfolder's ``.done`` stamp is there, nothing is regenerated; else
    the same bytes are rewritten atomically and the stamp is written last, so an
    interrupted run is redone. Wavs, manifests and plans that generator version 1 and the
    flat layout of version 2 left in ``out_dir`` itself are deleted.

    Args:
        root: where FSDD is or should be downloaded to (see ``ensure_fsdd``).
        out_dir: output folder (the plans go to a subfolder per parameter set).
        num_utterances: utterances per split; splits left out or set to 0 get no plan.
        min_digits: fewest recordings per utterance.
        max_digits: most recordings per utterance.
        silence_seconds: ``(min, max)`` length of the silence between recordings.
        seed: seed of the generator; the same seed gives the same data.
        sample_rate: sample rate of the audio the plans describe.
        download: allow downloading FSDD if it is not under ``root``.

    Returns:
        Plan path per split.
    """
    num_utterances = {split: int(n) for split, n in dict(num_utterances).items()}
    silence_seconds = (float(silence_seconds[0]), float(silence_seconds[1]))
    _check_params(num_utterances, min_digits, max_digits, silence_seconds, sample_rate)
    params = {
        "fsdd_version": FSDD_VERSION,
        "generator_version": GENERATOR_VERSION,
        "num_utterances": num_utterances,
        "min_digits": min_digits,
        "max_digits": max_digits,
        "silence_seconds": list(silence_seconds),
        "seed": seed,
        "sample_rate": sample_rate,
    }
    params_hash = _params_hash(params)
    plan_dir = Path(out_dir).absolute() / f"plans-{params_hash[:PLAN_DIR_HASH_CHARS]}"
    paths = {
        split: plan_dir / f"{split}{PLAN_SUFFIX}"
        for split in SPLITS
        if num_utterances.get(split, 0) > 0
    }

    stamp = plan_dir / ".done"
    if (
        stamp.is_file()
        and stamp.read_text(encoding="utf-8").strip() == params_hash
        and all(path.is_file() for path in paths.values())
        and find_fsdd_recordings(root) is not None  # the plans' audio is still there
    ):
        return paths

    recordings = ensure_fsdd(root, download=download)
    _remove_flat_layout(plan_dir.parent)
    plan_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(plan_dir / "params.json", json.dumps(params, indent=2) + "\n")
    splits = split_fsdd(fsdd_utterances(recordings))
    used = [utt.id for split in paths for utt in splits[split]]
    bank = RecordingBank.load(recordings, used, sample_rate)  # exact lengths at sample_rate
    for split, path in paths.items():
        plans = _plan_split(
            split,
            splits[split],
            num_utterances[split],
            min_digits,
            max_digits,
            silence_seconds,
            seed,
            bank,
        )
        write_plan(path, plans)
    atomic_write_text(stamp, params_hash + "\n")
    return paths


def load_connected_digits(
    plan_paths: Mapping[str, Path], root: str | Path, skip_bad_files: bool
) -> tuple[dict[str, list[ConnectedUtterance]], list[tuple[str, str]], Path]:
    """Read the plans and check their source recordings (what runs before training).

    Args:
        plan_paths: plan per split, from ``prepare_connected_digits``.
        root: FSDD's folder (``data.root``); must already hold the recordings.
        skip_bad_files: see ``check_sources``.

    Returns:
        ``(plans per split, skipped (path, reason) pairs, recordings folder)``.

    Raises:
        DataError: if a split has no plan or no utterance left.
    """
    recordings = ensure_fsdd(root, download=False)
    splits = {}
    for split in SPLITS:
        if split not in plan_paths:
            raise DataError(
                f"Connected digits need utterances in every split; the {split} split has "
                f"none. Fix: set data.num_{split} to 1 or more."
            )
        splits[split] = read_plan(plan_paths[split])
    kept, skipped = check_sources(splits, recordings, skip_bad_files)
    for split, plans in kept.items():
        if not plans:
            raise DataError(
                f"No connected-digit utterance of the {split} split is left: all use bad "
                f"recordings ({len(skipped)} bad). Fix the recordings under {recordings}."
            )
    return kept, skipped, recordings
