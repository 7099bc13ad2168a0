"""The random number generators' states, saved with checkpoints so resumes replay exactly."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng_state() -> dict[str, Any]:
    """Python's and torch's RNG states (and CUDA's, once CUDA is initialised)."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned (CUDA states for the GPUs present)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        states = state["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all([s.cpu() for s in states])
