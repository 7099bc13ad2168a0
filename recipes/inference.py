"""Load a trained run (its config and best checkpoint) and label audio files with it."""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from amp_utils import PRECISIONS, AMPConfig, Checkpointer, TorchAutocast, resolve_device
from amp_utils.precision import (
    AUTO,
    check_precision_supported,
    resolve_precision,
    warn_if_emulated,
)
from amp_utils.run_results import RESULTS_FILE, RunResults
from data.audio import load_audio
from data.connected_digits import read_plan
from data.dataset import AudioDataset, collate_audio
from data.errors import AudioError, DataError
from data.manifest import Utterance, read_manifest
from recipes.audio_brain import LEGACY_AVERAGE_FROM, checkpoints_to_average
from recipes.modules import build_modules
from recipes.run_folder import LABELS_FILE
from recipes.task import RunLabels, Task
from recipes.tasks import task_for

logger = logging.getLogger(__name__)


class RunNotFoundError(FileNotFoundError):
    """The path is not a run folder (or a checkpoint inside one)."""


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a folder that ``recipes/train.py`` ran in (its config and labels)."""
    return (path / ".hydra" / "config.yaml").is_file() and (path / LABELS_FILE).is_file()


#: What a ``-m`` sweep writes into its folder (Hydra), beside the job folders.
SWEEP_FILE = "multirun.yaml"


def sweep_jobs(path: str | Path) -> list[Path] | None:
    """The run folders of the sweep folder ``path``, in job order; None if ``path`` is not
    a sweep folder (no ``multirun.yaml``). Jobs stopped before they trained are left out."""
    path = Path(path)
    if not (path / SWEEP_FILE).is_file():
        return None
    jobs = [job for job in path.iterdir() if job.is_dir() and is_run_dir(job)]

    def order(job: Path) -> tuple[int, str]:  # Hydra's job number, then the name
        number = job.name.split("_")[0]
        return (int(number) if number.isdigit() else -1, job.name)

    return sorted(jobs, key=order)


def find_run_dir(path: str | Path) -> Path:
    """The run folder for a run folder, its ``checkpoints/`` or one ``CKPT+*`` inside it.

    Raises:
        RunNotFoundError: ``path`` does not exist (a relative path read from another
            folder, a sweep job's folder given without its sweep's), is a sweep's folder
            (the message names its jobs), or no run is there.
    """
    if not Path(path).exists():
        raise RunNotFoundError(
            f"{path} does not exist (relative paths are read from {Path.cwd()}). "
            "Pass the folder that recipes/train.py wrote."
        )
    jobs = sweep_jobs(path)
    if jobs is not None and not is_run_dir(Path(path)):
        names = ", ".join(job.name for job in jobs[:8]) + (", ..." if len(jobs) > 8 else "")
        raise RunNotFoundError(
            f"{path} is the folder of a -m sweep, not of one run. Pass one of its jobs, e.g. "
            f"{Path(path) / jobs[0].name} (jobs: {names})."
            if jobs
            else f"{path} is the folder of a -m sweep whose jobs have not started training "
            "(none holds a run). Pass a run folder that recipes/train.py wrote."
        )
    path = Path(path).resolve()
    for candidate in (path, path.parent, path.parent.parent):
        if is_run_dir(candidate):
            return candidate
    raise RunNotFoundError(
        f"{path} is not a training run folder (no .hydra/config.yaml and {LABELS_FILE} found "
        "there or above). Pass the folder that recipes/train.py wrote, e.g. outputs/..."
    )


@dataclass
class TrainedModel:
    """A trained recipe ready for inference on one device and precision."""

    cfg: DictConfig
    features: torch.nn.Module
    model: torch.nn.Module
    labels: RunLabels
    device: torch.device
    amp: AMPConfig
    #: ``(shortest, longest)`` training utterance in seconds, None if the run did not record
    #: it (``training_seconds``): a file far longer than the longest gets a warning.
    train_seconds: tuple[float, float] | None = None

    @property
    def speakers(self) -> tuple[str, ...]:
        """The run's speaker names."""
        return self.labels.speakers

    @property
    def task(self) -> Task:
        """The run's task (its model's outputs to labels)."""
        return task_for(self.cfg.model)

    def label(self, audio_paths: list[str | Path]) -> list[str]:
        """Transcripts (ASR) or speaker names (speaker ID) of the given audio files.

        Raises:
            AudioError: a file cannot be read (the first such file, before any labelling),
                or a clip is too short for the model's frames.
        """
        wavs = [self.load(path) for path in audio_paths]  # fails clearly on bad audio
        return self._label_waves(list(audio_paths), wavs)

    def label_each(self, audio_paths: list[str | Path]) -> list[str | AudioError]:
        """The label of each readable file, and for each file that cannot be read (missing,
        a folder, not audio) the ``AudioError`` that says why, in the order given.

        A bad file among many costs only its own label: ``transcribe.py a.wav missing.wav
        b.wav`` used to print no label at all.

        Raises:
            AudioError: a clip is too short for the model's frames.
        """
        loaded: list[torch.Tensor | AudioError] = []
        for path in audio_paths:
            try:
                loaded.append(self.load(path))
            except AudioError as err:
                loaded.append(err)
        readable = [
            (path, wav)
            for path, wav in zip(audio_paths, loaded, strict=True)
            if not isinstance(wav, AudioError)
        ]
        paths, wavs = [p for p, _ in readable], [w for _, w in readable]
        labels = iter(self._label_waves(paths, wavs) if readable else [])
        return [wav if isinstance(wav, AudioError) else next(labels) for wav in loaded]

    def load(self, path: str | Path) -> torch.Tensor:
        """The file's audio at the run's sample rate, with a warning if it is far longer
        than the audio the model was trained on (``LONG_CLIP_FACTOR``).

        Raises:
            AudioError: the file is missing, a folder, empty or not audio; names the file.
        """
        wav = load_audio(path, self.cfg.data.sample_rate)
        seconds = len(wav) / self.cfg.data.sample_rate
        if self.train_seconds is not None and seconds > LONG_CLIP_FACTOR * self.train_seconds[1]:
            shortest, longest = self.train_seconds
            logger.warning(
                "%s holds %.1f s of audio, far longer than the model's training audio "
                "(%.2f-%.2f s): its label may be wrong. Fix: cut it into clips of the training "
                "lengths.",
                path,
                seconds,
                shortest,
                longest,
            )
        return wav

    def _label_waves(self, audio_paths: list[str | Path], wavs: list[torch.Tensor]) -> list[str]:
        """The labels of the loaded audio ``wavs`` (of ``audio_paths``), in their order.

        Files go through the model shortest first, in batches of at most the run's
        ``data.max_batch_seconds`` padded seconds (one file alone may exceed it): one batch
        of them all padded every file to the longest one's length, so a long recording
        among many short ones asked for memory in proportion to both. Padding does not
        change a file's label (the models mask it), so the batches do not either.
        """
        budget = float(
            OmegaConf.select(self.cfg, "data.max_batch_seconds", default=None)
            or DEFAULT_BATCH_SECONDS
        )
        rate = self.cfg.data.sample_rate
        labels: list[str] = [""] * len(wavs)
        batch: list[int] = []
        for index in sorted(range(len(wavs)), key=lambda i: len(wavs[i])):
            if batch and (len(batch) + 1) * len(wavs[index]) / rate > budget:
                self._label_batch(batch, audio_paths, wavs, labels)
                batch = []
            batch.append(index)
        if batch:
            self._label_batch(batch, audio_paths, wavs, labels)
        return labels

    @torch.no_grad()
    def _label_batch(
        self,
        indices: list[int],
        all_paths: list[str | Path],
        all_wavs: list[torch.Tensor],
        labels: list[str],
    ) -> None:
        """Label the files at ``indices`` as one padded batch, into ``labels``."""
        audio_paths = [all_paths[i] for i in indices]
        wavs = [all_wavs[i] for i in indices]
        rate = self.cfg.data.sample_rate
        speaker = self.speakers[0] if self.speakers else ""
        utts = [
            Utterance(str(i), str(path), len(wav) / rate, "", speaker)
            for i, (path, wav) in enumerate(zip(audio_paths, wavs, strict=True))
        ]
        dataset = AudioDataset(utts, rate, None, speakers=self.speakers)
        batch = collate_audio([dataset[i] for i in range(len(dataset))]).to(self.device)
        try:
            with TorchAutocast(device_type=self.device.type, dtype=self.amp.dtype):
                feats, feat_lens = self.features(batch.wavs, batch.wav_lens)
                outputs = self.model(feats, feat_lens)
                predicted = self.task.predict(outputs, self.labels)
                for index, label in zip(indices, predicted, strict=True):
                    labels[index] = label
        except RuntimeError as err:
            shortest = min(utts, key=lambda utt: utt.duration)
            if shortest.duration >= MIN_CLIP_SECONDS:
                raise
            raise AudioError(
                f"{shortest.path} holds {shortest.duration * 1000:.0f} ms of audio, too short "
                f"for the model's frames ({str(err).splitlines()[0]}). Give clips of at least "
                f"{MIN_CLIP_SECONDS} s."
            ) from None


