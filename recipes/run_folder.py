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

The tools that write a folder of their own (``recipes/benchmark.py``,
``recipes/diagnose.py``) do the same through ``ToolFolderCallback``: their own checks before
Hydra touches the folder, then ``RunFolder.accept(..., run_record=False)`` once their work
starts, so a refused benchmark or diagnosis leaves no folder behind either.

A finished run trained further keeps its earlier record (``keep_finished_record``). Which
run a folder holds is ``recipes/run_overrides.py``'s; a sweep's jobs, their folders and
how each ends are ``recipes/sweep_jobs.py``'s.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import logging.handlers
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows: runs there are not locked
    fcntl = None  # type: ignore[assignment]

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from amp_utils.atomic import atomic_write_text
from amp_utils.run_results import EARLIER_RECORDS_DIR, RESULTS_FILE, RunResults
from recipes.config import ConfigError
from recipes.error_analysis import TEST_ERRORS_FILE
from recipes.preflight import USER_ERRORS, check_sweep_direction, preflight, sweeper_direction
from recipes.run_overrides import (
    RUN_OVERRIDES_FILE,
    check_run_overrides,
    finished_results,
    hydra_task_overrides,
    override_dirname_excludes,
    say_finished,
)
from recipes.search_space import search_problem, task_config
from recipes.sweep_jobs import (
    NO_OUTPUT_SUBDIR,
    sweep_job_output_subdir,
    take_sweep_job_hydra_files,
)

logger = logging.getLogger(__name__)

LABELS_FILE = "labels.json"  # the task and its speaker names, for inference
RESOLVED_CONFIG_FILE = "config_resolved.yaml"  # the config with every interpolation resolved


def first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def folder_problem(path: Path, key: str) -> str | None:
    """Why the folder ``path`` (set by the Hydra option ``key``) cannot be made or written
    in, or None.

    Hydra makes a run's or a sweep's folder itself, before the task starts: a folder below
    a file, or in a place the user may not write, ended in Hydra's ``NotADirectoryError`` or
    ``PermissionError`` traceback.
    """
    existing = first_existing(path)
    if not existing.is_dir():
        cause = f"{existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        cause = f"{existing} is not writable"
    else:
        return None
    return (
        f"The folder {path} cannot be made or written in: {cause}. Nothing was written. "
        f"Fix: give a folder you can write in ({key}=PATH)."
    )


@dataclass
class _TakenOver:
    """What ``RunFolderCallback`` took over from Hydra for this process's run."""

    run_dir: Path
    existing: Path  # the run folder itself if it existed, else its nearest existing ancestor
    output_subdir: str | None  # Hydra's ``.hydra`` (None: Hydra was told not to write it)
    log_files: list[tuple[str, str]]  # (file name, record format) of Hydra's job log files


_taken_over: _TakenOver | None = None


class RunFolderCallback(Callback):
    """Hydra callback: check a single run before Hydra writes into its folder.

    Registered in ``conf/config.yaml`` (``hydra.callbacks.run_folder``).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a sweep folder that cannot be made, a sweeper that would tune the wrong
        way, or a search that cannot run as asked (``search_problem``: its database, its
        number of trials, a value it could draw), before its first trial (each trial would
        be refused the same way, after the sweep had started)."""
        task_cfg = task_config(config)
        problem = folder_problem(Path(str(config.hydra.sweep.dir)), "hydra.sweep.dir")
        if problem is not None:
            sys.exit(f"error: {problem}")
        try:
            check_sweep_direction(task_cfg, sweeper_direction(config.hydra.sweeper))
        except USER_ERRORS as err:
            sys.exit(f"error: {err}")
        problem = search_problem(config)
        if problem is not None:
            sys.exit(f"error: {problem}")
        take_sweep_job_hydra_files(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep job: write the ``.hydra/`` files Hydra was told not to write
        (``take_sweep_job_hydra_files``), unless the job folder holds a run of other
        overrides, which the job refuses, or a finished run, which the job reports: that
        run's record stays as it is (a sweep run again with its values in another order
        gives the job another number and other sweep overrides in ``hydra.yaml``)."""
        subdir = sweep_job_output_subdir(config)
        if subdir is None:
            return
        run_dir = Path(str(config.hydra.runtime.output_dir))
        try:
            check_run_overrides(
                run_dir, list(config.hydra.overrides.task), override_dirname_excludes(config.hydra)
            )
        except ConfigError:
            return  # train() refuses the job and says why in train.log
        task_cfg = task_config(config)
        if finished_results(run_dir, task_cfg.trainer) is not None:
            return  # train() says it has finished
        keep_finished_record(run_dir, subdir)  # trained further: before .hydra/ is the longer run's
        write_hydra_files(run_dir, subdir, task_cfg, config.hydra)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a bad or finished command before Hydra creates or writes anything."""
        task_cfg = task_config(config)
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        try:
            preflight(task_cfg)
            check_run_overrides(
                run_dir,
                list(config.hydra.overrides.task),
                override_dirname_excludes(config.hydra),
            )
        except USER_ERRORS as err:
            sys.exit(f"error: {err}")
        results = finished_results(run_dir, task_cfg.trainer)
        if results is not None:
            say_finished(run_dir, results, task_cfg.trainer)
            sys.exit(0)
        take_over_run_folder(config, run_dir)


