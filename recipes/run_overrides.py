"""Which run a run folder holds, and whether a command goes on with it.

A run folder records the command-line overrides of its run (``run_overrides.yaml``, or its
``results.json``'s). A command resumes or extends that run only if its overrides describe
the same run: they may differ in the keys left out of folder names (``trainer.epochs`` and
the like, ``override_dirname_excludes``) and in ``MAY_CHANGE_ON_RESUME``
(``check_run_overrides``). A run has finished once its ``results.json`` holds the epochs
the command plans (``finished_results``); rerun, it says so and changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_utils.distributed import launch_rank
from amp_utils.run_results import RESULTS_FILE, RunResults
from recipes.config import ConfigError

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


def override_list(path: Path) -> list[str] | None:
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
    recorded = override_list(run_dir / RUN_OVERRIDES_FILE)
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


def say_finished(run_dir: Path, results: RunResults, trainer: Any) -> None:
    """Print ``finished_message`` to the console, from rank 0 alone: under DDP every rank
    finds the run finished, and the console printed the same line once per rank."""
    if launch_rank() == 0:
        print(finished_message(run_dir, results, trainer), flush=True)


def hydra_task_overrides() -> list[str] | None:
    """The command's overrides under ``@hydra.main`` (None when composed otherwise: tests,
    notebooks)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return [str(item) for item in HydraConfig.get().overrides.task]
