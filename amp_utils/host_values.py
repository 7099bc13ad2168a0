"""Read scalars computed on the GPU without stalling the GPU's queue.

``tensor.item()`` copies on the current stream, so it waits for *everything* queued so far,
including the next batch's forward and backward that the loop has already launched.
``HostValues`` copies a few scalars into pinned host memory right after they are computed
and records an event; reading them later waits for that event only. On the CPU (and other
devices) the values are simply kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostValues:
    """Scalars (0-d tensors) on their way to the host; ``get()`` returns them as floats."""

    def __init__(self, values: Sequence[torch.Tensor]) -> None:
        stacked = torch.stack([v.detach().reshape(()).float() for v in values])
        self._event: torch.cuda.Event | None = None
        if stacked.is_cuda:
            self._host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = stacked

    def ready(self) -> bool:
        """Whether ``get()`` would return without waiting."""
        return self._event is None or self._event.query()

    def get(self) -> list[float]:
        """The values; waits (if at all) only for the work queued before they were taken."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()
