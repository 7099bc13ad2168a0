"""Config helpers of the recipes: OmegaConf resolvers and the early validation of a config.

Hydra already rejects unknown group options (``precision=fp8`` lists the available ones)
and overrides of keys that do not exist; ``validate_config`` checks the values and refuses
keys that no config file defines (``+trainer.epohcs=3`` would otherwise be accepted and
ignored), so a bad setting fails before any data is prepared, with one line naming the
valid choices.

The schema of a group's node is the YAML file of the chosen option (``conf/<group>/
<option>.yaml``): every key there has a default and a comment, and a key that is in none of
them is not used by the recipes.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_utils.autocast import PRECISIONS
from amp_utils.distributed import BACKENDS
from amp_utils.precision import AUTO, DEVICE_CHOICES

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("precision", "device", "model", "data", "trainer")  # config groups with a node
TASKS = ("asr", "speaker")
MODELS = {"conformer_ctc": "asr", "conformer_ctc_m": "asr", "xvector": "speaker"}
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and the valid choices."""


#: Keys shown by ``--help`` (with the comment of their config file line).
HELP_KEYS = (
    ("trainer", "epochs"),
    ("trainer", "debug"),
    ("trainer", "ckpt_interval_minutes"),
    ("trainer", "grad_accumulation_factor"),
    ("trainer", "compile"),
    ("data", "root"),
    ("data", "max_batch_seconds"),
    ("model", "lr"),
    ("precision", "eval_precision"),
    ("device", "num_workers"),
)
HELP_EXAMPLES = (
    "python recipes/train.py                              # ASR on FSDD digits, fp32",
    "python recipes/train.py precision=bf16 device=cuda   # bf16 autocast on the GPU",
    "python recipes/train.py model=xvector trainer.epochs=5",
    "python recipes/train.py -m precision=fp32,fp16,bf16  # sweep + comparison table",
    "python recipes/train.py model=xvector --cfg job --resolve  # show the config, run nothing",
)


def precision_first(override_dirname: str) -> str:
    """``device=cpu,precision=bf16`` -> ``precision=bf16,device=cpu``.

    Names a sweep's job folder (TensorBoard's run name) with what a precision sweep
    varies first, where a truncated run list still shows it.
    """
    items = override_dirname.split(",") if override_dirname else []
    first = [item for item in items if item.lstrip("+").startswith("precision=")]
    return ",".join(first + [item for item in items if item not in first])


def register_resolvers() -> None:
    """Register ``${run_name:...}`` (the overrides as a folder name) and ``${config_help:}``."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver(
            "run_name", lambda overrides: (overrides or "default").replace("/", "_")
        )
    if not OmegaConf.has_resolver("precision_first"):
        OmegaConf.register_new_resolver("precision_first", precision_first)
    if not OmegaConf.has_resolver("config_help"):
        # Hydra's help template goes through string.Template: "$" must be doubled.
        OmegaConf.register_new_resolver("config_help", lambda: config_help().replace("$", "$$"))


def _comments(path: Path) -> tuple[str, dict[str, str]]:
    """A config file's first comment line and the comment of each top-level key."""
    lines = path.read_text().splitlines()
    title = lines[0].lstrip("# ").strip() if lines and lines[0].startswith("#") else ""
    keys = {}
    for line in lines:
        if line[:1].isalpha() and "#" in line and ":" in line.split("#")[0]:
            keys[line.split(":", 1)[0].strip()] = line.split("#", 1)[1].strip()
    return title, keys


def config_help() -> str:
    """``train.py --help``: each group's options with their descriptions, keys, examples."""
    defaults = {}
    for entry in OmegaConf.load(CONF_DIR / "config.yaml").get("defaults", []):
        if isinstance(entry, Mapping):
            defaults.update({str(k): str(v) for k, v in entry.items()})
    out = [
        "Train a speech model (Conformer-CTC ASR or x-vector speaker ID) on FSDD under the",
        "precision you pick (fp32, or fp16/bf16 torch.autocast). Re-running the same command",
        "resumes the run; a finished run is left as it is.",
        "",
        "Usage: python recipes/train.py [group=option ...] [key=value ...]  (-m: sweep)",
        "",
        "Config groups (group=option; * = default):",
    ]
    for group in GROUPS:
        out.append(f"  {group}:")
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            mark = "*" if defaults.get(group) == path.stem else " "
            out.append(f"   {mark}{path.stem:<14} {_comments(path)[0]}")
    out += ["", "Most used keys (key=value; every key: --cfg job):"]
    for group, key in HELP_KEYS:
        option = defaults.get(group, "default")
        comment = _comments(CONF_DIR / group / f"{option}.yaml")[1].get(key, "")
        out.append(f"  {f'{group}.{key}':<33} {comment}")
    out.append(f"  {'hydra.run.dir':<33} the run folder (default: outputs/<data>/<model>/...)")
    out += ["", "Examples:", *(f"  {example}" for example in HELP_EXAMPLES)]
    out += ["", "Hydra's own options: --hydra-help"]
    return "\n".join(out)


def _choice(cfg: DictConfig, key: str, choices: Iterable[str]) -> None:
    value = OmegaConf.select(cfg, key)
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(choices)}.")


def _positive(cfg: DictConfig, key: str, integer: bool = False) -> None:
    value: Any = OmegaConf.select(cfg, key)
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
        kind_name, example = ("integer", "1") if integer else ("number", "1.0")
        raise ConfigError(
            f"{key}={value!r} is not valid; it must be a positive {kind_name} "
            f"(e.g. {key}={example} or more)."
        )


