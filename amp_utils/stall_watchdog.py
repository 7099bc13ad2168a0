"""A stalled run says where it is stuck: the main thread's stack after N minutes without a batch.

A training step can stop making progress without failing: a kernel that never returns
(oneDNN's fp16 depthwise convolution on some CPUs looped forever while generating its kernel,
``benchmarks/results/2026-11-25-cpu-fp16-conv.md``), a collective waiting for a rank that
died, a DataLoader worker that hangs. The run then prints nothing, and SIGTERM cannot stop
it, because the signal handler only runs between Python bytecodes. :class:`StallWatchdog`
watches the loop's batches from a daemon thread; when none finished for ``minutes``, it logs
a warning with the main thread's Python stack (the innermost frames name the module and the
op) and how to stop the run, then again every further ``minutes`` while the stall lasts.

PyTorch releases the GIL inside its ops, so the thread runs while the main thread is stuck
in one. The loop pays one ``time.monotonic()`` and one uncontended lock per batch.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from types import TracebackType

logger = logging.getLogger(__name__)

#: Stack frames shown in the warning (the innermost ones: where the run is stuck).
FRAMES_SHOWN = 12


class StallWatchdog:
    """Context that warns, with the main thread's stack, when no batch finished for a while.

    Args:
        minutes: minutes without a finished batch before the warning (<= 0: off).
        where: called (from the watchdog's thread) for the loop's position, e.g.
            ``"epoch 3/30, train batch 12"``, shown in the warning.

    Call :meth:`beat` after every batch. The warning repeats every further ``minutes``
    of the same stall; a batch that finishes ends the stall (and says so). Entering the
    context again while it is active (``evaluate`` inside ``fit``) changes nothing.
    """

    def __init__(self, minutes: float, where: Callable[[], str] | None = None) -> None:
        self.seconds = float(minutes) * 60.0
        self.where = where
        self.last_beat = time.monotonic()
        self.warnings = 0  # warnings logged during the current stall
        self._main = threading.main_thread()
        self._stop = threading.Event()
        # beat() and the watchdog's check-and-warn run one at a time: without it a warning
        # decided just before a beat was logged after "The stall is over", and left a
        # stall count that made the next beat announce the end of a stall again.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._depth = 0

    @property
    def enabled(self) -> bool:
        """Whether the watchdog is on (``minutes`` > 0)."""
        return self.seconds > 0

    def beat(self) -> None:
        """A batch finished: the run makes progress."""
        with self._lock:
            self.last_beat = time.monotonic()
            if self.warnings:
                self.warnings = 0
                logger.warning("The stall is over: a batch finished.")

    def __enter__(self) -> StallWatchdog:
        self._depth += 1
        if self._depth > 1:
            return self
        self.last_beat = time.monotonic()
        self.warnings = 0
        if self.enabled and threading.current_thread() is self._main:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="stall-watchdog", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        poll = min(max(self.seconds / 10.0, 0.01), 30.0)
        while not self._stop.wait(poll):
            with self._lock:
                stalled = time.monotonic() - self.last_beat
                if stalled >= self.seconds * (self.warnings + 1):
                    self.warnings += 1
                    logger.warning(self.message(stalled))

    def message(self, stalled_s: float) -> str:
        """The warning: for how long, where the main thread is, and how to stop the run."""
        frame = sys._current_frames().get(self._main.ident or -1)
        stack = traceback.format_stack(frame)[-FRAMES_SHOWN:] if frame is not None else []
        where = f" (at {self.where()})" if self.where is not None else ""
        return (
            f"No batch has finished for {stalled_s / 60:.1f} min{where}. The "
            f"main thread is here (innermost last):\n{''.join(stack)}"
            "A first step that compiles (torch.compile) can take minutes; a step stuck in "
            "one op for longer is a hang, often a kernel that never returns. A stuck op "
            "ignores SIGTERM and Ctrl-C: stop the run with kill -9 (it resumes from its "
            "last checkpoint), then avoid the op, e.g. precision=fp32 or "
            "precision.fp32_modules=[...] for the module named above. "
            "trainer.stall_warning_minutes sets this warning's delay (0: off)."
        )
