"""``RunResults``: what one training run writes to ``results.json``, as one typed record.

The run writes it (``recipes/experiment.py``), and the sweep summary, the finished-run
check of a run folder and the tests read it through ``RunResults.from_json``, so the keys
are spelled in this one place. Reading is tolerant: a key that a file from an older version
lacks takes its default, and a key this version does not know is ignored.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amp_utils.atomic import atomic_write_json

RESULTS_FILE = "results.json"
#: The folder of a run where its record of fewer epochs is kept when the finished run is
#: trained further (``earlier/finished_<N>_epochs/results.json``): not a run of its own.
EARLIER_RECORDS_DIR = "earlier"
PERCENT_METRICS = frozenset({"CER", "WER", "accuracy"})  # metrics recorded in percent
SPEED_TAG = "speed/train_utterances_per_s"  # TensorBoard tag of a run's training speed


def metric_label(name: str, prefix: str = "test ") -> str:
    """A metric's column/axis label with its unit: ``test CER %``, ``test loss``."""
    return f"{prefix}{name} %" if name in PERCENT_METRICS else f"{prefix}{name}"


def metric_tag(name: str, stage: str = "test") -> str:
    """A metric's TensorBoard tag with its unit: ``test/CER_percent``, ``test/loss``.

    TensorBoard shows only the tag above a chart, so the unit goes into the tag.
    """
    return f"{stage}/{name}_percent" if name in PERCENT_METRICS else f"{stage}/{name}"


@dataclass
class Throughput:
    """Training speed of the run (all sessions), validation excluded.

    The rates leave out each session's first epoch (``warmup_time_s``): the process's CUDA
    start-up, compilation and graph captures land there, and in a sweep run in one process
    only the first job pays the start-up (on an H200 it made bf16 look 2.14x fp32, 1.19x
    from the second epoch on). A run that trained no epoch past a session's first (a
    one-epoch or debug run) is rated over all of them (``warmup_time_s`` is then 0).
    """

    train_utterances_per_s: float | None = None
    train_audio_seconds_per_s: float | None = None
    train_time_s: float | None = None  # all training time, warm-up included
    # share of the training time spent waiting for the data loader's next batch
    data_wait_share: float | None = None
    warmup_time_s: float | None = None  # the sessions' first epochs, left out of the rates
    # fit's time besides training: its validation loops, and the epochs' ends after them
    # (metrics, logs, checkpoint saving). None: a run from before they were recorded
    valid_time_s: float | None = None
    epoch_end_time_s: float | None = None

    @classmethod
    def from_train_stats(cls, stats: dict[str, float]) -> Throughput:
        """The rates of ``Brain.global_train_stats()`` (their ``warmup_*`` apart)."""
        total_s = max(float(stats["time_s"]), 1e-9)
        warmup_s = float(stats.get("warmup_time_s", 0.0))
        steady_s = total_s - warmup_s
        utterances = stats["utterances"] - stats.get("warmup_utterances", 0)
        audio_s = stats["audio_s"] - stats.get("warmup_audio_s", 0.0)
        if steady_s <= 1e-9 or utterances <= 0:  # only first epochs: rate them all
            warmup_s, steady_s = 0.0, total_s
            utterances, audio_s = stats["utterances"], stats["audio_s"]
        return cls(
            train_utterances_per_s=utterances / steady_s,
            train_audio_seconds_per_s=audio_s / steady_s,
            train_time_s=float(stats["time_s"]),
            data_wait_share=stats["data_wait_s"] / total_s,
            warmup_time_s=warmup_s,
            valid_time_s=float(stats.get("valid_time_s", 0.0)),
            epoch_end_time_s=float(stats.get("epoch_end_time_s", 0.0)),
        )


