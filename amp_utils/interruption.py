"""Interruption: SIGTERM/SIGINT catching and the mid-epoch checkpoint policy.

A preempted job (SLURM sends SIGTERM) or a Ctrl-C saves a checkpoint after the current
batch and exits with :class:`TrainingInterrupted`; a second signal stops at once (a SIGTERM
repeated within 2 s, e.g. torchrun's forwarded copy, counts once). Besides
signals, :class:`MidEpochCheckpointPolicy` asks for a checkpoint every N optimizer steps or
every N minutes. Under DDP the ranks decide together, so that all of them save (and stop)
after the same batch: a signal through the Brain's loss all-reduce (``agreed_stop``), the
clock at joint decision points.

Outside the epochs (data preparation, the checkpoint load, the test, the writing of the
results, a sweep's summary, ``recipes/evaluate.py``) there is no batch to finish:
:class:`RunSignals`, entered once around the whole run, stops it at once with
:class:`RunInterrupted` and a one-line message of what was interrupted (the run's current
:func:`run_phase`). :class:`StopSignals` takes over from it inside ``Brain.fit``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, NamedTuple

from amp_utils.distributed import any_rank

logger = logging.getLogger(__name__)


class TrainingInterrupted(SystemExit):
    """SIGTERM/SIGINT arrived; a checkpoint was saved and the run can be resumed."""


class _SignalCatcher:
    """What :class:`StopSignals` and :class:`RunSignals` share: how a signal counts.

    The first SIGTERM/SIGINT is noted in ``received``; a SIGTERM repeated within
    ``REPEAT_WINDOW_S`` is the same request; any other second signal raises
    ``KeyboardInterrupt`` at once. After the first signal SIGCHLD gets its default handling
    (DataLoader workers ended by a process-group signal are expected, not "killed by
    signal" errors) until the context restores ``_previous``.
    """

    #: A repeated SIGTERM this soon after the first is the same request, not a second one:
    #: under SLURM each rank of a ``torchrun`` job gets the job's SIGTERM and, within
    #: milliseconds, torchrun's forwarded copy. A second SIGINT (Ctrl-C) always stops.
    REPEAT_WINDOW_S = 2.0

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}  # signal -> the handler to restore

    def _note(self, signum: int) -> bool:
        """Note ``signum``: True for the first signal, False for a repeat of it.

        Raises:
            KeyboardInterrupt: a second signal.
        """
        if self.received is not None:
            if (
                signum == signal.SIGTERM == self.received
                and time.monotonic() - self._received_at < self.REPEAT_WINDOW_S
            ):
                return False
            raise KeyboardInterrupt
        self.received = signum
        self._received_at = time.monotonic()
        if hasattr(signal, "SIGCHLD") and signal.SIGCHLD not in self._previous:
            self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        return True

    def _install(self, handler: Callable[[int, FrameType | None], None]) -> bool:
        """Make ``handler`` that of SIGTERM and SIGINT, keeping theirs to restore; False
        outside the main thread, where signals cannot be caught (nothing installed)."""
        self._previous = {}
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, handler)
        return True

    def _restore(self) -> None:
        """Put back the handlers ``_install`` (and ``_note``, SIGCHLD's) replaced."""
        for sig, handler in self._previous.items():
            if handler is not None:  # None: installed outside Python, cannot be restored
                signal.signal(sig, handler)
        self._previous = {}


class StopSignals(_SignalCatcher):
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

    def __enter__(self) -> StopSignals:
        self._install(self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._note(signum):  # a second signal raised; this is a repeat
            logger.info("SIGTERM again (a forwarded copy): still checkpointing first.")
            return
        logger.warning("Received signal %d: checkpointing after this batch.", signum)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self._restore()
        # Under a RunSignals, the signal is the run's: a repeat of it (torchrun's forwarded
        # copy) arriving after fit is not a new one. Caught after the loop's last look (in
        # the last validation's end, the last checkpoint's write), it ended nothing: the
        # run would go on to test as if none had come; it stops the run now instead (the
        # checkpoints are on disk).
        outer = active_run_signals()
        if (
            self.received is not None
            and outer is not None
            and signal.getsignal(self.received) == outer.handle
        ):
            outer.caught_in_fit(self.received, self._received_at, stopped=exc_type is not None)


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
#: whose folder is named by the clock: ``recipes/sweep_jobs.py``).
RESUME_HINT = "Run the same command again to resume where it stopped."


def signal_name(signum: int | None) -> str:
    """``SIGTERM``, ``SIGINT``: the name of ``signum`` (None, another rank's: SIGTERM)."""
    return signal.Signals(signum or signal.SIGTERM).name


def interrupted_error(signum: int | None, epoch: Any, batch: int) -> TrainingInterrupted:
    """The exit raised after the signal's checkpoint, with the resume hint."""
    return TrainingInterrupted(
        f"Received {signal_name(signum)}: saved a checkpoint at epoch {epoch}, batch {batch}. "
        f"{RESUME_HINT}"
    )


class RunInterrupted(TrainingInterrupted):
    """SIGTERM/SIGINT outside the training epochs: the run stopped at once.

    Nothing recorded is lost: outside the epochs a run writes nothing that is not whole
    (each file is written atomically, the final records together), and what it was doing
    (reading data, loading a checkpoint, testing) is done again by the same command.
    A ``SystemExit``, like :class:`TrainingInterrupted`: exit status 1, its message on
    stderr, SIGINT included (no ``KeyboardInterrupt`` traceback).
    """


def stopped_error(signum: int | None, phase: str, hint: str = RESUME_HINT) -> RunInterrupted:
    """The exit raised by a signal outside the epochs: the signal, what the run was doing
    (``phase``), that nothing recorded was lost, and how to go on (``hint``, by default
    :data:`RESUME_HINT`, which a ``-m`` sweep replaces as it does after a checkpoint)."""
    return RunInterrupted(
        f"Received {signal_name(signum)} while {phase}: stopped there; nothing recorded was "
        f"lost (no file is left half-written). {hint}"
    )


#: The :class:`RunSignals` in force, innermost last (only those whose handlers are set).
_ACTIVE: list[RunSignals] = []


def active_run_signals() -> RunSignals | None:
    """The :class:`RunSignals` whose handlers are in force now, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


class RunSignals(_SignalCatcher):
    """Context in which SIGTERM/SIGINT stop a run at once with :class:`RunInterrupted`.

    For a whole run, outside the epochs: data preparation, the checkpoint load, the test,
    the writing of the results, a sweep's summary, an evaluation. Inside ``Brain.fit``,
    :class:`StopSignals` takes over (its checkpoint after the batch), and a signal it caught
    too late for the loop to act on is handed back here when it ends. The message names
    what the run was doing: the innermost :func:`run_phase` (``phase`` otherwise).

    Within :func:`signals_held` (records that must be written together: a run's final
    TensorBoard figures and ``results.json``), the first signal waits for the end of the
    block. After the first signal, a SIGTERM repeated within ``REPEAT_WINDOW_S`` counts as
    the first (torchrun's forwarded copy); any other raises ``KeyboardInterrupt`` at once,
    as a second signal in ``fit`` does. As during ``fit``, after the first signal SIGCHLD
    gets its default handling (DataLoader workers ended by a process-group signal are
    expected, not "killed by signal" errors). Outside the main thread, signals cannot be
    caught and the context does nothing.

    Args:
        phase: what the run does when no :func:`run_phase` says more.
        hint: the last sentence of the message: how to go on; a callable is asked when a
            signal comes (a sweep's folder is known only once Hydra set it up).
    """

    def __init__(
        self, phase: str = "starting the run", hint: str | Callable[[], str] = RESUME_HINT
    ):
        super().__init__()
        self._phases: list[tuple[str, str | Callable[[], str] | None]] = [(phase, hint)]
        self._held = 0
        self._raised = False  # the first signal's exit was raised

    def __enter__(self) -> RunSignals:
        if self._install(self.handle):
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._restore()

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: raise :class:`RunInterrupted` now, or at the end of the held
        block; a second signal raises ``KeyboardInterrupt``."""
        if not self._note(signum):  # a second signal raised; this is a repeat
            return
        if self._held:
            logger.warning(
                "Received %s: stopping once the records being written are whole.",
                signal_name(signum),
            )
            return
        self._raised = True
        raise self.error(signum)

    def caught_in_fit(self, signum: int, at: float, stopped: bool) -> None:
        """``signum``, caught by :class:`StopSignals` at ``at`` (``time.monotonic``), is
        this context's first signal. ``stopped``: fit stopped on it (its exit is on its
        way); otherwise the run stops now, raising :class:`RunInterrupted`."""
        if self.received is not None:
            return
        if stopped:
            self.received, self._received_at, self._raised = signum, at, True
            return
        self.handle(signum, None)

    def error(self, signum: int | None) -> RunInterrupted:
        """The exit for ``signum`` now: the innermost phase and its (or the nearest) hint."""
        phase = self._phases[-1][0]
        hint = next(h for _, h in reversed(self._phases) if h is not None)
        return stopped_error(signum, phase, hint() if callable(hint) else hint)

    @contextlib.contextmanager
    def phase(
        self, phase: str, hint: str | Callable[[], str] | None = None
    ) -> Iterator[RunSignals]:
        """Within the block the run is ``phase`` (and goes on by ``hint``, if given)."""
        self._phases.append((phase, hint))
        try:
            yield self
        finally:
            self._phases.pop()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A first signal within the block stops the run at its end, not inside it."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self.received is not None and not self._raised:
            self._raised = True
            raise self.error(self.received)


@contextlib.contextmanager
def run_phase(
    phase: str, hint: str | Callable[[], str] | None = None, install: bool = False
) -> Iterator[None]:
    """Name what the run does in the block, for the message of a signal that stops it.

    Under a :class:`RunSignals` the block is that phase (``hint``: how to go on from it).
    Without one, ``install=True`` enters one for the block (a recipe's entry point: a run,
    a sweep job started by a launcher, an evaluation); otherwise nothing changes (library
    use, e.g. ``Brain.fit`` outside a recipe, keeps the signals' usual handling).
    """
    active = active_run_signals()
    if active is not None:
        with active.phase(phase, hint):
            yield
    elif install:
        with RunSignals(phase, hint or RESUME_HINT):
            yield
    else:
        yield


def signals_held() -> contextlib.AbstractContextManager[None]:
    """:meth:`RunSignals.held` of the one in force (no-op without one): records written
    together are all written before a signal stops the run."""
    active = active_run_signals()
    return active.held() if active is not None else contextlib.nullcontext()
