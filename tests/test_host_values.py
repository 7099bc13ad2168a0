"""HostValues: device scalars read on the host without waiting for later queued work."""

from __future__ import annotations

import time

import pytest
import torch

from amp_utils.host_values import HostValues


def test_values_come_back_as_floats_in_order():
    values = HostValues([torch.tensor(1.5), torch.tensor(True), torch.tensor(2, dtype=torch.int64)])
    assert values.ready()
    assert values.get() == [1.5, 1.0, 2.0]


def test_non_finite_values_survive():
    got = HostValues([torch.tensor(float("nan")), torch.tensor(float("inf"))]).get()
    assert got[0] != got[0] and got[1] == float("inf")


@pytest.mark.gpu
def test_reading_does_not_wait_for_work_queued_afterwards(cuda_device):
    loss = torch.full((), 3.25, device=cuda_device)
    torch.cuda.synchronize()
    values = HostValues([loss, loss * 2])
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued after the values were taken
    start = time.perf_counter()
    got = values.get()
    waited = time.perf_counter() - start
    assert got == [3.25, 6.5]
    assert waited < 0.2, f"get() waited {waited:.2f} s: it synchronised the whole queue"
    torch.cuda.synchronize()
