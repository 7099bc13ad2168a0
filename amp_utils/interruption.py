"""Interruption: SIGTERM/SIGINT catching and the mid-epoch checkpoint policy.

A preempted job (SLURM sends SIGTERM) or a Ctrl-C saves a checkpoint after the current
batch and exits with :class:`TrainingInterrupted`; a second signal stops at once (a SIGTERM
repeated within 2 s, e.g. torchrun's forwarded copy, counts once). Besides
signals, :class:`MidEpochCheckpointPolicy` asks for a checkpoint every N optimizer steps or
every N minutes. Under DDP the ranks decide together, so that all of them save (and stop)
after the same batch: a signal through the Brain's loss all-reduce (``agreed_stop``), the
clock at joint decision points.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import Any, NamedTuple

from amp_utils.distributed import any_rank

logger = logging.getLogger(__name__)


class TrainingInterrupted(SystemExit):
    """SIGTERM/SIGINT arrived; a checkpoint was saved and the run can be resumed."""


class StopSignals:
    """Context in which SIGTERM/SIGINT request a checkpoint and a clean exit.

    The first signal is remembered in ``received`` (the loop checks it after each step);
    a second one raises ``KeyboardInterrupt`` at once (a SIGTERM repeated within
    ``REPEAT_WINDOW_S`` counts as the first). Outside the main thread, signals
    cannot be caught and the context does nothing.

    A signal sent to the whole process group (SLURM's preemption signals every process of
    the job; so do ``timeout`` and Ctrl-C) also ends DataLoader workers that do not ignore
    it (``amp_utils.loaders.tied_worker_init`` makes them ignore it; a caller's own loader
    may not), and PyTorch's SIGCHLD handler would then raise "DataLoader worker ... is
    killed by signal" in the middle of the batch, before the checkpoint. After the first
    signal the workers' ends are expected: SIGCHLD gets its default handling until the
    context exits. The loop asks for no batch after the signal: inside a
    gradient-accumulation window it saves the window's gradients with the checkpoint
    instead of waiting for the window's last batch (under DDP each rank saves its own, and
    the ranks stop together one batch after the signal).
    """

    #: A repeated SIGTERM this soon after the first is the same request, not a second one:
    #: under SLURM each rank of a ``torchrun`` job gets the job's SIGTERM and, within
    #: milliseconds, torchrun's forwarded copy. A second SIGINT (Ctrl-C) always stops.
    REPEAT_WINDOW_S = 2.0

    def __init__(self) -> None:
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # second signal: stop now, unless a repeat
            if (
                signum == signal.SIGTERM == self.received
                and time.monotonic() - self._received_at < self.REPEAT_WINDOW_S
            ):
                logger.info("SIGTERM again (a forwarded copy): still checkpointing first.")
                return
            raise KeyboardInterrupt
        self.received = signum
        self._received_at = time.monotonic()
        if hasattr(signal, "SIGCHLD") and signal.SIGCHLD not in self._previous:
            self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        logger.warning("Received signal %d: checkpointing after this batch.", signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            if handler is not None:  # None: installed outside Python, cannot be restored
                signal.signal(sig, handler)


class MidEpochDecision(NamedTuple):
    """What to do after an optimizer step: save a checkpoint, and stop after saving."""

    save: bool
    stop: bool


class MidEpochCheckpointPolicy:
    """When to save mid-epoch: every N optimizer steps, every N minutes, or on a signal.

    Args:
        interval_steps: save when the optimizer step count is a multiple of it (0: off).
        interval_minutes: save when this much time passed since the last save (0: off).
        world_size: number of DDP ranks; with several, they decide together every
            ``decide_every`` optimizer updates (one collective), so all save alike.
        decide_every: optimizer updates between joint decisions under DDP.
    """

    def __init__(
        self,
        interval_steps: int = 0,
        interval_minutes: float = 0.0,
        world_size: int = 1,
        decide_every: int = 1,
    ) -> None:
        self.interval_steps = interval_steps
        self.interval_minutes = interval_minutes
        self.world_size = world_size
        self.decide_every = decide_every
        self.last_save_time = time.time()

    def decide(
        self,
        updates: int,
        optimizer_step: int,
        signal_received: bool,
        can_save: bool,
        agreed_stop: bool = False,
    ) -> MidEpochDecision:
        """Whether to save (and stop) now, after optimizer update ``updates`` of the epoch.

        Args:
            updates: optimizer updates done in this epoch (batches / accumulation factor).
            optimizer_step: optimizer steps applied in the whole run.
            signal_received: this rank caught SIGTERM/SIGINT.
            can_save: a checkpointer exists (else only a signal stops the run).
            agreed_stop: every rank knows, at this same update, that some rank caught a
                signal (the Brain reads it from the loss all-reduce): stop now, without
                waiting for the next joint decision.
        """
        if agreed_stop:
            return MidEpochDecision(save=True, stop=True)
        stop = signal_received
        by_time = (
            can_save
            and self.interval_minutes > 0
            and time.time() - self.last_save_time >= self.interval_minutes * 60
        )
        if self.world_size > 1:
            # Ranks receive signals and read clocks at different moments.
            if updates % self.decide_every:
                stop = by_time = False
            else:
                stop, by_time = any_rank(stop, by_time)
        if stop:
            return MidEpochDecision(save=True, stop=True)
        by_steps = (
            can_save
            and self.interval_steps > 0
            and optimizer_step > 0
            and optimizer_step % self.interval_steps == 0
        )
        return MidEpochDecision(save=by_steps or by_time, stop=False)

    def saved(self) -> None:
        """Restart the clock of ``interval_minutes`` (a checkpoint was just saved)."""
        self.last_save_time = time.time()


#: How to resume, the last sentence of :func:`interrupted_error`'s message; a caller that
#: knows the command needs more to land in the same folder replaces it (a ``-m`` sweep
#: whose folder is named by the clock: ``recipes/run_folder.py``).
RESUME_HINT = "Run the same command again to resume where it stopped."


def interrupted_error(signum: int | None, epoch: Any, batch: int) -> TrainingInterrupted:
    """The exit raised after the signal's checkpoint, with the resume hint."""
    name = signal.Signals(signum or signal.SIGTERM).name  # None: another rank's signal
    return TrainingInterrupted(
        f"Received {name}: saved a checkpoint at epoch {epoch}, batch {batch}. {RESUME_HINT}"
    )
