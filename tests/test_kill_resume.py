"""Kill -9 at random moments (checkpoint writes included), restart, and lose nothing.

A real recipe run (CPU, FSDD, small budget, a checkpoint after every step) is SIGKILLed
at random times and restarted with the same command until it finishes. Its final weights
must be bitwise equal to an uninterrupted run's, its test metrics the same, and every
checkpoint left on disk readable.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from amp_utils import Checkpointer
from tests.recipe_helpers import FAST, REPO_ROOT

ARGS = [
    *FAST,
    "trainer.debug_batches=5",
    "trainer.debug_epochs=3",
    "trainer.epochs=3",
    "trainer.ckpt_interval_steps=1",
    "data.max_batch_seconds=4",
]


def command(run_dir: Path, prepared: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO_ROOT / "recipes" / "train.py"),
        *ARGS,
        f"data.prepared_dir={prepared}",
        f"hydra.run.dir={run_dir}",
    ]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = Checkpointer(run_dir / "checkpoints").find_checkpoint()
    state = torch.load(latest.path / "state.pt", weights_only=False)["state"]
    return state["module.model"]


def run_with_kills(run_dir: Path, prepared: Path, env: dict, kills: int, seed: int) -> int:
    """Restart until the run completes, SIGKILLing the first ``kills`` attempts."""
    rng = random.Random(seed)
    killed = 0
    for _ in range(kills + 20):
        proc = subprocess.Popen(
            command(run_dir, prepared),
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        if killed < kills:
            # Startup takes ~4 s; training with per-step checkpoints follows.
            deadline = time.monotonic() + rng.uniform(4.0, 14.0)
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                killed += 1
                # Every checkpoint left behind must be readable (none half-written).
                ckpt = Checkpointer(run_dir / "checkpoints")
                for found in ckpt.list_checkpoints():
                    torch.load(found.path / "state.pt", weights_only=False)
                continue
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        return killed
    raise AssertionError("the run never finished")


def kill_resume_check(tmp_path: Path, fsdd_root: Path, prepared: Path, kills: int) -> None:
    env = {**os.environ, "FSDD_ROOT": str(fsdd_root)}
    reference = tmp_path / "reference"
    subprocess.run(
        command(reference, prepared), cwd=REPO_ROOT, env=env, check=True, capture_output=True
    )
    killed_run = tmp_path / "killed"
    killed = run_with_kills(killed_run, prepared, env, kills, seed=kills)
    assert killed == kills
    expected, got = final_state(reference), final_state(killed_run)
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    metrics = [
        json.loads((r / "results.json").read_text())["test_metrics"]
        for r in (reference, killed_run)
    ]
    assert metrics[0] == metrics[1]


@pytest.fixture(scope="module")
def prepared(fsdd_root, tmp_path_factory) -> Path:
    from data.fsdd import prepare_fsdd_digits

    out = tmp_path_factory.mktemp("prepared")
    prepare_fsdd_digits(fsdd_root, out, download=False)
    return out


def test_three_kills_resume_to_identical_weights(tmp_path, fsdd_root, prepared):
    kill_resume_check(tmp_path, fsdd_root, prepared, kills=3)


@pytest.mark.slow
def test_twelve_kills_resume_to_identical_weights(tmp_path, fsdd_root, prepared):
    kill_resume_check(tmp_path, fsdd_root, prepared, kills=12)
