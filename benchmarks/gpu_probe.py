"""Probe of the training-step options on a GPU, before building the fast path (issue #10).

Measures, on fixed-shape synthetic batches (features + Conformer-CTC + CTC loss + clipping
+ fused AdamW), the step time of: eager; the model's forward/backward captured as CUDA
graphs (``torch.cuda.make_graphed_callables``); ``torch.compile`` (whole model or per
block, default or ``reduce-overhead`` CUDA graphs); and how fp16 and bf16 steps behave on
shapes seen for the first time (the fp16 loader slowdown). Every measurement is appended
to ``$OUT/probe.jsonl`` as it ends, so a run cut short keeps what it measured.

    python benchmarks/gpu_probe.py --deadline 400     # on the GPU machine
    python benchmarks/gpu_probe.py --cpu-dry-run      # tiny sizes on the CPU (checks the code)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recipes.asr.model import ConformerCTC, ctc_log_probs, ctc_loss  # noqa: E402
from recipes.frontend import LogMelFeatures  # noqa: E402
from recipes.step_timing import time_steps  # noqa: E402

DTYPES = {
    "fp32": torch.float32,
    "tf32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
SMALL = dict(d_model=144, num_layers=4, num_heads=4, ffn_dim=576, conv_kernel=15, subsampling=2)
MEDIUM = dict(d_model=256, num_layers=16, num_heads=4, ffn_dim=1024, conv_kernel=31, subsampling=4)

OUT = Path(os.environ.get("OUT", "benchmarks/out"))
START = time.perf_counter()


def log(row: dict) -> None:
    row["t"] = round(time.perf_counter() - START, 1)
    print(json.dumps(row), flush=True)
    with open(OUT / "probe.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def batch(b: int, seconds: float, device, seed: int = 0, sr: int = 8000):
    g = torch.Generator().manual_seed(seed)
    n = int(seconds * sr)
    lens = torch.randint(int(0.7 * n), n + 1, (b,), generator=g)
    lens[0] = n
    wavs = 0.1 * torch.randn(b, n, generator=g) * (torch.arange(n) < lens[:, None])
    tok_lens = torch.randint(3, 12, (b,), generator=g)
    tokens = torch.randint(1, 29, (b, 12), generator=g)
    return {
        "wavs": wavs.to(device),
        "wav_lens": lens.to(device),
        "wav_lens_cpu": lens,
        "tokens": tokens.to(device),
        "token_lens": tok_lens.to(device),
        "token_lens_cpu": tok_lens,
        "seconds": float(lens.sum()) / sr,
    }


import torch.nn.functional as F  # noqa: E402

from recipes.asr.model import ConvModule  # noqa: E402

_ORIGINAL_CONV_FORWARD = ConvModule.forward


def _depthwise_unfold(x, conv):
    """Depthwise conv1d as unfold + einsum (no cuDNN): ``x`` is ``[B, C, T]``."""
    k = conv.kernel_size[0]
    windows = F.pad(x, (k // 2, k // 2)).unfold(-1, k, 1)  # [B, C, T, k]
    weight = conv.weight.squeeze(1).to(x.dtype)
    return torch.einsum("bctk,ck->bct", windows, weight) + conv.bias.to(x.dtype)[:, None]


def _conv_forward_unfold(self, x, frame_mask):
    x = F.glu(self.pointwise_in(self.norm(x)), dim=-1)
    x = x.masked_fill(~frame_mask.unsqueeze(-1), 0.0)
    x = _depthwise_unfold(x.transpose(1, 2), self.depthwise).transpose(1, 2)
    x = F.silu(self.conv_norm(x))
    return self.dropout(self.pointwise_out(x))


class Setup:
    """Model, features, optimizer and one step function for a precision and a mode."""

    def __init__(self, cfg: dict, precision: str, device, mode: str, example=None) -> None:
        torch.manual_seed(0)
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        torch.backends.cudnn.benchmark = "+bench" in mode
        torch.backends.cudnn.enabled = "+nocudnn" not in mode
        from recipes.asr import model as asr_model

        asr_model.ConvModule.forward = (
            _conv_forward_unfold if "+unfold" in mode else _ORIGINAL_CONV_FORWARD
        )
        mode = mode.split("+")[0]
        self.device, self.dtype, self.mode = device, DTYPES[precision], mode
        self.features = LogMelFeatures().to(device)
        self.model = ConformerCTC(n_mels=40, vocab_size=29, dropout=0.1, **cfg).to(device)
        self.params = [p for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=device.type == "cuda")
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        self.forward = self.model
        if mode == "graphed":
            self.forward = None  # per-shape graphed callables, made on first sight
            self.graphs: dict = {}
        elif mode.startswith("compile"):
            # compile[-ro][-regional][-dyn]
            kw = {
                "mode": "reduce-overhead" if "-ro" in mode else "default",
                "dynamic": "-dyn" in mode,
            }
            if "-regional" in mode:
                for i, blk in enumerate(self.model.blocks):
                    self.model.blocks[i] = torch.compile(blk, **kw)
                self.forward = self.model
            else:
                self.forward = torch.compile(self.model, **kw)

    def autocast(self):
        return torch.autocast(
            self.device.type,
            dtype=self.dtype,
            enabled=self.dtype != torch.float32,
            cache_enabled=False,
        )

    def _graphed(self, feats, feat_lens):
        key = tuple(feats.shape)
        if key not in self.graphs:
            with self.autocast():
                torch.cuda.make_graphed_callables(
                    self.model, (feats.detach(), feat_lens), num_warmup_iters=3
                )
            # The module's forward is now the graphed one; keep it per shape, and put the
            # class's forward back so the next shape captures the plain model.
            self.graphs[key] = self.model.forward
            del self.model.forward
        return self.graphs[key](feats, feat_lens)

    def out_lens_cpu(self, b):
        flens = self.features.frame_lengths(b["wav_lens_cpu"])
        return self.model.frontend.output_lengths(flens)

    def step(self, b) -> torch.Tensor:
        if "-ro" in self.mode:
            torch.compiler.cudagraph_mark_step_begin()
        with self.autocast():
            feats, feat_lens = self.features(b["wavs"], b["wav_lens"])
            if self.mode == "graphed":
                logits, out_lens = self._graphed(feats, feat_lens)
            else:
                logits, out_lens = self.forward(feats, feat_lens)
            if self.mode != "eager":  # lengths known on the host: no sync in ctc_loss
                out_lens = self.out_lens_cpu(b)
            loss = ctc_loss(ctc_log_probs(logits), out_lens, b["tokens"], b["token_lens"])
        self.scaler.scale(loss).backward()
        self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.params, 5.0)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def timed(setup: Setup, batches: list, warmup: int, steps: int) -> dict:
    """Step times of ``setup`` over ``batches`` (cycled), as ``recipes.step_timing`` times
    the recipes' and the peers' steps (CUDA events, no host sync between steps)."""

    def size(b: dict) -> tuple[int, float, tuple[int, ...]]:
        return b["wavs"].shape[0], b["seconds"], tuple(b["wavs"].shape)

    losses = []
    batch_cycle = itertools.cycle(batches)
    start = time.perf_counter()
    for _ in range(warmup):  # compilation and capture: timed apart
        setup.step(next(batch_cycle))
    if setup.device.type == "cuda":
        torch.cuda.synchronize()
    warm_s = time.perf_counter() - start
    stats = time_steps(
        lambda b: losses.append(setup.step(b)), batch_cycle, 0, steps, setup.device, size
    )
    return {
        "warmup_s": round(warm_s, 2),
        "ms_per_step": round(1e3 * stats["seconds"] / steps, 2),
        "p50_ms": round(stats["p50_step_ms"], 2),
        "p90_ms": round(stats["p90_step_ms"], 2),
        "audio_s_per_s": round(stats["audio_seconds"] / stats["seconds"], 1),
        "peak_mb": round(stats["peak_memory_mb"]) if stats["peak_memory_mb"] else None,
        "final_loss": round(float(losses[-1]), 4),
    }


def step_flops(setup: Setup, b) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        setup.step(b)
    return float(counter.get_total_flops())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deadline", type=float, default=400.0)
    ap.add_argument("--cpu-dry-run", action="store_true")
    ap.add_argument("--suite", type=int, default=1)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    dry = args.cpu_dry_run
    device = torch.device("cpu" if dry else "cuda")
    if not dry:
        log({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__})
    small = dict(SMALL, num_layers=1) if dry else SMALL
    medium = dict(MEDIUM, num_layers=2, d_model=64, ffn_dim=128) if dry else MEDIUM
    warm, steps = (1, 2) if dry else (5, 20)
    small_b = [batch(8 if dry else 128, 1.0, device, s) for s in range(2)]
    med_b = [batch(4 if dry else 96, 4.0, device, s) for s in range(2)]
    med_big = [batch(4 if dry else 256, 4.0, device, s) for s in range(2)]

    def run(name, cfg, precision, mode, batches, flops=False):
        if time.perf_counter() - START > args.deadline:
            log({"skipped": name, "precision": precision, "mode": mode, "why": "deadline"})
            return
        try:
            setup = Setup(cfg, precision, device, mode)
            row = {
                "model": name,
                "precision": precision,
                "mode": mode,
                "batch": list(batches[0]["wavs"].shape),
            }
            row.update(timed(setup, batches, warm, steps))
            if flops and not dry:
                row["tflop_per_step"] = round(step_flops(setup, batches[0]) / 1e12, 3)
                row["tflops"] = round(row["tflop_per_step"] / (row["ms_per_step"] / 1e3), 1)
            log(row)
        except Exception as err:  # keep probing the other variants
            log(
                {
                    "model": name,
                    "precision": precision,
                    "mode": mode,
                    "error": repr(err)[:400],
                    "trace": traceback.format_exc()[-1500:],
                }
            )
        finally:
            if not dry:
                torch.cuda.empty_cache()

    if args.suite == 3:
        suite3(args, run, device, dry, medium, med_b)
        log({"done": True})
        return
    if args.suite == 2:
        suite2(args, run, device, dry, small, medium, small_b, med_b)
        log({"done": True})
        return
    # 1. eager baselines, small (the default recipe) and Conformer-M
    for p in ("fp32", "tf32", "bf16", "fp16"):
        run("small", small, p, "eager", small_b)
    for p in ("fp32", "tf32", "bf16", "fp16"):
        run("M", medium, p, "eager", med_b, flops=p == "bf16")
    # 2. CUDA graphs of the model's forward/backward (no compile)
    if not dry:
        for p in ("fp32", "tf32", "bf16", "fp16"):
            run("M", medium, p, "graphed", med_b)
        run("small", small, "bf16", "graphed", small_b)
        run("small", small, "fp32", "graphed", small_b)
    # 2b. a bigger batch: does bf16 pull ahead when there is more work per launch?
    for p in ("tf32", "bf16"):
        run("M-big", medium, p, "eager", med_big)
        run("M-big", medium, p, "graphed" if not dry else "eager", med_big)
    # 3. fp16 vs bf16 on shapes seen for the first time (small model, eager)
    for p in ("fp16", "bf16"):
        if time.perf_counter() - START > args.deadline:
            break
        setup = Setup(small, p, device, "eager")
        shapes = [
            batch(8 if dry else 100 + 7 * i, 0.5 + 0.05 * i, device, 10 + i) for i in range(8)
        ]
        firsts, seconds = [], []
        for _rnd, acc in ((0, firsts), (1, seconds)):
            for b in shapes:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                setup.step(b)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                acc.append(round(1e3 * (time.perf_counter() - t), 1))
        log(
            {
                "model": "small",
                "precision": p,
                "mode": "new-shapes",
                "first_visit_ms": firsts,
                "second_visit_ms": seconds,
            }
        )
        if p == "fp16" and not dry:
            from torch.profiler import ProfilerActivity, profile

            b = batch(171, 0.93, device, 99)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                setup.step(b)
                torch.cuda.synchronize()
            (OUT / "profile_fp16_new_shape.txt").write_text(
                prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
            )
    # 4. torch.compile variants on Conformer-M
    run("M", medium, "bf16", "compile-ro-regional-dyn", med_b)
    # 6. dynamic shapes through the regional reduce-overhead compile (3 shapes, revisits)
    if not dry and time.perf_counter() - START < args.deadline:
        try:
            setup = Setup(medium, "bf16", device, "compile-ro-regional-dyn")
            shapes = [batch(96, s, device, 20 + i) for i, s in enumerate((3.0, 4.0, 5.0))]
            times = []
            for _rnd in range(3):
                for b in shapes:
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    setup.step(b)
                    torch.cuda.synchronize()
                    times.append(round(1e3 * (time.perf_counter() - t), 1))
            from amp_utils.compile import compile_stats

            log(
                {
                    "model": "M",
                    "precision": "bf16",
                    "mode": "ro-regional-dyn 3 shapes x3",
                    "step_ms": times,
                    "compile": compile_stats(),  # graphs, recompiles, graph breaks
                }
            )
        except Exception as err:
            log(
                {
                    "mode": "ro-dyn-shapes",
                    "error": repr(err)[:400],
                    "trace": traceback.format_exc()[-1500:],
                }
            )
    for p, mode in (
        ("tf32", "compile-ro-regional-dyn"),
        ("fp32", "compile-ro-regional-dyn"),
        ("fp16", "compile-ro-regional-dyn"),
        ("bf16", "compile-regional"),
        ("bf16", "compile-ro"),
    ):
        run("M", medium, p, mode, med_b)
    log({"done": True})


def suite2(args, run, device, dry, small, medium, small_b, med_b) -> None:
    """Where the GPU time of a Conformer-M step goes, and fixes for the depthwise conv."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if not dry else [])
    for p in ("bf16", "tf32"):
        setup = Setup(medium, p, device, "eager")
        for _ in range(3):
            setup.step(med_b[0])
        with profile(activities=acts) as prof:
            for _ in range(2):
                setup.step(med_b[0])
            if not dry:
                torch.cuda.synchronize()
        key = "self_cpu_time_total" if dry else "self_device_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70)
        (OUT / f"profile_M_{p}_eager.txt").write_text(table)
        print(table[:6000], flush=True)
        del setup
    graphed = "eager" if dry else "graphed"
    for p in ("bf16", "tf32", "fp32", "fp16"):
        run("M", medium, p, graphed + "+unfold", med_b)
    for p in ("bf16", "tf32"):
        run("M", medium, p, graphed + "+bench", med_b)
        run("M", medium, p, graphed + "+nocudnn", med_b)
    run("small", small, "bf16", graphed + "+unfold", small_b)
    run("small", small, "fp32", graphed + "+unfold", small_b)
    run("M", medium, "bf16", "eager+unfold", med_b)
    run("M", medium, "fp32", "eager+unfold", med_b)


