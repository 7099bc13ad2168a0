"""End-to-end DDP on the CPU (gloo): ``torchrun`` with 2 processes on real FSDD audio.

The DDP run (2 ranks, 1 batch each per step) and a single process with gradient
accumulation over 2 batches see the same pairs of batches per optimizer step (the
sampler deals batch ``i`` to rank ``i % 2``), so with dropout and SpecAugment off both must
end with the same weights and metrics, up to float summation order. Then each run folder
is resumed by the other kind of run: a DDP checkpoint in one process and the reverse.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from amp_utils import Checkpointer
from amp_utils.checkpoint import Checkpoint, read_state
from tests.recipe_helpers import MANIFEST_8K, REPO_ROOT, recipe_command, run_command
from tests.test_recipes import prepared_digits  # noqa: F401 - session fixture

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="needs torch.distributed"
)

TOLERANCE = 1e-4  # weights/losses: DDP and accumulation differ only in summation order

#: Deterministic training (no dropout/SpecAugment) on small real-audio splits.
COMMON = [
    "device=cpu",
    "device.num_workers=0",
    "trainer.noprogressbar=true",
    "trainer.log_interval_steps=1",
    "trainer.epochs=1",
    "trainer.ckpt_interval_minutes=0.0001",  # mid-epoch checkpoints: a joint decision
    "model.dropout=0.0",
    "model.warmup_steps=2",
    "data.spec_augment.enabled=false",
    "data.max_batch_seconds=4",
    *MANIFEST_8K,
]


def subset_manifests(prepared: Path, out: Path, sizes: dict[str, int]) -> list[str]:
    """``sizes[split]`` rows spread over each FSDD manifest, as data.<split>= overrides."""
    out.mkdir(parents=True, exist_ok=True)
    overrides = []
    for split, size in sizes.items():
        with open(prepared / f"{split}.csv", newline="") as file:
            rows = list(csv.DictReader(file))
        rows = rows[:: len(rows) // size][:size]  # all digits and speakers
        path = out / f"{split}.csv"
        with open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        overrides.append(f"data.{split}={path}")
    return overrides


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_train(args: list[str], nproc: int = 1, ok: bool = True) -> subprocess.CompletedProcess:
    """Run the recipe to the end; with ``ok``, check that it succeeded."""
    result = run_command(recipe_command("train.py", args, nproc), ENV)
    if ok:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def latest_state(run_dir: Path) -> dict:
    ckpt = Checkpointer(run_dir / "checkpoints").find_checkpoint()
    assert ckpt is not None and ckpt.end_of_epoch
    return read_state(ckpt.path / "state.pt")["state"]


def results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def data_args(prepared_digits, tmp_path_factory) -> list[str]:  # noqa: F811
    out = tmp_path_factory.mktemp("ddp_manifests")
    return subset_manifests(prepared_digits, out, {"train": 48, "valid": 31, "test": 20})


@pytest.fixture(scope="module")
def runs(data_args, tmp_path_factory) -> dict[str, Path]:
    """A 2-process DDP run and the matching single-process run (accumulating 2 batches)."""
    root = tmp_path_factory.mktemp("ddp_runs")
    ddp, single = root / "ddp", root / "single"
    run_train([*COMMON, *data_args, f"hydra.run.dir={ddp}"], nproc=2)
    run_train(
        [*COMMON, *data_args, "trainer.grad_accumulation_factor=2", f"hydra.run.dir={single}"]
    )
    return {"ddp": ddp, "single": single}


def test_ddp_matches_single_process_with_the_same_global_batch(runs):
    ddp, single = latest_state(runs["ddp"]), latest_state(runs["single"])
    assert ddp["brain"]["world_size"] == 2 and single["brain"]["world_size"] == 1
    assert ddp["brain"]["optimizer_step"] == single["brain"]["optimizer_step"] >= 4
    assert ddp["brain"]["avg_train_loss"] == pytest.approx(
        single["brain"]["avg_train_loss"], rel=TOLERANCE
    )
    for name, weight in single["module.model"].items():
        torch.testing.assert_close(ddp["module.model"][name], weight, rtol=0, atol=TOLERANCE)
    ddp_res, single_res = results(runs["ddp"]), results(runs["single"])
    assert ddp_res["world_size"] == 2 and ddp_res["distributed_backend"] == "gloo"
    for split in ("valid_metrics", "test_metrics"):  # all-reduced over the ranks' shards
        for key, value in single_res[split].items():
            assert ddp_res[split][key] == pytest.approx(value, rel=TOLERANCE, abs=1e-6), key
    # The error report lists both ranks' shards of the 20 test utterances, as one process does.
    reports = [(runs[name] / "test_errors.md").read_text() for name in ("ddp", "single")]
    assert [report.split("\n")[2] for report in reports] == 2 * [reports[1].split("\n")[2]]
    assert " of 20 utterances wrong" in reports[0]


#: TensorBoard's event file name: events.out.tfevents.<time>.<hostname>.<pid>.<uid>; the
#: hostname may hold dots, so the process id is read from the end.
EVENT_FILE = re.compile(r"events\.out\.tfevents\.\d+\.(?P<host>.+)\.(?P<pid>\d+)\.\d+")


def writer_pid(name: str) -> int:
    """The id of the process that wrote a TensorBoard event file."""
    match = EVENT_FILE.fullmatch(name)
    assert match is not None, f"unexpected event file name {name!r}"
    return int(match["pid"])


def test_writer_pid_reads_the_process_id_of_an_event_file():
    assert writer_pid("events.out.tfevents.1732000000.vm.4242.0") == 4242
    assert writer_pid("events.out.tfevents.1732000000.node01.cluster.org.77.3") == 77


def test_only_rank_zero_writes_outputs(runs):
    run_dir = runs["ddp"]
    for name in ("results.json", "env.txt", "labels.json", "train.log"):
        assert (run_dir / name).is_file(), name
    events = [p.name for p in (run_dir / "tb").rglob("events.out.tfevents.*")]
    writers = {writer_pid(name) for name in events}
    assert len(writers) == 1, f"TensorBoard events from several processes: {events}"
    log = (run_dir / "train.log").read_text()
    assert log.count("epoch 1/") == 1 and log.count("test:") == 1  # rank 1 logs no INFO
    ckpt_names = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert all(name.startswith("CKPT+") for name in ckpt_names), ckpt_names


def test_ddp_checkpoint_resumes_in_one_process(runs, data_args):
    before = results(runs["ddp"])["optimizer_steps"]
    run_train([*COMMON, *data_args, "trainer.epochs=2", f"hydra.run.dir={runs['ddp']}"])
    after = results(runs["ddp"])
    assert after["world_size"] == 1 and after["epochs"] == 2
    assert after["optimizer_steps"] > before
    assert "Resumed from" in (runs["ddp"] / "train.log").read_text()


def test_single_process_checkpoint_resumes_under_ddp(runs, data_args):
    before = results(runs["single"])["optimizer_steps"]
    args = [*COMMON, *data_args, "trainer.epochs=2", f"hydra.run.dir={runs['single']}"]
    run_train(args, nproc=2)
    after = results(runs["single"])
    assert after["world_size"] == 2 and after["epochs"] == 2
    assert after["optimizer_steps"] > before
    assert "Resumed from" in (runs["single"] / "train.log").read_text()


#: A tiny model, so that the interrupted runs below take seconds.
TINY = [
    "model.d_model=32",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.ffn_dim=64",
    "trainer.epochs=2",
    "trainer.ckpt_interval_minutes=0",
    "trainer.log_interval_steps=2",  # ranks decide jointly (and stop) every 2 steps
]
RESUMED = re.compile(r"Resumed from \S+ \(optimizer step (\d+), (\d+) batches into the epoch\)")


def start_train(args: list[str], run_dir: Path, nproc: int, stdout: int) -> subprocess.Popen:
    """Start a training run in ``run_dir`` in the background (stderr goes with stdout)."""
    return subprocess.Popen(
        recipe_command("train.py", [*args, f"hydra.run.dir={run_dir}"], nproc=nproc),
        cwd=REPO_ROOT,
        env=ENV,
        stdout=stdout,
        stderr=subprocess.STDOUT,
    )


def wait_for_a_checkpoint(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 300) -> None:
    """Return as soon as the running ``proc`` has a checkpoint on disk (polled every 5 ms)."""
    deadline = time.monotonic() + timeout_s
    while not list((run_dir / "checkpoints").glob("CKPT+*")):
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)


def sigterm_in_epoch_2(args: list[str], run_dir: Path) -> dict:
    """Start a 2-process run, SIGTERM it once epoch 1 is checkpointed; returns the state of
    the mid-epoch checkpoint both ranks saved.

    torchrun forwards SIGTERM to every rank: both say how to resume, and they stop after
    the same batch with one checkpoint between them.
    """
    proc = start_train(args, run_dir, nproc=2, stdout=subprocess.PIPE)
    wait_for_a_checkpoint(proc, run_dir)  # the end of epoch 1
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode != 0, "the run ended before the signal stopped it: " + output[-2000:]
    assert output.count("Run the same command again to resume") == 2, output[-3000:]
    [mid_epoch] = [
        c
        for c in Checkpointer(run_dir / "checkpoints").list_checkpoints()
        if c.meta.get("intra_epoch")
    ]
    state = read_state(mid_epoch.path / "state.pt")["state"]
    assert state["epoch_counter"]["current"] == 2 and state["brain"]["world_size"] == 2
    assert state["brain"]["step"] > 0, "stopped at the end of an epoch, not inside one"
    return state


def stop_and_reference(root: Path, args: list[str]) -> dict:
    """An uninterrupted 2-process run and the same run SIGTERMed inside epoch 2."""
    run_train([*args, f"hydra.run.dir={root / 'reference'}"], nproc=2)
    state = sigterm_in_epoch_2(args, root / "stopped")
    return {"args": args, "root": root, "state": state}


@pytest.fixture(scope="module")
def interrupted(data_args, tmp_path_factory) -> dict:
    """Deterministic training (DDP equals one process accumulating 2 batches)."""
    root = tmp_path_factory.mktemp("ddp_interrupted")
    return stop_and_reference(root, [*COMMON, *data_args, *TINY])


@pytest.fixture(scope="module")
def interrupted_noisy(data_args, tmp_path_factory) -> dict:
    """Dropout and SpecAugment on, as users train: each rank draws its own random numbers."""
    root = tmp_path_factory.mktemp("ddp_interrupted_noisy")
    common = [a for a in COMMON if not a.startswith(("model.dropout", "data.spec_augment"))]
    return stop_and_reference(root, [*common, *data_args, *TINY])


def resume_copy(interrupted: dict, name: str) -> Path:
    """A copy of the stopped run's folder (each test resumes its own)."""
    run_dir = interrupted["root"] / name
    shutil.copytree(interrupted["root"] / "stopped", run_dir)
    return run_dir


