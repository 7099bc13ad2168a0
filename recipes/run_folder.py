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

import contextlib
import copy
import errno
import json
import logging
import logging.handlers
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
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
from amp_utils.distributed import launch_rank, lost_a_peer, lost_a_peer_message
from amp_utils.interruption import RESUME_HINT, TrainingInterrupted
from amp_utils.run_results import EARLIER_RECORDS_DIR, RESULTS_FILE, RunResults
from amp_utils.sweep_summary import (
    JOB_STATUS_FILE,
    MULTIRUN_ID_ENV,
    MULTIRUN_ID_FILE,
    sweep_dir_given,
)
from recipes.config import ConfigError
from recipes.error_report import TEST_ERRORS_FILE
from recipes.preflight import USER_ERRORS, check_sweep_direction, preflight, sweeper_direction

logger = logging.getLogger(__name__)

LABELS_FILE = "labels.json"  # the task and its speaker names, for inference
RESOLVED_CONFIG_FILE = "config_resolved.yaml"  # the config with every interpolation resolved
#: The command-line overrides of the run's sessions (the last one's): what the folder holds.
RUN_OVERRIDES_FILE = "run_overrides.yaml"


#: Keys a resumed run may change besides those left out of folder names: a run resumed
#: under another number of processes keeps its effective batch with another accumulation
#: factor (2 processes x 1 for 1 x 2; the Brain checks the epoch position fits).
MAY_CHANGE_ON_RESUME = ("trainer.grad_accumulation_factor",)


def _parsed_overrides(overrides: Sequence[str], exclude_keys: Collection[str]) -> dict[str, Any]:
    """``key -> value`` of Hydra overrides, values parsed (``1e-3`` equals ``0.001``);
    Hydra's own keys (``hydra.*``, ``hydra/...``) and ``exclude_keys`` left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = {}
    for override in OverridesParser.create().parse_overrides(list(overrides)):
        key = override.key_or_group + (f"@{override.package}" if override.package else "")
        if key in exclude_keys or key.startswith(("hydra.", "hydra/")) or key == "hydra":
            continue
        value = None if override.is_delete() else override.value()
        # ~key is not key=null, nor true 1: a value compares with its kind
        kind = "bool" if isinstance(value, bool) else ""
        parsed[key] = (override.is_delete(), kind, value)
    return parsed


def _override_list(path: Path) -> list[str] | None:
    """The list of overrides saved in the YAML file ``path``; None if it is missing, cannot
    be read or holds no list."""
    try:
        saved = OmegaConf.to_container(OmegaConf.load(path))
    except (OSError, ValueError):
        return None
    return [str(item) for item in saved] if isinstance(saved, list) else None


def recorded_overrides(run_dir: Path) -> list[str] | None:
    """The overrides of the run in ``run_dir``: ``run_overrides.yaml``, else (a run from
    before that file) its ``results.json``'s; None when the folder records none."""
    recorded = _override_list(run_dir / RUN_OVERRIDES_FILE)
    if recorded is not None:
        return recorded
    try:
        from_results = RunResults.read(run_dir / RESULTS_FILE).overrides
    except (OSError, ValueError):
        return None
    return [str(item) for item in from_results] if isinstance(from_results, list) else None


def override_differences(
    recorded: Sequence[str], overrides: Sequence[str], exclude_keys: Collection[str]
) -> list[str]:
    """``"key: value there, value now"`` for each key whose parsed value differs between
    the ``recorded`` overrides and ``overrides`` (``exclude_keys`` and Hydra's own keys left
    out); empty when they describe the same run."""
    there = _parsed_overrides(recorded, exclude_keys)
    now = _parsed_overrides(overrides, exclude_keys)
    return [
        f"{key}: {_shown(there, key)} there, {_shown(now, key)} now"
        for key in sorted(there.keys() | now.keys())
        if there.get(key, _UNSET) != now.get(key, _UNSET)
    ]


def resume_excludes(exclude_keys: Collection[str]) -> set[str]:
    """The keys a resumed run may change: those left out of folder names
    (``exclude_keys``) and ``MAY_CHANGE_ON_RESUME``."""
    return {*exclude_keys, *MAY_CHANGE_ON_RESUME}