#: Padded seconds of audio per labelling batch for a run whose config has no
#: ``data.max_batch_seconds`` (the single-digit recipe's default).
DEFAULT_BATCH_SECONDS = 30.0

#: A file more than this many times the longest training utterance gets a warning: the
#: models saw nothing like it (FSDD's training digits last 0.16-2.28 s, a 60-s recording
#: 26 times the longest). Twice leaves room for slower speakers and silence around a digit.
LONG_CLIP_FACTOR = 2.0

#: Clips shorter than this may be too short for the models' windows and subsampling
#: (at 8 kHz the default recipe needs about 25 ms): their failure is reported as such.
MIN_CLIP_SECONDS = 0.25


def unfinished_run_note(run_dir: Path) -> str | None:
    """None for a run that has tested its model (its ``results.json``); for one stopped
    before (killed, or still training), the line that says what its labels or metrics
    come from: its checkpoints so far, not its final model.

    Raises:
        RunNotFoundError: the run has no end-of-epoch checkpoint (stopped in its first
            epoch): evaluate.py tested its mid-epoch checkpoint, which has no validation
            metrics, as "the best", and transcribe.py said only "No checkpoint to average".
    """
    if (run_dir / RESULTS_FILE).is_file():
        return None
    epochs = Checkpointer(run_dir / "checkpoints").find_last_checkpoints(1)
    if not epochs:
        raise RunNotFoundError(
            f"{run_dir} has no checkpoint of a whole epoch: its training stopped in its first "
            "epoch. Fix: resume it (run its recipes/train.py command again) until at least "
            "one epoch has ended."
        )
    return (
        f"{run_dir} has not finished training (no {RESULTS_FILE}): using its checkpoints "
        f"so far (newest whole epoch: {epochs[0].meta.get('epoch', '?')}), not its final model."
    )