@dataclass
class RunResults:
    """The record of a whole run, over all its sessions (resumes); ``results.json``.

    Metrics are in percent for CER, WER and accuracy. ``valid_metrics`` are those of the
    weights the test used, not of the last epoch: the tested checkpoint's, or the average
    of checkpoints it tested (``valid_metrics_of``: ``tested_checkpoint`` or
    ``averaged_checkpoints``), scored as the test scores them (ASR: decoded with
    ``model.decoder``, whatever ``model.valid_decoder`` the epochs validated with).
    """

    precision: str | None = None  # as used (precision=auto resolved)
    eval_precision: str | None = None
    precision_requested: str | None = None  # as asked for (e.g. "auto")
    device: str | None = None  # device type: cpu, cuda
    device_name: str | None = None
    world_size: int = 1  # DDP processes
    distributed_backend: str | None = None
    model: str | None = None
    task: str | None = None
    data: str | None = None
    dataset: dict[str, Any] = field(default_factory=dict)  # root, manifests, split sizes
    overrides: list[str] | None = None  # Hydra overrides of the run (None: not recorded)
    test_metrics: dict[str, float] = field(default_factory=dict)
    # utterances the test scored (None: not recorded); a debug run's are its few batches'
    test_utterances: int | None = None
    # the test found a collapsed model (label, share, reference_share, said); None: it listens
    collapsed: dict[str, Any] | None = None
    tested_checkpoint: dict[str, Any] | None = None  # which checkpoint the test used
    valid_metrics: dict[str, float] = field(default_factory=dict)
    valid_metrics_of: str = "tested_checkpoint"  # or "averaged_checkpoints"
    throughput: Throughput = field(default_factory=Throughput)
    peak_memory_mb: float | None = None
    peak_memory_kind: str | None = None  # cuda_max_reserved | process_rss
    wall_time_s: float | None = None
    sessions: int = 1
    epochs: int | None = None  # planned (trainer.epochs)
    epochs_completed: int | None = None
    optimizer_steps: int | None = None
    skipped_steps: int | None = None  # non-finite steps not applied
    num_parameters: int | None = None
    skipped_files: int = 0  # unreadable audio files skipped (data.skip_bad_files)
    compile: dict[str, Any] | None = None  # torch.compile statistics, when compiled
    # trainer.graph_step: CUDA graphs captured, replays and eager steps (this session's)
    step_graphs: dict[str, int] | None = None
    # trainer.graph_eval: the same for validation's forward passes (this session's)
    eval_graphs: dict[str, int] | None = None
    torch_version: str | None = None

    @property
    def completed_epochs(self) -> int | None:
        """Epochs the run completed (older files recorded only the planned ``epochs``)."""
        return self.epochs_completed if self.epochs_completed is not None else self.epochs

    def time_split(self) -> str | None:
        """Where the run's wall time went, for its log: ``"wall time 386 s: training 354 s
        (92 %), validation 20 s (5 %), epoch ends 4 s (1 %), the rest 8 s (2 %)"``. The
        rest is start-up, data preparation and the test. None for a run from before the
        split was recorded."""
        speed, wall = self.throughput, self.wall_time_s
        if wall is None or wall <= 0 or None in (speed.train_time_s, speed.valid_time_s):
            return None
        parts = {
            "training": float(speed.train_time_s),
            "validation": float(speed.valid_time_s),
            "epoch ends (metrics, logs, checkpoints)": float(speed.epoch_end_time_s or 0.0),
        }
        parts["the rest (start-up, test)"] = max(wall - sum(parts.values()), 0.0)
        shown = ", ".join(f"{k} {v:.1f} s ({100 * v / wall:.0f} %)" for k, v in parts.items())
        return f"wall time {wall:.1f} s: {shown}"

    def final_metrics(self) -> dict[str, float]:
        """TensorBoard tags -> values of what the run ended with: the test metrics with
        units (``test/CER_percent``) and the training speed (``speed/train_utterances_per_s``).

        A run logs these at its last step; the HParams tab shows them as its metrics.
        """
        metrics = {metric_tag(k): v for k, v in (self.test_metrics or {}).items()}
        if self.throughput.train_utterances_per_s is not None:
            metrics[SPEED_TAG] = self.throughput.train_utterances_per_s
        return metrics

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``results.json`` (plain dicts, lists and numbers)."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """``results.json``'s text."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResults:
        """The record of a ``results.json`` object; missing keys take their defaults.

        Raises:
            ValueError: ``data`` is not a JSON object.
        """
        if not isinstance(data, dict):
            raise ValueError(f"results must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        throughput = values.get("throughput")
        if isinstance(throughput, dict):
            speed_keys = {f.name for f in dataclasses.fields(Throughput)}
            values["throughput"] = Throughput(
                **{k: v for k, v in throughput.items() if k in speed_keys}
            )
        else:
            values.pop("throughput", None)
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> RunResults:
        """Parse ``results.json``'s text (raises ``ValueError`` if it is not a JSON object)."""
        return cls.from_dict(json.loads(text))

    @classmethod
    def read(cls, path: Path) -> RunResults:
        """Read a ``results.json`` file (raises ``OSError`` or ``ValueError``)."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))

    def write(self, path: Path) -> None:
        """Write atomically to ``path`` (readers never see half a file)."""
        atomic_write_json(Path(path), self.to_dict())