def take_over_run_folder(config: DictConfig, run_dir: Path) -> None:
    """Take Hydra's writes into the single run's folder ``run_dir`` over (``.hydra/`` and the
    job's log files), for ``RunFolder.accept`` to make once the command is accepted; a
    folder that cannot be made or written in ends the command with one line.

    Called by a Hydra callback's ``on_run_start``, before Hydra creates the folder.
    """
    global _taken_over
    problem = folder_problem(run_dir, "hydra.run.dir")
    if problem is not None:
        sys.exit(f"error: {problem}")
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.runtime.output_dir = str(run_dir)  # run_job sets the same value
        job_logging = OmegaConf.to_container(config.hydra.job_logging, resolve=True)
        log_files = _take_file_handlers(config.hydra.job_logging, job_logging)
        subdir = config.hydra.output_subdir
        _taken_over = _TakenOver(
            run_dir, first_existing(run_dir), None if subdir is None else str(subdir), log_files
        )
        config.hydra.output_subdir = None  # RunFolder.accept writes .hydra


#: Run-folder locks this process holds (``RunFolder.lock``): file descriptors.
_HELD_LOCKS: set[int] = set()


def _drop_locks_in_child() -> None:
    """A forked child (a DataLoader worker) closes its copies of the run-folder locks.

    A ``flock`` lasts while any descriptor of it is open, and a forked child inherits them:
    a run whose main process was killed alone (``kill -9 PID``, the OOM killer) kept its
    folder locked until its orphaned loader workers noticed, seconds later, and a restart
    in between was refused. Closed (not unlocked) in the child, the parent keeps its lock.
    """
    for fd in _HELD_LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_locks_in_child)


def write_hydra_files(run_dir: Path, subdir: str, task_cfg: DictConfig, hydra: DictConfig) -> None:
    """Hydra's ``config.yaml``, ``hydra.yaml`` and ``overrides.yaml`` in ``run_dir/subdir``,
    as Hydra writes them (``hydra.yaml`` naming ``subdir``, without the override by which a
    sweep's jobs write them themselves), but each atomically: a resumed session replaces the
    earlier one's whole or not at all (a full disk or a kill in Hydra's in-place write left
    a truncated file)."""
    hydra_cfg = copy.deepcopy(OmegaConf.create({"hydra": hydra}))  # {"hydra": ...}, as saved
    with read_write(hydra_cfg.hydra), open_dict(hydra_cfg.hydra):
        hydra_cfg.hydra.output_subdir = subdir
        hydra_cfg.hydra.overrides.hydra = [
            o for o in hydra_cfg.hydra.overrides.hydra if str(o) != NO_OUTPUT_SUBDIR
        ]
    for name, node in (
        ("config.yaml", task_cfg),
        ("hydra.yaml", hydra_cfg),
        ("overrides.yaml", hydra_cfg.hydra.overrides.task),
    ):
        atomic_write_text(run_dir / subdir / name, OmegaConf.to_yaml(node))


#: The files of a run folder that a session rewrites, besides its checkpoints and its
#: appended logs: a finished run's record (``keep_finished_record``).
RECORD_FILES = (
    RESULTS_FILE,
    TEST_ERRORS_FILE,
    RESOLVED_CONFIG_FILE,
    RUN_OVERRIDES_FILE,
    LABELS_FILE,
    "env.txt",
)