def training_seconds(run_dir: Path, labels_record: dict[str, Any]) -> tuple[float, float] | None:
    """``(shortest, longest)`` training utterance of the run in ``run_dir``, in seconds:
    from its ``labels.json`` record (``labels_record["train_seconds"]``), or for a run from
    before that was recorded, from the training manifest its ``results.json`` names; None
    if neither gives it (the manifest gone, an unfinished older run)."""
    with contextlib.suppress(ValueError, TypeError):
        recorded = labels_record.get("train_seconds")
        if recorded:
            return float(recorded[0]), float(recorded[1])
    try:
        manifest = RunResults.read(run_dir / RESULTS_FILE).dataset["manifests"]["train"]
        plan = manifest.endswith(".plan.jsonl")  # connected digits
        utterances = read_plan(manifest) if plan else read_manifest(manifest)
    except (OSError, ValueError, KeyError, TypeError, DataError):
        return None
    durations = [utt.duration for utt in utterances]
    return (min(durations), max(durations)) if durations else None


def tested_precision(run_dir: Path) -> str:
    """The precision the run's test ran in (``results.json``'s ``eval_precision``, as
    resolved: ``precision=auto`` gives the one it picked); fp32 for a run without one."""
    try:
        recorded = RunResults.read(run_dir / RESULTS_FILE).eval_precision
    except (OSError, ValueError):
        recorded = None
    return recorded if recorded in PRECISIONS else "fp32"


def load_trained(
    path: str | Path, device: str = "auto", precision: str | None = None
) -> TrainedModel:
    """Rebuild the model of a run folder and load its best checkpoint (or, if the run
    averaged checkpoints for its test, the same average).

    ``precision`` None: the precision the run was tested in (:func:`tested_precision`), so
    that labels come out as the run's test figures were computed; ``auto``: the fastest
    precision this device computes natively (as ``precision=auto`` in training).

    Raises:
        ValueError: ``precision`` is not fp32, fp16, bf16 or auto (named, with the choices).
    """
    if precision is not None and precision not in (*PRECISIONS, AUTO):
        raise ValueError(
            f"precision={precision} is not valid; choose one of: {', '.join(PRECISIONS)}, {AUTO}."
        )
    run_dir = find_run_dir(path)
    note = unfinished_run_note(run_dir)
    if note is not None:
        logger.warning(note)
    precision = precision or tested_precision(run_dir)
    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    labels_json = json.loads((run_dir / LABELS_FILE).read_text())
    labels = RunLabels.from_config(cfg, labels_json["speakers"], labels_json.get("words", ()))
    speakers = labels.speakers
    dev = resolve_device(device)
    amp = AMPConfig.from_name(resolve_precision(precision, dev)[0])
    check_precision_supported(amp, dev)
    warn_if_emulated(amp, dev, key="--precision")  # e.g. a GPU run's bf16 on a CPU without it
    modules = build_modules(cfg, speakers, augment=False)
    features, model = modules["features"], modules["model"]
    ckpt = Checkpointer(run_dir / "checkpoints", {"module.model": model}, allow_partial_load=True)
    key = task_for(cfg.model).best_checkpoint_key()
    if ckpt.recover_if_possible(**key) is None:
        raise RunNotFoundError(f"No readable checkpoint in {run_dir / 'checkpoints'}.")
    num_averaged = int(OmegaConf.select(cfg, "trainer.average_checkpoints", default=1) or 1)
    if num_averaged > 1:  # the weights the run was tested with (older runs: the N best)
        average_from = OmegaConf.select(cfg, "trainer.average_from", default=LEGACY_AVERAGE_FROM)
        chosen = checkpoints_to_average(ckpt, num_averaged, average_from, **key)
        ckpt.load_averaged(chosen, ["module.model"])
    return TrainedModel(
        cfg,
        features.to(dev).eval(),
        model.to(dev).eval(),
        labels,
        dev,
        amp,
        train_seconds=training_seconds(run_dir, labels_json),
    )
