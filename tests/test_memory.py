"""Peak memory is measured per run, also for several runs of a sweep in one process."""

import sys
from pathlib import Path

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


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**10
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc peak RSS reset")
def test_a_cpu_window_does_not_count_heap_memory_freed_before_it():
    """A sweep's jobs in one process: memory an earlier job freed, but the C heap kept (small
    blocks under one still in use), counted in each later job's peak (measured: 753, 816 and
    855 MB for three identical jobs; now 749, 761, 765)."""
    cpu = torch.device("cpu")
    blocks = [bytes(1000) for _ in range(200_000)]  # ~200 MB of small malloc blocks
    above = bytes(1000)  # still in use, above them: the heap cannot shrink on its own
    with_blocks = _rss_mb()
    del blocks
    reset_peak_memory(cpu)
    assert peak_memory_mb(cpu) < with_blocks - 150
    del above


def test_a_new_job_releases_the_earlier_jobs_memory_before_its_window(monkeypatch):
    """Brain.fit starts its peak window after collecting garbage and (CUDA) emptying the
    allocator's cache: a sweep's earlier job, alive in a reference cycle until a collection,
    and its cached blocks counted in the next job's peak (an H200 sweep: bf16 1,280 MB
    reserved after fp32's 990 MB; the step benchmark, which releases first, gave bf16
    950 MB against fp32's 1,096 MB)."""
    import amp_utils.brain as brain_module
    from tests.test_brain import RegressionBrain, make_data, make_model, run_opts, sgd

    calls: list[str] = []
    monkeypatch.setattr(brain_module, "release_cached_memory", lambda d: calls.append("release"))
    monkeypatch.setattr(brain_module, "reset_peak_memory", lambda d: calls.append("reset"))
    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    brain.fit(range(1), torch.utils.data.DataLoader(make_data(), batch_size=8))
    assert calls[:2] == ["release", "reset"]


def test_a_cuda_window_reset_keeps_the_allocators_cache(monkeypatch):
    """The benchmark resets the peak after its warm-up steps: the timed steps reuse the
    blocks the warm-up cached (no collection, no empty_cache, which also waits for the GPU)."""
    import gc

    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset_peak")
    )
    reset_peak_memory(torch.device("cuda", 0))
    assert calls == ["reset_peak"]


def test_a_cpu_window_collects_garbage_once_before_its_heap_is_trimmed(monkeypatch):
    """On a CPU the window is the peak RSS: garbage is collected (a reference cycle's
    tensors freed) and the heap trimmed when it starts, once: releasing first, as a new
    job does, adds no second full collection."""
    import gc

    import amp_utils.memory as memory

    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(memory, "_trim_heap", lambda: calls.append("trim"))
    cpu = torch.device("cpu")
    memory.release_cached_memory(cpu)
    memory.reset_peak_memory(cpu)
    assert calls == ["collect", "trim"]


def test_a_cuda_release_collects_garbage_before_emptying_the_cache(monkeypatch):
    """Tensors alive only in a reference cycle hold their blocks until collected: the
    cache is emptied after the collection, or those blocks stay reserved."""
    import gc

    from amp_utils.memory import release_cached_memory

    calls: list[str] = []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    release_cached_memory(torch.device("cuda", 0))
    assert calls == ["collect", "empty_cache"]
