"""Peak memory is measured per run, also for several runs of a sweep in one process."""

import sys

import pytest
import torch

from amp_utils.memory import peak_memory_mb, reset_peak_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc peak RSS reset")
def test_cpu_peak_resets_between_runs():
    cpu = torch.device("cpu")
    big = torch.ones(50_000_000)  # 200 MB
    high = peak_memory_mb(cpu)
    del big
    reset_peak_memory(cpu)
    assert peak_memory_mb(cpu) < high - 150
