"""The jobs of a ``-m`` sweep: which folder each goes into, how each went, how one ends.

* ``sweep_job_folder`` (the resolver of ``hydra.sweep.subdir``) sends a job into the folder
  of its overrides in ``hydra.sweep.dir``: a sweep run again with fewer, more or reordered
  values finds its finished configurations (``choose_sweep_job_folder``);
* ``run_job`` runs a job (a single run too): bad input in one line; a failed sweep job ends
  alone and the sweep goes on; its ``job_status.json`` (``JobStatus``) tells the sweep's
  summary how it went;
* a sweep's jobs write Hydra's ``.hydra/`` files themselves
  (``take_sweep_job_hydra_files``), so that a job refused in a finished run's folder
  leaves that run's record alone (``recipes/run_folder.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not on Windows: sweep folders are not locked
    fcntl = None  # type: ignore[assignment]

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from amp_utils.atomic import atomic_write_text
from amp_utils.distributed import launch_rank, lost_a_peer, lost_a_peer_message
from amp_utils.interruption import RESUME_HINT, TrainingInterrupted
from amp_utils.sweep_keys import fit_folder_name
from amp_utils.sweep_summary import (
    JOB_STATUS_FILE,
    MULTIRUN_ID_ENV,
    MULTIRUN_ID_FILE,
    sweep_dir_given,
)
from recipes.preflight import USER_ERRORS, sweeper_direction
from recipes.run_overrides import (
    override_differences,
    override_dirname_excludes,
    override_list,
    recorded_overrides,
    resume_excludes,
)

logger = logging.getLogger(__name__)


#: The Hydra override by which a sweep's jobs leave ``.hydra/`` to ``on_job_start``, and
#: the environment variable holding the folder name it replaces (jobs inherit it).
NO_OUTPUT_SUBDIR = "hydra.output_subdir=null"


SWEEP_OUTPUT_SUBDIR_ENV = "AMP_UTILS_SWEEP_OUTPUT_SUBDIR"


def take_sweep_job_hydra_files(config: DictConfig) -> None:
    """Tell Hydra not to write its ``.hydra/`` files into a sweep's job folders.

    Hydra writes them before any callback or the job can look at the folder. A sweep run
    again into its folder with another fixed value lands in the finished jobs' folders and
    is refused there (``check_run_overrides``), but Hydra had written the refused
    command's config over the finished run's record. ``RunFolderCallback.on_job_start``
    writes the same files instead, where the job is not refused. Each job composes its
    config from the multirun's Hydra overrides, so one more override reaches every job.
    """
    subdir = config.hydra.output_subdir
    if subdir is None:  # the user asked for no .hydra/ files
        return
    os.environ[SWEEP_OUTPUT_SUBDIR_ENV] = str(subdir)
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.overrides.hydra.append(NO_OUTPUT_SUBDIR)


def sweep_job_output_subdir(config: DictConfig) -> str | None:
    """The ``.hydra/`` folder name a sweep job writes itself (None: Hydra wrote it, or
    none is wanted)."""
    if config.hydra.output_subdir is not None:
        return None
    if NO_OUTPUT_SUBDIR not in [str(o) for o in config.hydra.overrides.hydra]:
        return None
    return os.environ.get(SWEEP_OUTPUT_SUBDIR_ENV, ".hydra")  # a launcher without its env


#: A sweep job folder's name: its number, "_", its name (``sweep_job_folder``).
_NUMBERED_FOLDER = re.compile(r"(\d+)_")


#: The folder each sweep job of this process was given: (sweep folder, multirun, job
#: number, overrides) -> folder name, so that resolving ``hydra.sweep.subdir`` again gives
#: the same folder once the job has made it.
_chosen_job_folders: dict[tuple[str, str | None, int, tuple[str, ...]], str] = {}


def job_folder_overrides(job_dir: Path) -> list[str] | None:
    """The overrides a sweep job folder records: its run's (``recorded_overrides``), else
    the ``.hydra/overrides.yaml`` its job wrote when it started (a job refused or killed
    before its run was accepted); None when it records none."""
    recorded = recorded_overrides(job_dir)
    if recorded is not None:
        return recorded
    subdir = os.environ.get(SWEEP_OUTPUT_SUBDIR_ENV, ".hydra")
    return override_list(job_dir / subdir / "overrides.yaml")


def numbered_folder(number: Any, name: str) -> str:
    """A sweep job folder's name, ``{number}_{name}``, cut to the 255 bytes a folder name
    may have (``fit_folder_name``: the number and the start stay, a hash ends it)."""
    return fit_folder_name(f"{number}_{name}")


def _folder_number(folder: Path) -> int | None:
    match = _NUMBERED_FOLDER.match(folder.name)
    return int(match.group(1)) if match else None


def choose_sweep_job_folder(
    sweep_dir: Path,
    num: int,
    name: str,
    overrides: Sequence[str],
    exclude_keys: Collection[str],
    multirun: str | None,
) -> str:
    """The folder (a name in ``sweep_dir``) of sweep job ``num`` of ``multirun``, whose
    command-line overrides are ``overrides`` and whose name is ``name``.

    Hydra numbers a sweep's jobs by their place in the command, so a sweep run again into
    its folder with fewer, more or reordered values (``-m precision=fp32,bf16``, then
    ``-m precision=bf16,fp32,fp16``) gave a finished configuration a new folder and trained
    it again from scratch. In order:

    1. the folder this job already took (resolved again, another DDP rank of it);
    2. a folder whose recorded overrides (``job_folder_overrides``) this job may continue
       by ``check_run_overrides``' rule (``exclude_keys`` such as ``trainer.epochs`` may
       differ): a finished run there is answered "finished", an unfinished one resumes.
       A folder another job of this multirun took is left to it (``-m trainer.epochs=5,10``
       keeps two runs). Preferred: the same overrides exactly, then ``{num}_{name}``, then
       the lowest number;
    3. a new folder ``{n}_{name}``, ``n`` from ``num`` up, with a number no folder of
       other overrides (or of another job of this multirun) has.
    """
    folders = sorted((p for p in sweep_dir.iterdir() if p.is_dir()), key=lambda p: p.name)
    recorded = {folder: job_folder_overrides(folder) for folder in folders}
    claims = {folder: JobStatus.read(folder) for folder in folders}

    def taken_by_another(folder: Path) -> bool:
        claim_multirun, claim_job = claims[folder]
        return multirun is not None and claim_multirun == multirun and claim_job != num

    def continues(folder: Path) -> bool:
        there = recorded[folder]
        return there is not None and not override_differences(
            there, overrides, resume_excludes(exclude_keys)
        )

    for folder in folders:  # 1.
        taken = multirun is not None and claims[folder] == (multirun, num)
        if taken and (recorded[folder] is None or continues(folder)):
            return folder.name
    natural = numbered_folder(num, name)
    matching = [f for f in folders if not taken_by_another(f) and continues(f)]  # 2.
    if matching:
        return min(
            matching,
            key=lambda f: (
                bool(override_differences(recorded[f], overrides, ())),
                f.name != natural,
                _folder_number(f) is None,
                _folder_number(f) or 0,
                f.name,
            ),
        ).name
    by_number: dict[int, list[Path]] = {}
    for folder in folders:
        number = _folder_number(folder)
        if number is not None:
            by_number.setdefault(number, []).append(folder)
    number = num  # 3.
    while True:
        candidate = numbered_folder(number, name)
        if all(
            f.name == candidate and recorded[f] is None and not taken_by_another(f)
            for f in by_number.get(number, [])
        ):
            return candidate
        number += 1


@contextlib.contextmanager
def _sweep_folder_locked(sweep_dir: Path):
    """Hold ``sweep_dir`` (``flock``, waiting for it) while a job picks and takes its folder:
    jobs started side by side (submitit, joblib) see each other's choices. A filesystem
    without locks picks without."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(sweep_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):  # no locks here: pick without
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def sweep_job_folder(num: Any, name: str, *, _root_: DictConfig) -> str:
    """The resolver ``${sweep_job_folder:${hydra.job.num},NAME}`` of ``hydra.sweep.subdir``:
    the folder of this sweep job, ``choose_sweep_job_folder``'s choice.

    Hydra resolves the subdir in the job's own process (``hydra.core.utils.run_job``), just
    before it makes the folder, so the choice sees the folders earlier jobs made, also those
    of an earlier sweep into the same ``hydra.sweep.dir``. The job takes its folder at once
    (its ``job_status.json`` names this multirun and the job number), under a lock on the
    sweep folder: two jobs running side by side never take the same one. The TensorBoard
    run is the folder, so it keeps its name too. Outside a multirun job (``--cfg``), or
    without a job number: ``{num}_{name}``.
    """
    hydra = _root_.hydra
    natural = numbered_folder(num, name)
    number = _job_number(num)
    mode = OmegaConf.select(hydra, "mode", default=None)
    if number is None or getattr(mode, "name", str(mode)) != "MULTIRUN":
        return natural
    sweep_dir = Path(str(hydra.sweep.dir)).absolute()
    overrides = [str(item) for item in hydra.overrides.task]
    multirun = this_multirun(sweep_dir)
    key = (str(sweep_dir), multirun, number, tuple(overrides))
    if key in _chosen_job_folders:
        return _chosen_job_folders[key]
    if not sweep_dir.is_dir():
        return natural
    with _sweep_folder_locked(sweep_dir):
        folder = choose_sweep_job_folder(
            sweep_dir, number, name, overrides, override_dirname_excludes(hydra), multirun
        )
        existed = (sweep_dir / folder).is_dir()
        if launch_rank() == 0 and multirun is not None:  # taken: no other job picks it
            JobStatus(sweep_dir / folder / JOB_STATUS_FILE, multirun, number).write("running")
    if launch_rank() == 0 and folder != natural:  # said once (DDP ranks follow rank 0)
        if existed:
            logger.info("Sweep job %d goes into %s: its configuration's folder", number, folder)
        else:
            logger.info("Sweep job %d gets a new folder, %s (%s is taken)", number, folder, natural)
    _chosen_job_folders[key] = folder
    return folder


