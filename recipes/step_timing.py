"""Timing of training steps: per-step times without host syncs, and their statistics.

Used by the benchmark for our loops and the peers' (``recipes/benchmarking.py``,
``recipes/peers.py``). On CUDA each step is bracketed by CUDA events (the device's
timeline; the host does not wait between steps) and the device is synchronised only
around the measurement; on the CPU the host clock is used.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from amp_utils.loaders import timed_batches
from amp_utils.memory import peak_memory_mb, release_cached_memory, reset_peak_memory
from data.dataset import AudioBatch


def audio_batch_size(batch: AudioBatch) -> tuple[int, float, tuple[int, ...]]:
    """``(utterances, audio seconds, waveform shape)`` of a batch (seconds 0 if on the GPU:
    reading them would wait for the device)."""
    on_host = batch.durations.device.type == "cpu"
    audio_s = float(batch.durations.sum()) if on_host else 0.0
    return len(batch), audio_s, tuple(batch.wavs.shape)


def time_steps(
    step: Callable[[Any], object],
    batches: Iterator[Any],
    warmup: int,
    steps: int,
    device: torch.device,
    size: Callable[[Any], tuple[int, float, tuple[int, ...]]] = audio_batch_size,
) -> dict[str, Any]:
    """Run ``warmup`` + ``steps`` steps; per-step seconds and totals of the timed ones.

    ``size(batch)`` gives a batch's utterances, audio seconds and shape (``AudioBatch`` by
    default). The result adds ``shapes`` to :func:`step_stats`: the timed batches' shapes
    (for counting FLOPs afterwards), and ``wait_ms_mean``/``wait_ms_max``: the host's time
    blocked in ``next(batches)`` per timed step. When a DataLoader cannot keep up, the wait
    says so directly (a slow step with no wait is the device's; with a long wait, the
    loader's, e.g. workers refilling at an epoch boundary).
    """
    cuda = device.type == "cuda"
    release_cached_memory(device)  # earlier rows' cached blocks stay out of this peak
    for _ in range(warmup):
        step(next(batches))
    if cuda:
        torch.cuda.synchronize(device)
    reset_peak_memory(device)
    marks: list[Any] = []
    shapes: list[tuple[int, ...]] = []
    utterances, audio_s = 0, 0.0
    waits: list[float] = []
    timed = timed_batches(batches, waits.append)
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(timed)
        count, seconds, shape = size(batch)
        utterances, audio_s = utterances + count, audio_s + seconds
        shapes.append(shape)
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)
        else:
            marks.append(time.perf_counter())
        step(batch)
    if cuda:
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        torch.cuda.synchronize(device)
        marks.append(end)
        per_step = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:], strict=False)]
    else:
        marks.append(time.perf_counter())
        per_step = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    total = time.perf_counter() - start
    return {
        **step_stats(per_step, total, utterances, audio_s, device),
        "wait_ms_mean": 1e3 * statistics.fmean(waits),
        "wait_ms_max": 1e3 * max(waits),
        "shapes": shapes,
    }


def step_stats(
    per_step_s: list[float],
    total_s: float,
    utterances: int,
    audio_seconds: float,
    device: torch.device,
) -> dict[str, Any]:
    """Statistics of timed steps as ``time_steps`` returns them (peers' timers use it too)."""
    if not per_step_s:
        raise ValueError("No timed steps: steps must be at least 1.")
    ordered = sorted(per_step_s)
    steps = len(ordered)
    return {
        "steps": steps,
        "seconds": total_s,
        "steps_per_s": steps / total_s,
        "utterances": utterances,
        "audio_seconds": audio_seconds,
        "p50_step_ms": 1e3 * statistics.median(ordered),
        "p90_step_ms": 1e3 * ordered[math.ceil(0.9 * steps) - 1],  # nearest rank
        "peak_memory_mb": peak_memory_mb(device),
    }
