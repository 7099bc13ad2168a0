"""Where a finished run's wall time went, epoch by epoch: training, validation, epoch ends.

``results.json`` gives a run's totals (training time after its first epoch, validation,
epoch ends); ``train.log`` stamps the end of every epoch. Together they tell whether a
precision's end-to-end speed is its step's speed or something around the step: e.g. on the
2026-11-27 evening H200 the default recipe's bf16 trained 1.11x fp32's throughput, yet each
steady epoch took *longer* than fp32's wall (240 against 224 ms) because validation, eager,
took 107 against 77 ms.

    python -m benchmarks.epoch_split RUN_DIR [RUN_DIR ...]   # folders with train.log, results.json

Prints a Markdown table: per run, the mean wall time between the ends of the steady epochs
(from ``--steady-from``, default 4: past the epochs that capture CUDA graphs), and the
per-epoch means of validation, epoch ends and training (the rest) over those epochs.
"""

from __future__ import annotations

import argparse
import json
import re
from datetime import datetime
from pathlib import Path

#: A log line of an epoch's end: "[2026-11-27 21:34:20,581][recipes.audio_brain][INFO] -
#: epoch 1/30: lr ...".
EPOCH_LINE = re.compile(r"^\[([0-9-]+ [0-9:,]+)\]\[[^\]]*\]\[INFO\] - epoch (\d+)/(\d+):")


def epoch_ends(log: Path) -> dict[int, datetime]:
    """Each epoch's end time, from the ``epoch N/M:`` lines of ``train.log``."""
    ends = {}
    for line in log.read_text().splitlines():
        match = EPOCH_LINE.match(line)
        if match:
            stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            ends[int(match.group(2))] = stamp
    return ends


def split(run: Path, steady_from: int) -> dict[str, float]:
    """Per-epoch means (ms) over epochs ``steady_from``.. of ``run``: wall, validation,
    epoch ends, training (wall less the other two, which results.json gives as totals
    over all epochs: their per-epoch means are assumed steady)."""
    ends = epoch_ends(run / "train.log")
    results = json.loads((run / "results.json").read_text())
    epochs = sorted(e for e in ends if e >= steady_from and e - 1 in ends)
    if not epochs:
        raise SystemExit(f"{run}: no epochs from {steady_from} on in train.log")
    wall = sum((ends[e] - ends[e - 1]).total_seconds() for e in epochs) / len(epochs)
    throughput = results["throughput"]
    num_epochs = int(results["epochs_completed"])
    valid = throughput["valid_time_s"] / num_epochs
    epoch_end = throughput["epoch_end_time_s"] / num_epochs
    return {
        "epochs": len(epochs),
        "wall_ms": 1e3 * wall,
        "valid_ms": 1e3 * valid,
        "epoch_end_ms": 1e3 * epoch_end,
        "train_ms": 1e3 * (wall - valid - epoch_end),
        "precision": results["precision"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders")
    parser.add_argument("--steady-from", type=int, default=4, help="first epoch counted")
    args = parser.parse_args()
    print("| run | precision | epochs | wall ms/epoch | training | validation | epoch end |")
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        row = split(run, args.steady_from)
        print(
            f"| {run.name} | {row['precision']} | {row['epochs']} | {row['wall_ms']:.0f} | "
            f"{row['train_ms']:.0f} | {row['valid_ms']:.0f} | {row['epoch_end_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
