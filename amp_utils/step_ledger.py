"""The step ledger: what the host learns about each training batch, one batch late.

``Brain.fit_batch`` never waits for the device: it hands each batch's loss (and, when the
batch ended with an optimizer step, the gradient norm, the skipped flag and the fp16 loss
scale) to :meth:`StepLedger.record` as device tensors. :meth:`StepLedger.flush` reads them
back later -- before the next optimizer step, at the end of an epoch and before a
checkpoint -- and keeps the books: the running mean of the training loss, the non-finite
patience (``NonFiniteLossError``), the applied/skipped step counters, the last gradient
norm and the per-step TensorBoard scalars.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from amp_utils.host_values import HostValues
from amp_utils.running_mean import RunningMean

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError, ValueError):
    """Too many consecutive non-finite losses: training cannot continue.

    Also a ``ValueError``: SpeechBrain's ``Brain.check_loss_isfinite`` raises one, so code
    written for it (``except ValueError``) catches this too."""


class StepInfo(NamedTuple):
    """Device-side results of an optimizer step, read back by the ledger."""

    grad_norm: torch.Tensor
    skipped: torch.Tensor  # bool scalar


class PendingBatch(NamedTuple):
    """A trained batch whose values are on their way to the host.

    ``values`` holds the loss, then (if ``stepped``) the gradient norm and the skipped
    flag, then (if ``scaled``: fp16) the loss scale after the step, then (if ``signalled``:
    DDP) how many ranks had caught a stop signal. ``counted``: its loss has already been
    counted for the non-finite patience (:meth:`StepLedger.check_loss`).
    """

    step: int
    values: HostValues
    stepped: bool
    scaled: bool
    signalled: bool = False
    counted: bool = False


class StepLedger:
    """Lagged bookkeeping of training batches and optimizer steps.

    Args:
        nonfinite_patience: consecutive non-finite losses tolerated before stopping.
        on_applied_step: called once per optimizer step that was applied (not skipped),
            e.g. to step the LR scheduler.
        tensorboard: an ``amp_utils.TensorBoardLogger`` for per-step scalars, or None.
        log_interval_steps: write the per-step scalars every this many optimizer steps
            of the whole run (applied or skipped; the count runs on across epochs).
        extra_scalars: called when scalars are written; returns more of them (the
            learning rate, throughput) from state the ledger does not own.
    """

    def __init__(
        self,
        nonfinite_patience: int,
        on_applied_step: Callable[[], None] | None = None,
        tensorboard: Any = None,
        log_interval_steps: int = 10,
        extra_scalars: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        self.nonfinite_patience = nonfinite_patience
        self.on_applied_step = on_applied_step
        self.tensorboard = tensorboard
        self.log_interval_steps = log_interval_steps
        self.extra_scalars = extra_scalars
        self.records = 0  # batches recorded in this process (record's calls)
        self.optimizer_step = 0  # optimizer steps applied in the whole run
        self.skipped_steps = 0  # steps the scaler or the non-finite check skipped
        self.nonfinite_count = 0  # consecutive non-finite losses
        self.train_loss = RunningMean()  # of this epoch's finite losses
        self.last_grad_norm: float | None = None  # of the last optimizer step read back
        self.stop_requested = False  # DDP: a rank caught a stop signal (read on every rank)
        self._pending: list[PendingBatch] = []
        self._checked_steps: set[int] = set()  # batches check_loss counted, not yet recorded

    @property
    def avg_train_loss(self) -> float:
        """Mean of this epoch's finite training losses read back so far."""
        return self.train_loss.mean

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        step_info: StepInfo | None,
        loss_scale: torch.Tensor | None,
        ranks_signalled: torch.Tensor | None = None,
    ) -> None:
        """Queue batch ``step``'s device values; they are read back at the next flush.

        ``ranks_signalled`` (DDP): the number of ranks that had caught a stop signal, summed
        in the batch's loss all-reduce; once read, ``stop_requested`` is set on every rank
        at the same flush. A batch whose loss :meth:`check_loss` has counted is not
        counted again when it is read back.
        """
        self.records += 1
        counted = step in self._checked_steps
        self._checked_steps.clear()  # checks of batches never recorded are forgotten
        values = [loss]
        if step_info is not None:
            values += [step_info.grad_norm, step_info.skipped]
        if loss_scale is not None:
            values.append(loss_scale)
        if ranks_signalled is not None:
            values.append(ranks_signalled)
        self._pending.append(
            PendingBatch(
                step,
                HostValues(values),
                step_info is not None,
                loss_scale is not None,
                ranks_signalled is not None,
                counted,
            )
        )

    def flush(self) -> None:
        """Read back and account for every pending batch (syncs with the device)."""
        pending, self._pending = self._pending, []
        for item in pending:
            self._account(item)

    def count_nonfinite(self, loss: float, step: int) -> bool:
        """True if ``loss`` is finite; else counts it (the step is skipped).

        Raises:
            NonFiniteLossError: after more than ``nonfinite_patience`` consecutive ones.
        """
        if math.isfinite(loss):
            self.nonfinite_count = 0
            return True
        self.nonfinite_count += 1
        logger.warning(
            "Non-finite loss (%s) at batch %d: step skipped (%d in a row, patience %d).",
            loss,
            step,
            self.nonfinite_count,
            self.nonfinite_patience,
        )
        if self.nonfinite_count > self.nonfinite_patience:
            raise NonFiniteLossError(
                f"The loss was not finite for {self.nonfinite_count} consecutive batches "
                f"(nonfinite_patience={self.nonfinite_patience}); training stopped. "
                "Try a lower learning rate, precision=bf16 instead of fp16, a smaller "
                "trainer.max_grad_norm, or check the input data for silent/corrupt audio."
            )
        return False

    def check_loss(self, loss: float, step: int) -> bool:
        """:meth:`count_nonfinite` now, for batch ``step``, which :meth:`record` then
        queues without counting it a second time when it is read back.

        For ``Brain.check_loss_isfinite``, which a ``fit_batch`` overridden the SpeechBrain
        way calls on each batch's loss: each non-finite loss counted twice made a streak of
        n non-finite losses count 2n - 2 and end the run early (3 with the default
        patience of 3).
        """
        self._checked_steps.add(step)
        return self.count_nonfinite(loss, step)

    def _account(self, item: PendingBatch) -> None:
        values = item.values.get()  # the one read of this batch's values from the device
        loss = values[0]
        finite = math.isfinite(loss) if item.counted else self.count_nonfinite(loss, item.step)
        if finite:
            self.train_loss.add(loss)
        # The learning rate this step used: read before on_applied_step moves the
        # schedule on (logged after it, train/lr showed the next step's rate).
        extra = (
            self.extra_scalars()
            if self.tensorboard is not None and item.stepped and self.extra_scalars is not None
            else {}
        )
        if item.stepped:
            grad_norm, skipped = values[1], values[2] > 0.5
            if skipped:
                self.skipped_steps += 1
            else:
                self.optimizer_step += 1
                if self.on_applied_step is not None:
                    self.on_applied_step()
            self.last_grad_norm = grad_norm
        if item.signalled and values.pop() > 0.5:
            self.stop_requested = True
        scale = values[-1] if item.scaled else None
        self._log_scalars(item, loss, scale, extra)

    @property
    def steps_taken(self) -> int:
        """Optimizer steps of the whole run, applied or skipped: TensorBoard's x-axis."""
        return self.optimizer_step + self.skipped_steps

    def _log_scalars(
        self, item: PendingBatch, loss: float, scale: float | None, extra: dict[str, float]
    ) -> None:
        # Keyed on the run's optimizer steps, not on the in-epoch batch counter, so the
        # interval runs on across epochs (steps 10, 20, 30, not 10, 20, 37, 47).
        if self.tensorboard is None or not item.stepped:
            return
        if self.steps_taken % self.log_interval_steps:
            return
        scalars: dict[str, float] = {"train/loss": loss, **extra}
        if item.stepped and self.last_grad_norm is not None:
            scalars["train/grad_norm"] = self.last_grad_norm
        if scale is not None:
            scalars["train/loss_scale"] = scale
        scalars["train/skipped_steps"] = self.skipped_steps
        self.tensorboard.log_scalars(scalars, step=self.steps_taken)
