"""A hyperparameter search's space and settings, checked before its first trial.

A sweeper that draws trials (Hydra's Optuna sweeper: ``hparams_search=...``) composes each
trial only when it draws it, so a value no trial can run with, a study database that cannot
be opened or a search of no trials failed after the search had started: trials trained,
then the search ended in a traceback or with a refused trial's worst value as its best.
``search_problem`` finds these at the start (``RunFolderCallback.on_multirun_start``), and
the search is refused in one line before anything is written.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from importlib import metadata
from typing import Any

from omegaconf import DictConfig, open_dict, read_write

from recipes.config import validate_config
from recipes.preflight import USER_ERRORS


def task_config(config: DictConfig) -> DictConfig:
    """A callback's config without its ``hydra`` node: what the task function gets."""
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    return task_cfg


def _installed_version(package: str) -> str | None:
    """The installed version of a distribution (None when it is not installed)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def sweeper_storage_problem(
    storage: object, version: Callable[[str], str | None] = _installed_version
) -> str | None:
    """What stops the Optuna sweeper from opening its study's database, or None.

    hydra-optuna-sweeper 1.2 requires Optuna < 3, and Optuna 2 cannot open a database
    (``hydra.sweeper.storage=sqlite:///...``) with SQLAlchemy 2: the search ended at its
    start in an ``AssertionError`` traceback of Optuna's schema check. ``storage`` null (in
    memory) needs no database.

    Args:
        storage: ``hydra.sweeper.storage``.
        version: the installed version of a distribution (for tests).
    """
    if storage is None or not isinstance(storage, str):
        return None
    optuna, sqlalchemy = version("optuna"), version("sqlalchemy")
    if optuna is None or sqlalchemy is None:
        return None
    if int(optuna.split(".")[0]) >= 3 or int(sqlalchemy.split(".")[0]) < 2:
        return None
    return (
        f"hydra.sweeper.storage={storage} needs SQLAlchemy 1.x: Optuna {optuna} (which "
        f"hydra-optuna-sweeper 1.2 requires) cannot open a database with SQLAlchemy "
        f'{sqlalchemy}. Fix: pip install "sqlalchemy<2" "alembic<1.14" (what '
        'pip install -e ".[sweep]" installs), or hydra.sweeper.storage=null (in memory).'
    )


def _drawn_ends(override: Any) -> list[Any]:
    """The values an Optuna sweeper may draw that bound an interval or a range: an
    interval's low end and a value a millionth of its width below its high end (never
    drawn); a range's start and its last step at or below its stop (which Optuna draws too,
    unlike Hydra's ``range``). Empty for other overrides (a choice's values are listed one
    by one)."""
    value = override.value()
    if override.is_interval_sweep():
        low, high = float(value.start), float(value.end)
        below = float(f"{high - (high - low) * 1e-6:.15g}")  # short enough to read
        return [low, below if low < below < high else math.nextafter(high, low)]
    if override.is_range_sweep() and not value.shuffle:
        start, stop, step = value.start, value.stop, value.step
        if not step or (stop - start) / step < 0:
            return [start]
        last = start + math.floor((stop - start) / step) * step
        if all(isinstance(v, int) for v in (start, stop, step)):
            return [start, int(last)]
        return [start, last]
    return []


def sweep_choice_problem(config: DictConfig) -> str | None:
    """What is wrong with a value a trial-drawing sweeper could choose, or None.

    Hydra's basic sweeper composes every job before the first one runs, so a typo in
    ``precision=fp32,bf61`` fails at once. A sweeper that draws its trials (Optuna)
    composes each trial when it draws it: a typo in a ``choice(...)`` (on the command line
    or in ``hydra.sweeper.params``) ended the sweep at the first trial that drew it, after
    the earlier ones had trained. Each choice is composed here once, beside the first
    choice of every other discrete sweep.

    A value that composes but that ``validate_config`` refuses (``model.lr`` below 0, a
    dropout of 1.5) made each trial that drew it fail, and with ``tag(log, ...)`` below 0
    Optuna ended the search in a traceback: each choice and the ends of each interval and
    range (``_drawn_ends``) are validated too, beside the config's values of the other
    searched keys and beside the first and the last values of theirs; a value refused
    beside all of them, for its own key, is the problem. The sweeper's ``params`` (a
    preset's search space, ``hydra.sweeper.params`` overrides) are checked with the
    command line's sweeps, which take their place for the same key, as in the sweeper.
    """
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    # the sweeper's order: its params, then the command line (the last one of a key wins)
    texts = [f"{key}={value}" for key, value in params.items()]
    texts += [str(o) for o in config.hydra.overrides.task]
    parsed = OverridesParser.create().parse_overrides(texts)
    by_key = {o.get_key_element(): (text, o) for text, o in zip(texts, parsed, strict=True)}
    plain = [text for text, o in by_key.values() if not o.is_sweep_override()]
    choices = {
        key: list(o.sweep_string_iterator())
        for key, (_, o) in by_key.items()
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
    drawn: dict[str, list[str]] = {}  # each searched key: the values to validate
    for key, (text, override) in by_key.items():
        log_interval = override.is_interval_sweep() and "log" in override.value().tags
        if log_interval and float(override.value().start) <= 0:
            return (
                f"the sweep's {text} is refused: a log interval needs a low end above 0 "
                f"(got {override.value().start})."
            )
        ends = [f"{key}={value!r}" for value in _drawn_ends(override)]
        if key in choices and not ends:  # a choice, a shuffled range: every value
            ends = [f"{key}={value}" for value in choices[key]]
        if ends:
            drawn[key] = ends
    for key, values in drawn.items():
        others = [v for k, v in drawn.items() if k != key]
        besides = [[], [v[0] for v in others], [v[-1] for v in others]]
        for value in values:
            reasons = [_validation_problem(loader, config, [*plain, *b, value]) for b in besides]
            reason = reasons[0]
            if reason is None or None in reasons:
                continue
            own = reason.startswith((f"{key}=", f"{key}:", f"{key} ")) or (
                key.rsplit(".", 1)[-1] in reason
            )
            if own:
                return f"the sweep's {by_key[key][0]} can draw {value}, which is refused: {reason}"
    return None


def _validation_problem(loader: Any, config: DictConfig, overrides: list[str]) -> str | None:
    """What ``validate_config`` says of the trial of ``overrides`` (None: it runs, or it
    does not compose, which the choices' check and Hydra report)."""
    try:
        trial = loader.load_sweep_config(config, overrides)
    except Exception:  # noqa: BLE001
        return None
    try:
        validate_config(task_config(trial))
    except USER_ERRORS as err:
        return str(err)
    return None


def trial_count_problem(sweeper: DictConfig) -> str | None:
    """What is wrong with the number of trials a search asks for, or None.

    ``hydra.sweeper.n_trials=0`` ended in Optuna's ``ValueError: No trials are completed
    yet`` traceback after the search had started.
    """
    count = sweeper.get("n_trials")
    if isinstance(count, int) and not isinstance(count, bool) and count < 1:
        return (
            f"hydra.sweeper.n_trials={count}: a search needs at least one trial. "
            "Fix: hydra.sweeper.n_trials=N with N of 1 or more."
        )
    return None


def search_problem(config: DictConfig) -> str | None:
    """What stops a sweep's search from running as asked, or None (a sweeper that draws
    no trials, such as Hydra's basic sweeper, has nothing to check here).

    Args:
        config: the multirun's config, ``hydra`` node included.
    """
    sweeper = config.hydra.sweeper
    problem = sweeper_storage_problem(sweeper.get("storage"))
    if problem is not None:
        return problem
    if "params" not in sweeper:  # not a sweeper that draws trials (Optuna)
        return None
    problem = trial_count_problem(sweeper)
    if problem is not None:
        return problem
    problem = sweep_choice_problem(config)
    if problem is not None:
        return f"{problem} No trial has run: correct the search space and start the search again."
    return None
