"""Wall time and peak memory of a whole run, over all its sessions (resumes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class RunClock:
    """The run's wall time and peak memory across sessions; a checkpoint recoverable.

    Each checkpoint stores the run's wall time and peak memory up to that moment, and a
    resumed session adds its own to what the checkpoint it continues from recorded. The time
    a killed session spent after its last checkpoint is not counted, just like the batches
    it trained then (the Brain's training time is checkpointed the same way), so the
    training time never exceeds the wall time.

    Loads count until ``resumed`` is called (once the run has resumed, before it trains):
    loading the best checkpoint for testing later must not set the run's totals back.

    Args:
        peak_memory_mb: this session's peak memory so far (e.g. ``amp_utils.memory``).
        start: when this session started (``time.time()``); default: now.
    """

    def __init__(self, peak_memory_mb: Callable[[], float], start: float | None = None) -> None:
        self._session_peak = peak_memory_mb
        self.session_start = time.time() if start is None else start
        self.earlier_wall_time_s = 0.0  # of the sessions before this one
        self.earlier_peak_memory_mb = 0.0
        self.sessions = 1  # this one included
        self._loaded = False

    def wall_time_s(self) -> float:
        """Wall time of the run: earlier sessions plus this one so far."""
        return self.earlier_wall_time_s + time.time() - self.session_start

    def peak_memory_mb(self) -> float:
        """Peak memory of the run: the highest of any session."""
        return max(self.earlier_peak_memory_mb, self._session_peak())

    def resumed(self) -> None:
        """The run has resumed (or started afresh): later loads leave the totals alone."""
        self._loaded = True

    def state_dict(self) -> dict[str, Any]:
        """The run's totals up to now."""
        return {
            "wall_time_s": self.wall_time_s(),
            "peak_memory_mb": self.peak_memory_mb(),
            "sessions": self.sessions,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from the totals of the checkpoint the run resumes from."""
        if self._loaded:
            return
        self.earlier_wall_time_s = float(state["wall_time_s"])
        self.earlier_peak_memory_mb = float(state["peak_memory_mb"])
        self.sessions = int(state["sessions"]) + 1
