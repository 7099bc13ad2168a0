"""Everything that can refuse a command before any work, and what a refusal looks like.

``preflight`` checks the composed config (keys, values, the task and model, the device and
the precisions it supports, and the direction of a sweeper that tunes the run) before any
data is prepared or any file is written; ``USER_ERRORS`` are the errors of bad input, which
the entry points report as one line without a traceback. The Hydra callback of
``recipes/run_folder.py`` runs ``preflight`` before Hydra writes into a run folder.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf

from amp_utils import (
    AMPConfig,
    CheckpointError,
    DeviceNotAvailableError,
    DistributedConfigError,
    NonFiniteLossError,
    PrecisionNotSupportedError,
    RunOptions,
    resolve_device,
)
from amp_utils.module_precision import UnknownModulePatternError
from amp_utils.precision import check_precision_supported, resolve_precision
from data.errors import DataError
from data.synthetic_voices import check_synthesizers, draw_voices
from recipes.asr.decoding import DecoderUnavailableError, check_lexicon_decoder_available
from recipes.config import ConfigError, validate_config
from recipes.tasks import UnknownTaskError, task_for

RUN_OPTION_KEYS = frozenset(f.name for f in dataclasses.fields(RunOptions))  # trainer keys
USER_ERRORS = (  # bad input: reported as one line, without a traceback
    ConfigError,
    DataError,
    CheckpointError,
    NonFiniteLossError,
    PrecisionNotSupportedError,
    DeviceNotAvailableError,
    DistributedConfigError,
    UnknownTaskError,
    UnknownModulePatternError,
    DecoderUnavailableError,
)


def run_options(cfg: DictConfig) -> RunOptions:
    """Brain run options from the ``trainer``, ``precision`` and ``device`` nodes."""
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    return RunOptions.from_dict(
        {
            **{key: value for key, value in trainer.items() if key in RUN_OPTION_KEYS},
            "device": cfg.device.name,
            "precision": cfg.precision.name,
            "eval_precision": cfg.precision.eval_precision,
            "allow_tf32": cfg.precision.allow_tf32,
            "fused_weight_casts": cfg.precision.fused_weight_casts,
            "onednn_cache_capacity": cfg.device.onednn_cache_capacity,
            "seed": cfg.seed,
        }
    )


def _sweeper_direction() -> str | None:
    """The optimisation direction of the Hydra sweeper running this job (Optuna), if any."""
    from hydra.core.hydra_config import HydraConfig

    try:
        return sweeper_direction(HydraConfig.get().sweeper)
    except ValueError:  # composed outside @hydra.main
        return None


def sweeper_direction(sweeper: DictConfig) -> str | None:
    """The optimisation direction of a Hydra sweeper's config (``hydra.sweeper``), if any."""
    direction = sweeper.get("direction")
    if isinstance(direction, list | tuple) or OmegaConf.is_list(direction):
        return str(direction[0]) if len(direction) == 1 else None
    return str(direction) if direction is not None else None


def check_sweep_direction(cfg: DictConfig, direction: str | None) -> None:
    """A sweeper that optimises ``train.py``'s return value must go the metric's way.

    ``train.py`` returns the tested checkpoint's validation metric (CER: lower is better,
    accuracy: higher); maximising CER would tune the recipe to be worse.
    """
    if direction is None:
        return
    metric, wanted = task_for(cfg.model).selection_metric
    if direction.lower() != wanted:
        raise ConfigError(
            f"hydra.sweeper.direction={direction} but model={cfg.model.name} is tuned on its "
            f"validation {metric}, which it must {wanted}. Fix: hydra.sweeper.direction={wanted} "
            "(or pick the hparams_search preset of this task)."
        )


def preflight(cfg: DictConfig) -> None:
    """Everything that can refuse a command before any work: keys, values, device, precision,
    and the direction of a sweeper that tunes the run."""
    validate_config(cfg)
    if "lexicon" in (
        OmegaConf.select(cfg, "model.decoder"),
        OmegaConf.select(cfg, "model.valid_decoder"),
    ):
        check_lexicon_decoder_available()
    if OmegaConf.select(cfg, "data.synthetic_voices", default=0):
        check_synthesizers(draw_voices(cfg.data.synthetic_voices))
    check_sweep_direction(cfg, _sweeper_direction())
    check_device_and_precisions(cfg)


def check_device_and_precisions(cfg: DictConfig) -> None:
    """The device can be had (``device=cuda`` without a GPU is refused) and runs the
    training and evaluation precisions."""
    opts = run_options(cfg)
    device = resolve_device(opts.device)
    for name in (opts.precision, opts.eval_precision):
        check_precision_supported(AMPConfig.from_name(resolve_precision(name, device)[0]), device)


def diagnosis_training_config(cfg: DictConfig) -> DictConfig:
    """The training part of ``recipes/diagnose.py``'s ``cfg`` (no ``diagnose`` node),
    checked as train.py checks it.

    Raises:
        ConfigError: a bad key or value (one line naming the valid ones).
    """
    if cfg.diagnose.batches < 1:
        raise ConfigError(f"diagnose.batches={cfg.diagnose.batches} must be 1 or more.")
    train_cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "diagnose"])
    train_cfg.precision.fp32_modules = []  # applied by diagnose() itself, names reported
    # The probes hook every module in every step: a captured step would run them only at
    # its capture (fast_path=auto turns whole-step graphs on for CUDA).
    train_cfg.trainer.graph_step = False
    validate_config(train_cfg)
    return train_cfg


def preflight_diagnosis(cfg: DictConfig) -> None:
    """Everything that can refuse ``recipes/diagnose.py``'s command before any work: keys,
    values, device and precision (``DiagnosisFolderCallback`` runs it before Hydra writes
    the diagnosis's folder)."""
    check_device_and_precisions(diagnosis_training_config(cfg))
