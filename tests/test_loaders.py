"""Resuming inside an epoch: the remaining batches and the progress bar's total."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from amp_utils.loaders import start_epoch
from data.sampler import DurationBatchSampler


def numbered(n: int = 48) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("sampler_skips", [True, False], ids=["skipping_sampler", "loop"])
def test_mid_epoch_resume_yields_the_rest_and_counts_the_whole_epoch(sampler_skips):
    if sampler_skips:
        sampler = DurationBatchSampler([1.0] * 48, max_batch_seconds=4, seed=1, num_buckets=1)
        loader = DataLoader(numbered(), batch_sampler=sampler)
    else:
        loader = DataLoader(numbered(), batch_size=4)
    full = [batch[0].tolist() for batch in start_epoch(loader, epoch=2).batches]
    batches, total = start_epoch(loader, epoch=2, skip=5)
    rest = [batch[0].tolist() for batch in batches]
    assert len(full) == 12 and rest == full[5:]  # the same epoch, its first 5 batches left out
    # A bar with initial=5 must end at 12 of 12: the skipped batches are counted once.
    assert total == 12
    assert 5 + len(rest) == total


def test_timed_batches_reports_how_long_each_batch_took_to_arrive():
    import time

    from amp_utils.loaders import timed_batches

    def slow():
        for i in range(3):
            time.sleep(0.02 * i)
            yield i

    waits: list[float] = []
    assert list(timed_batches(slow(), waits.append)) == [0, 1, 2]
    assert len(waits) == 3 and waits[0] < 0.015 and waits[1] >= 0.02 and waits[2] >= 0.04
