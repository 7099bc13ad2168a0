"""Config checks of the recipes: the command line's overrides and the composed values.

``--help`` is ``recipes/config_help.py``'s; the OmegaConf resolvers are
``recipes/resolvers.py``'s.

The config's types live in ``recipes/schema.py`` (dataclasses in Hydra's ConfigStore): while
composing, Hydra refuses unknown group options (``precision=fp8`` lists the available ones)
and values of the wrong type; ``check_override_keys`` refuses, before it composes, overrides
of keys no schema has (with the close match), and ``check_option_keys`` those of keys only
other options of the group have (``data.num_train`` is the connected digits').
``validate_config`` checks, once and before any work, what a type cannot: keys added with
``+`` (``+trainer.epohcs=3`` would otherwise be accepted and ignored), value ranges and the
device string, each refusal one line naming the key and the valid choices.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import itertools
import math
import re
import sys
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from amp_utils.compile import CUDAGRAPH_MODES
from amp_utils.distributed import BACKENDS
from amp_utils.module_precision import UnknownModulePatternError, apply_fp32_modules
from amp_utils.precision import DEVICE_CHOICES, parse_device_name, resolve_device
from amp_utils.run_options import CHECKPOINT_WRITES
from recipes.asr.decoding import DECODERS
from recipes.audio_brain import AVERAGE_FROM
from recipes.augment import build_augment, build_wave_augment
from recipes.frontend import NORMALIZATIONS, PAD_MODES, build_features
from recipes.modules import MODULE_KEYS, build_model
from recipes.schema import OPTION_SCHEMAS, SCHEMA_GROUP, Precision
from recipes.tasks import UnknownTaskError, task_for

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("precision", "device", "model", "data", "trainer")  # config groups with a node
#: Groups of presets that ``--help`` lists too (each option sets keys of the groups above).
PRESET_GROUPS = ("fast_path", "experiment", "debug", "hparams_search")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and the valid choices."""


def on_cuda(device_name: str) -> bool:
    """Whether ``device.name`` trains on a CUDA GPU: ``cuda``/``cuda:N``, or ``auto`` on a
    machine with one (what ``resolve_device`` picks)."""
    name = parse_device_name(str(device_name))
    if name == "auto":
        return resolve_device(name).type == "cuda"
    return name.startswith("cuda")  # named: the run fails clearly if there is none


def _choice(cfg: DictConfig, key: str, choices: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, key)
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}.")


def _positive(cfg: DictConfig, key: str, integer: bool = False) -> None:
    """Refuse ``key`` unless it is a positive (finite) number, or integer."""
    value: Any = OmegaConf.select(cfg, key)
    kind = int if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not math.isfinite(value)
        or value <= 0
    ):
        kind_name, example = ("integer", "1") if integer else ("number", "1.0")
        raise ConfigError(
            f"{key}={value!r} is not valid; it must be a positive {kind_name} "
            f"(e.g. {key}={example} or more)."
        )


def _non_negative(cfg: DictConfig, key: str, meaning: str, finite: bool = False) -> None:
    """Refuse ``key`` unless it is a number >= 0 (and, with ``finite``, not infinite)."""
    value: Any = OmegaConf.select(cfg, key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or (finite and not math.isfinite(value))
    ):
        bound = ">= 0 and finite" if finite else ">= 0"
        raise ConfigError(f"{key}={value!r} is not valid; it must be {bound} ({meaning}).")


def _not_a_number(node: Any, where: str = "") -> str | None:
    """The first key under ``node`` (a plain container) whose value is NaN, else None."""
    if isinstance(node, float) and math.isnan(node):
        return where
    if isinstance(node, dict):
        children = [(f"{where}.{key}".lstrip("."), child) for key, child in node.items()]
    elif isinstance(node, list):
        children = [(f"{where}[{index}]", child) for index, child in enumerate(node)]
    else:
        return None
    for name, child in children:
        found = _not_a_number(child, name)
        if found is not None:
            return found
    return None