def test_ddp_run_stopped_mid_epoch_resumes_bitwise_under_the_same_world_size(
    interrupted_noisy,
):
    """Every rank gets its own RNG state back (dropout and SpecAugment replay exactly)."""
    interrupted = interrupted_noisy
    run_dir = resume_copy(interrupted, "resumed_ddp")
    run_train([*interrupted["args"], f"hydra.run.dir={run_dir}"], nproc=2)
    step = interrupted["state"]["brain"]["step"]
    resumes = RESUMED.findall((run_dir / "train.log").read_text())
    assert [int(batches) for _, batches in resumes] == [step]  # per-rank batches, W=2
    expected, got = latest_state(interrupted["root"] / "reference"), latest_state(run_dir)
    assert got["brain"]["optimizer_step"] == expected["brain"]["optimizer_step"]
    assert got["lr_scheduler"] == expected["lr_scheduler"]
    lrs = [s["optimizer"]["param_groups"][0]["lr"] for s in (expected, got)]
    assert lrs[0] == lrs[1]
    for module in ("module.model", "module.features"):
        for key, value in expected[module].items():
            assert torch.equal(value, got[module][key]), f"{module}.{key}"
    for index, moments in expected["optimizer"]["state"].items():
        for key, value in moments.items():
            assert torch.equal(value, got["optimizer"]["state"][index][key]), (index, key)
    utterances = [
        [stats["utterances"] for stats in s["brain"]["rank_train_stats"]] for s in (expected, got)
    ]
    assert utterances[0] == utterances[1]  # each rank trained (and counted) the same
    ref, res = results(interrupted["root"] / "reference"), results(run_dir)
    assert res["world_size"] == 2
    for key in ("optimizer_steps", "valid_metrics", "test_metrics"):
        assert res[key] == ref[key], key


