"""TensorBoard logging of a run: per-step scalars, per-epoch metrics, text and hparams."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter


class TensorBoardLogger:
    """Thin wrapper around ``SummaryWriter`` with the calls the recipes need.

    The event file is created on the first write, so a run refused before it trains
    leaves nothing behind.

    Args:
        log_dir: event folder; name it after the run's overrides so that runs of a sweep
            read clearly side by side in ``tensorboard --logdir``.
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer: SummaryWriter | None = None

    @property
    def writer(self) -> SummaryWriter:
        """The event writer (created, with its event file, on first use)."""
        if self._writer is None:
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        """Write each ``tag -> value`` at ``step``."""
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, float(value), global_step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Write markdown text (e.g. a few validation transcripts)."""
        self.writer.add_text(tag, text, global_step=step)

    def log_hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        """Record the run's settings with its final metrics (TensorBoard's HParams tab)."""
        clean = {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hparams.items()
        }
        self.writer.add_hparams(
            clean, {f"hparam/{k}": float(v) for k, v in metrics.items()}, run_name="."
        )

    def close(self) -> None:
        """Flush and close the event file (if one was written)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