def _check_numbers(cfg: DictConfig) -> None:
    """Refuse a NaN anywhere in the config: it passes every range comparison
    (``nan <= 0`` is false), so ``model.lr=nan`` and ``model.dropout=nan`` were accepted
    and trained NaN weights. Interpolations are not resolved: a NaN is the literal that the
    command line set, and the key named is that one."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra", None)
    key = _not_a_number(plain)
    if key is not None:
        raise ConfigError(
            f"{key}=nan is not valid; it must be a number (python recipes/train.py --cfg job "
            "shows its default)."
        )


#: Sizes of the models' layers (each model has some): positive integers. A zero or negative
#: one crashed the model check with a RuntimeError or ZeroDivisionError traceback, or built a
#: model without blocks (``model.num_layers=0``) or with -1 attention heads.
MODEL_SIZE_KEYS = (
    "d_model",
    "num_layers",
    "num_heads",
    "ffn_dim",
    "conv_kernel",
    "channels",
    "embedding_dim",
)
#: ``torch.manual_seed`` takes seeds in [-2**63, 2**64); the loaders add the epoch.
SEED_RANGE = (-(2**63), 2**63)


def _check_data_name(cfg: DictConfig) -> None:
    """``data.name`` picks how the data are prepared (and names the run folder): it must be
    the data option's own. ``data.name=manifest`` on ``data=fsdd_digits`` crashed with a
    KeyError once the run had started; ``data=fsdd_connected data.name=fsdd_digits`` trained
    on single digits."""
    options = {schema: name for name, schema in OPTION_SCHEMAS["data"]}
    name = OmegaConf.select(cfg, "data.name")
    expected = options.get(OmegaConf.get_type(cfg.data))
    if expected is None:  # an untyped config (evaluate.py's): any data option's name
        if name not in options.values():
            raise ConfigError(
                f"data.name={name!r} is not a data set; choose one of: "
                f"{', '.join(options.values())}."
            )
        return
    if name == expected:
        return
    fix = (
        f"choose the option instead (data={name})"
        if name in options.values()
        else f"choose one of: {', '.join(options.values())} (as data=...)"
    )
    raise ConfigError(
        f"data.name={name!r} is not this run's data={expected}: data.name is the option's own "
        f"(it picks how the data are prepared); {fix}, and leave data.name as it is."
    )


def _refuse_unknown(unknown: list[str], known: set[str], where: str, chosen: str = "") -> None:
    """Refuse the first of ``unknown`` (keys below ``where``), naming the options of its
    group that have it (``chosen``: this run's option of the group, when known)."""
    if not unknown:
        return
    key = unknown[0]
    options = _options_with_key(where.rstrip("."), key)
    if options:
        raise ConfigError(_other_options_key(where.rstrip("."), key, options, chosen))
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" Did you mean {where}{close[0]}?" if close else ""
    raise ConfigError(
        f"{where}{key} is not a config key: the recipe does not use it.{hint} Valid "
        f"{where.rstrip('.') or 'top-level'} keys: {', '.join(sorted(known))}."
    )


def _other_options_key(group: str, key: str, options: list[str], chosen: str = "") -> str:
    """The refusal of ``group.key`` for a run whose ``group`` option lacks the key that
    ``options`` have (``data.num_train`` is fsdd_connected's, not fsdd_digits')."""
    this = f"{group}={chosen}" if chosen else group
    return (
        f"{group}.{key} is a key of {' and '.join(f'{group}={o}' for o in options)}, not of "
        f"this run's {this}: choose that option ({group}={options[0]} {group}.{key}=...)."
    )


def _options_with_key(group: str, key: str) -> list[str]:
    """The options of config group ``group`` (``conf/<group>/*.yaml``) that set ``key``."""
    folder = CONF_DIR / group
    if not group or "." in group or not folder.is_dir():
        return []
    return [path.stem for path in sorted(folder.glob("*.yaml")) if key in OmegaConf.load(path)]


def check_known_keys(node: DictConfig, where: str = "") -> None:
    """Refuse every key of ``node`` (and its typed children) that its schema does not have.

    Hydra lets ``+key=value`` add a key to a typed node; the recipes would ignore it.

    Raises:
        ConfigError: one line naming the first unknown key, a close match, the valid keys.
    """
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return
    known = {f.name for f in dataclasses.fields(schema)}
    used = {str(key) for key in node} - ({"hydra"} if not where else set())
    group, name = where.rstrip("."), node.get("name") if "name" in known else None
    chosen = str(name) if group and (CONF_DIR / group / f"{name}.yaml").is_file() else ""
    _refuse_unknown(sorted(used - known), known, where, chosen)
    for key in sorted(used):
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            check_known_keys(child, f"{where}{key}.")


def _field_schemas(schema: type) -> dict[str, tuple[type, ...]]:
    """Each field of dataclass ``schema`` -> the dataclasses its value can be (empty: a leaf)."""
    hints = typing.get_type_hints(schema)
    out: dict[str, tuple[type, ...]] = {}
    for item in dataclasses.fields(schema):
        kinds = typing.get_args(hints[item.name]) or (hints[item.name],)  # Optional[X]: X
        out[item.name] = tuple(k for k in kinds if dataclasses.is_dataclass(k))
    return out


def _unknown_key(
    parts: list[str],
    schemas: tuple[type, ...],
    where: str,
    chosen: tuple[str, type] | None = None,
) -> str | None:
    """The refusal of key ``parts`` (below ``where``) if none of ``schemas`` has it, else None.

    ``chosen``: the group option the command line picks (``model=xvector``) and its schema;
    the close match and the valid keys of a refusal are then that option's, not those of
    every option of the group (``model.num_speakers`` with ``model=xvector`` was answered
    "Did you mean model.num_layers?", a Conformer key that x-vector runs refuse as well).
    """
    fields: dict[str, tuple[type, ...]] = {}
    for schema in schemas:
        for name, kinds in _field_schemas(schema).items():
            fields[name] = (*fields.get(name, ()), *kinds)
    head = parts[0]
    if head not in fields:
        valid, whose = sorted(fields), where.rstrip(".") or "top-level"
        if chosen is not None:
            valid, whose = sorted(_field_schemas(chosen[1])), f"{whose}={chosen[0]}"
        close = difflib.get_close_matches(head, valid, n=1)
        hint = f" Did you mean {where}{close[0]}?" if close else ""
        return f"{where}{head} is not a config key.{hint} Valid {whose} keys: {', '.join(valid)}."
    if len(parts) == 1 or not fields[head]:
        return None  # a value (a list or dict value's own keys are not checked here)
    return _unknown_key(parts[1:], fields[head], f"{where}{head}.")


def _parsed_overrides(overrides: Iterable[str]) -> list[tuple[str, Override]]:
    """The command line's overrides (``key=value``, ``+``/``++`` adds, ``~`` deletes), each
    with Hydra's parse of it; none if Hydra cannot parse them (its own message then says
    what is wrong with the syntax). Flags (``-m``, ``--cfg job``) are left out."""
    items = [arg for arg in overrides if arg.startswith("~") or ("=" in arg and arg[0] != "-")]
    try:
        parsed = OverridesParser.create().parse_overrides(items)
    except HydraException:
        return []
    return list(zip(items, parsed, strict=True))


def _sets_a_value(override: Override) -> bool:
    """Whether ``override`` sets an existing key (``validate_config`` checks what ``+``,
    ``++`` add; ``~`` deletes)."""
    return not (override.is_add() or override.is_force_add() or override.is_delete())


def _chosen_option(overrides: Iterable[str], group: str) -> tuple[str, type] | None:
    """``(option, its schema)`` of the one option of ``group`` that the command line picks
    (``model=xvector``: ``("xvector", XvectorConfig)``); None when it picks none (the default
    or a preset's), sweeps over several, or the option's schema is not found."""
    picked = [
        override
        for _, override in _parsed_overrides(overrides)
        if override.key_or_group == group and override.package is None and _sets_a_value(override)
    ]
    if len(picked) != 1 or picked[0].is_sweep_override():
        return None
    option = str(picked[0].value())
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return None  # Hydra lists the group's options
    schemas = dict(OPTION_SCHEMAS.get(group, ()))
    defaults = OmegaConf.load(path).get("defaults") or []
    for item in defaults:
        match = re.fullmatch(rf"/{SCHEMA_GROUP}/(\w+)@_here_", str(item))
        if match and match.group(1) in schemas:
            return option, schemas[match.group(1)]
    return None


def check_override_keys(overrides: Iterable[str], root: type) -> None:
    """Refuse, before Hydra composes anything, a ``key=value`` override of a key that no
    schema has (``trainer.epoch=3``), naming the close match and the valid keys.

    Hydra refuses it too, but only with "Key 'epoch' not in 'TrainerConfig'". A group node's
    key is valid if any of the group's option schemas has it (``model.channels``: x-vector);
    Hydra still refuses it for an option that lacks it. Group choices (``precision=bf16``),
    ``+``/``++``/``~`` overrides, ``hydra.*`` and command-line flags are left to Hydra and to
    ``validate_config``; so is an override Hydra cannot parse.

    Args:
        overrides: the command line's arguments (``sys.argv[1:]``).
        root: the primary config's schema (``Config``, ``BenchmarkRunConfig``, ...).

    Raises:
        ConfigError: one line for the first unknown key.
    """
    overrides = list(overrides)
    for _, override in _parsed_overrides(overrides):
        key = override.key_or_group
        if not _sets_a_value(override):
            continue
        if override.package is not None or key.split(".")[0] == "hydra" or "/" in key:
            continue
        if (CONF_DIR / key).is_dir():
            continue  # a group choice: Hydra lists the options of a missing one
        parts = key.split(".")
        group_schemas = OPTION_SCHEMAS.get(parts[0])
        if group_schemas and len(parts) > 1:
            refusal = _unknown_key(
                parts[1:],
                tuple(s for _, s in group_schemas),
                f"{parts[0]}.",
                _chosen_option(overrides, parts[0]),
            )
        else:
            refusal = _unknown_key(parts, (root,), "")
        if refusal:
            raise ConfigError(refusal)


def check_option_keys(overrides: Iterable[str], config_name: str) -> None:
    """Refuse an override of a key that some options of its group have but this run's
    option does not (``data.num_train=5000`` with the default ``data=fsdd_digits``: the key
    is ``data=fsdd_connected``'s), naming the options that have it.

    Hydra refuses it too, with "Key 'num_train' not in 'FsddDigitsConfig'" and the advice
    to add it with ``+``, which ``validate_config`` then refuses. Which option a run uses is
    known only once composed (the defaults, ``data=...``, an ``experiment=...`` preset), so
    the command line is composed without those overrides, and only when it has one.
    A sweep over a group's options, and a command line Hydra cannot compose, are left to
    Hydra.

    Args:
        overrides: the command line's arguments (``sys.argv[1:]``).
        config_name: the entry point's primary config (``config``, ``benchmark``, ...).

    Raises:
        ConfigError: one line for the first such key.
    """
    items = _parsed_overrides(overrides)
    suspects: dict[str, tuple[str, str, list[str]]] = {}  # argument -> group, key, options
    for item, override in items:
        parts = override.key_or_group.split(".")
        if (
            not _sets_a_value(override)
            or len(parts) < 2
            or parts[0] not in OPTION_SCHEMAS
            or override.package is not None
        ):
            continue
        group, key = parts[0], parts[1]
        options = _options_with_key(group, key)
        if options and len(options) < len(list((CONF_DIR / group).glob("*.yaml"))):
            suspects[item] = (group, key, options)
    if not suspects:
        return
    deciding = {group for group, _, _ in suspects.values()} | {"experiment"}
    kept = []
    for item, override in items:
        if item in suspects:
            continue
        if override.is_sweep_override():
            if override.key_or_group in deciding:
                return  # each job has its own option: Hydra reports each job's refusal
            continue  # another sweep (precision=fp32,bf16) leaves the option as it is
        kept.append(item)
    from hydra import compose, initialize_config_dir  # only for such a command line

    try:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name, overrides=kept, return_hydra_config=True)
    except Exception:  # noqa: BLE001 (whatever fails here, Hydra's own run reports it)
        return
    for group, key, options in suspects.values():
        if key not in cfg[group]:
            chosen = str(cfg.hydra.runtime.choices.get(group, ""))
            raise ConfigError(_other_options_key(group, key, options, chosen))


