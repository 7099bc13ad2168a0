"""Connected-digit utterances ("three one four") built by joining FSDD recordings.

Each utterance joins 2-7 recordings of one speaker from one FSDD split with short random
silences, so the test set only ever contains test recordings (no leakage) and the task
needs a sequence model (CTC), not a classifier. Generation is seeded and deterministic;
a ``.done`` stamp holding a hash of the parameters makes re-runs free.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import soundfile
import torch

from amp_utils.atomic import atomic_path, atomic_write_text
from data.audio import load_audio
from data.errors import DataError
from data.fsdd import FSDD_VERSION, ensure_fsdd, fsdd_utterances, parse_fsdd_name, split_fsdd
from data.manifest import Utterance, write_manifest
from data.text import DIGIT_WORDS

#: Default number of utterances per split.
DEFAULT_NUM_UTTERANCES: Mapping[str, int] = MappingProxyType(
    {"train": 2400, "valid": 200, "test": 300}
)
#: Bump when the generation algorithm changes, so old stamps no longer match.
GENERATOR_VERSION = 1
SPLITS = ("train", "valid", "test")


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


def _params_hash(params: dict) -> str:
    text = json.dumps(params, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _build_split(
    split: str,
    recordings: Sequence[Utterance],
    count: int,
    out_dir: Path,
    min_digits: int,
    max_digits: int,
    silence_seconds: tuple[float, float],
    seed: int,
    sample_rate: int,
    cache: dict[str, torch.Tensor],
) -> list[Utterance]:
    by_speaker: dict[str, list[Utterance]] = {}
    for utt in sorted(recordings, key=lambda u: u.id):
        by_speaker.setdefault(utt.speaker, []).append(utt)
    speakers = sorted(by_speaker)
    if count and not speakers:
        raise DataError(f"FSDD split {split!r} has no recordings. Fix: check data.root.")
    # A string seed is hashed with sha512 by random.Random: stable across runs and hosts.
    rng = random.Random(f"{seed}-{split}")
    wav_dir = out_dir / "wavs" / split
    utterances = []
    for number in range(count):
        speaker = rng.choice(speakers)
        pool = by_speaker[speaker]
        num_digits = rng.randint(min_digits, max_digits)
        parts = [rng.choice(pool) for _ in range(num_digits)]
        pieces = []
        for position, part in enumerate(parts):
            if position:
                silence = round(rng.uniform(*silence_seconds) * sample_rate)
                pieces.append(torch.zeros(silence))
            if part.path not in cache:
                cache[part.path] = load_audio(part.path, sample_rate)
            pieces.append(cache[part.path])
        wav = torch.cat(pieces).clamp(-1.0, 1.0)
        utt_id = f"{split}_{number:05d}_{speaker}"
        path = wav_dir / f"{utt_id}.wav"
        with atomic_path(path) as tmp:
            soundfile.write(str(tmp), wav.numpy(), sample_rate, subtype="PCM_16", format="WAV")
        transcript = " ".join(DIGIT_WORDS[parse_fsdd_name(p.path)[0]] for p in parts)
        utterances.append(
            Utterance(
                id=utt_id,
                path=str(path.absolute()),
                duration=wav.numel() / sample_rate,
                transcript=transcript,
                speaker=speaker,
            )
        )
    return utterances


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
    """Generate connected-digit wavs and ``{train,valid,test}.csv`` manifests.

    Every utterance joins ``min_digits``-``max_digits`` recordings of a single speaker,
    drawn from the same FSDD split (see ``split_fsdd``), separated by silences of a random
    length in ``silence_seconds``. Wavs are 16-bit files under ``out_dir/wavs/{split}/``.

    Safe to re-run: if ``out_dir/.done`` holds the hash of the same parameters, nothing is
    regenerated. The stamp is written last, so an interrupted run is redone.

    Args:
        root: where FSDD is or should be downloaded to (see ``ensure_fsdd``).
        out_dir: output folder (wavs, manifests, stamp).
        num_utterances: utterances per split; splits left out or set to 0 get no manifest.
        min_digits: fewest recordings per utterance.
        max_digits: most recordings per utterance.
        silence_seconds: ``(min, max)`` length of the silence between recordings.
        seed: seed of the generator; the same seed gives the same data.
        sample_rate: sample rate of the written wavs.
        download: allow downloading FSDD if it is not under ``root``.

    Returns:
        Manifest path per split.
    """
    num_utterances = {split: int(n) for split, n in dict(num_utterances).items()}
    silence_seconds = (float(silence_seconds[0]), float(silence_seconds[1]))
    _check_params(num_utterances, min_digits, max_digits, silence_seconds, sample_rate)
    out_dir = Path(out_dir).absolute()
    paths = {
        split: out_dir / f"{split}.csv" for split in SPLITS if num_utterances.get(split, 0) > 0
    }

    stamp = out_dir / ".done"
    params_hash = _params_hash(
        {
            "fsdd_version": FSDD_VERSION,
            "generator_version": GENERATOR_VERSION,
            "num_utterances": num_utterances,
            "min_digits": min_digits,
            "max_digits": max_digits,
            "silence_seconds": list(silence_seconds),
            "seed": seed,
            "sample_rate": sample_rate,
        }
    )
    if (
        stamp.is_file()
        and stamp.read_text(encoding="utf-8").strip() == params_hash
        and all(path.is_file() for path in paths.values())
    ):
        return paths

    recordings = ensure_fsdd(root, download=download)
    stamp.unlink(missing_ok=True)
    # Old wavs from other parameters would linger under new names; start clean.
    shutil.rmtree(out_dir / "wavs", ignore_errors=True)
    splits = split_fsdd(fsdd_utterances(recordings))
    cache: dict[str, torch.Tensor] = {}
    for split, path in paths.items():
        utterances = _build_split(
            split,
            splits[split],
            num_utterances[split],
            out_dir,
            min_digits,
            max_digits,
            silence_seconds,
            seed,
            sample_rate,
            cache,
        )
        write_manifest(path, utterances)
    atomic_write_text(stamp, params_hash + "\n")
    return paths
