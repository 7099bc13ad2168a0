"""Digits spoken by synthetic voices: more speakers for training a recognizer of new voices.

FSDD has six speakers. A model trained on five of them learns their voices along with the
digits and fails on a sixth (leave-one-speaker-out WER 27-37 %). Text-to-speech engines
give many more (if unnatural) voices for free and without downloads: ``espeak-ng``
(formant synthesis; 8 English accents x voice variants, pitch and rate) and ``flite``
(five CMU voices, rate and pitch). Keyword spotters trained on synthesized speech
generalise better from little real data (Lin et al., 2020, "Training keyword spotters with
limited and synthesized speech data"); ``data.synthetic_voices=N`` adds N such voices,
each saying the ten digits once, to the training split only (validation and test stay
real speech).

The voices are drawn by a fixed seed from the lists below, so ``N`` names the same voices
on every machine with the same engine versions; each synthesized file is cached under the
prepared-data folder by a name that spells out its voice.

The engines are Debian/Ubuntu packages: ``apt-get install flite espeak-ng``.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import soundfile
import torch
import torchaudio

from data.errors import DataError
from data.manifest import Utterance
from data.text import DIGIT_WORDS

#: espeak-ng's English accents (``espeak-ng --voices=en``, without the MBROLA ones).
ESPEAK_ACCENTS: tuple[str, ...] = (
    "en-us",
    "en-gb",
    "en-gb-scotland",
    "en-gb-x-gbclan",
    "en-gb-x-rp",
    "en-gb-x-gbcwmd",
    "en-029",
    "en-us-nyc",
)
#: espeak-ng voice variants that sound like a person (not robots, whispers or effects).
ESPEAK_VARIANTS: tuple[str, ...] = (
    *(f"m{i}" for i in range(1, 9)),
    *(f"f{i}" for i in range(1, 6)),
    *("klatt", "klatt2", "klatt3", "klatt4", "croak", "Alex", "Andy", "Annie", "adam"),
    *("anika", "aunty", "belinda", "benjamin", "boris", "caleb", "david", "edward"),
    *("grandma", "grandpa", "john", "linda", "max", "michel", "norbert", "paul"),
    *("quincy", "rob", "robert", "steph", "travis", "victor", "zac"),
)
#: flite's built-in voices (``flite -lv``).
FLITE_VOICES: tuple[str, ...] = ("kal", "kal16", "awb", "rms", "slt")
#: Share of the drawn voices that are flite's (it has few voices, but they sound natural).
FLITE_SHARE = 0.25
#: Seed of the voice draw: ``data.synthetic_voices=N`` always names the same N voices.
VOICE_SEED = 20261123
#: Samples quieter than this share of an utterance's peak, at its ends, are cut (FSDD's
#: recordings are trimmed too); a little margin is kept.
TRIM_THRESHOLD = 0.02
TRIM_MARGIN_SECONDS = 0.02


class SynthesizerUnavailableError(DataError):
    """A text-to-speech engine that ``data.synthetic_voices`` needs is not installed."""


@dataclass(frozen=True)
class SyntheticVoice:
    """One synthetic speaker: an engine, its voice, a pitch and a speaking rate.

    Attributes:
        engine: ``espeak-ng`` or ``flite``.
        voice: espeak-ng ``accent+variant`` or a flite voice name.
        pitch: espeak-ng's pitch (0-99, 50 normal); flite's mean F0 in Hz.
        rate: speaking rate relative to the engine's normal (1.2: 20 % faster).
    """

    engine: str
    voice: str
    pitch: int
    rate: float

    @property
    def name(self) -> str:
        """Speaker name, also the cache file prefix (``tts-espeak-ng-en-us+m3-p50-r1.10``)."""
        return f"tts-{self.engine}-{self.voice}-p{self.pitch}-r{self.rate:.2f}"

    def command(self, text: str, wav_path: Path) -> list[str]:
        """The engine's command line that writes ``text`` spoken by this voice to ``wav_path``."""
        if self.engine == "espeak-ng":
            words_per_minute = str(round(175 * self.rate))
            return ["espeak-ng", "-v", self.voice, "-p", str(self.pitch), "-s", words_per_minute,
                    "-w", str(wav_path), text]  # fmt: skip
        return ["flite", "-voice", self.voice,
                "--setf", f"duration_stretch={1.0 / self.rate:.3f}",
                "--setf", f"int_f0_target_mean={self.pitch}",
                "-t", text, "-o", str(wav_path)]  # fmt: skip


