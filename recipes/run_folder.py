"""A run folder's record: written once a run is accepted, left alone by refused commands.

Hydra creates the run folder, writes ``.hydra/*.yaml`` and opens ``train.log`` before the
task function starts. A command that is refused after that (a bad value, no GPU, data that
cannot be read, a checkpoint of another model), or that finds its run finished, would
rewrite a finished run's record or leave a stray folder behind. So, for a single run
(``python recipes/train.py ...``):

* ``RunFolderCallback.on_run_start`` checks the command before Hydra touches the folder:
  a refused command stops there with one line, and a finished run says where its results
  are and stops (exit code 0), leaving every file as it was;
* it also takes Hydra's writes over: ``RunFolder.accept`` writes ``.hydra/`` and starts
  ``train.log`` once the run is accepted (its data are read and its checkpoint, if any,
  loaded). Log lines from before are kept in memory and written then; a run refused
  before that removes the folders it created, if they are still empty.

Sweeps (``-m``) keep Hydra's own behaviour: each job writes into a new folder, and a
refused or failed job's folder records why (the sweep summary lists it as failed); the
sweep goes on with its other jobs (``recipes/train.py``).
"""

from __future__ import annotations

import copy
import logging
import logging.handlers
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from amp_utils.run_results import RESULTS_FILE, RunResults
from recipes.preflight import USER_ERRORS, check_sweep_direction, preflight, sweeper_direction

logger = logging.getLogger(__name__)

LABELS_FILE = "labels.json"  # the task and its speaker names, for inference
RESOLVED_CONFIG_FILE = "config_resolved.yaml"  # the config with every interpolation resolved


def planned_epochs(trainer: Any) -> int:
    """The epochs a run trains: ``trainer.epochs``, or in debug mode (``trainer.debug``)
    the first ``trainer.debug_epochs`` of them."""
    epochs = int(trainer.epochs)
    return min(epochs, int(trainer.debug_epochs)) if trainer.debug else epochs


def epochs_key(trainer: Any) -> str:
    """The option that sets ``planned_epochs``: what to raise to train a run further."""
    short_debug = planned_epochs(trainer) < int(trainer.epochs)
    return "trainer.debug_epochs" if short_debug else "trainer.epochs"


def finished_results(run_dir: Path, trainer: Any) -> RunResults | None:
    """The results of a run in ``run_dir`` that finished the epochs the ``trainer`` config
    plans (``planned_epochs``), else None.

    A run has finished when its ``results.json`` says it completed at least those epochs;
    with more epochs requested, the run is extended instead.
    """
    try:
        results = RunResults.read(run_dir / RESULTS_FILE)
    except (OSError, ValueError):
        return None
    completed = results.completed_epochs
    if not isinstance(completed, int) or completed < planned_epochs(trainer):
        return None
    return results


def finished_message(run_dir: Path, results: RunResults, trainer: Any) -> str:
    """One line: the run has finished, where its results are, how to train it further
    (raise the ``trainer`` option of ``epochs_key``)."""
    from recipes.audio_brain import format_metrics

    key = epochs_key(trainer)
    metrics = format_metrics(results.test_metrics)
    completed = results.completed_epochs
    return (
        f"This run has finished its {completed} epochs already (test: {metrics}); its "
        f"results are in {run_dir / RESULTS_FILE}. Nothing was changed. To train it "
        f"further, raise {key} (e.g. {key}={completed + 1 if completed else 1})."
    )


def first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@dataclass
class _TakenOver:
    """What ``RunFolderCallback`` took over from Hydra for this process's run."""

    run_dir: Path
    existing: Path  # the run folder itself if it existed, else its nearest existing ancestor
    output_subdir: str | None  # Hydra's ``.hydra`` (None: Hydra was told not to write it)
    log_files: list[tuple[str, str]]  # (file name, record format) of Hydra's job log files


_taken_over: _TakenOver | None = None


def _task_config(config: DictConfig) -> DictConfig:
    """A callback's config without its ``hydra`` node: what the task function gets."""
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    return task_cfg


class RunFolderCallback(Callback):
    """Hydra callback: check a single run before Hydra writes into its folder.

    Registered in ``conf/config.yaml`` (``hydra.callbacks.run_folder``).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a sweeper that would tune the wrong way before its first trial (each
        trial would be refused the same way, after the sweep had started)."""
        task_cfg = _task_config(config)
        try:
            check_sweep_direction(task_cfg, sweeper_direction(config.hydra.sweeper))
        except USER_ERRORS as err:
            sys.exit(f"error: {err}")

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a bad or finished command before Hydra creates or writes anything."""
        global _taken_over
        task_cfg = _task_config(config)
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        try:
            preflight(task_cfg)
        except USER_ERRORS as err:
            sys.exit(f"error: {err}")
        results = finished_results(run_dir, task_cfg.trainer)
        if results is not None:
            print(finished_message(run_dir, results, task_cfg.trainer))
            sys.exit(0)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.runtime.output_dir = str(run_dir)  # run_job sets the same value
            job_logging = OmegaConf.to_container(config.hydra.job_logging, resolve=True)
            log_files = _take_file_handlers(config.hydra.job_logging, job_logging)
            subdir = config.hydra.output_subdir
            _taken_over = _TakenOver(
                run_dir, first_existing(run_dir), None if subdir is None else str(subdir), log_files
            )
            config.hydra.output_subdir = None  # RunFolder.accept writes .hydra


def _take_file_handlers(node: DictConfig, resolved: dict[str, Any]) -> list[tuple[str, str]]:
    """Remove the file handlers from Hydra's job logging; returns (file, format) of each."""
    handlers = resolved.get("handlers") or {}
    taken = [name for name, h in handlers.items() if "filename" in h]
    files = []
    for name in taken:
        formatter = (resolved.get("formatters") or {}).get(handlers[name].get("formatter"), {})
        files.append((str(handlers[name]["filename"]), formatter.get("format", "%(message)s")))
        del node.handlers[name]
    if "root" in node and "handlers" in node.root:
        node.root.handlers = [h for h in node.root.handlers if h not in taken]
    return files