def keep_finished_record(run_dir: Path, hydra_subdir: str | None) -> Path | None:
    """Copy the record of a finished run in ``run_dir`` to ``earlier/finished_<N>_epochs/``
    before a session that trains it further rewrites it; returns the copy's folder.

    A finished run trained further (``trainer.epochs`` raised) wrote its new
    ``results.json``, ``test_errors.md``, configs and ``.hydra/`` over the earlier ones: the
    figures of the first N epochs were lost. A record is known by its ``results.json``:
    called again while that is unchanged (a sweep job's ``.hydra/`` is written before its
    run is accepted; the longer session interrupted and resumed, its configs already the
    longer run's), it finds the copy made first and adds none. None when the folder holds
    no ``results.json`` (not finished before).
    """
    try:
        completed = RunResults.read(run_dir / RESULTS_FILE).completed_epochs
    except (OSError, ValueError):
        return None
    files = [name for name in RECORD_FILES if (run_dir / name).is_file()]
    if hydra_subdir and (run_dir / hydra_subdir).is_dir():
        files += [
            f"{hydra_subdir}/{p.name}" for p in sorted((run_dir / hydra_subdir).glob("*.yaml"))
        ]
    record = {name: (run_dir / name).read_bytes() for name in files}
    base = run_dir / EARLIER_RECORDS_DIR / f"finished_{completed}_epochs"
    copy_dir, number = base, 1
    while copy_dir.exists():
        with contextlib.suppress(OSError):
            if (copy_dir / RESULTS_FILE).read_bytes() == record[RESULTS_FILE]:
                return copy_dir  # kept already, before the configs were rewritten
        number += 1
        copy_dir = base.with_name(f"{base.name}_{number}")
    # Written whole into a hidden folder, then renamed: a kill mid-copy leaves no partial
    # copy for the next session to mistake for another record.
    copy_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{copy_dir.name}.", dir=copy_dir.parent))
    try:
        for name, data in record.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        os.rename(staging, copy_dir)
    except OSError as err:
        raise ConfigError(
            f"Cannot keep the record of this run's first {completed} epoch(s) in {copy_dir} "
            f"before training it further ({err}); nothing was changed. Fix: make room in or "
            "give write access to the run folder, then run the command again."
        ) from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info(
        "This run finished %s epoch%s before; it trains further now, and the record of those "
        "(results.json, test_errors.md, configs) is kept in %s",
        completed,
        "" if completed == 1 else "s",
        copy_dir,
    )
    return copy_dir


