"""A run's record survives a kill, a second process and a rerun (found by the 2026-11-28
records audit): nothing a finished run wrote is lost, and nothing it did not write is
claimed as its record.

Runs are real ``recipes/train.py`` processes on FSDD (``debug=fast``, a tiny x-vector:
seconds each). A process is killed at a chosen moment by running the recipe through a small
wrapper that patches one function to send the signal (``_WRAPPER``).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amp_utils.tensorboard import session_hparams
from tests.recipe_helpers import FAST, REPO_ROOT, run_command

#: A tiny speaker-ID model: a whole debug run takes a few seconds on 2 CPU cores.
TINY = [*FAST, "model=xvector", "model.channels=32", "model.embedding_dim=16"]

#: ``python WRAPPER SCRIPT ARGS...`` runs ``recipes/SCRIPT`` with ``KILL_AT``
#: (``module:Class.method``) patched to send ``KILL_SIG`` to the process after
#: (``KILL_WHEN=after``) or before its ``KILL_NTH`` call.
_WRAPPER = """
import importlib, os, runpy, signal, sys
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
