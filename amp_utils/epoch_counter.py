"""A checkpointable epoch counter, so a resumed run continues at the right epoch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class EpochCounter:
    """Iterates epochs ``current+1 .. limit``; its position is saved with checkpoints.

    ``current`` is the epoch in progress (or last finished). A run restored from a mid-epoch
    checkpoint sets it back by one so that epoch is re-entered and the loop skips the batches
    it had already trained on.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"The number of epochs must be >= 1, got {limit} (trainer.epochs).")
        self.limit = int(limit)
        self.current = 0

    def __iter__(self) -> Iterator[int]:
        while self.current < self.limit:
            self.current += 1
            yield self.current

    def __len__(self) -> int:
        return self.limit

    def state_dict(self) -> dict[str, Any]:
        """The epoch in progress or last finished."""
        return {"current": self.current}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position (the limit stays as configured, so runs can be extended)."""
        self.current = int(state["current"])
