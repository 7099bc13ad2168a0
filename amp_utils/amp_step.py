"""The AMP optimizer step: scaled backward, then unscale -> clip -> skip on device -> step.

Per optimizer step (the order PyTorch's AMP recipe requires):

1. ``scaler.unscale_`` every optimizer (fp16 only; a no-op scaler otherwise);
2. clip the global gradient norm over **all** parameter groups (or just measure it);
3. decide on the device whether to skip: a non-finite loss since the last step, and
   non-finite gradients when asked (always with fp16, whose scaler checks them anyway);
4. step -- through the scaler (fp16, the skip flag joined to the scaler's ``found_inf``),
   through ``found_inf`` for fused optimizers, else only when the flag says so;
5. ``scaler.update()`` and zero the gradients.

Nothing waits for the device: the gradient norm and the skip flag come back as tensors,
and the LR scheduler steps later, once the step ledger reads that the step was applied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from amp_utils.step_ledger import StepInfo

logger = logging.getLogger(__name__)


def _step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``skip``; without a host sync for fused optimizers.

    Fused Adam/AdamW/SGD read ``found_inf`` (the GradScaler protocol) and skip the update
    inside the kernel; other optimizers need the flag on the host.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale = None
        optimizer.found_inf = skip.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif not bool(skip):
        optimizer.step()


class ScalerState:
    """Checkpoint adapter for the GradScaler that tolerates precision changes on resume.

    Resuming an fp16 run as bf16/fp32 (or the reverse) starts with a fresh scaler instead
    of failing: the loss scale only means something for fp16.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, and whether it was enabled (fp16)."""
        return {"enabled": self.scaler.is_enabled(), "state": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore an fp16 scaler's state; drop it (with a warning) if precision changed."""
        if state.get("enabled") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["state"])
        elif state.get("enabled") != self.scaler.is_enabled():
            logger.warning(
                "Precision changed since the checkpoint: the fp16 loss scaler state is dropped "
                "and a fresh one is used."
            )


class AMPOptimizerStep:
    """Scaled backward and the optimizer step of mixed-precision training.

    Args:
        scaler: a ``torch.amp.GradScaler`` (enabled for fp16 only).
        max_grad_norm: clip the global gradient norm to this; <= 0 measures it only.
        skip_nonfinite_grads: also skip steps whose gradients are not finite (always
            done with fp16).
    """

    def __init__(
        self, scaler: torch.amp.GradScaler, max_grad_norm: float, skip_nonfinite_grads: bool
    ) -> None:
        self.scaler = scaler
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite_grads = skip_nonfinite_grads
        self._window_finite: torch.Tensor | None = None  # all losses finite since last step

    def backward(self, loss: torch.Tensor, accumulation: int = 1) -> None:
        """Backward of ``loss / accumulation``, scaled for fp16."""
        self.scaler.scale(loss / accumulation).backward()

    def observe_loss(self, loss: torch.Tensor) -> None:
        """Note whether a batch's (rank-mean) loss is finite: the next step skips if not."""
        finite = torch.isfinite(loss)
        self._window_finite = (
            finite if self._window_finite is None else self._window_finite & finite
        )

    def window_finite(self) -> bool | None:
        """Whether every loss observed since the last step was finite; None before the
        first. Reads the device (for a checkpoint taken inside an accumulation window)."""
        return None if self._window_finite is None else bool(self._window_finite)

    def restore_window(self, finite: bool | None, device: torch.device) -> None:
        """Set what :meth:`window_finite` returned, on resuming inside the window."""
        self._window_finite = None if finite is None else torch.tensor(finite, device=device)

    def step(self, optimizers: Iterable[torch.optim.Optimizer]) -> StepInfo | None:
        """Unscale, clip all parameter groups, step unless skipped, update, zero grads.

        Returns:
            The step's gradient norm and skipped flag as device tensors; None when there
            is no optimizer or no parameter has a gradient.
        """
        optimizers = list(optimizers)
        window_finite, self._window_finite = self._window_finite, None
        if not optimizers:
            return None
        with_grads = {id(opt): _params_with_grads(opt) for opt in optimizers}
        params = [p for opt in optimizers for p in with_grads[id(opt)]]
        if not params:  # before unscale_: without the update() that follows it, fp16's
            _zero_grad(optimizers)  # scaler would refuse the next step's unscale_
            return None
        # An optimizer none of whose parameters got a gradient in the window has nothing
        # to update; fp16's scaler would refuse to step it (no inf checks recorded).
        active = [opt for opt in optimizers if with_grads[id(opt)]]
        for opt in active:
            self.scaler.unscale_(opt)
        if self.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        # Skip on a non-finite loss in the window (and non-finite gradients if asked);
        # fp16's scaler additionally skips any step with inf/NaN gradients.
        skip = (
            ~window_finite
            if window_finite is not None
            else torch.zeros((), dtype=torch.bool, device=grad_norm.device)
        )
        if self.skip_nonfinite_grads or self.scaler.is_enabled():
            skip = skip | ~torch.isfinite(grad_norm)
        for opt in active:
            if self.scaler.is_enabled():
                # The scaler checks the gradients only: a non-finite loss whose gradients
                # are finite must skip too, so its flag joins the scaler's (on the device;
                # the scaler then also backs off as after an overflow).
                found = self.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
                for flag in found.values():
                    torch.maximum(flag, skip.to(flag), out=flag)
                self.scaler.step(opt)
            else:
                _step_unless(opt, skip)
        self.scaler.update()
        _zero_grad(optimizers)
        return StepInfo(grad_norm.detach(), skip)

    def clear_window(self) -> None:
        """Forget the losses of an unfinished accumulation window whose gradients are
        dropped (an epoch's last batches): its non-finite loss must not skip a later step."""
        self._window_finite = None

    def reset(self) -> None:
        """Forget a step that was started but not finished (a CUDA-graph capture that
        failed part-way): the loss window and the scaler's per-optimizer stage, so that
        the next step unscales and steps afresh. The loss scale itself is kept."""
        self.clear_window()
        if self.scaler.is_enabled():
            from collections import defaultdict

            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def loss_scale(self) -> torch.Tensor | None:
        """The current fp16 loss scale as a device tensor (no sync); None without fp16."""
        return self.scaler._get_scale_async() if self.scaler.is_enabled() else None


def _params_with_grads(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of ``opt`` that have a gradient."""
    return [p for group in opt.param_groups for p in group["params"] if p.grad is not None]


def _zero_grad(optimizers: Iterable[torch.optim.Optimizer]) -> None:
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
