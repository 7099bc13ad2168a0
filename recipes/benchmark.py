"""Benchmark training steps: precisions, the Brain loop against a bare loop, real data.

    python recipes/benchmark.py device=cuda                      # fp32, fp32+TF32, fp16, bf16
    python recipes/benchmark.py device=cuda trainer.compile=true benchmark.batch_size=256

Writes ``benchmark.json`` and ``benchmark.md`` into the run folder and prints the table.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from amp_utils.atomic import atomic_write_json, atomic_write_text
from recipes.benchmarking import (
    compile_notes,
    preflight_benchmark,
    run_benchmark,
    step_graph_notes,
    summarize,
)
from recipes.config import exit_on_unknown_override_keys
from recipes.data_setup import DataBundle, build_data
from recipes.experiment import build_brain, device_name, seed_everything
from recipes.modules import build_modules
from recipes.preflight import USER_ERRORS
from recipes.resolvers import register_resolvers
from recipes.run_folder import RunFolder
from recipes.schema import BenchmarkRunConfig, register_schemas

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")
log = logging.getLogger(__name__)
register_resolvers()
register_schemas()


def benchmark(cfg: DictConfig) -> list[dict]:
    """Run the benchmark described by ``cfg``; returns one row per (precision, mode).

    A command refused before the timing starts (a bad value, no GPU, data that cannot be
    read) leaves no folder behind: the folder's ``.hydra/`` and log are written once the
    data is ready (``RunFolder``; Hydra's writes are taken over by ``ToolFolderCallback``).
    """
    folder = RunFolder(Path(cfg.output_dir))
    try:
        device = preflight_benchmark(cfg)
        with build_data(cfg, device) as data:  # its loader workers end with the benchmark
            folder.accept(cfg, run_record=False)
            return _benchmark(cfg, device, data)
    finally:
        folder.abandon()  # refused before it started: no trace of it (else a no-op)


def _benchmark(cfg: DictConfig, device: torch.device, data: DataBundle) -> list[dict]:
    def build(run_cfg: DictConfig):
        seed_everything(cfg.seed)
        return build_brain(run_cfg, data, None, None), data.train

    def fresh_modules(run_cfg: DictConfig) -> torch.nn.ModuleDict:
        return torch.nn.ModuleDict(build_modules(run_cfg, data.speakers))

    out = Path(cfg.output_dir)

    def save(rows: list[dict]) -> str:
        """Write benchmark.md/json for the rows measured so far; returns the table with its
        notes (skipped rows and why, graph and compile notes), as benchmark.md has them."""
        timed = [r for r in rows if "skipped" not in r]
        table = summarize(timed)
        notes = sorted({f"{r['mode']}: {n}" for r in timed for n in r.get("notes", [])})
        skipped = [f"{r['mode']} {r['precision']}: {r['skipped']}" for r in rows if "skipped" in r]
        footer = "".join(
            f"\n- {line}"
            for line in notes + step_graph_notes(timed) + compile_notes(timed) + skipped
        )
        atomic_write_text(out / "benchmark.md", header + table + "\n" + footer + "\n")
        atomic_write_json(
            out / "benchmark.json",
            {
                "device": device_name(device),
                "torch": torch.__version__,
                "config": OmegaConf.to_container(cfg, resolve=True),
                "rows": rows,
            },
        )
        return table + "\n" + footer

    t = cfg.trainer
    header = (
        f"device: {device_name(device)}; torch {torch.__version__}; model {cfg.model.name}; "
        f"batch {cfg.benchmark.batch_size} x {cfg.benchmark.utterance_seconds}s synthetic; "
        f"real batches {cfg.data.name} ({data.max_batch_seconds:g} "
        f"s padded audio); pad_to_buckets={cfg.data.pad_to_buckets}; compile={t.compile}"
        + (f" ({t.compile_mode}, regions={t.compile_regions})" if t.compile else "")
        + f"; graph_step={t.graph_step}; fused_weight_casts={cfg.precision.fused_weight_casts}"
        + f"; low_precision_norms={cfg.precision.low_precision_norms}"
        + f"; norm_saves_16bit={cfg.precision.norm_saves_16bit}"
        + f"; cuda_depthwise={cfg.device.cuda_depthwise}"
        + "\n\n"
    )
    rows = run_benchmark(cfg, build, profile_dir=out, build_modules=fresh_modules, on_progress=save)
    table = save(rows)
    print(header + table)
    return rows


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="benchmark")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: bad input ends with one line, no traceback."""
    try:
        benchmark(cfg)
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    # a key typo, or a key of another option: one line naming the fix
    exit_on_unknown_override_keys(BenchmarkRunConfig, config_name="benchmark")
    main()
