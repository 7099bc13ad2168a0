"""A rank whose torchrun launcher was killed with ``kill -9`` does not train on orphaned.

torchrun starts each rank in a session of its own, so neither its process group's
SIGKILL nor anything else reaches the ranks once torchrun is gone; they held the run
folder (the same command was refused) and trained on, unseen. ``init_distributed`` arms the
parent-death signal: the ranks get SIGTERM, which the training loop turns into a joint
stop with a checkpoint. Here a stand-in launcher starts one rank as torchrun does (own
session, torchrun's environment) and is killed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.recipe_helpers import REPO_ROOT

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and dist.is_available() and dist.is_gloo_available()),
    reason="needs Linux (prctl) and torch.distributed gloo",
)

#: The rank: joins a 1-process gloo group as a torchrun worker does, then waits.
RANK = """
import os, sys, time
from pathlib import Path
from amp_utils.distributed import init_distributed
init_distributed("gloo", "cpu")
Path(sys.argv[1]).write_text(str(os.getpid()))
time.sleep(120)
"""

#: The launcher: starts the rank in its own session, as torchrun does, and waits.
LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
time.sleep(120)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for a PID 1 that does not reap does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def test_a_rank_gets_sigterm_when_its_torchrun_launcher_is_killed(tmp_path):
    pid_file = tmp_path / "rank.pid"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "TORCHELASTIC_RUN_ID": "test",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
    }
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, RANK, str(pid_file)],
        env=env,
        start_new_session=True,
    )
    rank_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert launcher.poll() is None and time.monotonic() < deadline, "no rank started"
            time.sleep(0.05)
        rank_pid = int(pid_file.read_text())
        os.killpg(launcher.pid, signal.SIGKILL)  # kill -9 of torchrun's process group
        launcher.wait()
        deadline = time.monotonic() + 10
        while _running(rank_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(rank_pid), "the rank trains on without its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if rank_pid is not None and _running(rank_pid):
            os.kill(rank_pid, signal.SIGKILL)