def holds_training_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run of ``recipes/train.py`` (accepted, or with checkpoints
    or results)."""
    return any(
        (run_dir / name).exists()
        for name in (RESOLVED_CONFIG_FILE, RUN_OVERRIDES_FILE, RESULTS_FILE, "checkpoints")
    )


class ToolFolderCallback(Callback):
    """Hydra callback of the tools that write a run folder of their own
    (``recipes/benchmark.py``: ``conf/benchmark.yaml``): refuse a bad command before Hydra
    writes into the folder, as ``RunFolderCallback`` does for training.

    A benchmark refused for a bad value or a missing GPU left a new folder behind holding
    Hydra's ``.hydra/`` and an empty log. The tool's ``preflight`` (a function's dotted
    path, called with the task's config; it raises one of ``USER_ERRORS``) runs first; then
    Hydra's writes are taken over (``take_over_run_folder``): the tool's ``RunFolder``
    makes them once it starts its work (``accept(..., run_record=False)``), and a command
    refused before that leaves no folder (``abandon``).
    """

    def __init__(self, preflight: str) -> None:
        self.preflight = preflight

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Exit with one line, before Hydra creates or writes anything, if the tool's
        preflight refuses the command; else take Hydra's writes over."""
        from hydra.utils import get_method

        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        try:
            get_method(self.preflight)(task_config(config))
        except USER_ERRORS as err:
            sys.exit(f"error: {err}")
        take_over_run_folder(config, run_dir)


class DiagnosisFolderCallback(ToolFolderCallback):
    """Hydra callback of ``recipes/diagnose.py`` (``conf/diagnose.yaml``): refuse a run
    folder that holds a training run, or a bad command, before Hydra writes into it.

    A diagnosis writes its config (``.hydra/``), its log and its report into its own
    folder. Pointed at a training run's folder (``hydra.run.dir=RUN``), Hydra wrote the
    diagnosis's config over the run's ``.hydra/config.yaml`` and ``hydra.yaml``, and its
    histograms became a run nested in the run's ``tb/``. A diagnosis refused for a bad value
    left a new folder behind (``ToolFolderCallback``).
    """

    def __init__(self, preflight: str = "recipes.preflight.preflight_diagnosis") -> None:
        super().__init__(preflight)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Exit with one line, before Hydra creates or writes anything, if the folder holds
        a training run or the command is refused; else take Hydra's writes over."""
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        if holds_training_run(run_dir):
            sys.exit(
                f"error: {run_dir} holds a training run; a diagnosis there would write its "
                "config over the run's .hydra/ files and its report and TensorBoard "
                "histograms among the run's. Nothing was changed. Fix: leave hydra.run.dir "
                "out (diagnoses go to outputs/<data>/<model>/diagnose/...) or give a folder "
                "of its own."
            )
        super().on_run_start(config, **kwargs)


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
        self._lock_fd: int | None = None
        self._buffer: logging.handlers.MemoryHandler | None = None
        if taken and taken.log_files:  # keep the log lines until the log file may be written
            self._buffer = logging.handlers.MemoryHandler(
                capacity=sys.maxsize, flushLevel=logging.CRITICAL + 1
            )
            logging.getLogger().addHandler(self._buffer)

    def lock(self) -> None:
        """Hold the run folder for this process until ``release``, or until the process ends
        however it ends (the kernel drops the lock of a killed process).

        Two processes training one folder (a command started again while its run still
        runs, a requeued job beside the one it replaces) rotated each other's checkpoints
        away, appended to one ``train.log`` and wrote ``results.json`` each, the last one
        winning. The lock is ``flock`` on the folder itself, so no lock file is left behind.
        A filesystem without locks (some network filesystems) gets a warning instead.

        Raises:
            ConfigError: another process holds the folder, naming it and the fix.
        """
        if fcntl is None or self._lock_fd is not None:
            return
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # not in children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                logger.warning(
                    "Cannot lock the run folder %s (%s): nothing stops a second process from "
                    "training in it at the same time.",
                    self.path,
                    err,
                )
                return
            raise ConfigError(
                f"The run folder {self.path} is in use by another training process (this "
                "command's run still running?). Two processes in one folder delete each "
                "other's checkpoints and overwrite each other's results. Fix: let that run "
                "end (or stop it, then run this command again to resume it), or give this "
                "command its own folder (hydra.run.dir=PATH)."
            ) from None
        self._lock_fd = fd
        _HELD_LOCKS.add(fd)

    def release(self) -> None:
        """Let other processes have the folder (``lock``); a no-op if not held."""
        if self._lock_fd is None:
            return
        _HELD_LOCKS.discard(self._lock_fd)
        try:  # unlocked, not only closed: a child forked otherwise may share the descriptor
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def accept(self, cfg: DictConfig, write_files: bool = True, run_record: bool = True) -> None:
        """The run goes ahead: write its config record and start its log file.

        Writes ``config_resolved.yaml`` and, when Hydra's writes were taken over, the
        ``.hydra/`` files Hydra would have written; ``write_files=False`` (DDP ranks other
        than 0) only starts the log file. ``run_record=False`` (the tools' folders:
        benchmark, diagnosis) writes only what Hydra would have written, ``.hydra/`` and
        the log: a training run's record (``config_resolved.yaml``, ``run_overrides.yaml``)
        would make the folder pass for a training run's (``holds_training_run``).
        """
        if self.accepted:
            return
        self.accepted = True
        if write_files and not run_record:
            self.path.mkdir(parents=True, exist_ok=True)
            if self._taken is not None and self._taken.output_subdir is not None:
                self._write_hydra_files(cfg)
        elif write_files:
            self.path.mkdir(parents=True, exist_ok=True)
            hydra_subdir = self._taken.output_subdir if self._taken is not None else None
            keep_finished_record(self.path, hydra_subdir or ".hydra")
            # atomic: a resumed session replaces the earlier one's record whole or not at all
            atomic_write_text(
                self.path / RESOLVED_CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True)
            )
            overrides = hydra_task_overrides()
            if overrides is not None:  # what check_run_overrides compares a later command with
                atomic_write_text(
                    self.path / RUN_OVERRIDES_FILE, OmegaConf.to_yaml(OmegaConf.create(overrides))
                )
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

        hydra = HydraConfig.instance().cfg.hydra
        write_hydra_files(self.path, self._taken.output_subdir, cfg, hydra)

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
