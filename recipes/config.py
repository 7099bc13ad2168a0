"""Config helpers of the recipes: OmegaConf resolvers and the early validation of a config.

Hydra already rejects unknown group options (``precision=fp8`` lists the available ones)
and unknown keys; ``validate_config`` checks the values, so a bad setting fails before any
data is prepared, with one line naming the valid choices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_utils.autocast import PRECISIONS
from amp_utils.distributed import BACKENDS
from amp_utils.precision import AUTO, DEVICE_CHOICES

TASKS = ("asr", "speaker")
MODELS = {"conformer_ctc": "asr", "conformer_ctc_m": "asr", "xvector": "speaker"}
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class ConfigError(ValueError):
    """A config value is invalid; the message names the key and the valid choices."""


def register_resolvers() -> None:
    """Register ``${run_name:...}``: the run's overrides as a folder name, or "default"."""
    if not OmegaConf.has_resolver("run_name"):
        OmegaConf.register_new_resolver(
            "run_name", lambda overrides: (overrides or "default").replace("/", "_")
        )


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


def validate_config(cfg: DictConfig) -> None:
    """Check every value a run depends on; raises ConfigError on the first bad one."""
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
