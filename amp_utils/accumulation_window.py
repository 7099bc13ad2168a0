"""An unfinished gradient-accumulation window, carried across a mid-epoch checkpoint.

With ``grad_accumulation_factor > 1`` a signal may stop a run between two optimizer steps
(its loader's workers may already be gone). The window's gradients so far and whether its
losses were finite then travel with the checkpoint, so that the resumed run takes the step
the uninterrupted run would have taken, with the same gradients. Under DDP each rank keeps
its own partial sum (``no_sync`` left it unreduced), so a window resumes only under the
world size that saved it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from amp_utils.amp_step import AMPOptimizerStep
from amp_utils.checkpoint import CheckpointError
from amp_utils.distributed import DistributedInfo, any_rank


def optimized_params(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.nn.Parameter]:
    """Every optimizer's parameters, in a fixed order (the order they were built in)."""
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]


def window_state(
    params: list[torch.nn.Parameter], amp_step: AMPOptimizerStep, world_size: int
) -> dict[str, Any] | None:
    """The gradients of an unfinished window, for a mid-epoch checkpoint; None at a step
    boundary (the step set them to None).

    Under DDP all ranks call this (they agree on whether any rank holds gradients and
    whether the window is finite), and the gradients go to the CPU for the gather. A
    non-finite window keeps only that: its step will be skipped, and a checkpoint holds no
    NaN/Inf (fp16's scaler backs off as after the overflow; fp32/bf16 without
    ``skip_nonfinite_grads`` skip a step they would have applied non-finite).
    """
    grads = [p.grad for p in params]
    nonfinite = not all(g is None or bool(torch.isfinite(g).all()) for g in grads)
    # under DDP: whether any rank holds gradients, and whether any rank's overflowed
    nonfinite, any_grads = any_rank(nonfinite, any(g is not None for g in grads))
    if not any_grads:
        return None
    if nonfinite:
        return {"grads": None, "window_finite": False}
    to_cpu = world_size > 1
    return {
        "grads": [
            None if g is None else (g.detach().cpu() if to_cpu else g.detach().clone())
            for g in grads
        ],
        "window_finite": amp_step.window_finite(),
    }


def rank_window(
    state: Mapping[str, Any], saved_world_size: int, distributed: DistributedInfo
) -> dict[str, Any] | None:
    """This rank's unfinished window from a checkpoint's brain state (or None).

    Raises:
        CheckpointError: the window's gradients were saved by another number of
            processes (each rank's partial sum belongs to its own shard of the window).
    """
    per_rank = state.get("rank_pending_grads")
    saved = [state.get("pending_grads")] if per_rank is None else per_rank
    if all(grads is None for grads in saved):
        return None
    world_size = distributed.world_size
    if saved_world_size != world_size or len(saved) != world_size:
        raise CheckpointError(
            f"The mid-epoch checkpoint was saved by {saved_world_size} process(es) inside "
            "a gradient-accumulation window, with each process's partial gradients; "
            f"{world_size} process(es) cannot finish that window as the interrupted "
            f"run would have. Resume it with {saved_world_size} process(es); the world "
            "size may change at an optimizer step or an epoch end."
        )
    return saved[distributed.rank]


def restore_window(
    params: list[torch.nn.Parameter],
    window: Mapping[str, Any],
    amp_step: AMPOptimizerStep,
    device: torch.device,
) -> None:
    """Put a resumed window's gradients back on ``params`` and its finite flag on
    ``amp_step`` (after the epoch's ``zero_grad``).

    Raises:
        CheckpointError: the saved gradients do not fit ``params`` (another model or
            optimizer).
    """
    grads = window["grads"] or [None] * len(params)
    if len(grads) != len(params) or any(
        g is not None and g.shape != p.shape for p, g in zip(params, grads, strict=True)
    ):
        raise CheckpointError(
            "The mid-epoch checkpoint holds the gradients of an unfinished accumulation "
            f"window for {len(grads)} parameters whose shapes differ from this run's "
            f"{len(params)} optimized parameters: resume it with the model and "
            "optimizer it was saved with, or start the run afresh in a new output folder."
        )
    for p, g in zip(params, grads, strict=True):
        p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype)
    amp_step.restore_window(window["window_finite"], device)
