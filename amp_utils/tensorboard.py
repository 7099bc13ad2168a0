"""TensorBoard logging of a run: per-step scalars, per-epoch metrics, text and hparams.

Every scalar of a run is plotted against its optimizer step (applied or skipped, counted
over the whole run): ``train/*`` every ``log_interval_steps``, ``valid/*`` and ``epoch/*``
at the end of each epoch (the epoch itself is ``epoch/number``), the final ``test/*`` at
the last step. Units are part of the tag (``test/CER_percent``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tensorboard.compat.proto import types_pb2
from tensorboard.compat.proto.tensor_pb2 import TensorProto
from tensorboard.plugins.hparams import plugin_data_pb2
from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summaries

from amp_utils.interruption import signals_held

TENSORBOARD_DIR = "tb"  # a run's event folder inside its run folder


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
        self._purge_step: int | None = None

    def resume_at(self, step: int) -> None:
        """A resumed run goes on from ``step``: the points an interrupted session wrote from
        there on are superseded. The new event file starts with TensorBoard's session-start
        marker at ``step`` (``SummaryWriter(purge_step=...)``), so readers drop them instead
        of showing two points per step. Call it before the first write."""
        if self._writer is None:
            self._purge_step = step

    def start_over(self) -> None:
        """The run starts from its first step, in a folder where a session killed before its
        first checkpoint logged some: those points are superseded (``resume_at(0)``), else
        each of those steps had two. A folder without events is left as it is. Call it
        before the first write."""
        if any(self.log_dir.glob("events.out.tfevents.*")):
            self.resume_at(0)

    @property
    def writer(self) -> SummaryWriter:
        """The event writer (created, with its event file, on first use)."""
        if self._writer is None:
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=self._purge_step)
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

    def flush(self) -> None:
        """Put every event logged so far into the event file (if one was written).

        Events are queued for a writer thread; a process killed before it wrote them loses
        them. A run flushes before ``results.json`` marks it finished, since no later
        session logs a finished run's final metrics again.
        """
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flush and close the event file (if one was written)."""
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()


@contextlib.contextmanager
def _tensorboard_info_muted() -> Iterator[None]:
    """TensorBoard's own INFO lines (its directory watcher's "No path found after ...") left
    out of the console and the log while a run's events are read; its warnings stay."""
    tb_logger = logging.getLogger("tensorboard")
    level = tb_logger.level
    tb_logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        tb_logger.setLevel(level)


def session_hparams(log_dir: str | Path) -> dict[str, bool | float | str]:
    """The hparams a run recorded for the HParams tab (empty if it recorded none)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 1, "scalars": 1})
    with _tensorboard_info_muted():  # "No path found after ...": once per job of a sweep
        accumulator.Reload()
    if metadata.SESSION_START_INFO_TAG not in accumulator.Tags()["tensors"]:
        return {}
    content = accumulator.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content
    start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    values: dict[str, bool | float | str] = {}
    for name, value in start.hparams.items():
        kind = value.WhichOneof("kind")
        if kind in ("bool_value", "number_value", "string_value"):
            values[name] = getattr(value, kind)
    return values


def write_sweep_experiment(
    sweep_dir: str | Path,
    run_dirs: Sequence[str | Path],
    first: Sequence[str],
    metric_tags: Sequence[str],
) -> list[str]:
    """Write one HParams experiment for a sweep into ``sweep_dir`` (TensorBoard's run ".").

    Without one, TensorBoard lists every scalar tag of every run as a metric; with it, the
    HParams tab shows ``metric_tags`` (the test figures and speed) and, as columns shown
    without a click, ``first`` (the swept keys and ``precision``) and any other hparam whose
    value differs between runs (TensorBoard orders those by name, then the others).
    Each hparam's domain is the values the runs used, as TensorBoard would infer it.

    Args:
        sweep_dir: the multirun folder (``tensorboard --logdir`` on it shows the sweep).
        run_dirs: each job's TensorBoard folder.
        first: hparam names to put first, in this order (those that no run has are left out).
        metric_tags: the scalar tags shown as metrics.

    Returns:
        The hparam names in the written order (empty, and nothing written, if no run
        recorded hparams).
    """
    runs = [session_hparams(run_dir) for run_dir in run_dirs]
    names: list[str] = []
    for name in [*first, *sorted({n for run in runs for n in run})]:  # (a map: no order)
        if name not in names and any(name in run for run in runs):
            names.append(name)
    if not names:
        return []
    example, domains = {}, {}
    for name in names:
        values = [run[name] for run in runs if name in run]
        example[name] = values[0]
        if all(type(v) is type(values[0]) for v in values):  # noqa: E721 (bool is an int)
            domains[name] = sorted(set(values))
    experiment, _start, _end = hparams_summaries(example, dict.fromkeys(metric_tags, 0.0), domains)
    # TensorBoard shows the hparams marked as differing first (then by name) and hides the
    # rest beyond its column limit: mark the ones asked for first and those that differ.
    differing = {n for n in names if n in first or len({str(r.get(n)) for r in runs}) > 1}
    for value in experiment.value:
        data = plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content)
        for info in data.experiment.hparam_infos:
            info.differs = info.name in differing
        data.experiment.time_created_secs = 0.0  # no clock: a rerun writes the same bytes
        value.metadata.plugin_data.content = data.SerializeToString()
        value.tensor.CopyFrom(TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.0]))
    earlier = list(Path(sweep_dir).glob("events.out.tfevents.*"))  # this sweep's, if rerun
    if len(earlier) == 1 and _experiment_of(earlier[0]) == _plugin_data(experiment):
        return names  # the same experiment: a rerun of a finished sweep changes no file
    with signals_held():  # a signal waits: the old experiment is not gone without the new
        for old in earlier:
            old.unlink()
        with SummaryWriter(str(sweep_dir)) as writer:
            writer.file_writer.add_summary(experiment)
    return names


def _plugin_data(summary: Any) -> list[tuple[str, Any]]:
    """(tag, HParams plugin data) of each value of an experiment summary."""
    return [
        (
            value.tag,
            plugin_data_pb2.HParamsPluginData.FromString(value.metadata.plugin_data.content),
        )
        for value in summary.value
    ]


def _experiment_of(event_file: Path) -> list[tuple[str, Any]] | None:
    """The experiment an event file holds, as :func:`_plugin_data` gives it (None: none,
    or unreadable). Compared by content: the writer adds fields of its own (data_class)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    try:
        for event in EventFileLoader(str(event_file)).Load():
            if event.HasField("summary"):
                return _plugin_data(event.summary)
    except Exception:  # noqa: BLE001 -- a damaged file is rewritten
        return None
    return None
