"""The benchmark's table: ratios against fp32, the bare loop and synthetic batches."""

from recipes.benchmarking import summarize


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
        row("loader", "fp32", 90),
        row("bare", "fp32", 120, tf32=True),
        row("bare", "bf16", 200),
        row("brain", "bf16", 196),
    ]
    lines = summarize(rows).splitlines()[2:]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0][1] == "fp32" and cells[0][8:] == ["1.00", "—", "—"]
    assert cells[1][8:] == ["1.00", "0.95", "—"]  # Brain/bare
    assert cells[2][8:] == ["1.00", "—", "0.95"]  # loader/synthetic (vs Brain)
    assert cells[3][1] == "fp32+tf32" and cells[3][8] == "1.20"
    assert cells[4][8] == "2.00" and cells[5][8:] == ["2.06", "0.98", "—"]
