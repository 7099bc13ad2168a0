"""A run's record survives a kill, a second process and a rerun (found by the 2026-11-28
records audit): nothing a finished run wrote is lost, and nothing it did not write is
claimed as its record.

Runs are real ``recipes/train.py`` processes on FSDD (``debug=fast``, a tiny x-vector:
seconds each). A process is killed at a chosen moment by running the recipe through a small
wrapper that patches one function to send the signal (``_WRAPPER``).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amp_utils.tensorboard import session_hparams
from tests.recipe_helpers import FAST, REPO_ROOT, run_command

#: A tiny speaker-ID model: a whole debug run takes a few seconds on 2 CPU cores.
TINY = [*FAST, "model=xvector", "model.channels=32", "model.embedding_dim=16"]

#: ``python WRAPPER SCRIPT ARGS...`` runs ``recipes/SCRIPT`` with ``KILL_AT``
#: (``module:Class.method``) patched to send ``KILL_SIG`` to the process after
#: (``KILL_WHEN=after``) or before its ``KILL_NTH`` call. Under ``torchrun``, ``KILL_RANK``
#: (if set) patches that rank's process only.
_WRAPPER = """
import importlib, os, runpy, signal, sys
def patch():
    module, attr = os.environ["KILL_AT"].split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    calls = [0]
    def patched(*args, **kwargs):
        calls[0] += 1
        hit = calls[0] == int(os.environ.get("KILL_NTH", "1"))
        if hit and os.environ.get("KILL_WHEN") != "after":
            os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIG"]))
        out = original(*args, **kwargs)
        if hit and os.environ.get("KILL_WHEN") == "after":
            os.kill(os.getpid(), getattr(signal, os.environ["KILL_SIG"]))
        return out
    setattr(owner, name, patched)
if os.environ.get("KILL_RANK") in (None, os.environ.get("RANK")):
    patch()
