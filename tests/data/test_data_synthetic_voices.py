"""Synthetic voices (``data.synthetic_voices``): drawing, synthesis, caching, the manifests.

Most tests put fake ``espeak-ng``/``flite`` executables on the PATH (they write a tone at
the engine's own sample rate with silence around it, and count their calls), so the
subprocess, resampling, trimming and caching paths run everywhere; one test speaks with
the real engines where they are installed.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
from pathlib import Path

import pytest
import soundfile
import torch

from data import fsdd
from data.manifest import read_manifest
from data.synthetic_voices import (
    SynthesizerUnavailableError,
    SyntheticVoice,
    check_synthesizers,
    draw_voices,
    synthesize,
    synthetic_digit_utterances,
    trim_silence,
)
from data.text import DIGIT_WORDS

FAKE_ENGINE = """#!{python}
# Fake {engine}: writes 0.1 s silence, 0.3 s of a 440 Hz tone, 0.2 s silence at {rate} Hz.
import sys, numpy as np, soundfile
args = sys.argv[1:]
out = args[args.index("{out_flag}") + 1]
with open("{calls}", "a") as log:
    log.write(" ".join(args) + "\\n")
t = np.arange(int(0.3 * {rate})) / {rate}
tone = 0.5 * np.sin(2 * np.pi * 440 * t)
wav = np.concatenate([np.zeros(int(0.1 * {rate})), tone, np.zeros(int(0.2 * {rate}))])
soundfile.write(out, wav, {rate})
"""


@pytest.fixture()
def fake_engines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Fake engines first on the PATH; returns the file their calls are logged to."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.txt"
    bin_dir.mkdir()
    calls.write_text("")
    for engine, out_flag, rate in (("espeak-ng", "-w", 22050), ("flite", "-o", 16000)):
        script = bin_dir / engine
        script.write_text(
            FAKE_ENGINE.format(
                python=sys.executable, engine=engine, out_flag=out_flag, rate=rate, calls=calls
            )
        )
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    return calls


def test_voices_are_drawn_the_same_way_every_time_and_more_only_add() -> None:
    voices = draw_voices(40)
    assert voices == draw_voices(40) and draw_voices(10) == voices[:10]
    assert len(set(voices)) == 40 and len({v.name for v in voices}) == 40
    assert {v.engine for v in voices} == {"espeak-ng", "flite"}
    assert all(0.8 <= v.rate <= 1.25 for v in voices)


def test_each_engine_gets_its_own_command_line(tmp_path: Path) -> None:
    espeak = SyntheticVoice("espeak-ng", "en-gb+f3", 40, 1.2)
    assert espeak.command("seven", tmp_path / "a.wav") == [
        "espeak-ng", "-v", "en-gb+f3", "-p", "40", "-s", "210",
        "-w", str(tmp_path / "a.wav"), "seven",
    ]  # fmt: skip
    flite = SyntheticVoice("flite", "slt", 180, 0.8).command("two", tmp_path / "b.wav")
    assert flite[:3] == ["flite", "-voice", "slt"] and "duration_stretch=1.250" in flite
    assert "int_f0_target_mean=180" in flite and flite[-4:] == [
        "-t",
        "two",
        "-o",
        str(tmp_path / "b.wav"),
    ]
    assert espeak.name == "tts-espeak-ng-en-gb+f3-p40-r1.20"


def test_missing_engines_are_named_with_the_install_command(monkeypatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SynthesizerUnavailableError, match=r"espeak-ng, flite.*apt-get install"):
        check_synthesizers(draw_voices(20))
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    check_synthesizers(draw_voices(20))


def test_trimming_keeps_the_speech_and_a_small_margin() -> None:
    rate = 8000
    speech = torch.sin(torch.arange(2400) * 0.3)
    wav = torch.cat([torch.zeros(1000), speech, torch.zeros(3000)])
    trimmed = trim_silence(wav, rate)
    margin = round(0.02 * rate)
    assert 2400 <= trimmed.numel() <= 2400 + 2 * margin + 1
    assert torch.equal(trim_silence(torch.zeros(100), rate), torch.zeros(100))


def test_synthesized_audio_is_resampled_trimmed_and_cached(fake_engines: Path, tmp_path) -> None:
    out = tmp_path / "tts"
    utts = synthetic_digit_utterances(3, out, sample_rate=8000)
    assert len(utts) == 30 and [u.transcript for u in utts[:10]] == DIGIT_WORDS
    assert {u.speaker for u in utts} == {v.name for v in draw_voices(3)}
    for utt in utts:
        info = soundfile.info(utt.path)
        assert info.samplerate == 8000 and info.channels == 1
        assert 0.3 <= utt.duration <= 0.35  # the tone and the margins, not the silence
        assert utt.duration == pytest.approx(info.frames / 8000)
    assert len(fake_engines.read_text().splitlines()) == 30
    assert synthetic_digit_utterances(3, out, sample_rate=8000) == utts  # from the cache
    assert len(fake_engines.read_text().splitlines()) == 30
    assert not list(out.rglob("*.tmp.wav"))


def test_cached_voices_need_no_engines_and_missing_ones_name_theirs(
    fake_engines: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepared folder moved to a machine without espeak-ng/flite still works; only the
    engines of voices with files still missing are required."""
    out = tmp_path / "tts"
    utts = synthetic_digit_utterances(3, out, sample_rate=8000)
    monkeypatch.setattr(shutil, "which", lambda name: None)  # no engine installed
    assert synthetic_digit_utterances(3, out, sample_rate=8000) == utts

    voices = draw_voices(3)
    (out / "8000hz" / f"{voices[1].name}-seven.wav").unlink()
    with pytest.raises(SynthesizerUnavailableError) as info:
        synthetic_digit_utterances(3, out, sample_rate=8000)
    assert f"engine(s) {voices[1].engine}, which" in str(info.value)  # only the one needed