def test_ddp_run_stopped_mid_epoch_resumes_in_one_process_without_losing_a_batch(
    interrupted,
):
    """World size 2 -> 1 inside an epoch: after k batches per rank the first 2k batches of
    the epoch's list are done (brain.load_state_dict), so one process goes on at batch 2k.
    Accumulating 2 batches per step it is the same training as the DDP run (up to
    summation order): a batch skipped or trained twice changes the step count and weights."""
    run_dir = resume_copy(interrupted, "resumed_single")
    args = [*interrupted["args"], "trainer.grad_accumulation_factor=2"]
    run_train([*args, f"hydra.run.dir={run_dir}"], nproc=1)
    step = interrupted["state"]["brain"]["step"]
    resumes = RESUMED.findall((run_dir / "train.log").read_text())
    assert [int(batches) for _, batches in resumes] == [2 * step]  # batches of the epoch
    expected, got = latest_state(interrupted["root"] / "reference"), latest_state(run_dir)
    assert got["brain"]["world_size"] == 1
    # Utterances trained over the run: the two ranks' before the stop, then one process's.
    ranks = expected["brain"]["rank_train_stats"]
    assert got["brain"]["train_stats"]["utterances"] == sum(s["utterances"] for s in ranks)
    assert got["brain"]["optimizer_step"] == expected["brain"]["optimizer_step"]
    assert got["lr_scheduler"]["last_epoch"] == expected["lr_scheduler"]["last_epoch"]
    for name, weight in expected["module.model"].items():
        torch.testing.assert_close(got["module.model"][name], weight, rtol=0, atol=TOLERANCE)
    ref, res = results(interrupted["root"] / "reference"), results(run_dir)
    assert res["world_size"] == 1 and res["optimizer_steps"] == ref["optimizer_steps"]


