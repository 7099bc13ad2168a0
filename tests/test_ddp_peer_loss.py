"""A DDP rank whose peer process ended (``kill -9``, the OOM killer, a crash).

Its next collective fails with a gloo connection error; ``run_job`` turns it into one
``error:`` line that names the cause and the resume, also written to the run's log file.
Two real gloo processes (spawned, as torchrun starts them): rank 1 leaves without a word
while rank 0 sums tensors with it.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank(rank: int, port: int, tmp: str) -> None:
    """Rank 1: three sums, then gone. Rank 0: sums until that fails, inside ``run_job``."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
        os._exit(0)  # as a killed process: no goodbye to the group

    from recipes.sweep_jobs import run_job

    log_file = Path(tmp) / "train.log"
    logging.getLogger().addHandler(logging.FileHandler(log_file))

    def job() -> float:
        for _ in range(10_000):  # fails once rank 1 has gone
            dist.all_reduce(torch.ones(4))
        return 0.0

    report: dict = {}
    try:
        run_job(job)
        report["outcome"] = "returned"
    except SystemExit as err:
        report["outcome"] = "exit"
        report["message"] = str(err.code)
    except BaseException:  # the test shows what escaped
        report["outcome"] = "raised"
        report["message"] = traceback.format_exc()
    report["log"] = log_file.read_text()
    (Path(tmp) / "report.json").write_text(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)  # no teardown of a group whose peer is gone


def test_a_rank_whose_peer_ended_stops_with_one_line_saying_to_resume(tmp_path):
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path))) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=120)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["outcome"] == "exit", report
    message = report["message"]
    assert message.startswith("error: Another process of this DDP run ended"), message
    assert "\n" not in message and "Run the same command again to resume" in message
    assert "Another process of this DDP run ended" in report["log"]  # the run's log says why
