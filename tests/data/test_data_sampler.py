"""DurationBatchSampler: budget, coverage, determinism, distribution and resuming."""

from __future__ import annotations

import random

import pytest
import torch

from data.errors import DataError
from data.sampler import DurationBatchSampler

DURATIONS = [random.Random(i).uniform(0.2, 3.0) for i in range(300)] + [15.0]
BUDGET = 10.0


def _epoch(sampler: DurationBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return list(sampler)


def test_budget_respected_and_every_index_once() -> None:
    sampler = DurationBatchSampler(DURATIONS, BUDGET, seed=3)
    batches = _epoch(sampler, 0)
    assert len(batches) == len(sampler)
    for batch in batches:
        padded = len(batch) * max(DURATIONS[i] for i in batch)
        assert padded <= BUDGET or len(batch) == 1
    assert sorted(i for batch in batches for i in batch) == list(range(len(DURATIONS)))
    assert [len(DURATIONS) - 1] in batches  # the 15 s item is alone


def test_deterministic_per_epoch_and_different_across_epochs() -> None:
    first = DurationBatchSampler(DURATIONS, BUDGET, seed=3)
    second = DurationBatchSampler(DURATIONS, BUDGET, seed=3)
    assert _epoch(first, 4) == _epoch(second, 4)
    assert _epoch(first, 4) != _epoch(first, 5)
    assert _epoch(first, 4) != _epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=4), 4)


def test_runs_of_other_seeds_share_no_epoch_order() -> None:
    """A sweep over seeds: seed 2's epochs were seed 1's shifted by one (seed + epoch), so
    its runs trained on the same data orders and looked more alike than they are."""
    orders = {
        (seed, epoch): _epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=seed), epoch)
        for seed in (1, 2, 3)
        for epoch in range(1, 5)
    }
    assert len({str(order) for order in orders.values()}) == len(orders)


def test_no_shuffle_is_fixed_and_sorted() -> None:
    sampler = DurationBatchSampler(DURATIONS, BUDGET, shuffle=False)
    batches = _epoch(sampler, 0)
    assert batches == _epoch(sampler, 1)
    flat = [i for batch in batches for i in batch]
    assert flat == sorted(range(len(DURATIONS)), key=lambda i: DURATIONS[i])


@pytest.mark.parametrize("pad_to_buckets", [False, True])
def test_ascending_epochs_go_shortest_bucket_first_then_random(pad_to_buckets: bool) -> None:
    """SortaGrad: epochs up to ``ascending_epochs`` present the buckets shortest first, each
    bucket's batches (and items) still shuffled per epoch; later epochs are exactly those of
    a sampler without it, so a run's other epochs keep their orders."""
    kwargs = {"seed": 3, "num_buckets": 6, "pad_to_buckets": pad_to_buckets}
    sorted_first = DurationBatchSampler(DURATIONS, BUDGET, ascending_epochs=2, **kwargs)
    plain = DurationBatchSampler(DURATIONS, BUDGET, **kwargs)
    bucket_of = {i: b for b, bucket in enumerate(plain._buckets()) for i in bucket}
    for epoch in (1, 2):
        batches = _epoch(sorted_first, epoch)
        buckets = [bucket_of[batch[0]] for batch in batches]
        assert buckets == sorted(buckets) and len(set(buckets)) == 6
        # every item once, the same batches as the random order packs, in another order
        assert sorted(map(sorted, batches)) == sorted(map(sorted, _epoch(plain, epoch)))
    assert _epoch(sorted_first, 1) != _epoch(sorted_first, 2)  # still shuffled per epoch
    assert _epoch(sorted_first, 3) == _epoch(plain, 3)
    assert _epoch(sorted_first, 0) == _epoch(plain, 0)  # epochs count from 1
    for sampler, epoch in ((plain, 1), (plain, 0), (sorted_first, 0)):
        random_buckets = [bucket_of[batch[0]] for batch in _epoch(sampler, epoch)]
        assert random_buckets != sorted(random_buckets)
    with pytest.raises(DataError, match="ascending_epochs must be >= 0"):
        DurationBatchSampler(DURATIONS, BUDGET, ascending_epochs=-1)


def test_drop_last_drops_only_incomplete_batches() -> None:
    full = _epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=1), 0)
    dropped = _epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=1, drop_last=True), 0)
    assert 0 < len(dropped) < len(full)
    assert all(batch in full for batch in dropped)
    for batch in full:
        if batch not in dropped:  # only batches with room for one more item go
            assert (len(batch) + 1) * max(DURATIONS[i] for i in batch) <= BUDGET


