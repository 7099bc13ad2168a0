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
import time
from pathlib import Path

import pytest
import torch

from amp_utils import Checkpointer
from tests.recipe_helpers import FAST, REPO_ROOT, recipe_command, run_command

ARGS = [
    *FAST,
    "trainer.debug_batches=8",
    "trainer.debug_epochs=3",
    "trainer.epochs=3",
    "trainer.ckpt_interval_steps=1",
    "data.max_batch_seconds=4",
]


def command(run_dir: Path, prepared: Path) -> list[str]:
    args = [*ARGS, f"data.prepared_dir={prepared}", f"hydra.run.dir={run_dir}"]
    return recipe_command("train.py", args)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    latest = Checkpointer(run_dir / "checkpoints").find_checkpoint()
    state = torch.load(latest.path / "state.pt", weights_only=False)["state"]
    return state["module.model"]


STEPS = 3 * 8  # epochs x batches: one checkpoint per step (+ one per epoch end)


def newest_checkpoint(run_dir: Path) -> str | None:
    names = sorted(p.name for p in (run_dir / "checkpoints").glob("CKPT+*"))
    return names[-1] if names else None


def run_with_kills(run_dir: Path, prepared: Path, env: dict, kills: int, seed: int) -> int:
    """SIGKILL ``kills`` attempts at random moments, then let the run finish.

    Each attempt is killed after a random number of new checkpoints (0 = during start-up),
    at most ``STEPS / (kills + 1)``, plus a random delay within a step, so the kill points
    spread over the whole run, checkpoint writes included, and the run cannot finish
    before the last kill.
    """
    rng = random.Random(seed)
    killed = 0
    while killed < kills:
        proc = subprocess.Popen(
            command(run_dir, prepared),
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        wanted = rng.randint(0, STEPS // (kills + 1))
        seen, last = 0, newest_checkpoint(run_dir)
        while proc.poll() is None and seen < wanted:
            newest = newest_checkpoint(run_dir)
            if newest != last:
                seen, last = seen + 1, newest
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed += 1
        # Every checkpoint left behind must be complete and readable.
        folders = sorted((run_dir / "checkpoints").glob("CKPT+*"))
        readable = Checkpointer(run_dir / "checkpoints").list_checkpoints()
        assert [c.path for c in readable] == folders
        for found in readable:
            torch.load(found.path / "state.pt", weights_only=False)
    result = run_command(command(run_dir, prepared), env)
    assert result.returncode == 0, result.stderr[-3000:]
    return killed


def kill_resume_check(tmp_path: Path, fsdd_root: Path, prepared: Path, kills: int) -> None:
    env = {**os.environ, "FSDD_ROOT": str(fsdd_root)}
    reference = tmp_path / "reference"
    subprocess.run(
        command(reference, prepared), cwd=REPO_ROOT, env=env, check=True, capture_output=True
    )
    killed_run = tmp_path / "killed"
    assert run_with_kills(killed_run, prepared, env, kills, seed=kills) == kills
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
