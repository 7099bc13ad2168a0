"""DurationBatchSampler: fixed bucket batch sizes, defaults, boundaries and error messages.

The fast unit checks that ``tests/data/test_data_sampler.py`` leaves open (found by mutation
testing, docs/mutation_testing.md): ``pad_to_buckets`` packing and edges without a data set,
the exact ``drop_last`` boundary, the seed of an epoch, and what each error tells the user.
"""

from __future__ import annotations

import pytest

from data.errors import DataError
from data.sampler import DurationBatchSampler


def sizes(sampler: DurationBatchSampler) -> list[int]:
    return [len(batch) for batch in sampler]


def test_pad_to_buckets_cuts_each_bucket_into_budget_sized_batches() -> None:
    # Bucket 1: ten 0.5 s items (edge 0.5 -> 4 // 0.5 = 8 per batch); bucket 2: ten 1.2 s
    # items (edge 1.3 -> 3 per batch); bucket 3: one 9 s item, longer than the budget.
    durations = [0.5] * 10 + [1.2] * 9 + [1.3] + [9.0] * 21
    sampler = DurationBatchSampler(
        durations, 4.0, shuffle=False, num_buckets=2, pad_to_buckets=True
    )
    assert sampler.bucket_edges() == [1.3, 9.0]  # defaults: no rounding (pad_quantum=0)
    assert sizes(sampler) == [3] * 6 + [2] + [1] * 21
    assert sorted(i for batch in sampler for i in batch) == list(range(len(durations)))

    three = DurationBatchSampler(
        [0.5] * 10 + [1.3] * 10, 4.0, shuffle=False, num_buckets=2, pad_to_buckets=True
    )
    assert three.bucket_edges() == [0.5, 1.3]
    assert sizes(three) == [8, 2, 3, 3, 3, 1]


@pytest.mark.parametrize(
    ("durations", "expected"),
    [
        ([1.0] * 7, [3, 3]),  # two full batches and one of 1: the 1 goes
        ([1.0] * 6, [3, 3]),  # exactly full: nothing goes
        ([1.0] * 4, [3]),  # two batches, the second incomplete: it goes
        ([1.0] * 2, [2]),  # one batch in the bucket: kept even if incomplete
    ],
)
def test_pad_to_buckets_drop_last(durations: list[float], expected: list[int]) -> None:
    kept = DurationBatchSampler(
        durations, 3.0, shuffle=False, num_buckets=1, pad_to_buckets=True, drop_last=True
    )
    assert sizes(kept) == expected and kept.epoch_utterances() == sum(expected)
    everything = DurationBatchSampler(
        durations, 3.0, shuffle=False, num_buckets=1, pad_to_buckets=True
    )
    assert sum(sizes(everything)) == len(durations)


def test_pad_quantum_rounds_bucket_edges_up() -> None:
    sampler = DurationBatchSampler(
        [0.3, 0.5, 0.9, 1.0], 4.0, num_buckets=2, pad_to_buckets=True, pad_quantum=64 / 8000
    )
    assert sampler.bucket_edges() == pytest.approx([0.504, 1.0], abs=1e-12)
    assert sampler.bucket_edges()[1] == 1.0  # already a multiple: not a quantum more
    coarse = DurationBatchSampler([0.3, 1.1], 4.0, num_buckets=2, pad_quantum=2.0)
    assert coarse.bucket_edges() == [2.0, 2.0]


def test_pad_to_buckets_with_silent_items_keeps_them_in_one_batch() -> None:
    sampler = DurationBatchSampler([0.0] * 5, 4.0, num_buckets=1, pad_to_buckets=True)
    assert sizes(sampler) == [5]


def test_drop_last_boundary_is_room_for_exactly_one_more_item() -> None:
    # Budget 4 s, 1 s items: batches of 4; a last batch of 3 has room for exactly one more.
    assert sizes(
        DurationBatchSampler([1.0] * 11, 4.0, shuffle=False, num_buckets=1, drop_last=True)
    ) == [4, 4]
    assert sizes(DurationBatchSampler([1.0] * 11, 4.0, shuffle=False, num_buckets=1)) == [4, 4, 3]


def test_defaults_seed_zero_epoch_zero_and_no_skip() -> None:
    durations = [0.1 * (i % 17 + 1) for i in range(100)]
    fresh = DurationBatchSampler(durations, 2.0)
    assert len(fresh) == len(list(fresh))  # usable before set_epoch
    explicit = DurationBatchSampler(durations, 2.0, seed=0)
    explicit.set_epoch(0)
    assert list(fresh) == list(explicit)
    assert list(DurationBatchSampler(durations, 2.0, seed=1)) != list(fresh)