@pytest.mark.parametrize("pad_to_buckets", [False, True])
def test_drop_last_keeps_a_buckets_only_batch(pad_to_buckets: bool) -> None:
    """A small split whose buckets each fit in one incomplete batch keeps every batch:
    dropping them would leave an empty epoch."""
    durations = [1.0 + 0.01 * i for i in range(100)]  # 10 buckets of 10 items, ~11 s each
    sampler = DurationBatchSampler(
        durations, 30.0, drop_last=True, num_buckets=10, pad_to_buckets=pad_to_buckets
    )
    batches = _epoch(sampler, 0)
    assert len(batches) == 10 and sampler.epoch_utterances() == len(durations)
    assert sorted(i for batch in batches for i in batch) == list(range(len(durations)))


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_distributed_ranks_disjoint_equal_length(num_replicas: int) -> None:
    samplers = [
        DurationBatchSampler(DURATIONS, BUDGET, seed=5, num_replicas=num_replicas, rank=r)
        for r in range(num_replicas)
    ]
    per_rank = [_epoch(s, 2) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1
    assert all(len(b) == len(s) for b, s in zip(per_rank, samplers, strict=True))
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen))
    whole = _epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=5), 2)
    assert len(per_rank[0]) == len(whole) // num_replicas
    assert per_rank[1] == whole[1 : num_replicas * len(per_rank[0]) : num_replicas]


@pytest.mark.parametrize("num_replicas", [2, 3, 4])
def test_evaluation_shards_cover_every_batch_once(num_replicas: int) -> None:
    """drop_uneven=False (evaluation): the ranks together see the whole split, once."""
    whole = _epoch(DurationBatchSampler(DURATIONS, BUDGET, shuffle=False), 0)
    assert len(whole) % num_replicas, "pick sizes where the shards are really uneven"
    per_rank = [
        _epoch(
            DurationBatchSampler(
                DURATIONS,
                BUDGET,
                shuffle=False,
                num_replicas=num_replicas,
                rank=r,
                drop_uneven=False,
            ),
            0,
        )
        for r in range(num_replicas)
    ]
    assert sorted(b for batches in per_rank for b in batches) == sorted(whole)
    assert max(map(len, per_rank)) - min(map(len, per_rank)) == 1


def test_skip_batches_holds_for_the_epoch_and_set_epoch_clears_it() -> None:
    sampler = DurationBatchSampler(DURATIONS, BUDGET, seed=9)
    sampler.set_epoch(1)
    full = list(sampler)
    sampler.skip_batches(3)
    assert len(sampler) == len(full) - 3
    assert list(sampler) == full[3:]
    assert list(sampler) == full[3:]  # iterated again (e.g. by a DataLoader): same position
    assert len(sampler) == len(full) - 3
    sampler.set_epoch(2)  # the next epoch starts at its first batch
    assert len(sampler) == len(_epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=9), 2))
    assert list(sampler) == _epoch(DurationBatchSampler(DURATIONS, BUDGET, seed=9), 2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_batches_through_a_dataloader_with_workers(num_workers: int) -> None:
    """A multiprocessing DataLoader calls the batch sampler's ``__iter__`` twice at start."""
    sampler = DurationBatchSampler([1.0] * 40, max_batch_seconds=4, seed=2)
    loader = torch.utils.data.DataLoader(
        list(range(40)), batch_sampler=sampler, num_workers=num_workers
    )
    sampler.set_epoch(0)
    full = [batch.tolist() for batch in loader]
    assert len(full) == 10
    sampler.skip_batches(3)
    assert len(loader) == 7
    assert [batch.tolist() for batch in loader] == full[3:]


@pytest.mark.parametrize("budget", [0, -5.0])
def test_non_positive_budget_raises(budget: float) -> None:
    with pytest.raises(DataError, match="must be positive.*data.max_batch_seconds=40"):
        DurationBatchSampler(DURATIONS, budget)


def test_bad_arguments_raise() -> None:
    with pytest.raises(DataError, match="rank"):
        DurationBatchSampler(DURATIONS, BUDGET, num_replicas=2, rank=2)
    with pytest.raises(DataError, match="duration"):
        DurationBatchSampler([], BUDGET)


def test_spanning_epochs_runs_on_into_the_next_epochs_without_changing_the_current_one():
    """``spans_epochs`` (set by amp_utils.loaders.start_epoch around a DataLoader's start):
    one iteration yields the current epoch past its skip, then each later epoch's batches
    exactly as set_epoch would give them; the sampler's own epoch, len() and fingerprint
    stay the current epoch's."""
    from itertools import islice

    durations = [0.5 + (i * 7 % 11) / 10 for i in range(40)]

    def plan(epoch: int) -> list[list[int]]:
        reference = DurationBatchSampler(durations, max_batch_seconds=4, seed=5, num_buckets=3)
        reference.set_epoch(epoch)
        return list(reference)

    sampler = DurationBatchSampler(durations, max_batch_seconds=4, seed=5, num_buckets=3)
    sampler.set_epoch(2)
    sampler.skip_batches(3)
    fingerprint, length = sampler.epoch_fingerprint(), len(sampler)
    sampler.spans_epochs = True
    expected = plan(2)[3:] + plan(3) + plan(4)
    assert list(islice(iter(sampler), len(expected))) == expected
    assert sampler.epoch == 2 and len(sampler) == length
    assert sampler.epoch_fingerprint() == fingerprint
    sampler.spans_until = 3  # a run whose last epoch is 3: nothing of epoch 4
    assert list(sampler) == plan(2)[3:] + plan(3)
    sampler.spans_epochs = False
    assert list(sampler) == plan(2)[3:]  # finite again