def draw_voices(count: int, seed: int = VOICE_SEED) -> list[SyntheticVoice]:
    """``count`` distinct voices, drawn from the engines' lists by ``seed``.

    The first ``k`` of ``draw_voices(n)`` are ``draw_voices(k)``: more voices only add.
    """
    rng = random.Random(seed)
    voices: list[SyntheticVoice] = []
    seen: set[SyntheticVoice] = set()
    while len(voices) < count:
        rate = round(rng.uniform(0.8, 1.25), 2)
        if rng.random() < FLITE_SHARE:
            voice = SyntheticVoice(
                "flite", rng.choice(FLITE_VOICES), rng.randrange(80, 220, 10), rate
            )
        else:
            name = f"{rng.choice(ESPEAK_ACCENTS)}+{rng.choice(ESPEAK_VARIANTS)}"
            voice = SyntheticVoice("espeak-ng", name, rng.randrange(20, 81, 5), rate)
        if voice not in seen:
            seen.add(voice)
            voices.append(voice)
    return voices


def check_synthesizers(voices: Sequence[SyntheticVoice]) -> None:
    """Fail before any work when an engine of ``voices`` is not on the PATH.

    Raises:
        SynthesizerUnavailableError: naming the missing engines and the install command.
    """
    missing = sorted({v.engine for v in voices if shutil.which(v.engine) is None})
    if missing:
        raise SynthesizerUnavailableError(
            f"data.synthetic_voices needs the text-to-speech engine(s) {', '.join(missing)}, "
            f"which are not installed. Fix: `sudo apt-get install {' '.join(missing)}` "
            "(Debian/Ubuntu), or data.synthetic_voices=0."
        )


def trim_silence(wav: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """``wav`` without the near-silence at its ends (keeping ``TRIM_MARGIN_SECONDS``)."""
    loud = (wav.abs() > TRIM_THRESHOLD * wav.abs().max()).nonzero().flatten()
    if loud.numel() == 0:
        return wav
    margin = round(TRIM_MARGIN_SECONDS * sample_rate)
    return wav[max(int(loud[0]) - margin, 0) : int(loud[-1]) + margin + 1]


def synthesize(voice: SyntheticVoice, text: str, out_path: Path, sample_rate: int) -> float:
    """Write ``text`` spoken by ``voice`` to ``out_path`` (mono, ``sample_rate``, trimmed).

    Returns:
        The duration in seconds.

    Raises:
        DataError: the engine failed or wrote no audio (with its message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        done = subprocess.run(voice.command(text, raw), capture_output=True, text=True)
        if done.returncode != 0 or not raw.is_file():
            raise DataError(
                f"{voice.engine} could not speak {text!r} as {voice.name}: "
                f"{done.stderr.strip() or f'exit status {done.returncode}'}"
            )
        audio, rate = soundfile.read(raw, dtype="float32", always_2d=True)
    wav = torch.from_numpy(audio).mean(dim=1)
    wav = torchaudio.functional.resample(wav, rate, sample_rate) if rate != sample_rate else wav
    wav = trim_silence(wav, sample_rate)
    if wav.numel() == 0 or float(wav.abs().max()) == 0.0:
        raise DataError(f"{voice.engine} wrote silence for {text!r} as {voice.name}.")
    tmp_path = out_path.with_suffix(".tmp.wav")
    soundfile.write(tmp_path, wav.numpy(), sample_rate, subtype="PCM_16")
    tmp_path.replace(out_path)  # a killed run never leaves a half-written file behind
    return wav.numel() / sample_rate


def synthetic_digit_utterances(
    count: int, out_dir: str | Path, sample_rate: int, words: Sequence[str] = DIGIT_WORDS
) -> list[Utterance]:
    """The ten digit words spoken by each of ``count`` voices (``draw_voices``), cached.

    Files already in ``out_dir`` are reused (their names spell the voice, word and rate);
    only the engines of voices with files still missing must be installed, so a cached
    set can be used on a machine without espeak-ng or flite.

    Returns:
        One utterance per voice and word, the voice's name as the speaker.

    Raises:
        SynthesizerUnavailableError: an engine needed for a missing file is not installed.
    """
    voices = draw_voices(count)
    out_dir = Path(out_dir) / f"{sample_rate}hz"

    def cached(voice: SyntheticVoice, word: str) -> Path:
        return out_dir / f"{voice.name}-{word}.wav"

    check_synthesizers(
        [voice for voice in voices if not all(cached(voice, word).is_file() for word in words)]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    utterances = []
    for voice in voices:
        for word in words:
            path = cached(voice, word)
            if path.is_file():
                duration = soundfile.info(path).frames / sample_rate
            else:
                duration = synthesize(voice, word, path, sample_rate)
            utterances.append(Utterance(path.stem, str(path), duration, word, voice.name))
    return utterances
