"""SIGTERM/SIGINT outside the training epochs: one line, nothing lost, the rerun finishes.

A preemption, ``kill`` or Ctrl-C that came while a run prepared its data, loaded its
checkpoint, tested or wrote its results killed it without a word (SIGTERM) or with a
traceback (SIGINT). ``amp_utils.interruption.RunSignals`` now spans the whole run. Here a
real run (FSDD audio, ``debug=fast``, a tiny x-vector) gets a signal at a fixed point of
each phase, sent by the process to itself from a patched function, as
``tests/test_run_records.py`` does. Each stop must say what it interrupted, change no
record, and the same command must then end exactly where an uninterrupted run ends: the
same test and validation figures, bitwise the same checkpoints, the same TensorBoard
points.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amp_utils.brain import Brain
from amp_utils.checkpoint import Checkpointer
from amp_utils.interruption import RunInterrupted
from amp_utils.run_results import RunResults
from recipes import evaluate
from recipes.audio_brain import AudioBrain
from recipes.experiment import train
from recipes.run_folder import RunFolder
from tests.recipe_helpers import FAST, REPO_ROOT, compose_config, run_command
from tests.test_kill_resume import assert_same_state, child_pids, epoch_states, still_running

#: A tiny speaker-ID model: a whole debug run takes a few seconds on 2 CPU cores.
TINY = [*FAST, "model=xvector", "model.channels=32", "model.embedding_dim=16"]


class SignalNotHandled(Exception):
    """Raised by the tests' own handler: the code under test left the signal alone (it
    would have killed the process without a word, or raised KeyboardInterrupt)."""


@pytest.fixture(autouse=True)
def _unhandled_signals_fail_the_test() -> Iterator[None]:
    """SIGTERM/SIGINT that no code under test catches fail the test instead of killing (or
    interrupting) pytest itself."""

    def unhandled(signum, frame):
        raise SignalNotHandled(signal.Signals(signum).name)

    before = {sig: signal.signal(sig, unhandled) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def signal_at(
    monkeypatch: pytest.MonkeyPatch,
    owner: object,
    name: str,
    sig: signal.Signals = signal.SIGTERM,
    nth: int = 1,
    armed: Callable[[], bool] = lambda: True,
) -> None:
    """Patch ``owner.name`` to send ``sig`` to this process before its ``nth`` call (among
    the calls made while ``armed()``)."""
    original = getattr(owner, name)
    calls = [0]

    def patched(*args, **kwargs):
        if armed():
            calls[0] += 1
            if calls[0] == nth:
                os.kill(os.getpid(), sig)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, patched)


def stopped(run: Callable[[], object], phase: str, sig: str = "SIGTERM") -> str:
    """Run ``run``, which a signal must stop in ``phase``; returns the message. The
    handlers are as they were afterwards, and the run folder is free."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)}
    with pytest.raises(RunInterrupted) as caught:
        run()
    message = str(caught.value)
    assert message.startswith(f"Received {sig} while {phase}: stopped there; nothing recorded"), (
        message
    )
    assert "\n" not in message
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    return message


def tiny_config(out: Path, fsdd_root: Path, prepared: Path, *extra: str):
    return compose_config(
        [
            *TINY,
            f"data.root={fsdd_root}",
            f"data.prepared_dir={prepared}",
            f"output_dir={out}",
            *extra,
        ]
    )


