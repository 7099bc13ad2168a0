"""``benchmarks/epoch_split.py``: a finished run's steady epochs split into training,
validation and epoch ends, from its ``train.log`` and ``results.json``."""

from __future__ import annotations

import json

import pytest

from benchmarks.epoch_split import epoch_ends, split


def _run(tmp_path, stamps_ms: list[int], valid_s: float, epoch_end_s: float):
    lines = ["[2026-11-27 21:34:16,802][recipes.data_setup][INFO] - Audio held in memory."]
    for epoch, ms in enumerate(stamps_ms, start=1):
        seconds, millis = divmod(20_000 + ms, 1000)
        lines.append(
            f"[2026-11-27 21:34:{seconds:02d},{millis:03d}][recipes.audio_brain][INFO] - "
            f"epoch {epoch}/{len(stamps_ms)}: lr 2.80e-04, train loss 6.5925"
        )
        lines.append(
            f"[2026-11-27 21:34:{seconds:02d},{millis:03d}][amp_utils.checkpoint]"
            "[INFO] - Saved checkpoint x"
        )
    (tmp_path / "train.log").write_text("\n".join(lines) + "\n")
    results = {
        "precision": "bf16",
        "epochs_completed": len(stamps_ms),
        "throughput": {"valid_time_s": valid_s, "epoch_end_time_s": epoch_end_s},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    return tmp_path


def test_steady_epochs_split_into_training_validation_and_epoch_ends(tmp_path) -> None:
    # epochs 1-3 slow (captures), then 200 ms apart; 5 epochs, 0.5 s validation in all
    run = _run(tmp_path, [0, 900, 1500, 1700, 1900], valid_s=0.5, epoch_end_s=0.05)
    assert sorted(epoch_ends(run / "train.log")) == [1, 2, 3, 4, 5]
    row = split(run, steady_from=4)
    assert row["epochs"] == 2 and row["precision"] == "bf16"
    assert row["wall_ms"] == pytest.approx(200)
    assert row["valid_ms"] == pytest.approx(100) and row["epoch_end_ms"] == pytest.approx(10)
    assert row["train_ms"] == pytest.approx(90)
    assert split(run, steady_from=2)["wall_ms"] == pytest.approx(1900 / 4)


def test_a_log_without_steady_epochs_says_so(tmp_path) -> None:
    run = _run(tmp_path, [0, 900], valid_s=0.1, epoch_end_s=0.0)
    with pytest.raises(SystemExit, match="no epochs from 4 on"):
        split(run, steady_from=4)