def test_the_seed_and_the_epoch_seed_the_shuffle_apart() -> None:
    """seed 3's epoch 4 was seed 5's epoch 2 (the epoch was added to the seed)."""
    durations = [0.1 * (i % 17 + 1) for i in range(100)]
    a = DurationBatchSampler(durations, 2.0, seed=3)
    b = DurationBatchSampler(durations, 2.0, seed=5)
    a.set_epoch(4)
    b.set_epoch(2)
    assert list(a) != list(b)


def test_skipping_zero_or_every_batch() -> None:
    sampler = DurationBatchSampler([1.0] * 12, 4.0, seed=1, num_buckets=1)
    full = list(sampler)
    sampler.skip_batches(0)
    assert list(sampler) == full and len(sampler) == 3
    sampler.skip_batches(3)
    assert list(sampler) == [] and len(sampler) == 0
    sampler.skip_batches(5)  # past the end: nothing left, never a negative length
    assert len(sampler) == 0


def test_small_budgets_and_zero_durations_are_valid() -> None:
    assert sizes(DurationBatchSampler([0.1] * 4, 0.25, shuffle=False, num_buckets=1)) == [2, 2]
    assert sizes(DurationBatchSampler([0.0, 0.0], 1.0, num_buckets=1)) == [2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"durations": [1.0], "max_batch_seconds": 0},
            "max_batch_seconds must be positive, got 0. Fix: set a budget in seconds of padded "
            "audio per batch, e.g. data.max_batch_seconds=40.",
        ),
        (
            {"durations": [1.0, -1.0, float("inf"), -2.0, float("nan"), -3.0]},
            "DurationBatchSampler needs one finite, non-negative duration per item; got 6 "
            "durations, 5 bad (e.g. [-1.0, inf, -2.0]). Fix: check the manifest's duration "
            "column and that the split is not empty.",
        ),
        (
            {"durations": [1.0], "num_buckets": 0},
            "num_buckets must be at least 1, got 0. Fix: e.g. num_buckets=10.",
        ),
        (
            {"durations": [1.0], "num_replicas": 2, "rank": -1},
            "Need num_replicas >= 1 and 0 <= rank < num_replicas, got num_replicas=2, rank=-1. "
            "Fix: pass the world size and this process's rank from torch.distributed.",
        ),
    ],
    ids=["budget", "durations", "buckets", "rank"],
)
def test_errors_say_what_is_wrong_and_how_to_fix_it(kwargs: dict, message: str) -> None:
    kwargs = {"max_batch_seconds": 4.0, **kwargs}
    with pytest.raises(DataError) as err:
        DurationBatchSampler(**kwargs)
    assert str(err.value) == message


def test_negative_skip_says_what_to_pass() -> None:
    with pytest.raises(DataError) as err:
        DurationBatchSampler([1.0], 4.0).skip_batches(-1)
    assert str(err.value) == (
        "skip_batches needs a count >= 0, got -1. Fix: pass the number of batches of this "
        "epoch already trained."
    )


def test_the_epoch_fingerprint_tells_apart_every_plan_a_resume_could_meet() -> None:
    """A mid-epoch resume skips the batches trained, which is exact only in the same plan;
    the checkpoint's fingerprint is how a changed plan is noticed. Plans with the same batch
    sizes but other utterances in them (another seed or epoch, SortaGrad's first epoch, the
    items of a bucket batched differently) must get other fingerprints, and the same plan
    the same one, whatever the sampler's resume position."""
    durations = [1.0] * 24  # equal durations: every plan cuts the same batch sizes

    def plan(epoch: int = 2, skip: int = 0, **options) -> tuple[list[list[int]], str]:
        sampler = DurationBatchSampler(durations, 4.0, **{"seed": 1, "num_buckets": 3, **options})
        sampler.set_epoch(epoch)
        sampler.skip_batches(skip)
        return sampler._all_batches(), sampler.epoch_fingerprint()

    batches, fingerprint = plan()
    assert plan(skip=3) == (batches, fingerprint)  # the position is not part of the plan
    for other in (
        plan(seed=2),
        plan(epoch=3),
        plan(epoch=1, ascending_epochs=1),
        plan(shuffle=False),
    ):
        assert [len(b) for b in other[0]] == [len(b) for b in batches]  # sizes alike
        assert other[0] != batches and other[1] != fingerprint
