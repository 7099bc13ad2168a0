"""Training-step benchmark: the recipe's Brain loop against a bare PyTorch loop and peers.

For each precision it times (a) ``bare``: a minimal loop (autocast + the recipe's forward
and loss + GradScaler + fused AdamW + clipping, nothing else) over fixed-shape synthetic
batches pre-staged on the device, (b) ``brain``: ``Brain.fit_batch`` over the same
batches, (c) ``staged``: the Brain over the real data's first batches, pre-staged on the
device, and (d) ``loader``: the Brain over the same real batches streamed by the
DataLoader, so loader/staged is the cost of loading alone (same shapes, same order);
optionally (e) ``speechbrain`` and ``lightning``: the peer toolkits' own loops over the
synthetic batches (``recipes.peers``; skipped when the toolkits are not installed).

Warm-up steps are excluded; with fixed batch shapes (``data.pad_to_buckets``) every shape
of an epoch is run twice (``trainer.graph_step``: its warm-up steps plus two) before timing,
so that compilation and CUDA-graph capture stay out of the numbers. On CUDA, per-step
times come from CUDA events (the device timeline, no sync between steps) and the device
is synchronised only around a measurement. Each row also has the model FLOPs per second
(counted once per batch shape with ``torch.utils.flop_counter``) and, on GPUs with known
peak rates, the model FLOPs utilisation (MFU). With ``benchmark.profile_steps`` the
``torch.profiler`` summary of a few more steps is written per precision and mode, and a
table per mode of the ops where each precision spends more time than fp32, to show why a
target is missed.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from torch.utils.flop_counter import FlopCounterMode

from amp_utils import Stage
from amp_utils.atomic import atomic_write_text
from amp_utils.autocast import PRECISIONS
from amp_utils.loaders import start_epoch
from amp_utils.precision import configure_tf32, resolve_device
from data.dataset import AudioBatch
from recipes.audio_brain import AudioBrain
from recipes.config import ConfigError, validate_config
from recipes.peers import OptimizerSettings, run_peer
from recipes.preflight import run_options
from recipes.step_timing import time_steps

#: Dense peak rates (TFLOP/s) from the vendors' datasheets, by GPU name and precision
#: ("tf32": fp32 with TF32 matmuls). The first matching name wins (PCIe before SXM).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
}
PEER_MODES = ("speechbrain", "lightning")
MODES = ("bare", "brain", "staged", "loader", *PEER_MODES)


#: The shortest synthetic utterance the models' frames and subsampling take (seconds).
MIN_UTTERANCE_SECONDS = 0.25


def check_benchmark_config(cfg: DictConfig) -> None:
    """Refuse unknown modes and precisions, and sizes out of range, before any work (data,
    models): ``benchmark.batch_size=0`` and ``utterance_seconds=0`` ended in an FFT
    traceback, ``steps=-1`` timed nothing for minutes; ``utterance_seconds=inf`` ended in
    an OverflowError, ``modes=[]`` or ``precisions=[]`` timed nothing.

    Raises:
        ConfigError: naming the key, the bad values and the valid ones.
    """
    bench = cfg.benchmark
    for key in ("batch_size", "steps"):
        value = bench[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"benchmark.{key}={value!r} is not valid; it must be a positive integer "
                f"(e.g. benchmark.{key}=8)."
            )
    for key in ("warmup_steps", "profile_steps"):
        value = bench[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"benchmark.{key}={value!r} is not valid; it must be 0 or more.")
    seconds = bench.utterance_seconds
    if not isinstance(seconds, int | float) or not MIN_UTTERANCE_SECONDS <= seconds < math.inf:
        raise ConfigError(
            f"benchmark.utterance_seconds={seconds!r} is not valid: it must be a finite "
            f"length of {MIN_UTTERANCE_SECONDS} s or more, the shortest audio the models take "
            "(e.g. benchmark.utterance_seconds=1.0)."
        )
    for key, valid in (
        ("benchmark.modes", MODES),
        ("benchmark.precisions", tuple(PRECISIONS)),
        ("benchmark.peer_precisions", tuple(PRECISIONS)),
    ):
        if key != "benchmark.peer_precisions" and not OmegaConf.select(cfg, key):
            raise ConfigError(  # a run that times no mode or no precision
                f"{key}=[] times nothing: name at least one of {', '.join(valid)} "
                f"(e.g. {key}=[{','.join(valid[:2])}])."
            )
        unknown = [value for value in OmegaConf.select(cfg, key) or [] if value not in valid]
        if unknown:
            raise ConfigError(
                f"{key} has {unknown}; valid: {', '.join(valid)} "
                f"(e.g. {key}=[{','.join(valid[:2])}])."
            )


def preflight_benchmark(cfg: DictConfig) -> torch.device:
    """Everything that can refuse ``recipes/benchmark.py``'s command before any work: keys,
    values, the benchmark's own settings and the device; returns the device.
    ``ToolFolderCallback`` runs it before Hydra writes the benchmark's folder.

    Raises:
        ConfigError, DeviceNotAvailableError: naming the problem and the fix.
    """
    validate_config(cfg)
    check_benchmark_config(cfg)
    return resolve_device(run_options(cfg).device)


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


def peak_tflops(device: torch.device, variant: str) -> float | None:
    """Datasheet dense peak of ``device`` for ``variant`` (fp32, tf32, fp16, bf16), if known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, rates in PEAK_TFLOPS.items():
        if key in name:
            return rates.get(variant)
    return None