#: Hydra plugins of the optional extras: (the ``hydra/<group>`` option, its package, the
#: pip requirement, the extra of ``pyproject.toml`` that installs it).
OPTIONAL_PLUGINS = {
    ("hydra/sweeper", "optuna"): (
        "hydra_plugins.hydra_optuna_sweeper",
        "hydra-optuna-sweeper==1.2.0",
        "sweep",
    ),
}


def _plugin_choices(group: str, option: str) -> list[tuple[str, str]]:
    """The ``hydra/<group>`` options a command-line choice ``group=option`` selects: the
    choice itself, or those a preset (``hparams_search=asr_optuna``) overrides."""
    if group.startswith("hydra/"):
        return [(group, option)]
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return []  # Hydra lists the group's options
    chosen = []
    for entry in OmegaConf.load(path).get("defaults", []) or []:
        if isinstance(entry, Mapping):
            for key, value in entry.items():
                name = str(key).removeprefix("override ").strip().lstrip("/")
                if name.startswith("hydra/"):
                    chosen.append((name, str(value)))
    return chosen


def _installed(package: str) -> bool:
    """Whether ``package`` (dotted) can be imported, without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_optional_plugins(overrides: Iterable[str]) -> None:
    """Refuse a command line that chooses a Hydra plugin of an optional extra that is not
    installed (``hparams_search=asr_optuna`` without ``hydra-optuna-sweeper``), naming the
    install command; Hydra said only "Could not find 'hydra/sweeper/optuna'", with
    ``basic`` as the one available option.

    Raises:
        ConfigError: one line naming the choice, the missing package and its extra.
    """
    for item, override in _parsed_overrides(overrides):
        if not _sets_a_value(override) or override.is_sweep_override():
            continue
        option = override.value()
        if not isinstance(option, str):
            continue
        for plugin in _plugin_choices(override.key_or_group, option):
            if plugin not in OPTIONAL_PLUGINS:
                continue
            package, requirement, extra = OPTIONAL_PLUGINS[plugin]
            if _installed(package):
                continue
            raise ConfigError(
                f"{item} needs Hydra's {plugin[1]} plugin ({requirement}), which is not "
                f'installed in this Python environment. Fix: pip install -e ".[{extra}]" '
                f"from the repository's folder (or pip install {requirement}), then run the "
                "command again."
            )


def _is_group_choice(override: Override) -> bool:
    """Whether ``override`` chooses a config group's option (``precision=bf16``,
    ``hydra/launcher=slurm``) rather than setting a value (``model.lr=0.001``)."""
    key = override.key_or_group
    return "/" in key or (CONF_DIR / key).is_dir()


#: Combinations of the other lists a refused sweep value is tried with (at most).
SWEEP_COMBINATIONS_TRIED = 32


def sweep_value_problem(overrides: Iterable[str], config_name: str) -> str | None:
    """A value a ``-m`` sweep lists that no job can run with (``validate_config`` refuses it
    beside every value of the other lists), or None.

    Hydra composes every job of a sweep before the first runs, so a value that does not
    compose (``precision=fp32,bf61``, ``trainer.epochs=1,two``) fails at once; a value that
    composes but is out of range (``model.lr=0.001,-1``) was refused only when its job came,
    after the jobs before it had trained. Each listed value (``a,b``, ``choice()``,
    ``range()``) is checked beside the first value of every other list, and a refused one
    beside the other combinations (up to ``SWEEP_COMBINATIONS_TRIED``): a value refused only
    in some (``model.num_heads=5`` with ``model.d_model=144`` but not 160) leaves those jobs
    to fail alone, as before. Intervals, which a sweeper draws from, keep their config value.
    Only what the config itself decides is checked here: whether the device and its
    precisions exist is each job's to check, on the machine it runs on (a SLURM node has the
    GPU the submitting host may lack). A command line that does not compose is left to
    Hydra, whose message says why.

    Args:
        overrides: the command line's arguments (``sys.argv[1:]``).
        config_name: the entry point's primary config (``config``, ``benchmark``, ...).
    """
    items = _parsed_overrides(overrides)
    sweeps: list[tuple[Override, list[str]]] = []  # each list and its values, as overrides
    for _, override in items:
        if override.is_discrete_sweep():
            try:
                values = [str(value) for value in override.sweep_string_iterator()]
            except Exception:  # noqa: BLE001 (e.g. glob(), which needs Hydra's loader)
                return None
            if values:
                key = override.get_key_element()
                sweeps.append((override, [f"{key}={value}" for value in values]))
    if not sweeps:
        return None
    plain = [item for item, override in items if not override.is_sweep_override()]
    first = [texts[0] for _, texts in sweeps]
    from hydra import compose, initialize_config_dir  # only for a sweep's command line
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return None  # inside a Hydra app (its callbacks check what they need)
    parser = OverridesParser.create()

    def refused_by_validation(make_config: Callable[[], DictConfig]) -> str | None:
        """What validate_config says of the config ``make_config`` builds (None: it can
        run, or it does not compose, which Hydra reports)."""
        try:
            validate_config(make_config())
        except (ConfigError, UnknownModulePatternError) as err:
            return str(err)
        except Exception:  # noqa: BLE001 (does not compose: Hydra reports it)
            return None
        return None

    def refusal(job: list[str]) -> str | None:
        """What validate_config says of the job of these overrides."""
        return refused_by_validation(
            lambda: compose(config_name, overrides=[*plain, *job], return_hydra_config=True)
        )

    def with_value(key: str, text: str) -> DictConfig:
        """The first job's config with ``key`` set to the value of the override ``text``."""
        cfg = copy.deepcopy(base)
        OmegaConf.update(cfg, key, parser.parse_override(text).value())
        return cfg

    refused: list[tuple[str, list[str]]] = []  # values no job can run with, and why
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        try:
            base = compose(config_name, overrides=[*plain, *first], return_hydra_config=True)
        except Exception:  # noqa: BLE001 (Hydra's own run says what does not compose)
            return None
        for index, (override, texts) in enumerate(sweeps):
            others = [other for i, (_, other) in enumerate(sweeps) if i != index]
            for text in texts:
                if _is_group_choice(override) or not _sets_a_value(override):
                    problem = refusal([*first[:index], text, *first[index + 1 :]])
                else:  # a value: set on the composed config (much faster than composing)
                    problem = refused_by_validation(
                        lambda key=override.key_or_group, text=text: with_value(key, text)
                    )
                if problem is None:
                    continue
                reasons = [problem]
                combinations = itertools.islice(
                    itertools.product(*others), 1, SWEEP_COMBINATIONS_TRIED
                )  # the first (the first values) is the one just tried
                for combination in combinations:
                    reason = refusal([*combination, text])
                    if reason is None:
                        break  # some jobs can run with it: those that cannot fail alone
                    reasons.append(reason)
                else:
                    refused.append((text, reasons))
    if not refused:
        return None

    def own(reason: str, text: str) -> bool:  # the refusal is about this value's key
        key = text.split("=", 1)[0].lstrip("+~")
        return reason.startswith((f"{key}=", f"{key}:", f"{key} ")) or (
            key.rsplit(".", 1)[-1] in reason
        )

    text, reasons = next(
        ((t, r) for t, r in refused if any(own(reason, t) for reason in r)), refused[0]
    )
    reason = next((reason for reason in reasons if own(reason, text)), reasons[0])
    return f"the sweep's {text} is refused: {reason}"