def killed_after_a_mid_epoch_checkpoint(args: list[str], run_dir: Path) -> Checkpoint:
    """Start a one-process run and SIGKILL it once a mid-epoch checkpoint is on disk, before
    its epoch ends (the end-of-epoch save deletes the mid-epoch ones); returns that one."""
    proc = start_train(args, run_dir, nproc=1, stdout=subprocess.DEVNULL)
    try:
        wait_for_a_checkpoint(proc, run_dir)
        proc.send_signal(signal.SIGSTOP)  # at once: the epoch has ~40 batches left to run
    finally:
        proc.kill()
        proc.wait()
    ckpts = Checkpointer(run_dir / "checkpoints").list_checkpoints()
    # the newest is mid-epoch (a stop between writing a new checkpoint and deleting the one
    # before it can leave two)
    assert ckpts and not ckpts[-1].end_of_epoch, "the epoch ended before the kill"
    return ckpts[-1]


def test_mid_epoch_position_two_ranks_cannot_continue_from_is_refused(
    prepared_digits,  # noqa: F811
    tmp_path,
):
    """World size 1 -> 2 after an odd number of batches: two ranks can only go on from an
    even batch, so one batch would be trained twice (or skipped). The resume is refused,
    with one line (per rank) that says what to do, and nothing is trained."""
    run_dir = tmp_path / "run"
    sizes = {"train": 400, "valid": 31, "test": 20}  # an epoch long enough to kill inside
    args = [
        *COMMON,
        *subset_manifests(prepared_digits, tmp_path / "manifests", sizes),
        *(arg for arg in TINY if not arg.startswith("trainer.epochs=")),
        "trainer.epochs=1",
        "trainer.ckpt_interval_steps=2",  # optimizer steps are read back one batch late
        f"hydra.run.dir={run_dir}",
    ]
    mid_epoch = killed_after_a_mid_epoch_checkpoint(args, run_dir)
    state = read_state(mid_epoch.path / "state.pt")["state"]
    batches = state["brain"]["step"]
    assert state["brain"]["world_size"] == 1 and batches % 2 == 1, batches

    result = run_train(args, nproc=2, ok=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    message = f"error: The mid-epoch checkpoint was saved after {batches} batches"
    assert output.count(message) == 2, output[-3000:]
    assert "CheckpointError" not in output, output[-3000:]  # no traceback of ours
    assert not (run_dir / "results.json").exists()
    assert Checkpointer(run_dir / "checkpoints").list_checkpoints() == [mid_epoch]


@pytest.mark.gpu
def test_nccl_ddp_with_one_process_per_gpu(data_args, tmp_path):
    """The nccl path: as many ranks as GPUs (a 1-GPU machine runs DDP with world size 1)."""
    nproc = torch.cuda.device_count()
    args = [arg for arg in COMMON if not arg.startswith("device=")]
    run_dir = tmp_path / "run"
    cuda = ["device=cuda", "precision=bf16", "trainer.sync_batchnorm=true"]
    # torchrun even for one GPU: DDP with world size 1 still runs the nccl code path.
    command = recipe_command(
        "train.py",
        [*args, *data_args, *cuda, f"hydra.run.dir={run_dir}"],
        nproc=nproc,
        torchrun=True,
    )
    result = run_command(command, ENV)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    res = results(run_dir)
    assert res["world_size"] == nproc and res["distributed_backend"] == "nccl"
    assert res["device"] == "cuda" and res["optimizer_steps"] > 0


def test_ranks_with_different_run_folders_stop_with_the_fix(tmp_path):
    """A clock in the folder name gives each rank its own folder: refused on every rank."""
    clocked = f"hydra.run.dir={tmp_path}/run_${{now:%H-%M-%S-%f}}"
    unread = [f"data.{split}={tmp_path}/{split}.csv" for split in ("train", "valid", "test")]
    result = run_train([*COMMON, *unread, clocked], nproc=2, ok=False)  # refused before reading
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("error: The DDP processes composed different run folders") == 2
    assert "hydra.run.dir=PATH" in output


def test_ddp_ranks_stop_within_two_steps_of_a_signal_between_joint_decisions(
    prepared_digits,  # noqa: F811
    tmp_path,
):
    """The ranks' periodic joint decision (every ``log_interval_steps`` steps, here 1000:
    never inside an epoch) is not what stops them: every batch's loss all-reduce carries
    whether a rank caught a signal, and all ranks read it at the same optimizer step. So
    a SIGTERM inside epoch 2 stops both ranks after the same batch of epoch 2, one
    checkpoint between them, instead of training on to the end."""
    data = subset_manifests(
        prepared_digits, tmp_path / "data", {"train": 200, "valid": 8, "test": 8}
    )
    args = [*COMMON, *data, *TINY, "trainer.log_interval_steps=1000"]
    state = sigterm_in_epoch_2(args, tmp_path / "run")
    assert state["brain"]["optimizer_step"] < 2 * 11  # ~11 steps per epoch and rank


def test_a_signal_to_the_whole_ddp_job_checkpoints_and_resumes(prepared_digits, tmp_path):  # noqa: F811
    """A SIGTERM to torchrun's process group (``timeout``, Ctrl-C, a job's preemption):
    torchrun forwards it to each rank's own process group, which holds the rank's
    DataLoader workers. The ranks train on until they all know of the signal (a step or
    two), so their workers must not have died of it: both ranks save one
    checkpoint, say how to resume and leave no process behind; the same command then
    resumes (and its workers, which ignore SIGTERM, do not hang its exit)."""
    from tests.test_kill_resume import child_pids, kill_group, still_running

    data = subset_manifests(
        prepared_digits, tmp_path / "data", {"train": 200, "valid": 8, "test": 8}
    )
    args = [
        *[a for a in COMMON if not a.startswith("device.num_workers")],
        "device.num_workers=2",
        *data,
        *TINY,
        "trainer.log_interval_steps=4",
    ]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        recipe_command("train.py", [*args, f"hydra.run.dir={run_dir}"], nproc=2),
        cwd=REPO_ROOT,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a job's
    )
    ranks: set[int] = set()
    try:
        wait_for_a_checkpoint(proc, run_dir)  # the end of epoch 1
        ranks = child_pids(proc.pid)  # each in its own process group (torchrun's choice)
        workers = set().union(*(child_pids(rank) for rank in ranks))
        os.killpg(proc.pid, signal.SIGTERM)  # torchrun forwards it to each rank's group
        output = proc.communicate(timeout=120)[0].decode()
    finally:
        for pgid in (proc.pid, *ranks):  # a run that failed the test leaves nothing behind
            kill_group(pgid)
    assert output.count("Run the same command again to resume") == 2, output[-3000:]
    assert "killed by signal" not in output and "exited unexpectedly" not in output, output[-3000:]
    assert len(ranks) == 2 and workers and not still_running(ranks | workers)
    mid_epoch = [
        c
        for c in Checkpointer(run_dir / "checkpoints").list_checkpoints()
        if c.meta.get("intra_epoch")
    ]
    assert len(mid_epoch) == 1, output[-3000:]
    run_train([*args, f"hydra.run.dir={run_dir}"], nproc=2)  # and exits
    assert RESUMED.search((run_dir / "train.log").read_text())