def bare_step_fn(brain: AudioBrain, precision: str) -> Callable[[AudioBatch], None]:
    """The reference loop: autocast, the recipe's forward and loss, GradScaler, fused AdamW,
    clipping, and nothing else (no bookkeeping, no non-finite checks)."""
    params = [p for p in brain.modules.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    dtype = PRECISIONS[precision]
    device_type = brain.device.type
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)

    def step(batch: AudioBatch) -> None:
        brain.mark_step()
        with torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32):
            outputs = brain.compute_forward(batch, Stage.TRAIN)
            loss = brain.compute_objectives(outputs, batch, Stage.TRAIN)
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
        brain.train_step(batch)

    return step


def forward_loss_fn(brain: AudioBrain) -> Callable[[torch.nn.ModuleDict, AudioBatch], Any]:
    """``forward_loss(modules, batch)``: the recipe's training forward and loss on ``modules``.

    What the peer loops and the FLOP counter run: the Brain's own ``compute_forward`` and
    ``compute_objectives`` (public SpeechBrain API), over modules other than its own.
    """

    def forward_loss(modules: torch.nn.ModuleDict, batch: AudioBatch) -> torch.Tensor:
        original, brain.modules = brain.modules, modules
        try:
            outputs = brain.compute_forward(batch, Stage.TRAIN)
            return brain.compute_objectives(outputs, batch, Stage.TRAIN)
        finally:
            brain.modules = original

    return forward_loss


class FlopCounter:
    """Model FLOPs of one training step (forward + backward) per batch shape, cached.

    Counted on an eager fp32 copy of the recipe's modules (the count does not depend on
    the precision), with ``torch.utils.flop_counter`` (matmuls, convolutions, attention).
    """

    def __init__(self, modules: torch.nn.ModuleDict, brain: AudioBrain) -> None:
        self.modules = modules
        self.forward_loss = forward_loss_fn(brain)
        self.cache: dict[tuple[int, ...], float] = {}

    def __call__(self, batch: AudioBatch) -> float:
        key = tuple(batch.wavs.shape)
        if key not in self.cache:
            # Lengths on the device: under a dispatch mode, ctc_loss rejects host lengths
            # next to CUDA tensors (the CTC's own FLOPs are negligible either way).
            batch = replace(batch, host=None)
            with FlopCounterMode(display=False) as counter:
                self.forward_loss(self.modules, batch).backward()
            self.modules.zero_grad(set_to_none=True)
            self.cache[key] = float(counter.get_total_flops())
        return self.cache[key]