def suite3(args, run, device, dry, medium, med_b) -> None:
    """Whole-model compile with dynamic shapes + CUDA graphs: compile time, shapes, speed."""
    sync = torch.cuda.synchronize if not dry else (lambda: None)
    for p in ("bf16", "fp32"):
        t0 = time.perf_counter()
        try:
            setup = Setup(medium, p, device, "compile-ro-dyn")
            n = 4 if dry else 96
            shapes = [batch(n, s, device, 30 + i) for i, s in enumerate((3.0, 4.0, 5.0))]
            times = []
            for _ in range(2 if p == "bf16" else 1):
                for b in shapes:
                    sync()
                    t = time.perf_counter()
                    setup.step(b)
                    sync()
                    times.append(round(1e3 * (time.perf_counter() - t), 1))
            row = {
                "model": "M",
                "precision": p,
                "mode": "compile-ro-dyn",
                "visits_ms": times,
                "setup_s": round(time.perf_counter() - t0, 1),
            }
            row.update(timed(setup, [shapes[1]], 3, 10 if dry else 20))
            log(row)
        except Exception as err:
            log(
                {
                    "mode": "compile-ro-dyn",
                    "precision": p,
                    "error": repr(err)[:400],
                    "trace": traceback.format_exc()[-1500:],
                }
            )
    run("M", medium, "fp32", "compile-ro", med_b)


if __name__ == "__main__":
    main()