def run_job(job: Callable[[], float]) -> float:
    """Run a training job, reporting bad input (``USER_ERRORS``) in one line.

    A single run exits with ``error: ...`` (status 1). A job of a ``-m`` sweep outside DDP
    that fails, with bad input or a crash, ends alone: the error goes to its ``train.log``
    (a crash with its traceback) and the job returns the worst value for the sweeper's
    direction (``failed_job_value``); the sweep goes on, and its summary lists the job as
    failed (``SweepSummaryCallback``). A sweep job records how it went in its folder's
    ``job_status.json`` (``JobStatus``), for the summary of the multirun that launched it.
    Under DDP, a rank whose collective failed because another rank ended (``kill -9``, a
    crash: ``lost_a_peer``) exits with one ``error:`` line saying so and how to resume,
    also written to ``train.log``, instead of gloo's traceback.
    """
    status = JobStatus.for_this_job()
    status.write("running")
    try:
        value = job()
        status.write("finished")
        return value
    except TrainingInterrupted as err:  # a signal: saved (or nothing to save), how to resume
        hint = sweep_resume_hint()
        message = str(err) if hint is None else str(err).replace(RESUME_HINT, hint)
        log_to_files(logging.WARNING, message)  # train.log says why this session ended
        if hint is None:
            raise
        raise type(err)(message) from None
    except USER_ERRORS as err:  # bad input: one line, no traceback, printed once
        log_to_files(logging.ERROR, f"{type(err).__name__}: {err}")  # the run's train.log
        status.write("failed", f"{type(err).__name__}: {err}")
        if not in_single_process_sweep():
            sys.exit(f"error: {err}")
        print(f"error: {err}\n(this sweep job failed; the sweep goes on)", file=sys.stderr)
    except Exception as err:
        status.write("failed", f"{type(err).__name__}: {err}")
        if lost_a_peer(err):  # another DDP rank ended: one line, not gloo's traceback
            message = lost_a_peer_message(err)
            log_to_files(logging.ERROR, message)  # train.log says why the run stopped
            sys.exit(f"error: {message}")
        if not in_single_process_sweep():
            raise
        logger.exception("This sweep job failed; the sweep goes on.")
    return failed_job_value()