class OpTime(NamedTuple):
    """One profiled op (or GPU kernel) per training step: its own time and its calls."""

    ms: float
    calls: float


def compiled_code_calls(averages: Any) -> int:
    """How often compiled code ran in a profile (``prof.key_averages()``): TorchDynamo's
    "Torch-Compiled Region" events, plus inductor's ``triton_*`` kernels on CUDA -- the only
    trace compiled code leaves inside a replayed CUDA graph, where no host event runs.

    0 with ``trainer.compile`` on means the modules ran eagerly: on the 2026-11-26 H200
    every captured step did (a dispatch mode had made TorchDynamo skip them for good), and
    nothing said so until the kernel names were read."""
    return sum(
        e.count
        for e in averages
        if e.key.startswith("Torch-Compiled Region")
        or (e.device_type == DeviceType.CUDA and e.key.startswith("triton_"))
    )


def profile_steps(
    step: Callable[[AudioBatch], None],
    batches: Iterator[AudioBatch],
    steps: int,
    device: torch.device,
) -> tuple[str, dict[str, OpTime], float]:
    """``torch.profiler`` summary of ``steps`` steps (launches per step and the top ops),
    each op's self time per step (the device's on CUDA: kernels; else the CPU's), and the
    calls of compiled code per step (:func:`compiled_code_calls`)."""
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
    compiled = compiled_code_calls(averages) / steps
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    summary = (
        f"{steps} profiled steps on {device}; per step: {kernels / steps:.0f} GPU kernel "
        f"launches, {aten_ops / steps:.0f} aten op calls, {compiled:.0f} compiled-code calls "
        f"(compiled regions, inductor kernels); sorted by {sort_by}\n\n"
        + averages.table(sort_by=sort_by, row_limit=25)
    )
    ops = {
        e.key: OpTime(getattr(e, sort_by) / 1000 / steps, e.count / steps)
        for e in averages
        if getattr(e, sort_by) > 0
    }
    return summary, ops, compiled


