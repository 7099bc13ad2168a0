"""Kill -9 during training, restart with the same command, and lose nothing.

A real ``recipes/train.py`` run, as users start it (default DataLoader workers, no debug
truncation of the epochs; a small model on a small FSDD subset so it takes seconds), is
SIGKILLed inside chosen epochs and restarted with the same command until it finishes. It
must end where an uninterrupted run ends: the same optimizer step count, learning rate and
scheduler position, bitwise the same weights and optimizer state (and, for fp16, the same
loss scaler state), the same validation and test metrics; every checkpoint left on disk
after a kill must be readable.

The scenario (model, precision, checkpoint trigger, the epochs and moments of the kills) is
drawn from a seed shown in the test id; ``KILL_RESUME_SEED=N pytest tests/test_kill_resume.py``
replays one (by default every session draws a new seed).
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from amp_utils import Checkpointer
from amp_utils.checkpoint import read_state
from tests.recipe_helpers import MANIFEST_8K, REPO_ROOT, recipe_command, run_command


def session_seed() -> int:
    """``KILL_RESUME_SEED``, else a new draw per session: under pytest-xdist one shared by
    every worker (its test-run id), since the workers must collect the same test ids."""
    if "KILL_RESUME_SEED" in os.environ:
        return int(os.environ["KILL_RESUME_SEED"])
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id:
        return int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % 10**6
    return random.SystemRandom().randrange(10**6)


SEED = session_seed()
EPOCHS = 3
#: Utterances per split of the FSDD subset; about 15 training batches per epoch.
SUBSET = {"train": 48, "valid": 12, "test": 12}
#: Small models (seconds per run on 2 CPU cores); the loaders keep the default workers.
MODELS = {
    "xvector": ["model=xvector", "model.channels=32", "model.embedding_dim=16"],
    "conformer_ctc": [
        "model=conformer_ctc",
        "model.d_model=32",
        "model.num_layers=1",
        "model.num_heads=2",
        "model.ffn_dim=64",
    ],
}
TRIGGERS = {  # mid-epoch checkpoints every 1-2 optimizer steps, or every 30 ms by the clock
    "steps": lambda rng: [f"trainer.ckpt_interval_steps={rng.randint(1, 2)}"],
    "time": lambda rng: ["trainer.ckpt_interval_minutes=0.0005"],
}
#: Every training precision; on a CPU without native fp16/bf16 those are emulated (slower).
PRECISIONS = ("fp32", "fp16", "bf16")
RESUMED = re.compile(r"Resumed from \S+ \(optimizer step (\d+), (\d+) batches into the epoch\)")


@dataclass(frozen=True)
class Scenario:
    """One drawn kill/resume scenario: what runs and where it is killed."""

    seed: int
    model: str
    precision: str
    trigger: str
    args: tuple[str, ...]
    kills: tuple[tuple[int, int, float], ...]  # (epoch, mid-epoch checkpoints seen, delay s)

    @property
    def name(self) -> str:
        epochs = "+".join(str(epoch) for epoch, _, _ in self.kills)
        return f"seed{self.seed}-{self.model}-{self.precision}-{self.trigger}-kill@epoch{epochs}"


def draw(
    seed: int,
    kills: int,
    model: str | None = None,
    trigger: str | None = None,
    precision: str | None = None,
) -> Scenario:
    """A scenario drawn from ``seed``: ``kills`` kills in random (non-decreasing) epochs."""
    rng = random.Random(seed)
    model = model or rng.choice(sorted(MODELS))
    trigger = trigger or rng.choice(sorted(TRIGGERS))
    precision = precision or rng.choice(PRECISIONS)
    args = (*MODELS[model], f"precision={precision}", *TRIGGERS[trigger](rng))
    # At most 3 kills per epoch, each after 1-2 new mid-epoch checkpoints (at most every 2
    # steps) plus a delay that may fall into a checkpoint write: 12 of the ~15 steps of an
    # epoch at most, so the run cannot finish before its last kill.
    pool = [epoch for epoch in range(1, EPOCHS + 1) for _ in range(3)]
    epochs = sorted(rng.sample(pool, kills))
    moments = tuple((e, rng.randint(1, 2), rng.uniform(0.0, 0.05)) for e in epochs)
    return Scenario(seed, model, precision, trigger, args, moments)


def write_subset(prepared: Path, out: Path) -> dict[str, Path]:
    """Manifests of a fixed random subset of FSDD's prepared splits (absolute paths)."""
    manifests = {}
    for split, size in SUBSET.items():
        with open(prepared / f"{split}.csv", newline="") as file:
            rows = random.Random(0).sample(list(csv.DictReader(file)), size)
        manifests[split] = out / f"{split}.csv"
        with open(manifests[split], "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            for row in rows:
                row["path"] = str((prepared / row["path"]).resolve())
                writer.writerow(row)
    return manifests


def command(
    scenario: Scenario, manifests: dict[str, Path], run_dir: Path, *extra: str
) -> list[str]:
    """The training command; every attempt of a run uses exactly this one."""
    args = [
        "device=cpu",  # default loader workers, as users run it
        "trainer.noprogressbar=true",
        f"trainer.epochs={EPOCHS}",
        "data.max_batch_seconds=2",
        "model.warmup_steps=5",
        f"trainer.keep_checkpoints={EPOCHS + 1}",  # every epoch end stays, to be compared
        *MANIFEST_8K,
        *(f"data.{split}={path}" for split, path in manifests.items()),
        *scenario.args,
        *extra,
        f"hydra.run.dir={run_dir}",
    ]
    assert not any("num_workers" in arg for arg in args)
    return recipe_command("train.py", args)


def mid_epoch_checkpoints(run_dir: Path) -> set[str]:
    """Names of the mid-epoch checkpoints on disk now."""
    found = set()
    for path in (run_dir / "checkpoints").glob("CKPT+*"):
        try:
            if json.loads((path / "meta.json").read_text()).get("intra_epoch"):
                found.add(path.name)
        except (OSError, ValueError):  # deleted while we looked
            continue
    return found


def epoch_finished(run_dir: Path, epoch: int) -> bool:
    """Whether the log (of any attempt so far) has the end-of-epoch line of ``epoch``."""
    log = run_dir / "train.log"
    return epoch == 0 or (log.exists() and f"epoch {epoch}/{EPOCHS}: lr" in log.read_text())


def child_pids(pid: int) -> set[int]:
    """The processes whose parent is ``pid`` (a run's DataLoader workers), from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # ended while we looked
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` if any of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def still_running(pids: set[int], within: float = 10.0) -> set[int]:
    """Those of ``pids`` still running (not ended, not zombies) after up to ``within`` s."""
    deadline = time.monotonic() + within
    while True:
        running = set()
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):
                running.add(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def wait_for_mid_epoch_checkpoints(proc, run_dir: Path, epoch: int, seen: int) -> None:
    """Wait until ``proc`` is in ``epoch`` and has saved ``seen`` new mid-epoch checkpoints."""
    while proc.poll() is None and not epoch_finished(run_dir, epoch - 1):
        time.sleep(0.005)
    known, new = mid_epoch_checkpoints(run_dir), 0
    while proc.poll() is None and new < seen:
        now = mid_epoch_checkpoints(run_dir)
        new += len(now - known)
        known |= now
        time.sleep(0.002)


def kill_during(proc: subprocess.Popen, run_dir: Path, epoch: int, seen: int, delay: float):
    """SIGKILL ``proc`` in ``epoch`` after ``seen`` new mid-epoch checkpoints and ``delay``;
    its DataLoader workers must end with it (not linger as orphans)."""
    wait_for_mid_epoch_checkpoints(proc, run_dir, epoch, seen)
    time.sleep(delay)
    assert proc.poll() is None, "the run finished before it could be killed"
    workers = child_pids(proc.pid)
    assert workers, "the run has no DataLoader workers to check"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not still_running(workers), "DataLoader workers outlived the killed run"


def run_with_kills(
    scenario: Scenario, manifests: dict[str, Path], run_dir: Path, env, *extra: str
) -> str:
    """Kill the run as the scenario says, then let it finish; returns the whole log."""
    for epoch, seen, delay in scenario.kills:
        proc = subprocess.Popen(
            command(scenario, manifests, run_dir, *extra),
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        kill_during(proc, run_dir, epoch, seen, delay)
        # Every checkpoint left behind must be complete and readable.
        folders = sorted((run_dir / "checkpoints").glob("CKPT+*"))
        readable = Checkpointer(run_dir / "checkpoints").list_checkpoints()
        assert [c.path for c in readable] == folders
        for found in readable:
            read_state(found.path / "state.pt")
    result = run_command(command(scenario, manifests, run_dir, *extra), env)
    assert result.returncode == 0, result.stderr[-3000:]
    return (run_dir / "train.log").read_text()


def epoch_states(run_dir: Path) -> dict[int, dict]:
    """The states of the run's end-of-epoch checkpoints on disk, by epoch."""
    states = {}
    for ckpt in Checkpointer(run_dir / "checkpoints").list_checkpoints():
        if ckpt.end_of_epoch:
            state = read_state(ckpt.path / "state.pt")["state"]
            states[state["epoch_counter"]["current"]] = state
    return states


def assert_same_state(expected: dict, got: dict, precision: str) -> None:
    """Bitwise the same training state: counters, schedule, weights, optimizer, scaler."""
    assert got["brain"]["optimizer_step"] == expected["brain"]["optimizer_step"]
    assert got["brain"]["skipped_steps"] == expected["brain"]["skipped_steps"]
    assert got["lr_scheduler"]["last_epoch"] == expected["lr_scheduler"]["last_epoch"]
    lrs = [s["optimizer"]["param_groups"][0]["lr"] for s in (expected, got)]
    assert lrs[0] == lrs[1]
    assert got["epoch_counter"] == expected["epoch_counter"]
    modules = sorted(k for k in expected if k.startswith("module."))
    assert modules and modules == sorted(k for k in got if k.startswith("module."))
    for name in modules:
        for key, value in expected[name].items():
            assert torch.equal(value, got[name][key]), f"{name}.{key}"
    for index, moments in expected["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, got["optimizer"]["state"][index][key]), (index, key)
    # fp16: the loss scale and its growth tracker; the others keep a disabled scaler.
    assert expected["scaler"]["enabled"] == (precision == "fp16")
    assert got["scaler"] == expected["scaler"]


def kill_resume_check(
    scenario: Scenario, tmp_path: Path, prepared: Path, *killed_extra: str
) -> None:
    """The killed-and-resumed run (``killed_extra``: its own further overrides) ends
    exactly where the uninterrupted one does."""
    manifests = write_subset(prepared, tmp_path)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    result = run_command(command(scenario, manifests, reference), env)
    assert result.returncode == 0, result.stderr[-3000:]
    log = run_with_kills(scenario, manifests, killed, env, *killed_extra)
    resumes = [(int(step), int(batches)) for step, batches in RESUMED.findall(log)]
    assert len(resumes) == len(scenario.kills), log[-3000:]
    assert any(batches > 0 for _, batches in resumes), f"no mid-epoch resume: {resumes}"

    # Every epoch end both runs kept (the last one and the best at least), not only the
    # last: a difference that a later event hides (an fp16 overflow resets the scaler's
    # growth tracker) still shows at an earlier epoch end.
    expected, got = epoch_states(reference), epoch_states(killed)
    assert EPOCHS in expected and sorted(got) == sorted(expected)
    for epoch in sorted(expected):
        assert_same_state(expected[epoch], got[epoch], scenario.precision)
    results = [json.loads((r / "results.json").read_text()) for r in (reference, killed)]
    assert results[0]["precision"] == scenario.precision
    assert results[0]["optimizer_steps"] > 0  # fp16: some steps survive the scale's backoff
    for key in ("optimizer_steps", "skipped_steps", "test_metrics", "valid_metrics"):
        assert results[0][key] == results[1][key], key


@pytest.fixture(scope="module")
def prepared(fsdd_root, tmp_path_factory) -> Path:
    from data.fsdd import prepare_fsdd_digits

    out = tmp_path_factory.mktemp("prepared")
    prepare_fsdd_digits(fsdd_root, out, download=False)
    return out


FAST_SCENARIO = draw(SEED, kills=2)


@pytest.mark.parametrize("scenario", [FAST_SCENARIO], ids=[FAST_SCENARIO.name])
def test_killed_run_resumes_to_the_uninterrupted_result(scenario, tmp_path, prepared):
    kill_resume_check(scenario, tmp_path, prepared)


BACKGROUND_SCENARIO = draw(SEED + 1000, kills=2)


@pytest.mark.parametrize("scenario", [BACKGROUND_SCENARIO], ids=[BACKGROUND_SCENARIO.name])
def test_a_killed_run_writing_checkpoints_in_the_background_resumes_exactly(
    scenario, tmp_path, prepared
):
    """``trainer.checkpoint_writes=background`` (CUDA's default): the writer thread puts
    each checkpoint on disk while training goes on, and a kill may land in its write. The
    killed run still ends where an uninterrupted foreground one does, bitwise."""
    kill_resume_check(scenario, tmp_path, prepared, "trainer.checkpoint_writes=background")


#: Every model under every precision, each model with both checkpoint triggers.
SLOW_SCENARIOS = [
    draw(SEED + n, kills=6, model=model, precision=precision, trigger=sorted(TRIGGERS)[n % 2])
    for n, (model, precision) in enumerate((m, p) for m in sorted(MODELS) for p in PRECISIONS)
]


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SLOW_SCENARIOS, ids=[s.name for s in SLOW_SCENARIOS])
def test_killed_many_times_resumes_to_the_uninterrupted_result(scenario, tmp_path, prepared):
    kill_resume_check(scenario, tmp_path, prepared)


@pytest.mark.parametrize("accumulation", [1, 8])
def test_a_signal_to_the_whole_process_group_checkpoints_and_resumes(
    tmp_path, prepared, accumulation
):
    """Slurm's preemption, ``timeout`` and Ctrl-C signal every process of the job, the
    DataLoader workers too. The run must still save after its batch and say how to resume
    (not crash for want of its workers' batches), leave no worker behind, and resume.

    With accumulation over 8 batches (a step every 8th of ~15 batches per epoch) the signal
    most likely lands inside a window: the run saves after that batch, not at the
    window's end."""
    scenario = draw(SEED, kills=1)
    manifests = write_subset(prepared, tmp_path)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [*command(scenario, manifests, run_dir)]
    if accumulation > 1:
        args += [f"trainer.grad_accumulation_factor={accumulation}"]
    proc = subprocess.Popen(
        args,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a job's
    )
    try:
        wait_for_mid_epoch_checkpoints(proc, run_dir, 1, 1)
        assert proc.poll() is None, "the run finished before it could be signalled"
        workers = child_pids(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        kill_group(proc.pid)  # a run that failed the test leaves nothing behind
    assert "Received SIGTERM: saved a checkpoint" in stderr, stderr[-3000:]
    assert "killed by signal" not in stderr, stderr[-3000:]
    assert workers and not still_running(workers)
    result = run_command(args, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert RESUMED.search((run_dir / "train.log").read_text())
