"""The recipe's ``nn.Module``s from a config: the front end and the task's model.

Training, the benchmark and inference build their modules here, so that a trained
checkpoint loads into exactly the modules it was trained with.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipes.frontend import build_augment, build_features
from recipes.tasks import task_for


def build_model(cfg: DictConfig, speakers: tuple[str, ...]) -> torch.nn.Module:
    """The configured task's model, sized for the features and the labels (speakers)."""
    return task_for(cfg.model).build_model(cfg.model, cfg.data.features.n_mels, tuple(speakers))


def build_modules(
    cfg: DictConfig, speakers: tuple[str, ...], augment: bool = True
) -> dict[str, torch.nn.Module]:
    """Log-mel ``features``, the ``model`` and, if on and ``augment``, SpecAugment ``augment``.

    Inference passes ``augment=False``: SpecAugment only acts in training.
    """
    modules: dict[str, torch.nn.Module] = {
        "features": build_features(cfg.data),
        "model": build_model(cfg, speakers),
    }
    spec_augment = build_augment(cfg.data) if augment else None
    if spec_augment is not None:
        modules["augment"] = spec_augment
    return modules
