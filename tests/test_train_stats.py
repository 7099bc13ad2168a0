"""amp_utils.train_stats: a run's training totals across checkpoints and world sizes."""

from __future__ import annotations

from amp_utils.distributed import DistributedInfo
from amp_utils.train_stats import TRAIN_STATS, count_as_warmup, restored_train_stats


def _stats(**values: float) -> dict[str, float]:
    return {**TRAIN_STATS, **values}


def test_a_checkpoint_of_two_ranks_resumed_by_one_process_keeps_the_totals():
    """World size 2 -> 1: the one process carries the utterances and audio of both ranks
    and the slowest rank's times (what ``global_train_stats`` reported before the stop)."""
    ranks = [
        _stats(time_s=10.0, utterances=40, audio_s=20.0, warmup_time_s=3.0, valid_time_s=1.0),
        _stats(time_s=12.0, utterances=44, audio_s=22.5, warmup_time_s=2.0, valid_time_s=1.5),
    ]
    state = {"train_stats": ranks[0], "rank_train_stats": ranks}
    restored = restored_train_stats(state, _stats(), DistributedInfo(world_size=1))
    assert restored["utterances"] == 84 and restored["audio_s"] == 42.5
    assert restored["time_s"] == 12.0 and restored["warmup_time_s"] == 3.0
    assert restored["valid_time_s"] == 1.5


def test_under_another_world_size_only_rank_zero_carries_the_counts():
    """Else ``global_train_stats`` would add the counts once per rank."""
    state = {"train_stats": _stats(utterances=10, audio_s=5.0, time_s=4.0)}
    restored = restored_train_stats(state, _stats(), DistributedInfo(world_size=2, rank=1))
    assert restored["utterances"] == 0 and restored["audio_s"] == 0.0
    assert restored["time_s"] == 4.0  # every rank has trained that long


def test_the_same_world_size_gets_each_rank_its_own_and_old_checkpoints_count_zero():
    ranks = [{"time_s": 1.0, "utterances": 3}, {"time_s": 2.0, "utterances": 5}]
    state = {"rank_train_stats": ranks}
    restored = restored_train_stats(state, _stats(), DistributedInfo(world_size=2, rank=1))
    assert restored["time_s"] == 2.0 and restored["utterances"] == 5
    assert restored["data_wait_s"] == 0.0  # a stat the checkpoint predates


def test_an_epoch_counted_as_warm_up_adds_what_it_trained_since_it_started():
    stats = _stats(utterances=100, audio_s=50.0, warmup_time_s=1.0, warmup_utterances=30)
    count_as_warmup(stats, trained_before=(60, 35.0), seconds=2.5)
    assert stats["warmup_time_s"] == 3.5
    assert stats["warmup_utterances"] == 30 + 40
    assert stats["warmup_audio_s"] == 15.0
