"""The recipe's ``nn.Module``s from a config: the front end and the task's model.

Training, the benchmark and inference build their modules here, so that a trained
checkpoint loads into exactly the modules it was trained with.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from amp_utils.fast_kernels import use_cuda_depthwise
from amp_utils.module_precision import (
    apply_fp32_modules,
    apply_low_precision_norms,
    apply_norm_saves_16bit,
)
from recipes.augment import build_augment, build_wave_augment
from recipes.frontend import build_features
from recipes.tasks import task_for

#: The keys of the modules ``build_modules`` returns (``trainer.compile_module_keys``).
MODULE_KEYS = ("features", "model", "wave_augment", "augment")


def build_model(cfg: DictConfig, speakers: tuple[str, ...]) -> torch.nn.Module:
    """The configured task's model, sized for the features and the labels (speakers)."""
    return task_for(cfg.model).build_model(cfg.model, cfg.data.features.n_mels, tuple(speakers))


def build_modules(
    cfg: DictConfig, speakers: tuple[str, ...], augment: bool = True
) -> dict[str, torch.nn.Module]:
    """Log-mel ``features``, the ``model`` and, if on and ``augment``, the augmentations.

    ``wave_augment`` (speed, noise) acts on the waveforms before the features,
    ``augment`` (SpecAugment) on the features; both only in training. Inference passes
    ``augment=False``. ``precision.fp32_modules`` pins the named modules to fp32;
    ``precision.low_precision_norms`` runs the other LayerNorms in the autocast dtype;
    ``precision.norm_saves_16bit`` has them keep a 16-bit normalized input for backward;
    ``device.cuda_depthwise`` picks how depthwise convolutions compute on CUDA.
    """
    modules: dict[str, torch.nn.Module] = {
        "features": build_features(cfg.data),
        "model": build_model(cfg, speakers),
    }
    if augment:
        for name, module in (
            ("wave_augment", build_wave_augment(cfg.data)),
            ("augment", build_augment(cfg.data)),
        ):
            if module is not None:
                modules[name] = module
    apply_fp32_modules(modules, list(cfg.precision.get("fp32_modules") or []))
    if cfg.precision.get("low_precision_norms", False):
        apply_low_precision_norms(modules)
    if cfg.precision.get("norm_saves_16bit", False):
        apply_norm_saves_16bit(modules)
    if cfg.device.get("cuda_depthwise", "torch") != "torch":
        use_cuda_depthwise(modules, str(cfg.device.cuda_depthwise))
    return modules