def compare_profiles(
    baseline: dict[str, OpTime], other: dict[str, OpTime], name: str, rows: int = 15
) -> str:
    """Markdown: where ``name`` spends more (and less) time per step than ``baseline``
    (fp32), op by op. An op missing on one side (a cast, a kernel of another precision)
    counts 0 there. This is the "why" behind a precision that is slower than fp32."""
    keys = set(baseline) | set(other)
    zero = OpTime(0.0, 0.0)
    delta = {k: other.get(k, zero).ms - baseline.get(k, zero).ms for k in keys}
    total = (sum(t.ms for t in baseline.values()), sum(t.ms for t in other.values()))
    lines = [
        f"### {name} against fp32: {total[1]:.1f} ms against {total[0]:.1f} ms of op time "
        f"per step ({total[1] - total[0]:+.1f} ms)",
        "",
        f"| op | fp32 ms | {name} ms | change ms | fp32 calls | {name} calls |",
        "|---|---|---|---|---|---|",
    ]
    losers = sorted((k for k in keys if delta[k] > 0), key=lambda k: -delta[k])[:rows]
    gainers = sorted((k for k in keys if delta[k] < 0), key=lambda k: delta[k])[: rows // 3]
    for key in [*losers, *gainers]:
        a, b = baseline.get(key, zero), other.get(key, zero)
        lines.append(
            f"| `{key[:80]}` | {a.ms:.2f} | {b.ms:.2f} | {delta[key]:+.2f} | "
            f"{a.calls:.0f} | {b.calls:.0f} |"
        )
    return "\n".join(lines)


def write_profile_comparisons(
    profile_dir: Path, profiles: dict[str, dict[str, dict[str, OpTime]]]
) -> None:
    """``profile_compare_<mode>.md`` for every mode profiled in fp32 and another variant."""
    for mode, variants in profiles.items():
        if "fp32" not in variants or len(variants) < 2:
            continue
        sections = [
            compare_profiles(variants["fp32"], ops, variant)
            for variant, ops in variants.items()
            if variant != "fp32"
        ]
        atomic_write_text(
            profile_dir / f"profile_compare_{mode}.md",
            f"# Where each precision's `{mode}` step spends its time, against fp32\n\n"
            "Self time per training step, op by op (GPU kernels on CUDA), from "
            "`benchmark.profile_steps` profiled steps; the ops that grew most first, then "
            "those that shrank most.\n\n" + "\n\n".join(sections) + "\n",
        )


def cycle(items: list[AudioBatch]) -> Iterator[AudioBatch]:
    """Endless iterator over ``items``."""
    while True:
        yield from items


def loader_batches(loader: Any) -> Iterator[AudioBatch]:
    """Endless iterator over a DataLoader, epoch after epoch, each started as the Brain's
    training starts it (``start_epoch``: the next epoch's batches load during the last
    ones of an epoch where the loader streams its epochs)."""
    epoch = 0
    while True:
        yield from start_epoch(loader, epoch).batches
        epoch += 1


def staged_batches(loader: Any, count: int, device: torch.device) -> list[AudioBatch]:
    """The loader's first ``count`` batches, moved to ``device`` ahead of time.

    Durations stay on the host, where the throughput bookkeeping reads them.
    """
    return [
        replace(batch.to(device), durations=batch.durations)
        for batch in islice(loader_batches(loader), count)
    ]


def shape_representatives(loader: Any, device: torch.device) -> list[AudioBatch]:
    """One batch per distinct batch shape of the loader's first epoch, on ``device``.

    Only meaningful with fixed shapes (``pad_to_buckets``): running each twice before
    timing keeps compilation and CUDA-graph capture of every shape out of the numbers.
    Reads the sampler's index lists and loads one batch per (size, padded length, padded
    token length).
    """
    sampler = loader.batch_sampler
    sampler.set_epoch(0)
    dataset, collate = loader.dataset, loader.collate_fn
    length_for = getattr(collate, "length_for", None)
    tokens_for = getattr(collate, "tokens_for", None)
    rate = getattr(dataset, "sample_rate", 1)
    seen: dict[tuple[int, int, int], list[int]] = {}
    for indices in sampler:
        longest = max(round(dataset.durations[i] * rate) for i in indices)
        tokens = max(len(dataset.tokens[i]) for i in indices)
        key = (
            len(indices),
            length_for(longest) if length_for else longest,
            tokens_for(tokens) if tokens_for else tokens,
        )
        seen.setdefault(key, list(indices))
    batches = {}
    for indices in seen.values():
        batch = collate([dataset[i] for i in indices])
        batches.setdefault(
            (tuple(batch.wavs.shape), tuple(batch.tokens.shape)),
            replace(batch.to(device), durations=batch.durations),
        )
    return list(batches.values())


def _variant(row: dict[str, Any]) -> str:
    """Precision name of a row, ``+tf32`` marking the TF32 fp32 baseline."""
    return row["precision"] + ("+tf32" if row.get("tf32") else "")


def _ratio(numerator: dict[str, Any] | None, denominator: dict[str, Any] | None) -> str:
    """utt/s ratio of two rows, or "—" when one is missing."""
    if numerator is None or denominator is None:
        return "—"
    return f"{numerator['utt_per_s'] / denominator['utt_per_s']:.2f}"


def _fmt(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _wait(row: dict[str, Any]) -> str:
    """``mean (max)`` host wait for the next batch, in ms; ``—`` where not measured."""
    if row.get("wait_ms_mean") is None:
        return "—"
    return f"{row['wait_ms_mean']:.1f} ({row['wait_ms_max']:.1f})"


def summarize(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the measurements, with the ratios the targets are stated in.

    ``vs fp32`` and ``vs tf32`` compare with the same mode in fp32 (TF32 off / on);
    ``Brain/bare`` the Brain with the bare loop, ``loader/staged`` streamed with pre-staged
    real batches, ``ours/peer`` our Brain with a peer toolkit's loop (same precision).
    ``wait ms`` is the host's mean (max) time per step blocked on the next batch: what
    separates a loader that cannot keep up from a slow step (peers: synthetic batches, no wait).
    """
    by_mode = {(r["mode"], _variant(r)): r for r in rows}
    lines = [
        "| mode | precision | steps/s | utt/s | audio-s/s | p50 ms | p90 ms | peak MB | "
        "TFLOP/s | MFU | vs fp32 | vs tf32 | Brain/bare | loader/staged | ours/peer | wait ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name, mode = _variant(r), r["mode"]
        fp32 = by_mode.get((mode, "fp32"))
        tf32 = by_mode.get((mode, "fp32+tf32"))
        brain_bare = _ratio(r, by_mode.get(("bare", name))) if mode == "brain" else "—"
        loader_staged = _ratio(r, by_mode.get(("staged", name))) if mode == "loader" else "—"
        ours_peer = _ratio(by_mode.get(("brain", name)), r) if mode in PEER_MODES else "—"
        mfu = r.get("mfu")
        lines.append(
            f"| {mode} | {name} | {r['steps_per_s']:.2f} | {r['utt_per_s']:.0f} | "
            f"{r['audio_s_per_s']:.0f} | {r['p50_step_ms']:.1f} | {r['p90_step_ms']:.1f} | "
            f"{r['peak_memory_mb']:.0f} | {_fmt(r.get('tflops'), '.1f')} | "
            f"{_fmt(None if mfu is None else 100 * mfu, '.1f')}{'' if mfu is None else ' %'} | "
            f"{_ratio(r, fp32)} | {_ratio(r, tf32)} | {brain_bare} | {loader_staged} | "
            f"{ours_peer} | {_wait(r)} |"
        )
    return "\n".join(lines)


def run_benchmark(
    cfg: DictConfig,
    build: Callable[[DictConfig], tuple[AudioBrain, Any]],
    profile_dir: Path | None = None,
    build_modules: Callable[[DictConfig], torch.nn.ModuleDict] | None = None,
    on_progress: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list:
    """Time every (precision, mode) of ``cfg.benchmark``; ``build`` makes brain + loader.

    ``build_modules`` (a fresh, eager copy of the recipe's modules) enables FLOP counts
    and the peer loops. With ``cfg.benchmark.profile_steps > 0`` and ``profile_dir``,
    also writes ``profile_<mode>_<precision>.txt`` there for every timed mode, and
    ``profile_compare_<mode>.md``: each precision's op times against fp32's.
    ``on_progress(rows)`` is called after each precision (e.g. to save what is measured
    so far, should the run be cut short).
    """
    rows = []
    profiles: dict[str, dict[str, dict[str, OpTime]]] = {}  # mode -> variant -> op times
    variants = [(p, False) for p in cfg.benchmark.precisions]
    if cfg.benchmark.tf32_baseline and "fp32" in cfg.benchmark.precisions:
        variants.insert(1, ("fp32", True))
    check_benchmark_config(cfg)
    for precision, tf32 in variants:
        # One precision's Brain lives inside this call only: after it returns, nothing
        # refers to it, so its memory (weights, optimizer state, graph pools) is freed
        # before the next precision is timed (it was not, and inflated their peak MB).
        rows += _precision_rows(cfg, precision, tf32, build, build_modules, profile_dir, profiles)
        if profile_dir is not None:
            write_profile_comparisons(profile_dir, profiles)
        if on_progress is not None:
            on_progress(_ordered(rows))
        gc.collect()  # the Brain's step graphs refer back to it: free them (and their pool)
        torch._dynamo.reset()  # frees compiled graphs and their CUDA-graph memory pools
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return _ordered(rows)


def _precision_rows(
    cfg: DictConfig,
    precision: str,
    tf32: bool,
    build: Callable[[DictConfig], tuple[AudioBrain, Any]],
    build_modules: Callable[[DictConfig], torch.nn.ModuleDict] | None,
    profile_dir: Path | None,
    profiles: dict[str, dict[str, dict[str, OpTime]]],
) -> list[dict[str, Any]]:
    """The rows of one precision (one variant): every mode of ``cfg.benchmark`` on one
    Brain. The peers run first, before our Brain has optimizer state or step graphs, so
    that their peak memory holds no more of ours than its weights."""
    warmup, steps = cfg.benchmark.warmup_steps, cfg.benchmark.steps
    rows: list[dict[str, Any]] = []
    run_cfg = OmegaConf.merge(
        cfg, {"precision": {"name": precision, "eval_precision": precision, "allow_tf32": tf32}}
    )
    brain, loader = build(run_cfg)
    if brain.device.type != "cuda" and tf32:
        return rows
    configure_tf32(brain.device, tf32)
    brain.on_fit_start()
    brain.modules.train()
    flops = FlopCounter(build_modules(run_cfg).to(brain.device), brain) if build_modules else None
    batch = synthetic_batch(cfg, brain.device, len(brain.hparams.speakers))
    staged: list[AudioBatch] | None = None
    shapes: list[AudioBatch] = []
    if cfg.data.pad_to_buckets and {"staged", "loader"} & set(cfg.benchmark.modes):
        shapes = shape_representatives(loader, brain.device)
    variant = precision + ("+tf32" if tf32 else "")
    modes = sorted(cfg.benchmark.modes, key=lambda mode: mode not in PEER_MODES)
    for mode in modes:
        extra_warmup: list[AudioBatch] = []
        if mode == "bare":
            step, batches = bare_step_fn(brain, precision), cycle([batch])
        elif mode == "brain":
            step, batches = brain_step_fn(brain), cycle([batch])
        elif mode in ("staged", "loader"):
            step = brain_step_fn(brain)
            if staged is None:
                staged = staged_batches(loader, warmup + steps, brain.device)
                # Compile on first sight, capture on the second (trainer.graph_step:
                # after its eager warm-up steps), and replay once, before timing.
                rounds = 2 + (
                    run_cfg.trainer.graph_step_warmup if run_cfg.trainer.graph_step else 0
                )
                extra_warmup = shapes * rounds
            batches = cycle(staged) if mode == "staged" else loader_batches(loader)
        elif precision not in cfg.benchmark.peer_precisions or tf32:
            continue
        else:
            row = _peer_row(mode, precision, tf32, cfg, brain, build_modules, batch, flops)
            rows.append(row)
            continue
        compiled: float | None = None  # compiled-code calls per profiled step
        for extra in extra_warmup:
            step(extra)
        stats = time_steps(step, batches, warmup, steps, brain.device)
        if cfg.benchmark.profile_steps > 0 and profile_dir is not None:
            summary, ops, compiled = profile_steps(
                step, batches, cfg.benchmark.profile_steps, brain.device
            )
            atomic_write_text(profile_dir / f"profile_{mode}_{variant}.txt", summary)
            profiles.setdefault(mode, {})[variant] = ops
        brain.flush_pending()
        if mode in ("bare", "brain"):  # synthetic batches
            stats["audio_seconds"] = stats["utterances"] * cfg.benchmark.utterance_seconds
        row = _row(mode, precision, tf32, stats, flops, batch, brain.device)
        if compiled is not None and run_cfg.trainer.compile:
            row["compiled_calls_per_step"] = compiled
        if mode != "bare" and run_cfg.trainer.graph_step:
            # So far in this precision (the modes share one Brain); None: not in use.
            row["step_graphs"] = brain.step_graph_stats()
        rows.append(row)
    return rows


def step_graph_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per row timed with ``trainer.graph_step``: whether its steps replayed graphs."""
    notes = []
    for row in rows:
        if "step_graphs" not in row:
            continue
        stats = row["step_graphs"]
        what = (
            f"{stats['graphs']} graphs captured, {stats['replays']} replays, "
            f"{stats['eager_steps']} eager steps so far"
            if stats
            else "not in use (the log says why)"
        )
        notes.append(f"{row['mode']} {row['precision']}: whole-step CUDA graphs {what}")
    return notes


def compile_notes(rows: list[dict[str, Any]]) -> list[str]:
    """One line per profiled row with ``trainer.compile`` on: whether its steps ran
    compiled code, and a warning where they did not."""
    notes = []
    for row in rows:
        calls = row.get("compiled_calls_per_step")
        if calls is None:
            continue
        name = f"{row['mode']} {row['precision']}"
        if calls > 0:
            notes.append(f"{name}: compiled code ran ({calls:.0f} calls per profiled step)")
        else:
            notes.append(
                f"{name}: WARNING: trainer.compile is on, but no compiled code ran in the "
                "profiled steps: the modules ran eagerly (TORCH_LOGS=recompiles,graph_breaks "
                "shows what TorchDynamo skipped)"
            )
    return notes


def _ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Timed rows first, then the skipped ones."""
    return [r for r in rows if "skipped" not in r] + [r for r in rows if "skipped" in r]


def _peer_row(
    mode: str,
    precision: str,
    tf32: bool,
    cfg: DictConfig,
    brain: AudioBrain,
    build_modules: Callable[[DictConfig], torch.nn.ModuleDict] | None,
    batch: AudioBatch,
    flops: FlopCounter | None,
) -> dict[str, Any]:
    """A peer toolkit's loop over the synthetic batches, on a fresh eager copy of the modules."""
    variant = precision + ("+tf32" if tf32 else "")
    if build_modules is None:
        return {"mode": mode, "precision": variant, "skipped": "no module builder given"}
    result = run_peer(
        mode,
        build_modules(cfg).to(brain.device),
        forward_loss_fn(brain),
        cycle([batch]),
        precision=precision,
        device=brain.device,
        settings=OptimizerSettings(
            lr=cfg.model.lr,
            weight_decay=cfg.model.weight_decay,
            max_grad_norm=cfg.trainer.max_grad_norm,
            fused=cfg.trainer.fused_optimizer,
        ),
        warmup=cfg.benchmark.warmup_steps,
        steps=cfg.benchmark.steps,
    )
    if result.status != "ran":
        return {"mode": mode, "precision": variant, "skipped": f"{result.status}: {result.reason}"}
    stats = dict(result.stats)
    stats["audio_seconds"] = stats["utterances"] * cfg.benchmark.utterance_seconds
    row = _row(mode, precision, tf32, stats, flops, batch, brain.device)
    row["notes"] = list(result.notes)
    row["version"] = result.version
    return row


def _row(
    mode: str,
    precision: str,
    tf32: bool,
    stats: dict[str, Any],
    flops: FlopCounter | None,
    example: AudioBatch,
    device: torch.device,
) -> dict[str, Any]:
    """One table row: the timing stats plus throughput, model TFLOP/s and MFU."""
    shapes = stats.pop("shapes", None) or [tuple(example.wavs.shape)] * stats["steps"]
    row = {
        "mode": mode,
        "precision": precision,
        "tf32": tf32,
        "utt_per_s": stats["utterances"] / stats["seconds"],
        "audio_s_per_s": stats["audio_seconds"] / stats["seconds"],
        **stats,
    }
    if flops is not None:
        total = sum(flops(_example_of_shape(example, shape)) for shape in shapes)
        row["tflops"] = total / stats["seconds"] / 1e12
        peak = peak_tflops(device, "tf32" if tf32 else precision)
        row["mfu"] = row["tflops"] / peak if peak else None
    return row


def _example_of_shape(example: AudioBatch, shape: tuple[int, ...]) -> AudioBatch:
    """A batch like ``example`` with waveforms of ``shape`` (for counting FLOPs only)."""
    if tuple(example.wavs.shape) == shape:
        return example
    size, samples = shape
    device = example.wavs.device
    tokens = example.tokens[:1].expand(size, -1).contiguous()
    return AudioBatch(
        ids=[str(i) for i in range(size)],
        wavs=torch.zeros(size, samples, device=device),
        wav_lens=torch.full((size,), samples, dtype=torch.int64),
        tokens=tokens.cpu(),
        token_lens=example.token_lens[:1].expand(size).cpu(),
        speakers=torch.zeros(size, dtype=torch.int64),
        transcripts=["x"] * size,
        durations=torch.zeros(size),
    ).to(device)