def run_with_a_signal(args: list[str], rank: int, at: str, tmp_path: Path) -> str:
    """Run a 2-process ``recipes/train.py`` with ``args`` in which rank ``rank`` sends itself
    SIGTERM before its first call of ``at`` (``module:Class.method``); returns the output.
    A run that does not end in 120 s fails the test, and leaves no process behind."""
    from tests.test_kill_resume import child_pids, kill_group
    from tests.test_run_records import _WRAPPER

    wrapper = tmp_path / "signalling_wrapper.py"
    wrapper.write_text(_WRAPPER)
    env = {
        **ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), ENV.get("PYTHONPATH")])),
        "RECIPES": str(REPO_ROOT / "recipes"),
        **{"KILL_AT": at, "KILL_SIG": "SIGTERM", "KILL_RANK": str(rank)},
    }
    launcher = recipe_command("train.py", args, nproc=2)
    script = launcher.index(str(REPO_ROOT / "recipes" / "train.py"))
    command = [*launcher[:script], str(wrapper), "train.py", *args]
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        output = proc.communicate(timeout=120)[0].decode()
    except subprocess.TimeoutExpired:
        ranks = child_pids(proc.pid)
        for pgid in (proc.pid, *ranks):
            kill_group(pgid)
        pytest.fail(f"the run hung after a SIGTERM to rank {rank} at {at}")
    assert proc.returncode != 0, output[-3000:]
    return output