class RunFolder:
    """The record of one run in its folder, written only once the run is accepted.

    Create it before the folder is created (it notes what existed), ``accept`` it once the
    run is going to train, and ``abandon`` it if the run is refused before that.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        taken = _taken_over if _taken_over and _taken_over.run_dir == self.path.absolute() else None
        self._taken = taken
        self._existing = taken.existing if taken else first_existing(self.path)
        self.accepted = False
        self._buffer: logging.handlers.MemoryHandler | None = None
        if taken and taken.log_files:  # keep the log lines until the log file may be written
            self._buffer = logging.handlers.MemoryHandler(
                capacity=sys.maxsize, flushLevel=logging.CRITICAL + 1
            )
            logging.getLogger().addHandler(self._buffer)

    def accept(self, cfg: DictConfig, write_files: bool = True) -> None:
        """The run goes ahead: write its config record and start its log file.

        Writes ``config_resolved.yaml`` and, when Hydra's writes were taken over, the
        ``.hydra/`` files Hydra would have written; ``write_files=False`` (DDP ranks other
        than 0) only starts the log file.
        """
        if self.accepted:
            return
        self.accepted = True
        if write_files:
            self.path.mkdir(parents=True, exist_ok=True)
            OmegaConf.save(cfg, self.path / RESOLVED_CONFIG_FILE, resolve=True)
            if self._taken is not None and self._taken.output_subdir is not None:
                self._write_hydra_files(cfg)
        if self._buffer is not None:
            logging.getLogger().removeHandler(self._buffer)
            for file_name, fmt in self._taken.log_files:
                handler = logging.FileHandler(file_name, mode="a")
                handler.setFormatter(logging.Formatter(fmt))
                for record in self._buffer.buffer:
                    handler.handle(record)
                logging.getLogger().addHandler(handler)
            self._buffer.buffer.clear()
            self._buffer = None

    def _write_hydra_files(self, cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig

        hydra_dir = self.path / self._taken.output_subdir
        hydra_dir.mkdir(parents=True, exist_ok=True)
        hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)  # {"hydra": ...}, as Hydra saves
        with read_write(hydra_cfg.hydra), open_dict(hydra_cfg.hydra):
            hydra_cfg.hydra.output_subdir = self._taken.output_subdir
        for name, node in (
            ("config.yaml", cfg),
            ("hydra.yaml", hydra_cfg),
            ("overrides.yaml", hydra_cfg.hydra.overrides.task),
        ):
            (hydra_dir / name).write_text(OmegaConf.to_yaml(node), encoding="utf-8")

    def abandon(self) -> None:
        """The run was refused before ``accept``: drop its log lines and the folders it made.

        Only folders that did not exist before and are still empty are removed.
        """
        if self.accepted:
            return
        if self._buffer is not None:
            logging.getLogger().removeHandler(self._buffer)
            self._buffer = None
        path = self.path.absolute()
        while path != self._existing and self._existing in path.parents:
            try:
                path.rmdir()  # only if empty
            except OSError:
                return
            path = path.parent


def run_job(job: Callable[[], float]) -> float:
    """Run a training job, reporting bad input (``USER_ERRORS``) in one line.

    A single run exits with ``error: ...`` (status 1). A job of a ``-m`` sweep outside DDP
    that fails, with bad input or a crash, ends alone: the error goes to its ``train.log``
    (a crash with its traceback) and the job returns NaN (to Optuna: a failed trial); the
    sweep goes on, and its summary lists the job as failed (``SweepSummaryCallback``).
    """
    try:
        return job()
    except USER_ERRORS as err:  # bad input: one line, no traceback, printed once
        log_to_files(logging.ERROR, f"{type(err).__name__}: {err}")  # the run's train.log
        if not in_single_process_sweep():
            sys.exit(f"error: {err}")
        print(f"error: {err}\n(this sweep job failed; the sweep goes on)", file=sys.stderr)
    except Exception:
        if not in_single_process_sweep():
            raise
        logger.exception("This sweep job failed; the sweep goes on.")
    return float("nan")


def in_single_process_sweep() -> bool:
    """Whether this process runs one job of a ``-m`` sweep, outside DDP: a job that fails
    then ends alone and the sweep goes on (under DDP every rank would have to agree)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or not HydraConfig.initialized():
        return False
    return HydraConfig.get().mode == RunMode.MULTIRUN


def log_to_files(level: int, message: str) -> None:
    """Write one log line to the log files only (the console shows it otherwise)."""
    root = logging.getLogger()
    record = root.makeRecord(__name__, level, __file__, 0, message, None, None)
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
