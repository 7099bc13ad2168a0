"""Training-step benchmark: the recipe's Brain loop against a bare PyTorch loop.

For each precision it times (a) ``bare``: a minimal loop (autocast + GradScaler + fused
AdamW + clipping, nothing else) over fixed-shape synthetic batches pre-staged on the
device, (b) ``brain``: ``Brain.fit_batch`` over the same batches, (c) ``staged``: the Brain
over the real data's first batches, pre-staged on the device, and (d) ``loader``: the
Brain over the same real batches streamed by the DataLoader, so loader/staged is the
cost of loading alone (same shapes, same order). Warm-up steps are excluded; on CUDA,
per-step times come from CUDA events (the device timeline, no sync between steps) and the
device is synchronised only around a measurement. With ``benchmark.profile_steps`` the
``torch.profiler`` summary of a few more steps (top ops by device or CPU time, kernel
launches and aten ops per step) is written per precision and mode, to show why a target
is missed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

from amp_utils.atomic import atomic_write_text
from amp_utils.autocast import PRECISIONS
from amp_utils.memory import peak_memory_mb, reset_peak_memory
from amp_utils.precision import configure_tf32
from data.dataset import AudioBatch
from recipes.asr.model import ctc_log_probs, ctc_loss
from recipes.audio_brain import AudioBrain
from recipes.speaker.brain import classification_loss


def synthetic_batch(cfg: DictConfig, device: torch.device, num_speakers: int) -> AudioBatch:
    """A fixed-shape batch of noise 'utterances' with 5-character targets, on ``device``."""
    gen = torch.Generator().manual_seed(cfg.seed)
    size, seconds = cfg.benchmark.batch_size, cfg.benchmark.utterance_seconds
    samples = int(seconds * cfg.data.sample_rate)
    return AudioBatch(
        ids=[str(i) for i in range(size)],
        wavs=0.1 * torch.randn(size, samples, generator=gen),
        wav_lens=torch.full((size,), samples, dtype=torch.int64),
        tokens=torch.randint(1, 27, (size, 5), generator=gen),
        token_lens=torch.full((size,), 5, dtype=torch.int64),
        speakers=torch.randint(0, num_speakers, (size,), generator=gen),
        transcripts=["x"] * size,
        durations=torch.full((size,), float(seconds)),
    ).to(device)


def bare_step_fn(brain: AudioBrain, precision: str) -> Callable[[AudioBatch], None]:
    """The reference loop: autocast, GradScaler, fused AdamW, clipping, and nothing else."""
    modules, device = brain.modules, brain.device
    params = [p for p in modules.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    dtype = PRECISIONS[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    asr = brain.metric_key == "CER"

    def step(batch: AudioBatch) -> None:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            feats, feat_lens = modules.features(batch.wavs, batch.wav_lens)
            if "augment" in modules:
                feats = modules.augment(feats)
            if asr:
                logits, out_lens = modules.model(feats, feat_lens)
                loss = ctc_loss(ctc_log_probs(logits), out_lens, batch.tokens, batch.token_lens)
            else:
                loss = classification_loss(modules.model(feats, feat_lens), batch.speakers)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 5.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def brain_step_fn(brain: AudioBrain) -> Callable[[AudioBatch], None]:
    """One training step through the Brain, as its fit loop does it."""

    def step(batch: AudioBatch) -> None:
        brain.step += 1
        brain.fit_batch(batch)

    return step


def time_steps(
    step: Callable[[AudioBatch], None],
    batches: Iterator[AudioBatch],
    warmup: int,
    steps: int,
    device: torch.device,
) -> dict[str, Any]:
    """Run ``warmup`` + ``steps`` steps; per-step seconds and totals of the timed ones."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step(next(batches))
    if cuda:
        torch.cuda.synchronize(device)
    reset_peak_memory(device)
    marks: list[Any] = []
    utterances, audio_s = 0, 0.0
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(batches)
        utterances += len(batch)
        audio_s += float(batch.durations.sum()) if batch.durations.device.type == "cpu" else 0.0
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
    per_step.sort()
    return {
        "steps": steps,
        "seconds": total,
        "steps_per_s": steps / total,
        "utterances": utterances,
        "audio_seconds": audio_s,
        "p50_step_ms": 1e3 * statistics.median(per_step),
        "p90_step_ms": 1e3 * per_step[int(0.9 * (len(per_step) - 1))],
        "peak_memory_mb": peak_memory_mb(device),
    }