def exit_on_unknown_override_keys(
    root: type, argv: list[str] | None = None, config_name: str | None = None
) -> None:
    """An entry point's first step: exit with ``error: <the refusal>`` (status 1, the way
    the recipes' other user errors exit) if ``check_optional_plugins`` or
    ``check_override_keys`` refuses the command line, or, given the primary
    ``config_name``, ``check_option_keys`` or, for a ``-m`` sweep, ``sweep_value_problem``
    (before any job trains)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        check_optional_plugins(args)
        check_override_keys(args, root)
        if config_name is not None:
            check_option_keys(args, config_name)
    except ConfigError as err:
        sys.exit(f"error: {err}")
    sweeping = bool({"-m", "--multirun"} & set(args))
    search = [arg for arg in args if arg.startswith("hparams_search=") and arg[15:] != "null"]
    if search and not sweeping and not {"--cfg", "-c", "--info", "-i"} & set(args):
        sys.exit(  # it trained one run with the config's values, the search ignored
            f"error: {search[0]} is a search over several runs, which Hydra runs only as a "
            f"sweep: add -m (python recipes/train.py -m {search[0]} ...)."
        )
    if config_name is not None and sweeping:
        problem = sweep_value_problem(args, config_name)
        if problem is not None:
            sys.exit(
                f"error: {problem} No job has run: correct the value and start the sweep again."
            )


def _check_augmentation(data_cfg: DictConfig) -> dict[str, torch.nn.Module]:
    """Build the augmentation modules once: their constructors are the one check of their
    values. Returns those switched on, by their module key (``build_modules``' keys)."""
    modules = {}
    for group, key, build in (
        ("spec_augment", "augment", build_augment),
        ("wave_augment", "wave_augment", build_wave_augment),
    ):
        try:
            module = build(data_cfg)
        except ValueError as err:
            raise ConfigError(f"data.{group}: {err}") from None
        if module is not None:
            modules[key] = module
    return modules


def _check_graph_step(cfg: DictConfig) -> None:
    """``trainer.graph_step`` captures the step of each batch shape: the shapes must be few
    (``data.pad_to_buckets``), torch.compile's own CUDA graphs cannot run inside it, and
    compiled code must have compiled before it (a second warm-up step)."""
    trainer = cfg.trainer
    if trainer.graph_step and not cfg.data.pad_to_buckets:
        raise ConfigError(
            "trainer.graph_step=true captures one CUDA graph per batch shape, and without "
            "data.pad_to_buckets=true nearly every batch has a shape of its own. Use "
            "fast_path=step_graphs (both on), or add data.pad_to_buckets=true."
        )
    if trainer.graph_step and trainer.compile and trainer.compile_mode in CUDAGRAPH_MODES:
        raise ConfigError(
            f"trainer.graph_step=true captures the whole training step as a CUDA graph, and "
            f"trainer.compile_mode={trainer.compile_mode} replays CUDA graphs of its own, which "
            "cannot run inside that capture. Use trainer.compile_mode=default, "
            "trainer.compile=false, or trainer.graph_step=false (fast_path=cuda_graphs)."
        )
    if trainer.graph_step and trainer.compile and trainer.graph_step_warmup < 2:
        raise ConfigError(
            f"trainer.graph_step_warmup={trainer.graph_step_warmup} with trainer.compile=true: "
            "compiled code runs eagerly in each batch shape's first warm-up step (the check "
            "for host reads), so it would compile during the capture, which inductor cannot "
            "do; the first capture fails and the whole run trains without CUDA graphs. Use "
            "trainer.graph_step_warmup=2 (the default) or more."
        )
    later = trainer.graph_step_later_warmup
    if trainer.graph_step and trainer.compile and later is not None and later < 2:
        raise ConfigError(
            f"trainer.graph_step_later_warmup={later} with trainer.compile=true: each later "
            "batch shape's compiled code compiles in its second eager step (the first, checked "
            "for host reads, runs it eagerly), and inductor cannot compile inside a capture, "
            "so those shapes would fail to capture and the run train without CUDA graphs. Use "
            "trainer.graph_step_later_warmup=null (the default: 2 with trainer.compile) or 2."
        )


def _missing_values(node: DictConfig, prefix: str = "") -> list[str]:
    """The keys under ``node`` left at ``???`` (no default), without resolving anything."""
    missing = []
    for key in node:
        path = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            missing.append(path)
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            missing += _missing_values(node[key], f"{path}.")
    return missing


def _check_required(cfg: DictConfig) -> None:
    missing = [key for key in _missing_values(cfg) if not key.startswith("hydra.")]
    if not missing:
        return
    what = (
        " (data=manifest: the manifest of each split, CSV or JSONL;"
        " see docs/data.md, Your own data)"
        if OmegaConf.select(cfg, "data.name") == "manifest"
        else ""
    )
    raise ConfigError(
        f"{', '.join(missing)} must be set{what}: e.g. "
        + " ".join(f"{key}=PATH" if key.startswith("data.") else f"{key}=..." for key in missing)
    )


#: Speakers for the checks that build a model (the x-vector's classifier needs some).
_PLACEHOLDER_SPEAKERS = ("speaker_a", "speaker_b")


def _check_model_and_features(cfg: DictConfig, augmentations: dict[str, torch.nn.Module]) -> None:
    """Build the features and the model once, the model on the meta device (no memory, no
    compute): their constructors are the one check of their sizes (heads that divide
    ``d_model``, a power-of-two subsampling, dropout in [0, 1), enough mel bands). With
    ``augmentations`` (from :func:`_check_augmentation`) they are the run's modules, which
    ``precision.fp32_modules`` patterns must name."""
    for key in ("data.features.n_mels", "data.features.n_fft", "data.features.win_length"):
        _positive(cfg, key, integer=True)
    _positive(cfg, "data.features.hop_length", integer=True)
    features = cfg.data.features
    if features.win_length > features.n_fft:
        raise ConfigError(
            f"data.features.win_length={features.win_length} is longer than data.features."
            f"n_fft={features.n_fft}; the window must fit the FFT (e.g. data.features.n_fft="
            f"{1 << (features.win_length - 1).bit_length()})."
        )
    try:
        modules = {"features": build_features(cfg.data)}
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. zero-element tensors of a size 0
            modules["model"] = build_model(cfg, _PLACEHOLDER_SPEAKERS)
    except ValueError as err:
        raise ConfigError(f"model={cfg.model.name}: {err}") from None
    # (after the model: too few mel bands for its subsampling is named first)
    spec = OmegaConf.select(cfg, "data.spec_augment")
    if spec is not None and spec.enabled and spec.freq_mask > features.n_mels:
        raise ConfigError(
            f"data.spec_augment.freq_mask={spec.freq_mask} is wider than the "
            f"data.features.n_mels={features.n_mels} mel bands it masks. Fix: "
            f"data.spec_augment.freq_mask=N with N <= {features.n_mels} (0: no frequency masks)."
        )
    modules.update(augmentations)
    # precision.fp32_modules: a pattern that names no module is refused here, not after
    # the data are prepared (UnknownModulePatternError, one line)
    apply_fp32_modules(modules, list(OmegaConf.select(cfg, "precision.fp32_modules") or []))


def validate_config(cfg: DictConfig) -> None:
    """Check what the schema's types cannot; raises ConfigError on the first bad value.

    Args:
        cfg: the composed, typed config (with or without its ``hydra`` node).
    """
    check_known_keys(cfg)
    _check_required(cfg)
    _check_numbers(cfg)
    seed = OmegaConf.select(cfg, "seed")
    if isinstance(seed, int) and not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ConfigError(
            f"seed={seed} is not valid; it must lie in [-2**63, 2**63) (e.g. seed=1234)."
        )
    _check_data_name(cfg)
    try:
        parse_device_name(cfg.device.name)
    except ValueError as err:
        raise ConfigError(
            f"device.name={cfg.device.name!r} is not valid; choose one of: "
            f"{', '.join(DEVICE_CHOICES)}."
        ) from err
    try:
        task = task_for(cfg.model)
    except UnknownTaskError as err:
        raise ConfigError(str(err)) from None
    if OmegaConf.select(cfg, "data.synthetic_voices", default=0):
        _positive(cfg, "data.synthetic_voices", integer=True)
        if cfg.data.name != "fsdd_digits" or task.closed_set_speakers:
            raise ConfigError(
                "data.synthetic_voices works with data=fsdd_digits and an ASR model only "
                f"(got data={cfg.data.name}, model={cfg.model.name}); speaker ID can only "
                "name the speakers it is tested on. Use data.synthetic_voices=0."
            )
    if OmegaConf.select(cfg, "data.test_speakers"):
        if cfg.data.name != "fsdd_digits":
            raise ConfigError(
                f"data.test_speakers works with data=fsdd_digits only (got data={cfg.data.name}); "
                "for other data, hold speakers out in your own manifests (data=manifest)."
            )
        if task.closed_set_speakers:
            raise ConfigError(
                f"data.test_speakers cannot be used with model={cfg.model.name}: speaker ID is "
                "closed-set (it can only name speakers it was trained on). Use an ASR model."
            )
    for key in (
        "trainer.epochs",
        "trainer.debug_batches",
        "trainer.debug_epochs",
        "trainer.grad_accumulation_factor",
        "trainer.log_interval_steps",
        "trainer.graph_step_warmup",
        "trainer.graph_step_max_shapes",
        "trainer.keep_checkpoints",
        "trainer.average_checkpoints",
        "data.sample_rate",
        "data.num_buckets",
    ):
        _positive(cfg, key, integer=True)
    if cfg.trainer.graph_step_later_warmup is not None:
        _positive(cfg, "trainer.graph_step_later_warmup", integer=True)
    if cfg.data.name == "fsdd_connected":
        for key in ("data.num_train", "data.num_valid", "data.num_test"):
            _positive(cfg, key, integer=True)
        data = cfg.data
        if not 1 <= data.min_digits <= data.max_digits:
            raise ConfigError(
                f"data.min_digits={data.min_digits} and data.max_digits={data.max_digits} are "
                "not valid: they need 1 <= min <= max (e.g. data.min_digits=2 data.max_digits=7)."
            )
        if not 0 <= data.silence_min <= data.silence_max < math.inf:
            raise ConfigError(
                f"data.silence_min={data.silence_min} and data.silence_max={data.silence_max} "
                "are not valid: they need 0 <= min <= max seconds (e.g. data.silence_min=0.05 "
                "data.silence_max=0.25)."
            )
    for key in ("data.max_batch_seconds", "device.batch_scale", "model.lr"):
        _positive(cfg, key)
    for key in MODEL_SIZE_KEYS:
        if OmegaConf.select(cfg, f"model.{key}") is not None:  # the keys of the run's model
            _positive(cfg, f"model.{key}", integer=True)
    _non_negative(cfg, "model.weight_decay", "AdamW weight decay; 0: off", finite=True)
    _non_negative(cfg, "model.warmup_steps", "linear warm-up steps; 0: none")
    for key in ("precision.name", "precision.eval_precision"):  # evaluate.py's untyped config
        _choice(cfg, key, [str(p) for p in Precision])
    _choice(cfg, "trainer.average_from", AVERAGE_FROM)
    _choice(cfg, "trainer.checkpoint_writes", CHECKPOINT_WRITES)
    _choice(cfg, "data.features.normalize", NORMALIZATIONS)
    _choice(cfg, "data.features.pad_mode", PAD_MODES)
    if OmegaConf.select(cfg, "model.decoder") is not None:
        _choice(cfg, "model.decoder", DECODERS)
        _choice(cfg, "model.valid_decoder", DECODERS)
        _positive(cfg, "model.beam_size", integer=True)
    if cfg.precision.low_precision_norms and cfg.precision.norm_saves_16bit:
        raise ConfigError(
            "precision.low_precision_norms and precision.norm_saves_16bit cannot both be on: "
            "the first computes the LayerNorms in 16 bits, the second keeps their fp32 "
            "computation and saves 16 bits for backward. Pick one (e.g. "
            "precision.low_precision_norms=false)."
        )
    _choice(cfg, "trainer.compile_mode", COMPILE_MODES)
    _choice(cfg, "trainer.compile_backend", COMPILE_BACKENDS)
    _choice(cfg, "trainer.distributed_backend", BACKENDS)
    _check_graph_step(cfg)
    _non_negative(
        cfg, "data.cache_audio_mb", "MiB of audio held in memory; 0 reads the files for every batch"
    )
    if cfg.trainer.nonfinite_patience < 0:
        raise ConfigError("trainer.nonfinite_patience must be >= 0.")
    if cfg.device.onednn_cache_capacity is not None:  # null: oneDNN's own default
        _non_negative(
            cfg,
            "device.onednn_cache_capacity",
            "e.g. device.onednn_cache_capacity=4096; 0: no cache; null: oneDNN's own default",
        )
    _non_negative(cfg, "device.num_workers", "DataLoader worker processes; 0 loads in the loop")
    # negative intervals and counts acted as 0 ("off"), which is not what was asked for
    for key, meaning in (
        ("trainer.ckpt_interval_minutes", "minutes between mid-epoch checkpoints; 0: off"),
        ("trainer.ckpt_interval_steps", "optimizer steps between mid-epoch checkpoints; 0: off"),
        ("trainer.stall_warning_minutes", "minutes without a batch before a warning; 0: off"),
        ("trainer.num_text_examples", "validation transcripts written to TensorBoard"),
    ):
        if OmegaConf.select(cfg, key) is not None:
            _non_negative(cfg, key, meaning)
    root = OmegaConf.select(cfg, "data.root")
    if isinstance(root, str) and not root.strip():  # the folder the command runs in
        raise ConfigError(
            f"data.root={root!r} is empty: it would be the folder the command runs in, and "
            "FSDD would be downloaded there. Fix: data.root=PATH (or FSDD_ROOT=PATH), the "
            "folder holding FSDD or one to download it into."
        )
    _non_negative(
        cfg, "data.ascending_epochs", "first epochs in shortest-first order; 0: random order"
    )
    keys = OmegaConf.select(cfg, "trainer.compile_module_keys")
    unknown = [key for key in keys or [] if key not in MODULE_KEYS]
    if unknown:
        raise ConfigError(
            f"trainer.compile_module_keys has {unknown}, which are not modules of the run; "
            f"valid: {', '.join(MODULE_KEYS)} (e.g. trainer.compile_module_keys=[model])."
        )
    _check_model_and_features(cfg, _check_augmentation(cfg.data))
    smoothing = OmegaConf.select(cfg, "model.label_smoothing", default=0.0)
    if not 0.0 <= smoothing < 1.0:
        raise ConfigError(
            f"model.label_smoothing={smoothing!r} is not valid; it must be in [0, 1) "
            "(e.g. model.label_smoothing=0.1; 0 turns it off)."
        )