def half_written(folder: Path) -> list[Path]:
    """Temporary files of atomic writes (``.NAME.XXXX.tmp.SUFFIX``) and checkpoint
    writes (``.tmp-*``) left in ``folder``."""
    return [p for p in folder.rglob("*") if ".tmp" in p.name]


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's points of a run, tag -> (step, value), as TensorBoard shows them
    (the points a resumed session superseded dropped)."""
    accumulator = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.fixture(scope="module")
def reference(fsdd_root: Path, tmp_path_factory) -> Path:
    """An uninterrupted run (with the ``.hydra/config.yaml`` the command would write)."""
    root = tmp_path_factory.mktemp("reference")
    config = tiny_config(root / "run", fsdd_root, root / "prepared")
    train(config)
    (root / "run" / ".hydra").mkdir()
    OmegaConf.save(config, root / "run" / ".hydra" / "config.yaml")
    return root / "run"


def test_signals_outside_the_epochs_stop_with_one_line_and_the_rerun_ends_as_uninterrupted(
    reference: Path, fsdd_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run folder, stopped by a signal in each phase outside the epochs in turn, then
    run to its end: every stop says what it interrupted, leaves no half-written file and
    keeps the folder free; the end is the uninterrupted run's, bitwise."""
    run, prepared = tmp_path / "run", tmp_path / "prepared"
    config = tiny_config(run, fsdd_root, prepared)

    def check_folder_free() -> None:
        folder = RunFolder(run)
        folder.lock()  # refused if the stopped run still held it
        folder.release()

    # Data preparation, between two manifests: no trace of the run at all.
    with monkeypatch.context() as patch:
        import data.fsdd

        signal_at(patch, data.fsdd, "write_manifest", nth=2)
        stopped(lambda: train(config), "preparing the data")
    assert not run.exists()
    assert not half_written(prepared)

    # The last epoch's checkpoint write, where fit no longer looks at its signal: the run
    # stopped there instead of testing as if none had come.
    with monkeypatch.context() as patch:
        signal_at(patch, Checkpointer, "save_and_keep_only", nth=2)
        stopped(lambda: train(config), "training")
    assert len(Checkpointer(run / "checkpoints").list_checkpoints()) == 2
    check_folder_free()

    # The checkpoint load of the next session.
    with monkeypatch.context() as patch:
        signal_at(patch, Checkpointer, "recover_if_possible")
        stopped(lambda: train(config), "loading the checkpoint to resume from")
    check_folder_free()

    # The test, at its first batch; Ctrl-C: the same line, no KeyboardInterrupt.
    testing: list[bool] = []
    with monkeypatch.context() as patch:
        on_evaluate_start = Brain.on_evaluate_start

        def arm(self, *args, **kwargs):
            testing.append(True)
            return on_evaluate_start(self, *args, **kwargs)

        patch.setattr(Brain, "on_evaluate_start", arm)
        signal_at(patch, AudioBrain, "evaluate_batch", signal.SIGINT, armed=lambda: bool(testing))
        stopped(lambda: train(config), "testing the best checkpoint", "SIGINT")
    assert testing and not (run / "results.json").exists()
    check_folder_free()

    # The records: before the test's error report is written...
    with monkeypatch.context() as patch:
        import recipes.experiment

        signal_at(patch, recipes.experiment, "error_report")
        stopped(lambda: train(config), "writing the results")
    assert not (run / "results.json").exists() and not (run / "test_errors.md").exists()

    # ... and within the final TensorBoard figures and results.json, written whole first.
    with monkeypatch.context() as patch:
        signal_at(patch, RunResults, "write")
        stopped(lambda: train(config), "writing the results")
    assert json.loads((run / "results.json").read_text())["test_metrics"]
    check_folder_free()
    assert not half_written(run)

    # The same command: the run has finished, exactly as the uninterrupted one.
    results = train(config)
    expected = json.loads((reference / "results.json").read_text())
    for key in ("test_metrics", "valid_metrics", "optimizer_steps", "epochs_completed"):
        assert results[key] == expected[key], key
    assert results["tested_checkpoint"]["epoch"] == expected["tested_checkpoint"]["epoch"]
    want, got = epoch_states(reference), epoch_states(run)
    assert sorted(got) == sorted(want) == [1, 2]
    for epoch in want:
        assert_same_state(want[epoch], got[epoch], "fp32")
    want_points, got_points = scalars(reference), scalars(run)
    assert sorted(got_points) == sorted(want_points)
    for tag, points in want_points.items():
        assert [s for s, _ in got_points[tag]] == [s for s, _ in points], tag
        if tag.startswith(("test/", "valid/", "train/loss")):
            assert got_points[tag] == points, tag
    assert (run / "test_errors.md").read_text().splitlines()[1:] == (
        (reference / "test_errors.md").read_text().splitlines()[1:]
    )