def test_a_failing_engine_is_reported_with_its_message(tmp_path, monkeypatch) -> None:
    voice = SyntheticVoice("espeak-ng", "en-us+m1", 50, 1.0)
    monkeypatch.setattr(
        SyntheticVoice,
        "command",
        lambda self, text, path: [sys.executable, "-c", "import sys; sys.exit('no voice')"],
    )
    with pytest.raises(ValueError, match="espeak-ng could not speak 'one'.*no voice"):
        synthesize(voice, "one", tmp_path / "one.wav", 8000)
    assert not (tmp_path / "one.wav").exists()


def test_synthetic_voices_join_the_training_split_only(fake_engines, fsdd_root, tmp_path) -> None:
    plain = fsdd.prepare_fsdd_digits(fsdd_root, tmp_path, download=False, test_speakers=["theo"])
    paths = fsdd.prepare_fsdd_digits(
        fsdd_root, tmp_path, download=False, test_speakers=["theo"], synthetic_voices=2
    )
    assert paths["train"].parent.name == "synthetic_voices=2"
    assert (
        paths["train"].parent.parent == plain["train"].parent
    )  # beside, not over, the plain split
    train, plain_train = read_manifest(paths["train"]), read_manifest(plain["train"])
    added = [u for u in train if u.speaker.startswith("tts-")]
    assert len(train) == len(plain_train) + 20 and len(added) == 20
    assert train[: len(plain_train)] == plain_train
    for split in ("valid", "test"):
        assert read_manifest(paths[split]) == read_manifest(plain[split])


@pytest.mark.skipif(
    not (shutil.which("espeak-ng") and shutil.which("flite")),
    reason="needs the real engines: apt-get install flite espeak-ng",
)
def test_the_real_engines_speak_a_digit(tmp_path: Path) -> None:
    for voice in (
        SyntheticVoice("espeak-ng", "en-gb-scotland+m3", 50, 1.0),
        SyntheticVoice("flite", "slt", 170, 1.0),
    ):
        duration = synthesize(voice, "seven", tmp_path / f"{voice.engine}.wav", 8000)
        wav, rate = soundfile.read(tmp_path / f"{voice.engine}.wav")
        assert rate == 8000 and 0.2 < duration < 1.5 and abs(wav).max() > 0.05
