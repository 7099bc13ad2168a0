"""Log lines of DDP ranks other than 0: tagged with the rank in the run's shared log."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from amp_utils.distributed import DistributedInfo
from recipes import experiment


def test_ranks_other_than_0_tag_their_log_lines_in_the_shared_train_log(monkeypatch, tmp_path):
    """Every rank appends to one train.log. Rank 1's warnings came untagged: a SIGTERM
    caught by both ranks was logged twice, identically, and one caught by rank 1 alone
    read as rank 0's. A log file opened after the process group started (as
    ``RunFolder.accept`` opens train.log) gets the tag too, and a second start (a sweep's
    next job) does not tag twice."""
    monkeypatch.setattr(
        experiment,
        "init_distributed",
        lambda backend, device: DistributedInfo(world_size=2, rank=1, backend="gloo"),
    )
    monkeypatch.setattr(experiment, "_untagged_record_factory", None, raising=False)
    root = logging.getLogger()
    factory, level = logging.getLogRecordFactory(), root.level
    handler = logging.FileHandler(tmp_path / "train.log")
    handler.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    opts = SimpleNamespace(distributed_backend="auto")
    try:
        info = experiment.start_distributed(opts, torch.device("cpu"))
        root.addHandler(handler)
        logging.getLogger("amp_utils.interruption").warning(
            "Received signal %d: checkpointing after this batch.", 15
        )
        logging.getLogger("recipes.experiment").info("rank 0 logs the run, not rank 1")
        experiment.start_distributed(opts, torch.device("cpu"))  # the next job of a sweep
        logging.getLogger("amp_utils.stall_watchdog").warning("No batch has finished")
    finally:
        root.removeHandler(handler)
        handler.close()
        logging.setLogRecordFactory(factory)
        root.setLevel(level)
    assert info.rank == 1
    assert (tmp_path / "train.log").read_text().splitlines() == [
        "[amp_utils.interruption][WARNING] - [rank 1] Received signal 15: checkpointing "
        "after this batch.",
        "[amp_utils.stall_watchdog][WARNING] - [rank 1] No batch has finished",
    ]
    assert logging.makeLogRecord({"msg": "after"}).getMessage() == "after"  # restored


def test_rank_0_logs_untagged(monkeypatch):
    monkeypatch.setattr(
        experiment,
        "init_distributed",
        lambda backend, device: DistributedInfo(world_size=2, rank=0, backend="gloo"),
    )
    factory = logging.getLogRecordFactory()
    experiment.start_distributed(SimpleNamespace(distributed_backend="auto"), torch.device("cpu"))
    assert logging.getLogRecordFactory() is factory