def test_a_signal_stops_an_evaluation_at_once_or_after_its_files(
    reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``recipes/evaluate.py``: stopped while testing, nothing is written (the run folder
    never is); stopped while writing ``--json`` and ``--errors``, both are whole first
    (a rerun refuses files that exist)."""
    before = {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()}
    out, errors = tmp_path / "metrics.json", tmp_path / "errors.md"
    argv = [str(reference), "--json", str(out), "--errors", str(errors)]
    with monkeypatch.context() as patch:
        signal_at(patch, AudioBrain, "evaluate_batch")
        message = stopped(lambda: evaluate.main(argv), f"evaluating {reference}")
    assert message.endswith(evaluate.EVALUATE_AGAIN)
    assert not out.exists() and not errors.exists() and not half_written(tmp_path)
    with monkeypatch.context() as patch:
        signal_at(patch, evaluate, "atomic_write_json")
        message = stopped(lambda: evaluate.main(argv), f"writing {out} and {errors}")
    assert message.endswith(evaluate.WRITTEN_WHOLE)
    assert json.loads(out.read_text())["metrics"] and errors.read_text()
    assert {p: p.read_bytes() for p in reference.rglob("*") if p.is_file()} == before


def test_a_signal_while_the_sweep_summary_is_written_says_how_to_write_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The summary at the end of a ``-m`` sweep: stopped with one line naming the sweep
    folder to give (its default name holds the clock), each file whole or not written; the
    same call then writes it."""
    import amp_utils.sweep_summary as sweep_summary
    from tests.test_sweep_summary import _multirun_job_config, _results, _write_job

    sweep = tmp_path / "multirun"
    for index, precision in enumerate(("fp32", "bf16")):
        overrides = [f"precision={precision}"]
        _write_job(sweep, str(index), overrides, _results(precision, overrides))
    config = _multirun_job_config(sweep, "0")
    config.hydra.overrides.hydra = []  # the folder named by the clock, as by default
    callback = sweep_summary.SweepSummaryCallback()
    with monkeypatch.context() as patch:
        signal_at(patch, sweep_summary, "format_csv")
        message = stopped(lambda: callback.on_multirun_end(config), "writing the sweep summary")
    assert f"Run the same command again with hydra.sweep.dir={sweep.absolute()} " in message
    assert (sweep / "summary.md").is_file() and not (sweep / "summary.csv").exists()
    assert not half_written(sweep)
    callback.on_multirun_end(config)
    assert (sweep / "summary.csv").is_file()


#: ``python WRAPPER SCRIPT ARGS...`` runs ``recipes/SCRIPT`` with ``SIGNAL_AT``
#: (``module:Class.method``) patched to send ``SIGNAL`` to the process before its first
#: call after one of ``ARM_AT`` (the same form); the pids of its children at that moment
#: go to the file ``CHILDREN``.
_WRAPPER = """
import importlib, multiprocessing, os, runpy, signal, sys

def patch(spec, before):
    module, attr = spec.split(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = getattr(owner, name)
    def patched(*args, **kwargs):
        before()
        return original(*args, **kwargs)
    setattr(owner, name, patched)

state = {"armed": False, "sent": False}
def arm():
    state["armed"] = True
def send():
    if state["armed"] and not state["sent"]:
        state["sent"] = True
        with open(os.environ["CHILDREN"], "w") as out:
            out.write(" ".join(str(c.pid) for c in multiprocessing.active_children()))
        os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
patch(os.environ["ARM_AT"], arm)
patch(os.environ["SIGNAL_AT"], send)
sys.argv = [os.path.join(os.environ["RECIPES"], sys.argv[1]), *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_ctrl_c_in_the_test_ends_the_command_with_one_line_and_its_workers(
    fsdd_root: Path, tmp_path: Path
) -> None:
    """``recipes/train.py`` with DataLoader workers, Ctrl-C at the first test batch: exit
    status 1 (as after a checkpoint in the epochs), the one line last on stderr and no
    traceback, every worker ended; the same command resumes and finishes."""
    run_dir = tmp_path / "run"
    args = [
        *TINY,
        "device.num_workers=2",
        f"data.prepared_dir={tmp_path / 'prepared'}",
        f"hydra.run.dir={run_dir}",
    ]
    wrapper, children = tmp_path / "wrapper.py", tmp_path / "children"
    wrapper.write_text(_WRAPPER)
    env = {
        **os.environ,
        "FSDD_ROOT": str(fsdd_root),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "RECIPES": str(REPO_ROOT / "recipes"),
    }
    signalled = {
        **env,
        "ARM_AT": "amp_utils.brain:Brain.on_evaluate_start",
        "SIGNAL_AT": "recipes.audio_brain:AudioBrain.evaluate_batch",
        "SIGNAL": "SIGINT",
        "CHILDREN": str(children),
    }
    proc = subprocess.Popen(
        [sys.executable, str(wrapper), "train.py", *args],
        cwd=tmp_path,
        env=signalled,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    workers = {int(pid) for pid in children.read_text().split()}
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("Received SIGINT while testing the best checkpoint: stopped there"), (
        stderr[-3000:]
    )
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert workers and not still_running(workers) and not child_pids(proc.pid)
    assert last in (run_dir / "train.log").read_text()  # the log says why it stopped
    assert not (run_dir / "results.json").exists()

    rerun = run_command([sys.executable, str(REPO_ROOT / "recipes" / "train.py"), *args], env)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Resumed from" in (run_dir / "train.log").read_text()
    assert RunResults.read(run_dir / "results.json").test_metrics
