"""Peak memory of a run, measured the same way for every precision so they compare."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def release_cached_memory(device: torch.device) -> None:
    """On CUDA, collect garbage and hand the allocator's cached free blocks back.

    Call it before the warm-up of a measurement: a new peak-memory window starts at the
    memory reserved then, cached blocks that earlier work left behind included, so a row
    timed after another would otherwise count the other's leftovers. On a CPU the window
    is the process's peak RSS, and :func:`reset_peak_memory` collects and trims the heap
    itself when it starts one (collecting here too ran a second full collection).
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window.

    On CUDA this resets the allocator's peak; on Linux CPUs it resets the process's peak
    RSS (``VmHWM``), so that the runs of a sweep in one process are measured separately.
    A reset peak starts at the memory held then: a new job calls
    :func:`release_cached_memory` first (a sweep's earlier job, its model, optimizer and
    CUDA graph pools freed only by the collector, and the allocator's cache made the next
    job's peak its own: on an H200 bf16 recorded 1,280 MB reserved after fp32's 990 MB),
    a benchmark before its warm-up (not after it: the timed steps reuse the warm-up's
    cached blocks).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # Not Linux, or not allowed: the peak then covers the whole process.
    gc.collect()
    _trim_heap()
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")


def _trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``).

    The window's peak RSS starts from the RSS at its reset: memory that earlier work in
    this process freed but the allocator kept (a sweep's earlier runs, in one process)
    would count as this run's. Elsewhere (no glibc) a no-op.
    """
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _vm_hwm_mb() -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**10  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory reserved by the allocator on CUDA; the process's peak RSS on the CPU.

    Reserved, not allocated: tensors that live in a captured CUDA graph's memory pool are
    not counted as allocated while the graph replays (the H100 run of 2026-11-23 reported
    1.2 GB "allocated" for a step whose activations need 4.4 GB), but their segments are
    reserved. Reserved memory also holds the allocator's cached free blocks, so it is an
    upper bound of what the run needs.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    hwm = _vm_hwm_mb()
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux and bytes on macOS.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
