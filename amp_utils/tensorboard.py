"""TensorBoard logging of a run: per-step scalars, per-epoch metrics, text and hparams.

Every scalar of a run is plotted against its optimizer step (applied or skipped, counted
over the whole run): ``train/*`` every ``log_interval_steps``, ``valid/*`` and ``epoch/*``
at the end of each epoch (the epoch itself is ``epoch/number``), the final ``test/*`` at
the last step. Units are part of the tag (``test/CER_percent``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import types_pb2
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summaries


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

    def log_hparams(self, hparams: Mapping[str, Any], metric_tags: Sequence[str]) -> None:
        """Record the run's settings for TensorBoard's HParams tab.

        Only the session start/end infos are written, no experiment summary. With none,
        TensorBoard builds the experiment from all runs' sessions, marks the hparams whose
        values differ between runs (``precision`` in a precision sweep) and lists them
        first, so they are among the columns shown by default. ``add_hparams`` instead
        writes an experiment summary into every run, which TensorBoard takes as the whole
        experiment: hparams in name order, the ones that differ often hidden.

        Args:
            hparams: setting name -> value (other types than bool/int/float/str as text).
            metric_tags: scalar tags already logged in this run (e.g. ``test/CER_percent``)
                that the HParams tab shows as the run's metrics.
        """
        clean = {
            k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in hparams.items()
        }
        _experiment, session_start, session_end = hparams_summaries(
            clean, dict.fromkeys(metric_tags, 0.0)
        )
        file_writer = self.writer.file_writer  # SummaryWriter has no public add_summary
        for summary in (session_start, session_end):
            for value in summary.value:
                # A scalar placeholder, as TensorBoard's own hparams summary_v2 writes: the
                # plugin reads only the metadata, but event readers list the tag as a tensor.
                value.tensor.CopyFrom(TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.0]))
            file_writer.add_summary(summary)

    def close(self) -> None:
        """Flush and close the event file (if one was written)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