sys.argv = [os.path.join(os.environ["RECIPES"], sys.argv[1]), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _env(fsdd_root: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "FSDD_ROOT": str(fsdd_root),
        "PYTHONUNBUFFERED": "1",
        # this checkout's code, from any working folder
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "RECIPES": str(REPO_ROOT / "recipes"),
        **extra,
    }


def _train_args(tmp_path: Path, run_dir: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.prepared_dir={tmp_path / 'prepared'}", *extra, f"hydra.run.dir={run_dir}"]


def run_killed(
    tmp_path: Path, fsdd_root: Path, args: list[str], kill_at: str, when: str, sig: str = "SIGKILL"
):
    """Run ``recipes/train.py args`` with ``kill_at`` signalling the process ``when``."""
    wrapper = tmp_path / "killing_wrapper.py"
    wrapper.write_text(_WRAPPER)
    env = _env(fsdd_root, KILL_AT=kill_at, KILL_WHEN=when, KILL_SIG=sig)
    return run_command([sys.executable, str(wrapper), "train.py", *args], env)


def run_train(fsdd_root: Path, args: list[str]):
    return run_command(
        [sys.executable, str(REPO_ROOT / "recipes" / "train.py"), *args], _env(fsdd_root)
    )


def scalar_tags(log_dir: Path) -> set[str]:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


def test_a_run_killed_just_after_its_results_keeps_its_final_tensorboard_metrics(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """``results.json`` marks a run finished: a rerun then changes nothing. A run killed
    right after writing it must therefore have its TensorBoard record complete already (the
    test metrics at the last step and the hparams), else no later session ever writes them
    and the run (and its sweep's HParams view) lacks its test figures for good."""
    run_dir = tmp_path / "run"
    args = _train_args(tmp_path, run_dir)
    killed = run_killed(
        tmp_path, fsdd_root, args, "amp_utils.run_results:RunResults.write", "after"
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (run_dir / "results.json").is_file()

    rerun = run_train(fsdd_root, args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "has finished" in rerun.stdout
    tags = scalar_tags(run_dir / "tb")
    assert {"test/loss", "test/accuracy_percent"} <= tags, sorted(tags)
    assert session_hparams(run_dir / "tb").get("model") == "xvector"


def test_a_sweep_stopped_by_sigterm_says_how_to_resume_it_and_that_resumes(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """A sweep's folder is named by the clock (``multirun/<date>_<time>``): "run the same
    command again" started a new sweep in a new folder, every job from scratch, and the
    checkpoint the signal saved was never used. The hint must name the sweep folder, and
    the command it gives must resume the interrupted job."""
    args = [*TINY, "trainer.debug_batches=4", f"data.prepared_dir={tmp_path / 'prepared'}"]
    sweep = ["-m", "precision=fp32,bf16"]
    wrapper = tmp_path / "killing_wrapper.py"
    wrapper.write_text(_WRAPPER)
    env = _env(
        fsdd_root,
        KILL_AT="recipes.audio_brain:AudioBrain.fit_batch",
        KILL_NTH="2",
        KILL_SIG="SIGTERM",
    )
    stopped = subprocess.run(
        [sys.executable, str(wrapper), "train.py", *sweep, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "Received SIGTERM: saved a checkpoint" in stopped.stderr, stopped.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "multirun").iterdir()
    hint = re.search(r"hydra\.sweep\.dir=(\S+)", stopped.stderr)
    assert hint, stopped.stderr[-1000:]
    assert Path(hint.group(1)) == sweep_dir.absolute()

    resumed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "recipes" / "train.py"), *sweep, *args, hint.group(0)],
        cwd=tmp_path,
        env=_env(fsdd_root),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [p.name for p in (tmp_path / "multirun").iterdir()] == [sweep_dir.name]
    log = (sweep_dir / "0_precision=fp32" / "train.log").read_text()
    assert "Resumed from" in log and "(optimizer step 2, 2 batches into the epoch)" in log


def test_a_second_process_on_a_run_folder_in_use_is_refused(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """The same command started again while its run still trains (or a requeued job beside
    the one it replaces) trained in the same folder at the same time: each process rotated
    the other's checkpoints away, both appended to one ``train.log`` and each wrote
    ``results.json``. The second process must be refused in one line and leave the folder
    to the first; once the first is killed, the folder is free again."""
    from recipes.run_folder import RunFolder

    run_dir = tmp_path / "run"
    args = _train_args(tmp_path, run_dir, "trainer.debug_batches=100000")  # whole epochs
    first = subprocess.Popen(
        [sys.executable, str(REPO_ROOT / "recipes" / "train.py"), *args],
        cwd=REPO_ROOT,
        env=_env(fsdd_root),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        log = run_dir / "train.log"
        deadline = time.monotonic() + 120
        while not (log.is_file() and "run folder:" in log.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, (
                "the first run did not start"
            )
            time.sleep(0.1)
        try:
            second = run_command(
                [sys.executable, str(REPO_ROOT / "recipes" / "train.py"), *args],
                _env(fsdd_root),
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            raise AssertionError("the second process trained in the folder in use") from None
        assert second.returncode == 1, second.stderr[-3000:]
        assert "is in use by another training process" in second.stderr
        assert first.poll() is None, "the first run did not go on"
        text = log.read_text()
        assert text.count("run folder:") == 1 and "Resumed from" not in text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    folder = RunFolder(run_dir)  # a killed run's lock goes with it
    folder.lock()
    folder.release()


def test_a_run_folder_is_free_once_its_process_is_killed_though_its_workers_live_on(
    tmp_path: Path,
) -> None:
    """``kill -9`` of a run's main process alone (the OOM killer's way) leaves its forked
    DataLoader workers alive for a few seconds; holding copies of the folder's lock, they
    kept it locked, and a restart in between was refused as "in use"."""
    import multiprocessing

    from recipes.run_folder import RunFolder

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = f"""
import multiprocessing, sys, time
from pathlib import Path
from recipes.run_folder import RunFolder
folder = RunFolder(Path({str(run_dir)!r}))
folder.lock()
worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
worker.start()
print(worker.pid, flush=True)
time.sleep(60)
"""
    assert "fork" in multiprocessing.get_all_start_methods()
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        worker_pid = int(process.stdout.readline())
        os.kill(process.pid, signal.SIGKILL)  # the main process alone
        process.wait()
        os.kill(worker_pid, 0)  # the worker lives on
        folder = RunFolder(run_dir)
        folder.lock()  # refused before: the worker's copy of the lock held the folder
        folder.release()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def test_a_sweep_job_refused_for_other_overrides_leaves_the_finished_runs_config_alone(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """A sweep run again into its folder with another fixed value (``model.lr``) and a
    job folder named by the job number alone (``hydra.sweep.subdir=job${hydra.job.num}``;
    the default subdir gives such a job a new folder) lands in the finished jobs' folders
    and is refused there. Hydra wrote the refused command's ``.hydra/config.yaml``,
    ``hydra.yaml`` and ``overrides.yaml`` over the finished run's before the job could
    refuse: the run's record then said it trained with the other learning rate. The
    refused job may add why to ``train.log``; the config record and the results stay as
    they were."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", *TINY, "precision=choice(fp32)", f"data.prepared_dir={tmp_path / 'prepared'}"]
    args += [f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir=job${hydra.job.num}"]
    first = run_train(fsdd_root, args)
    assert first.returncode == 0, first.stderr[-3000:]
    job = sweep_dir / "job0"
    kept = [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"]
    kept += ["config_resolved.yaml", "run_overrides.yaml", "results.json", "test_errors.md"]
    before = {name: (job / name).read_bytes() for name in kept}

    refused = run_train(fsdd_root, [*args, "model.lr=0.005"])
    assert refused.returncode == 1
    assert "holds a run of other overrides" in (job / "train.log").read_text()
    changed = [name for name in kept if (job / name).read_bytes() != before[name]]
    assert not changed, changed

    again = run_train(fsdd_root, args)  # the same sweep again: the run has finished
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished" in again.stdout
    changed = [name for name in kept if (job / name).read_bytes() != before[name]]
    assert not changed, changed


def test_a_sweep_job_trained_further_keeps_its_earlier_record(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """A sweep run again with more epochs trains its finished jobs further. A sweep job's
    ``.hydra/`` files are written when the job starts, before the run is accepted: the copy
    of the earlier record must be made before that, or it holds the longer run's config."""
    sweep_dir = tmp_path / "sweep"
    args = ["-m", *TINY, "precision=choice(fp32)", f"data.prepared_dir={tmp_path / 'prepared'}"]
    args += [f"hydra.sweep.dir={sweep_dir}"]
    first = run_train(fsdd_root, [*args, "trainer.debug_epochs=1"])
    assert first.returncode == 0, first.stderr[-3000:]
    job = sweep_dir / "0_precision=fp32"
    kept = [".hydra/config.yaml", ".hydra/hydra.yaml", ".hydra/overrides.yaml"]
    kept += ["config_resolved.yaml", "run_overrides.yaml", "results.json", "test_errors.md"]
    before = {name: (job / name).read_bytes() for name in kept}

    longer = run_train(fsdd_root, [*args, "trainer.debug_epochs=2"])
    assert longer.returncode == 0, longer.stderr[-3000:]
    copy = job / "earlier" / "finished_1_epochs"
    assert {name: (copy / name).read_bytes() for name in kept} == before
    assert "trainer.debug_epochs=2" in (job / ".hydra" / "overrides.yaml").read_text()
    assert [p.name for p in (job / "earlier").iterdir()] == ["finished_1_epochs"]
    summary = (sweep_dir / "summary.csv").read_text().splitlines()
    assert len(summary) == 2, summary  # the header and the job, not its earlier record


def test_a_diagnosis_pointed_at_a_training_run_folder_is_refused_and_changes_nothing(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """``recipes/diagnose.py`` writes its report into its own run folder. Pointed at a
    training run's folder (``hydra.run.dir=RUN``), Hydra wrote the diagnosis's config over
    the run's ``.hydra/config.yaml`` and ``hydra.yaml`` (the run's record then described a
    diagnosis), and its histograms became a run nested in the training run's ``tb/``. It
    must be refused before anything is written."""
    run_dir = tmp_path / "run"
    trained = run_train(fsdd_root, _train_args(tmp_path, run_dir))
    assert trained.returncode == 0, trained.stderr[-3000:]
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}

    diagnose = [sys.executable, str(REPO_ROOT / "recipes" / "diagnose.py")]
    refused = run_command([*diagnose, *_train_args(tmp_path, run_dir)], _env(fsdd_root))
    assert refused.returncode == 1, refused.stderr[-3000:]
    assert "holds a training run" in refused.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def _job_files(sweep_dir: Path) -> dict[str, bytes]:
    """Every file of the sweep's job folders by path, but the job's record of its latest
    attempt (``job_status.json``), which each multirun that launches the job rewrites."""
    return {
        str(p.relative_to(sweep_dir)): p.read_bytes()
        for p in sorted(sweep_dir.glob("*_*/**/*"))
        if p.is_file() and p.name != "job_status.json"
    }


def _summary_runs(sweep_dir: Path) -> dict[str, str]:
    """``run -> status`` of the sweep's ``summary.csv``."""
    import csv

    with open(sweep_dir / "summary.csv", newline="") as file:
        return {row["run"]: row["status"] for row in csv.DictReader(file)}


def test_a_sweep_run_again_with_other_values_reuses_the_finished_jobs_folders(
    tmp_path: Path, fsdd_root: Path
) -> None:
    """A sweep's job folders were numbered by the job's place in the command
    (``hydra.job.num``): ``-m precision=fp32,bf16`` and then ``-m precision=fp16,bf16,fp32``
    into the same ``hydra.sweep.dir`` trained fp32 and bf16 again from scratch, in
    ``1_precision=bf16`` (over the earlier fp32 job's number) and ``2_precision=fp32``. A
    job whose overrides are those of a folder of the sweep goes into that folder (its
    finished run says so and changes nothing); a new one gets a number no folder has. The
    summary lists this command's configs, each from its folder, and not the earlier ones
    the command left out."""
    sweep_dir = tmp_path / "sweep"
    common = [*TINY, f"data.prepared_dir={tmp_path / 'prepared'}", f"hydra.sweep.dir={sweep_dir}"]
    first = run_train(fsdd_root, ["-m", "precision=fp32,bf16", *common])
    assert first.returncode == 0, first.stderr[-3000:]
    finished = _job_files(sweep_dir)
    assert {name.split("/")[0] for name in finished} == {"0_precision=fp32", "1_precision=bf16"}

    again = run_train(fsdd_root, ["-m", "precision=fp16,bf16,fp32", *common])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("This run has finished") == 2, again.stdout[-3000:]
    now = _job_files(sweep_dir)
    assert {name: now.get(name) for name in finished} == finished  # not retrained, byte for byte
    jobs = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert jobs == ["0_precision=fp32", "1_precision=bf16", "2_precision=fp16"]
    assert (sweep_dir / "2_precision=fp16" / "results.json").is_file()
    assert (sweep_dir / "2_precision=fp16" / "tb").is_dir()  # its TensorBoard run: its folder
    assert _summary_runs(sweep_dir) == dict.fromkeys(jobs, "ok")

    fewer = run_train(fsdd_root, ["-m", "precision=bf16", *common])
    assert fewer.returncode == 0, fewer.stderr[-3000:]
    assert "This run has finished" in fewer.stdout
    assert _job_files(sweep_dir) == now
    assert _summary_runs(sweep_dir) == {"1_precision=bf16": "ok"}  # this command's config only