def test_a_signal_to_one_rank_outside_fit_ends_both_with_one_line_each(
    data_args,
    tmp_path,
):
    """A SIGTERM to one rank outside the epochs (its test starting, its results about to be
    written) while the other waits for it in a collective (the test's sums, the barrier
    before the records): the signalled rank stops at once with the line of what it
    interrupted, the waiting one does not hang (gloo's timeout: 30 minutes) but ends with
    one line too (its peer ended, or torchrun's SIGTERM), no traceback from either, no
    results written; the same command then finishes the run."""
    run_dir = tmp_path / "run"
    args = [
        *[a for a in COMMON if not a.startswith(("model.", "trainer.ckpt_interval"))],
        "model=xvector",
        "model.channels=32",
        "model.embedding_dim=16",
        *data_args,
        f"hydra.run.dir={run_dir}",
    ]
    stops = [
        # rank 1 as its test starts; rank 0 tests and waits in the test's sums
        (1, "recipes.audio_brain:AudioBrain.evaluate_best", "testing the best checkpoint"),
        # rank 0 before the barrier of the results; rank 1 waits in it
        (0, "recipes.experiment:ddp_barrier", "writing the results"),
    ]
    for rank, at, phase in stops:
        output = run_with_a_signal(args, rank, at, tmp_path)
        lines = [
            line
            for line in output.splitlines()
            if line.startswith(
                ("Received SIGTERM while", "error: Another process of this DDP run ended")
            )
        ]
        assert len(lines) == 2, output[-3000:]  # one per rank
        assert any(
            line.startswith(f"Received SIGTERM while {phase}: stopped there") for line in lines
        ), output[-3000:]
        assert all("Run the same command again to resume" in line for line in lines)
        # no rank's traceback (torchrun's own, of the child that failed, names site-packages,
        # which lie below the repository where the venv is .venv: only our code counts)
        for package in ("amp_utils", "recipes", "data"):
            assert f'File "{REPO_ROOT / package}' not in output, output[-3000:]
        assert not (run_dir / "results.json").exists()
    run_train(args, nproc=2)  # and succeeds
    assert results(run_dir)["world_size"] == 2 and results(run_dir)["test_metrics"]
