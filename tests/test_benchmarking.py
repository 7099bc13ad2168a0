"""The benchmark's table: ratios against fp32, the bare loop and pre-staged batches."""

import json

import pytest

from recipes.benchmarking import summarize
from tests.recipe_helpers import run_cli


def row(mode: str, precision: str, utt_per_s: float, tf32: bool = False) -> dict:
    return {
        "mode": mode,
        "precision": precision,
        "tf32": tf32,
        "utt_per_s": utt_per_s,
        "steps_per_s": 1.0,
        "audio_s_per_s": utt_per_s,
        "p50_step_ms": 1.0,
        "p90_step_ms": 2.0,
        "peak_memory_mb": 100.0,
    }


def test_summary_ratios():
    rows = [
        row("bare", "fp32", 100),
        row("brain", "fp32", 95),
        row("staged", "fp32", 100),
        row("loader", "fp32", 95),
        row("bare", "fp32", 120, tf32=True),
        row("bare", "bf16", 200),
        row("brain", "bf16", 196),
    ]
    lines = summarize(rows).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][1] == "fp32" and cells[0][8:] == ["1.00", "—", "—"]
    assert cells[1][8:] == ["1.00", "0.95", "—"]  # Brain/bare
    assert cells[2][8:] == ["1.00", "—", "—"]
    assert cells[3][8:] == ["1.00", "—", "0.95"]  # loader/staged: the same real batches
    assert cells[4][1] == "fp32+tf32" and cells[4][8] == "1.20"
    assert cells[5][8] == "2.00" and cells[6][8:] == ["2.06", "0.98", "—"]


def test_benchmark_cli_times_every_mode_on_real_data(tmp_path, fsdd_root):
    """recipes/benchmark.py end to end on the CPU: every mode and precision gets a row."""
    out = tmp_path / "bench"
    result = run_cli(
        "benchmark.py",
        [
            "device=cpu",
            "device.num_workers=0",
            "benchmark.batch_size=4",
            "benchmark.steps=3",
            "benchmark.warmup_steps=1",
            "benchmark.precisions=[fp32,bf16]",
            "benchmark.profile_steps=1",
            "data.max_batch_seconds=4",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"hydra.run.dir={out}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "benchmark.json").read_text())["rows"]
    assert [(r["mode"], r["precision"]) for r in rows] == [
        (mode, precision)
        for precision in ("fp32", "bf16")
        for mode in ("bare", "brain", "staged", "loader")
    ]
    staged, loader = rows[2], rows[3]
    assert staged["utterances"] == loader["utterances"]  # the same real batches
    assert staged["audio_seconds"] == pytest.approx(loader["audio_seconds"])
    assert all(r["steps_per_s"] > 0 and r["peak_memory_mb"] > 0 for r in rows)
    assert "loader/staged" in (out / "benchmark.md").read_text()
    profile = (out / "profile_loader_bf16.txt").read_text()
    assert "aten op calls" in profile and "aten::" in profile  # the profiler's op table
    assert len(list(out.glob("profile_*.txt"))) == 8