def check_run_overrides(
    run_dir: Path, overrides: Sequence[str], exclude_keys: Collection[str]
) -> None:
    """Refuse to resume, extend or report a run of other overrides than this command's.

    A run folder is named after its overrides (``hydra.job.override_dirname``), so two
    commands that share one differ only in ``exclude_keys`` (``trainer.epochs`` and the
    like). A fixed folder (``hydra.run.dir=PATH``, or a sweep run again into the same
    ``hydra.sweep.dir`` with its own ``hydra.sweep.subdir``) breaks that: the run would
    resume another configuration's checkpoint, or its finished results would be reported
    as this one's. (The default sweep subdir, ``sweep_job_folder``, never picks such a
    folder.)

    Raises:
        ConfigError: naming each key whose value differs, and the fix.
    """
    recorded = recorded_overrides(run_dir)
    if recorded is None:
        return
    differences = override_differences(recorded, overrides, resume_excludes(exclude_keys))
    if differences:
        raise ConfigError(
            f"The run folder {run_dir} holds a run of other overrides ({'; '.join(differences)})."
            " Resuming it would mix two configurations, and its results are not this "
            "command's. Fix: give this command its own folder (hydra.run.dir=PATH, or a new "
            "hydra.sweep.dir for -m), or repeat that run's overrides to continue it."
        )


_UNSET = object()


def _shown(overrides: dict[str, Any], key: str) -> str:
    if key not in overrides:
        return "not set"
    deleted, _, value = overrides[key]
    return "deleted" if deleted else repr(value)


def override_dirname_excludes(hydra_cfg: DictConfig) -> list[str]:
    """The keys left out of run folder names (``hydra.job.config.override_dirname``)."""
    keys = OmegaConf.select(hydra_cfg, "job.config.override_dirname.exclude_keys", default=[])
    return [str(key) for key in keys or []]


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


