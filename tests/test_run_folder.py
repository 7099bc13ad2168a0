"""A run folder's record (``recipes/run_folder.py``): nothing of an earlier session lost,
and a sweep job's status says finished only once it has."""

from __future__ import annotations

import errno
import io
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from amp_utils.sweep_summary import JOB_STATUS_FILE, MULTIRUN_ID_ENV
from recipes import run_folder
from tests.test_sweep_summary import _multirun_job_config


def test_accepting_a_resumed_run_keeps_its_log_and_the_lines_logged_before(
    tmp_path: Path, monkeypatch
) -> None:
    """A single run resumed (or extended) into its folder: ``RunFolder.accept`` starts the
    log file Hydra's writes were taken from. It must append to the earlier sessions'
    ``train.log`` (not start it anew) and write first the lines logged while the run was
    not yet accepted (data preparation, the resume)."""
    run_dir = (tmp_path / "run").absolute()
    run_dir.mkdir()
    log_file = run_dir / "train.log"
    log_file.write_text("session 1: epoch 1 done\n")
    taken = run_folder._TakenOver(run_dir, run_dir, None, [(str(log_file), "%(message)s")])
    monkeypatch.setattr(run_folder, "_taken_over", taken)
    logger = logging.getLogger("tests.test_run_folder")
    logger.setLevel(logging.INFO)  # a logger of this test only
    root = logging.getLogger()
    handlers = list(root.handlers)
    try:
        folder = run_folder.RunFolder(run_dir)
        logger.info("session 2: data read")
        assert log_file.read_text() == "session 1: epoch 1 done\n"  # not accepted yet
        folder.accept(OmegaConf.create({}), write_files=False)
        logger.info("session 2: epoch 2 done")
    finally:
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
            handler.close()
    assert log_file.read_text().splitlines() == [
        "session 1: epoch 1 done",
        "session 2: data read",
        "session 2: epoch 2 done",
    ]


def test_a_sweep_job_is_recorded_finished_only_once_it_has_finished(
    tmp_path: Path, monkeypatch
) -> None:
    """While the job trains its ``job_status.json`` says ``running``: a job killed then is
    listed as failed, never with an earlier attempt's ``results.json`` as this one's."""
    sweep = tmp_path / "sweep"
    monkeypatch.setenv(MULTIRUN_ID_ENV, "this")
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)  # restored
    HydraConfig.instance().set_config(_multirun_job_config(sweep, "0"))
    status_file = sweep / "0" / JOB_STATUS_FILE
    seen = []

    def job() -> float:
        seen.append(json.loads(status_file.read_text())["status"])
        return 0.25

    assert run_folder.run_job(job) == 0.25
    assert seen == ["running"]
    assert json.loads(status_file.read_text()) == {
        "multirun": "this",
        "status": "finished",
        "error": None,
    }


@pytest.mark.parametrize("failing", ["config_resolved.yaml", ".hydra/hydra.yaml"])
def test_a_resumed_run_that_cannot_write_its_config_record_keeps_the_earlier_one(
    tmp_path: Path, monkeypatch, failing: str
) -> None:
    """A resumed (or extended) run rewrites ``config_resolved.yaml`` and ``.hydra/*.yaml``
    when it is accepted. Written in place, a full disk (or a kill) in the write left the
    file truncated: the run's record of its config, which ``evaluate.py`` reads, was lost
    although the run had trained with it. Each file is replaced whole or not at all."""
    run_dir = (tmp_path / "run").absolute()
    earlier = {}
    for name in ("config_resolved.yaml", ".hydra/config.yaml", ".hydra/hydra.yaml"):
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        earlier[name] = f"# the first session's {name}\n" + "trainer:\n  epochs: 2\n" * 50
        (run_dir / name).write_text(earlier[name])
    taken = run_folder._TakenOver(run_dir, run_dir, ".hydra", [])
    monkeypatch.setattr(run_folder, "_taken_over", taken)
    monkeypatch.setattr(HydraConfig.instance(), "cfg", HydraConfig.instance().cfg)  # restored
    HydraConfig.instance().set_config(_multirun_job_config(tmp_path, "run"))
    real_open = io.open

    class FullDisk:  # writes half of what it is given, then the disk is full
        def __init__(self, handle: Any) -> None:
            self.handle = handle

        def write(self, data: Any) -> int:
            self.handle.write(data[: len(data) // 2])
            self.handle.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.close()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.handle, name)

    def full_disk_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        target = Path(os.fspath(file)).absolute()
        written = ("w" in mode or "a" in mode) and target.parent == (run_dir / failing).parent
        is_failing = target.name == Path(failing).name or target.name.startswith(
            f".{Path(failing).name}."  # an atomic write's temporary file
        )
        return FullDisk(handle) if written and is_failing else handle

    monkeypatch.setattr(io, "open", full_disk_open)
    with pytest.raises(OSError):
        run_folder.RunFolder(run_dir).accept(OmegaConf.create({"trainer": {"epochs": 3}}))
    monkeypatch.undo()
    assert (run_dir / failing).read_text() == earlier[failing]
