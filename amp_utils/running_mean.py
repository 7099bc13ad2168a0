"""``RunningMean``: the mean of a stage's finite losses, updated one value at a time."""

from __future__ import annotations

import math


class RunningMean:
    """Incremental mean of the finite values added; non-finite ones are left out.

    Both loops use it: the step ledger for the training loss (restored from checkpoints
    with its count, so a resumed epoch's mean matches an uninterrupted one) and the
    evaluation loop for the validation/test loss.
    """

    def __init__(self, mean: float = 0.0, count: int = 0) -> None:
        self.mean = mean
        self.count = count

    def add(self, value: float) -> bool:
        """Add ``value`` if it is finite; returns whether it was added."""
        if not math.isfinite(value):
            return False
        self.count += 1
        self.mean += (value - self.mean) / self.count
        return True