def sweep_resume_hint() -> str | None:
    """How to resume this ``-m`` sweep job, when the same command would not: its sweep folder
    is named by the clock (``multirun/${now:...}``, the default), so the same command starts
    a new sweep in a new folder and trains every job from scratch. Names the folder to give
    (``hydra.sweep.dir=PATH``); None outside sweeps or when the command fixed the folder."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra_cfg = HydraConfig.get()
    if sweep_dir_given(hydra_cfg):  # fixed on the command line: the same command finds it
        return None
    sweep_dir = Path(str(hydra_cfg.sweep.dir)).absolute()
    return (
        f"Run the same command again with hydra.sweep.dir={sweep_dir} to resume where it "
        "stopped (without it the sweep starts again in a new folder named by the clock, "
        "every job from scratch)."
    )


def resume_hint() -> str:
    """How to go on with this command after a signal: :func:`sweep_resume_hint` in a sweep
    whose folder is named by the clock, else the same command (``RESUME_HINT``). Asked
    when the signal comes (``recipes/train.py``'s ``RunSignals``): Hydra sets the sweep's
    folder up after the process started."""
    return sweep_resume_hint() or RESUME_HINT


def failed_job_value() -> float:
    """What a failed sweep job returns: the worst value for the sweeper's direction (``inf``
    when it minimises, ``-inf`` when it maximises), else NaN.

    The Optuna sweeper (hydra-optuna-sweeper 1.2) tells Optuna a NaN as a completed trial,
    which Optuna refuses, and then as a failed one with a value, which it refuses too: the
    whole study stopped at the first failed trial, without its summary. An infinite value
    is a completed trial as bad as can be, and the search goes on.
    """
    from hydra.core.hydra_config import HydraConfig

    direction = sweeper_direction(HydraConfig.get().sweeper) if HydraConfig.initialized() else None
    if direction is None:
        return float("nan")
    return float("-inf") if direction.lower() == "maximize" else float("inf")


@dataclass
class JobStatus:
    """A sweep job's ``job_status.json``: the multirun that launched it (the id that
    ``SweepSummaryCallback`` wrote into the sweep folder), and ``running``, ``finished`` or
    ``failed`` (with the error). A job killed outside Python stays ``running``.

    The summary of a sweep run again into the same folder thus lists the jobs it launched
    and how they went this time: not a job of an earlier sweep, nor an earlier attempt's
    ``results.json`` as this attempt's. Only a sweep job's rank 0 writes one (``path``
    None: nothing is written).
    """

    path: Path | None
    multirun: str | None
    job: int | None = None  # the job's number in its multirun (``hydra.job.num``)

    @classmethod
    def for_this_job(cls) -> JobStatus:
        """The status file of this process's sweep job; a no-op one outside sweeps."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
            return cls(None, None)
        if launch_rank() != 0:
            return cls(None, None)
        hydra_cfg = HydraConfig.get()
        return cls(
            Path(hydra_cfg.runtime.output_dir) / JOB_STATUS_FILE,
            this_multirun(Path(hydra_cfg.sweep.dir)),
            _job_number(hydra_cfg.job.get("num")),
        )

    @classmethod
    def read(cls, job_dir: Path) -> tuple[str | None, int | None]:
        """The multirun and job number a job folder's ``job_status.json`` names (None, None
        when it has none)."""
        try:
            record = json.loads((job_dir / JOB_STATUS_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None, None
        if not isinstance(record, dict):
            return None, None
        return record.get("multirun") or None, _job_number(record.get("job"))

    def write(self, status: str, error: str | None = None) -> None:
        """Record ``status`` (atomically; a status that cannot be written is a warning)."""
        if self.path is None:
            return
        record = {"multirun": self.multirun, "job": self.job, "status": status, "error": error}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(record, indent=2) + "\n")
        except OSError as err:
            logger.warning("Cannot write %s: %s", self.path, err)


def _job_number(value: Any) -> int | None:
    """A job number (``hydra.job.num``) as an int; None if it is not one."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def this_multirun(sweep_dir: Path) -> str | None:
    """The id of the multirun this process runs a job of (``SweepSummaryCallback``): from
    the environment, which local, submitit and SLURM jobs inherit, else the one its rank 0
    wrote into the sweep folder. A DDP rank other than 0 under ``torchrun -m`` began a
    multirun of its own (an id only it knows): it takes its rank 0's, from the folder."""
    from_env = os.environ.get(MULTIRUN_ID_ENV) or None
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if from_env is not None and (launch_rank() == 0 or not under_torchrun):
        return from_env
    try:
        return (sweep_dir / MULTIRUN_ID_FILE).read_text().strip() or from_env
    except OSError:
        return from_env


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