def _leaf_keys(node: Any, prefix: str = "") -> set[str]:
    """Dotted paths of the leaves of a nested mapping (a ``defaults`` list is no key)."""
    if not isinstance(node, Mapping) or not node:
        return {prefix.rstrip(".")}
    keys: set[str] = set()
    for key, value in node.items():
        if key != "defaults":
            keys |= _leaf_keys(value, f"{prefix}{key}.")
    return keys


def _yaml_keys(path: Path) -> set[str]:
    return _leaf_keys(OmegaConf.to_container(OmegaConf.load(path), resolve=False))


def _option_keys(group: str, option: str) -> set[str]:
    """Keys of ``conf/<group>/<option>.yaml`` and of the same-group options it extends."""
    node = OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
    keys = _leaf_keys(node)
    for parent in node.get("defaults", []) if isinstance(node, dict) else []:
        if isinstance(parent, str) and parent != "_self_":
            keys |= _option_keys(group, parent)
    return keys


def _group_schema(group: str, option: str | None) -> set[str]:
    """Keys of the group's chosen option; of all the group's options if it is unknown."""
    if option is not None and (CONF_DIR / group / f"{option}.yaml").is_file():
        return _option_keys(group, option)
    options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    return set().union(*(_option_keys(group, o) for o in options))


def _refuse_unknown(unknown: list[str], known: set[str], where: str) -> None:
    if not unknown:
        return
    key = unknown[0]
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f" Did you mean {where}{close[0]}?" if close else ""
    raise ConfigError(
        f"{where}{key} is not a config key: the recipe does not use it.{hint} Valid "
        f"{where.rstrip('.') or 'top-level'} keys: {', '.join(sorted(known))}."
    )


def check_known_keys(
    cfg: DictConfig, choices: Mapping[str, str] | None = None, primary: str | None = None
) -> None:
    """Refuse every key that no config file defines (e.g. ``+trainer.epohcs=3``).

    Args:
        cfg: the composed config (with or without its ``hydra`` node).
        choices: the chosen option of each group (Hydra's ``runtime.choices``); without
            them, a group's ``name`` key names its option, else all options' keys count.
        primary: the primary config file (``conf/<primary>.yaml``) that defines the top
            level; None: the top level is not checked.

    Raises:
        ConfigError: one line naming the first unknown key and the valid ones.
    """
    if primary is not None:
        top = {key.split(".")[0] for key in _yaml_keys(CONF_DIR / f"{primary}.yaml")}
        top = top - {"hydra"} | set(GROUPS)
        _refuse_unknown(sorted(set(cfg.keys()) - top - {"hydra"}), top, "")
    for group in GROUPS:
        if group not in cfg:
            continue
        option = (choices or {}).get(group) or OmegaConf.select(cfg, f"{group}.name")
        known = _group_schema(group, "default" if group == "trainer" else option)
        used = _leaf_keys(OmegaConf.to_container(cfg[group], resolve=False))
        # A leaf of the schema may hold a mapping or list (e.g. compile_module_keys).
        unknown = [
            k for k in sorted(used) if not any(k == s or k.startswith(f"{s}.") for s in known)
        ]
        _refuse_unknown(unknown, known, f"{group}.")


def validate_config(
    cfg: DictConfig, choices: Mapping[str, str] | None = None, primary: str | None = None
) -> None:
    """Check every key and value a run depends on; raises ConfigError on the first bad one.

    ``choices`` and ``primary`` are passed on to ``check_known_keys``.
    """
    check_known_keys(cfg, choices, primary)
    _choice(cfg, "precision.name", (*PRECISIONS, AUTO))
    _choice(cfg, "precision.eval_precision", (*PRECISIONS, AUTO))
    device = str(cfg.device.name)
    if not (
        device in ("auto", "cpu", "cuda") or (device.startswith("cuda:") and device[5:].isdigit())
    ):
        raise ConfigError(
            f"device.name={device!r} is not valid; choose one of: {', '.join(DEVICE_CHOICES)}."
        )
    _choice(cfg, "model.name", MODELS)
    _choice(cfg, "model.task", TASKS)
    if MODELS[cfg.model.name] != cfg.model.task:
        raise ConfigError(
            f"model.task={cfg.model.task!r} does not fit model.name={cfg.model.name!r} "
            f"(which does {MODELS[cfg.model.name]!r})."
        )
    for key in (
        "trainer.epochs",
        "trainer.debug_batches",
        "trainer.debug_epochs",
        "trainer.grad_accumulation_factor",
        "trainer.log_interval_steps",
        "trainer.keep_checkpoints",
        "data.sample_rate",
        "data.num_buckets",
    ):
        _positive(cfg, key, integer=True)
    if cfg.data.name == "fsdd_connected":
        for key in ("data.num_train", "data.num_valid", "data.num_test"):
            _positive(cfg, key, integer=True)
    for key in ("data.max_batch_seconds", "device.batch_scale", "model.lr"):
        _positive(cfg, key)
    _choice(cfg, "trainer.compile_mode", COMPILE_MODES)
    _choice(cfg, "trainer.compile_backend", COMPILE_BACKENDS)
    _choice(cfg, "trainer.distributed_backend", BACKENDS)
    if cfg.trainer.nonfinite_patience < 0:
        raise ConfigError("trainer.nonfinite_patience must be >= 0.")