def sweep_choice_problem(config: DictConfig) -> str | None:
    """What is wrong with a value a trial-drawing sweeper could choose, or None.

    Hydra's basic sweeper composes every job before the first one runs, so a typo in
    ``precision=fp32,bf61`` fails at once. A sweeper that draws its trials (Optuna)
    composes each trial when it draws it: a typo in a ``choice(...)`` (on the command line
    or in ``hydra.sweeper.params``) ended the sweep at the first trial that drew it, after
    the earlier ones had trained. Each choice is composed here once, beside the first
    choice of every other discrete sweep (intervals keep their config value).
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    texts = [str(o) for o in config.hydra.overrides.task]
    texts += [f"{key}={value}" for key, value in params.items()]
    parsed = OverridesParser.create().parse_overrides(texts)
    plain = [text for text, o in zip(texts, parsed, strict=True) if not o.is_sweep_override()]
    choices = {
        o.get_key_element(): list(o.sweep_string_iterator())
        for o in parsed
        if o.is_discrete_sweep()
    }
    loader = GlobalHydra.instance().config_loader()
    for key, values in choices.items():
        for value in values:
            others = [f"{k}={v[0]}" for k, v in choices.items() if k != key and v]
            try:
                loader.load_sweep_config(config, [*plain, *others, f"{key}={value}"])
            except Exception as err:  # Hydra's composition errors, schema validation
                reason = str(err).split("\nConfig search path:")[0].strip()  # Hydra's listing
                if err.__cause__ is not None:  # "Error merging override ...": and why
                    reason += f" ({str(err.__cause__).splitlines()[0]})"
                return f"the sweep's {key}={value} does not compose: {reason}"
    return None


class RunFolderCallback(Callback):
    """Hydra callback: check a single run before Hydra writes into its folder.

    Registered in ``conf/config.yaml`` (``hydra.callbacks.run_folder``).
    """

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a sweeper that would tune the wrong way, or a choice it would draw that
        does not compose, before its first trial (each trial would be refused the same
        way, after the sweep had started)."""
        task_cfg = _task_config(config)
        try:
            check_sweep_direction(task_cfg, sweeper_direction(config.hydra.sweeper))
        except USER_ERRORS as err:
            sys.exit(f"error: {err}")
        if "params" in config.hydra.sweeper:  # a sweeper that draws trials (Optuna)
            problem = sweep_choice_problem(config)
            if problem is not None:
                sys.exit(f"error: {problem}")
        _take_sweep_job_hydra_files(config)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        """A sweep job: write the ``.hydra/`` files Hydra was told not to write
        (``_take_sweep_job_hydra_files``), unless the job folder holds a run of other
        overrides, which the job refuses, or a finished run, which the job reports: that
        run's record stays as it is (a sweep run again with its values in another order
        gives the job another number and other sweep overrides in ``hydra.yaml``)."""
        subdir = _sweep_job_output_subdir(config)
        if subdir is None:
            return
        run_dir = Path(str(config.hydra.runtime.output_dir))
        try:
            check_run_overrides(
                run_dir, list(config.hydra.overrides.task), override_dirname_excludes(config.hydra)
            )
        except ConfigError:
            return  # train() refuses the job and says why in train.log
        task_cfg = _task_config(config)
        if finished_results(run_dir, task_cfg.trainer) is not None:
            return  # train() says it has finished
        keep_finished_record(run_dir, subdir)  # trained further: before .hydra/ is the longer run's
        write_hydra_files(run_dir, subdir, task_cfg, config.hydra)

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Refuse a bad or finished command before Hydra creates or writes anything."""
        global _taken_over
        task_cfg = _task_config(config)
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


#: The Hydra override by which a sweep's jobs leave ``.hydra/`` to ``on_job_start``, and
#: the environment variable holding the folder name it replaces (jobs inherit it).
_NO_OUTPUT_SUBDIR = "hydra.output_subdir=null"
SWEEP_OUTPUT_SUBDIR_ENV = "AMP_UTILS_SWEEP_OUTPUT_SUBDIR"


def _take_sweep_job_hydra_files(config: DictConfig) -> None:
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
        config.hydra.overrides.hydra.append(_NO_OUTPUT_SUBDIR)


def _sweep_job_output_subdir(config: DictConfig) -> str | None:
    """The ``.hydra/`` folder name a sweep job writes itself (None: Hydra wrote it, or
    none is wanted)."""
    if config.hydra.output_subdir is not None:
        return None
    if _NO_OUTPUT_SUBDIR not in [str(o) for o in config.hydra.overrides.hydra]:
        return None
    return os.environ.get(SWEEP_OUTPUT_SUBDIR_ENV, ".hydra")  # a launcher without its env


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
            o for o in hydra_cfg.hydra.overrides.hydra if str(o) != _NO_OUTPUT_SUBDIR
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
    return _override_list(job_dir / subdir / "overrides.yaml")


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
    natural = f"{num}_{name}"
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
        candidate = f"{number}_{name}"
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
    natural = f"{num}_{name}"
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


def holds_training_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run of ``recipes/train.py`` (accepted, or with checkpoints
    or results)."""
    return any(
        (run_dir / name).exists()
        for name in (RESOLVED_CONFIG_FILE, RUN_OVERRIDES_FILE, RESULTS_FILE, "checkpoints")
    )


class DiagnosisFolderCallback(Callback):
    """Hydra callback of ``recipes/diagnose.py`` (``conf/diagnose.yaml``): refuse a run
    folder that holds a training run, before Hydra writes into it.

    A diagnosis writes its config (``.hydra/``), its log and its report into its own
    folder. Pointed at a training run's folder (``hydra.run.dir=RUN``), Hydra wrote the
    diagnosis's config over the run's ``.hydra/config.yaml`` and ``hydra.yaml``, and its
    histograms became a run nested in the run's ``tb/``.
    """

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Exit with one line, before Hydra creates or writes anything, if the folder holds
        a training run."""
        run_dir = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        if holds_training_run(run_dir):
            sys.exit(
                f"error: {run_dir} holds a training run; a diagnosis there would write its "
                "config over the run's .hydra/ files and its report and TensorBoard "
                "histograms among the run's. Nothing was changed. Fix: leave hydra.run.dir "
                "out (diagnoses go to outputs/<data>/<model>/diagnose/...) or give a folder "
                "of its own."
            )


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


def hydra_task_overrides() -> list[str] | None:
    """The command's overrides under ``@hydra.main`` (None when composed otherwise: tests,
    notebooks)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return [str(item) for item in HydraConfig.get().overrides.task]


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
