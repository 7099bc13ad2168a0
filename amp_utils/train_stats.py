"""A run's training totals: time, utterances, audio, data wait, and where fit's time went.

``Brain.train_stats`` is a plain dict with the keys of :data:`TRAIN_STATS`; it is saved with
every checkpoint (so a resumed run goes on counting), read by ``run_results.Throughput``
(utterances/s after the first epoch, the time split) and summed over DDP ranks here. The
loop adds to it; this module says what the keys mean, how a checkpoint's totals come back
under another world size, and when an epoch waited too long for its batches.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from amp_utils.distributed import DistributedInfo, all_reduce_counts, all_reduce_max

logger = logging.getLogger(__name__)

#: Training totals of a run (all sessions): seconds training, utterances and seconds of
#: audio trained on, and seconds the loop waited for the loader's next batch.
TRAIN_STATS: dict[str, float] = {
    "time_s": 0.0,
    "utterances": 0,
    "audio_s": 0.0,
    "data_wait_s": 0.0,
    # each session's first trained epoch (start-up, compilation, graph captures), also
    # counted above: run_results.Throughput rates the run without it
    "warmup_time_s": 0.0,
    "warmup_utterances": 0,
    "warmup_audio_s": 0.0,
    # fit's time besides training: the validation loops, and each epoch's end after its
    # validation (metrics, logs, TensorBoard, checkpoint saving). A short step's epoch
    # spends most of its time there (the default recipe on an H200: ~0.2 of ~0.6 s trains)
    "valid_time_s": 0.0,
    "epoch_end_time_s": 0.0,
}
#: Over DDP ranks the counts add up and the times are the slowest rank's.
SUMMED_TRAIN_STATS = ("utterances", "audio_s", "warmup_utterances", "warmup_audio_s")
SLOWEST_TRAIN_STATS = (
    "time_s",
    "data_wait_s",
    "warmup_time_s",
    "valid_time_s",
    "epoch_end_time_s",
)
#: An epoch that waits for data this share of its time or more, and at least
#: ``DATA_WAIT_MIN_S`` seconds (not a debug run's blink), gets a warning (once a run).
DATA_WAIT_WARNING = 0.2
DATA_WAIT_MIN_S = 1.0


def count_as_warmup(
    stats: dict[str, float], trained_before: tuple[float, float], seconds: float
) -> None:
    """Add an epoch, trained for ``seconds`` so far, to ``stats``' warm-up totals.

    ``trained_before`` is (utterances, audio seconds) of ``stats`` when the epoch started:
    what was added since is the epoch's.
    """
    utterances, audio_s = trained_before
    stats["warmup_time_s"] += seconds
    stats["warmup_utterances"] += stats["utterances"] - utterances
    stats["warmup_audio_s"] += stats["audio_s"] - audio_s


def restored_train_stats(
    state: Mapping[str, Any], current: Mapping[str, float], distributed: DistributedInfo
) -> dict[str, float]:
    """This rank's training totals from a checkpoint's brain state (``current``: a
    checkpoint without any). Under another world size rank 0 carries the totals:
    :func:`global_train_stats` sums utterances and audio over the ranks, and takes the
    slowest rank's times."""
    saved = state.get("rank_train_stats") or [state.get("train_stats", current)]
    saved = [{**TRAIN_STATS, **s} for s in saved]  # checkpoints from before a stat: 0
    if len(saved) == distributed.world_size:
        return dict(saved[distributed.rank])
    mine = distributed.rank == 0
    return {
        **{key: max(float(s[key]) for s in saved) for key in SLOWEST_TRAIN_STATS},
        **{
            key: sum(s[key] for s in saved) if mine else TRAIN_STATS[key]
            for key in SUMMED_TRAIN_STATS
        },
    }


def global_train_stats(
    stats: Mapping[str, float], distributed: DistributedInfo
) -> dict[str, float]:
    """Training totals of all ranks together: utterances and audio add up over the ranks;
    the times are the slowest rank's. Every rank must call it under DDP (collectives)."""
    if distributed.world_size == 1:
        return dict(stats)
    totals = all_reduce_counts({key: stats[key] for key in SUMMED_TRAIN_STATS})
    times = [stats[key] for key in SLOWEST_TRAIN_STATS]
    slowest = all_reduce_max(torch.tensor(times, dtype=torch.float64))
    return {
        **totals,
        **{key: float(v) for key, v in zip(SLOWEST_TRAIN_STATS, slowest, strict=True)},
    }


class DataWaitReport:
    """Each epoch's share of time spent waiting for batches: TensorBoard's
    ``epoch/data_wait_share``, and a warning the first time it reaches
    :data:`DATA_WAIT_WARNING` (and :data:`DATA_WAIT_MIN_S`): the loader, not the model,
    then sets the speed."""

    def __init__(self) -> None:
        self.warned = False

    def report(
        self,
        epoch_label: str,
        wait_s: float,
        epoch_s: float,
        num_workers: int | None,
        tensorboard: Any = None,
        step: int = 0,
    ) -> float:
        """Log and, once a run, warn about an epoch's data wait; returns its share."""
        share = wait_s / epoch_s if epoch_s > 0 else 0.0
        if tensorboard is not None:
            tensorboard.log_scalars({"epoch/data_wait_share": share}, step=step)
        if share >= DATA_WAIT_WARNING and wait_s >= DATA_WAIT_MIN_S and not self.warned:
            self.warned = True
            logger.warning(
                "epoch %s: training waited for the next batch %.0f %% of the time (%.1f of "
                "%.1f s): the data loader, not the model, sets the speed here. More loader "
                "processes (device.num_workers, now %s) would help.",
                epoch_label,
                100 * share,
                wait_s,
                epoch_s,
                num_workers,
            )
        return share