def profile_steps(
    step: Callable[[AudioBatch], None],
    batches: Iterator[AudioBatch],
    steps: int,
    device: torch.device,
) -> str:
    """``torch.profiler`` summary of ``steps`` steps: launches per step and the top ops."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step(next(batches))
        if cuda:
            torch.cuda.synchronize(device)
    averages = prof.key_averages()
    kernels = sum(e.count for e in averages if e.device_type == DeviceType.CUDA)
    aten_ops = sum(e.count for e in averages if e.key.startswith("aten::"))
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    return (
        f"{steps} profiled steps on {device}; per step: {kernels / steps:.0f} GPU kernel "
        f"launches, {aten_ops / steps:.0f} aten op calls; sorted by {sort_by}\n\n"
        + averages.table(sort_by=sort_by, row_limit=25)
    )


def cycle(items: list[AudioBatch]) -> Iterator[AudioBatch]:
    """Endless iterator over ``items``."""
    while True:
        yield from items


def loader_batches(loader: Any) -> Iterator[AudioBatch]:
    """Endless iterator over a DataLoader, epoch after epoch."""
    epoch = 0
    while True:
        loader.batch_sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def staged_batches(loader: Any, count: int, device: torch.device) -> list[AudioBatch]:
    """The loader's first ``count`` batches, moved to ``device`` ahead of time.

    Durations stay on the host, where the throughput bookkeeping reads them.
    """
    return [
        replace(batch.to(device), durations=batch.durations)
        for batch in islice(loader_batches(loader), count)
    ]


def _variant(row: dict[str, Any]) -> str:
    """Precision name of a row, ``+tf32`` marking the TF32 fp32 baseline."""
    return row["precision"] + ("+tf32" if row.get("tf32") else "")


def _ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> str:
    """utt/s ratio of two rows, or "—" when one is missing."""
    if numerator is None or denominator is None:
        return "—"
    return f"{numerator['utt_per_s'] / denominator['utt_per_s']:.2f}"


def summarize(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the measurements, with the ratios the targets are stated in."""
    fp32 = {r["mode"]: r for r in rows if _variant(r) == "fp32"}
    by_mode = {(r["mode"], _variant(r)): r for r in rows}
    lines = [
        "| mode | precision | steps/s | utt/s | audio-s/s | p50 ms | p90 ms | peak MB | "
        "vs fp32 | Brain/bare | loader/staged |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = _variant(r)
        brain_bare = _ratio(r, by_mode.get(("bare", name))) if r["mode"] == "brain" else "—"
        loader_syn = _ratio(r, by_mode.get(("staged", name))) if r["mode"] == "loader" else "—"
        lines.append(
            f"| {r['mode']} | {name} | {r['steps_per_s']:.2f} | {r['utt_per_s']:.0f} | "
            f"{r['audio_s_per_s']:.0f} | {r['p50_step_ms']:.1f} | {r['p90_step_ms']:.1f} | "
            f"{r['peak_memory_mb']:.0f} | {_ratio(r, fp32.get(r['mode']))} | {brain_bare} | "
            f"{loader_syn} |"
        )
    return "\n".join(lines)


def run_benchmark(
    cfg: DictConfig,
    build: Callable[[DictConfig], tuple[AudioBrain, Any]],
    profile_dir: Path | None = None,
) -> list:
    """Time every (precision, mode) of ``cfg.benchmark``; ``build`` makes brain + loader.

    With ``cfg.benchmark.profile_steps > 0`` and ``profile_dir``, also writes
    ``profile_<mode>_<precision>.txt`` there for every timed mode.
    """
    rows = []
    variants = [(p, False) for p in cfg.benchmark.precisions]
    if cfg.benchmark.tf32_baseline and "fp32" in cfg.benchmark.precisions:
        variants.insert(1, ("fp32", True))
    for precision, tf32 in variants:
        run_cfg = OmegaConf.merge(
            cfg, {"precision": {"name": precision, "eval_precision": precision, "allow_tf32": tf32}}
        )
        brain, loader = build(run_cfg)
        if brain.device.type != "cuda" and tf32:
            continue
        configure_tf32(brain.device, tf32)
        brain.on_fit_start()
        brain.modules.train()
        batch = synthetic_batch(cfg, brain.device, len(brain.hparams.speakers))
        for mode in cfg.benchmark.modes:
            if mode == "bare":
                step, batches = bare_step_fn(brain, precision), cycle([batch])
            elif mode == "brain":
                step, batches = brain_step_fn(brain), cycle([batch])
            elif mode == "staged":
                count = cfg.benchmark.warmup_steps + cfg.benchmark.steps
                step = brain_step_fn(brain)
                batches = cycle(staged_batches(loader, count, brain.device))
            elif mode == "loader":
                step, batches = brain_step_fn(brain), loader_batches(loader)
            else:
                raise ValueError(
                    f"benchmark.modes has {mode!r}; valid: bare, brain, staged, loader."
                )
            stats = time_steps(
                step, batches, cfg.benchmark.warmup_steps, cfg.benchmark.steps, brain.device
            )
            if cfg.benchmark.profile_steps > 0 and profile_dir is not None:
                summary = profile_steps(step, batches, cfg.benchmark.profile_steps, brain.device)
                variant = precision + ("+tf32" if tf32 else "")
                atomic_write_text(profile_dir / f"profile_{mode}_{variant}.txt", summary)
            brain._flush_pending()
            if mode in ("bare", "brain"):  # synthetic batches
                stats["audio_seconds"] = stats["utterances"] * cfg.benchmark.utterance_seconds
            rows.append(
                {
                    "mode": mode,
                    "precision": precision,
                    "tf32": tf32,
                    "utt_per_s": stats["utterances"] / stats["seconds"],
                    "audio_s_per_s": stats["audio_seconds"] / stats["seconds"],
                    **stats,
                }
            )
        del brain, loader
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows
