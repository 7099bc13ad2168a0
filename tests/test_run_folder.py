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
from recipes import run_folder, sweep_jobs
from recipes.run_overrides import RUN_OVERRIDES_FILE
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
    config = _multirun_job_config(sweep, "0")
    config.hydra.job.num = 0
    HydraConfig.instance().set_config(config)
    status_file = sweep / "0" / JOB_STATUS_FILE
    seen = []

    def job() -> float:
        seen.append(json.loads(status_file.read_text())["status"])
        return 0.25

    assert sweep_jobs.run_job(job) == 0.25
    assert seen == ["running"]
    assert json.loads(status_file.read_text()) == {
        "multirun": "this",
        "job": 0,  # its number in the multirun: the folder is this job's (sweep_job_folder)
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


def _sweep_job(sweep: Path, num: int, overrides: list[str]):
    """Hydra's config of job ``num`` of a ``-m`` sweep into ``sweep`` with ``overrides``
    (the swept key is ``precision``), before its folder is chosen."""
    from omegaconf import open_dict, read_write

    cfg = _multirun_job_config(sweep, "unused")
    excluded = set(cfg.hydra.job.config.override_dirname.exclude_keys)
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.job.num = num
        cfg.hydra.overrides.task = overrides
        named = [o for o in overrides if o.partition("=")[0] not in excluded]
        cfg.hydra.job.override_dirname = ",".join(named)  # as Hydra makes it
    return cfg


def _job_folder(sweep: Path, num: int, overrides: list[str]) -> str:
    """The folder ``conf/config.yaml``'s ``hydra.sweep.subdir`` gives the job: what Hydra's
    ``run_job`` resolves in the job's process."""
    return str(OmegaConf.select(_sweep_job(sweep, num, overrides), "hydra.sweep.subdir"))


def _finished_job(sweep: Path, folder: str, overrides: list[str], multirun: str, num: int):
    """A job folder as a finished sweep job of ``multirun`` leaves it."""
    job = sweep / folder
    (job / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job / ".hydra" / "overrides.yaml")
    OmegaConf.save(OmegaConf.create(overrides), job / RUN_OVERRIDES_FILE)
    record = {"multirun": multirun, "job": num, "status": "finished", "error": None}
    (job / JOB_STATUS_FILE).write_text(json.dumps(record))


def test_a_sweep_job_goes_into_the_folder_of_its_overrides(tmp_path: Path, monkeypatch) -> None:
    """``-m precision=fp32,bf16`` then ``-m precision=fp16,bf16,fp32`` into one sweep folder:
    Hydra numbered the jobs by their place in the command, so fp32 and bf16 got new folders
    (``1_precision=bf16`` over fp32's number 1... ) and trained again. Each goes into the
    folder its overrides recorded (``.hydra/overrides.yaml`` of a job refused before its
    run was accepted counts too); fp16 gets a number no other folder has; the choice is
    the same when resolved again, and it is taken (``job_status.json``) at once."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    _finished_job(sweep, "0_precision=fp32", ["precision=fp32"], "earlier", 0)
    _finished_job(sweep, "1_precision=bf16", ["precision=bf16", "model.lr=1e-3"], "earlier", 1)
    (sweep / "1_precision=bf16" / RUN_OVERRIDES_FILE).unlink()  # refused early
    monkeypatch.setenv(MULTIRUN_ID_ENV, "now")
    (sweep / "multirun.yaml").write_text("hydra:\n  overrides:\n    task: [precision=a,b]\n")

    assert _job_folder(sweep, 0, ["precision=fp16"]) == "2_precision=fp16"
    assert json.loads((sweep / "2_precision=fp16" / JOB_STATUS_FILE).read_text())["job"] == 0
    assert _job_folder(sweep, 1, ["precision=bf16", "model.lr=0.001"]) == "1_precision=bf16"
    assert _job_folder(sweep, 2, ["precision=fp32"]) == "0_precision=fp32"
    assert _job_folder(sweep, 0, ["precision=fp16"]) == "2_precision=fp16"  # again: the same
    sweep_jobs._chosen_job_folders.clear()  # another process of the job (a DDP rank)
    assert _job_folder(sweep, 0, ["precision=fp16"]) == "2_precision=fp16"
    assert _job_folder(sweep, 3, ["precision=bf16"]) == "3_precision=bf16"  # other overrides
    outside = _sweep_job(sweep, 0, ["precision=fp32"])
    outside.hydra.mode = None  # --cfg hydra --resolve: no choice, nothing written
    assert OmegaConf.select(outside, "hydra.sweep.subdir") == "0_precision=fp32"


def test_sweep_jobs_of_one_multirun_never_share_a_folder(tmp_path: Path, monkeypatch) -> None:
    """``-m trainer.epochs=1,2`` varies a key a run may change and stay the same run: both
    jobs' overrides fit one folder, and the second job extended the first one's run over
    its results. A folder another job of this multirun took is left to it; a later sweep
    gives each job the folder of its exact overrides, and one with more epochs extends the
    folder of its number."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    monkeypatch.setenv(MULTIRUN_ID_ENV, "first")
    assert _job_folder(sweep, 0, ["trainer.epochs=1"]) == "0_default"  # epochs: not named
    _finished_job(sweep, "0_default", ["trainer.epochs=1"], "first", 0)
    assert _job_folder(sweep, 1, ["trainer.epochs=2"]) == "1_default"
    _finished_job(sweep, "1_default", ["trainer.epochs=2"], "first", 1)

    monkeypatch.setenv(MULTIRUN_ID_ENV, "second")
    assert _job_folder(sweep, 0, ["trainer.epochs=2"]) == "1_default"
    assert _job_folder(sweep, 1, ["trainer.epochs=1"]) == "0_default"
    monkeypatch.setenv(MULTIRUN_ID_ENV, "third")
    assert _job_folder(sweep, 1, ["trainer.epochs=3"]) == "1_default"


def test_sweep_jobs_started_side_by_side_take_new_folders_of_their_own(
    tmp_path: Path, monkeypatch
) -> None:
    """Jobs of a sweep that run at the same time (submitit, joblib) each pick a new folder
    whose number no folder has: without the lock on the sweep folder both jobs saw the same
    free number and took it (``2_precision=fp16`` and ``2_precision=bf16``)."""
    import threading
    import time

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    monkeypatch.setenv(MULTIRUN_ID_ENV, "now")
    for num, precision in enumerate(["fp32", "fp64"]):
        _finished_job(sweep, f"{num}_precision={precision}", [f"precision={precision}"], "x", num)
    choose = sweep_jobs.choose_sweep_job_folder

    def slow_choice(*args: Any) -> str:
        folder = choose(*args)
        time.sleep(0.5)  # the other job looks meanwhile
        return folder

    monkeypatch.setattr(sweep_jobs, "choose_sweep_job_folder", slow_choice)
    jobs = {0: ["precision=fp16"], 1: ["precision=bf16"]}
    configs = {num: _sweep_job(sweep, num, overrides) for num, overrides in jobs.items()}
    chosen: dict[int, str] = {}
    start = threading.Barrier(len(jobs))

    def resolve(num: int) -> None:
        start.wait()
        chosen[num] = str(OmegaConf.select(configs[num], "hydra.sweep.subdir"))

    threads = [threading.Thread(target=resolve, args=(num,)) for num in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    numbers = sorted(name.partition("_")[0] for name in chosen.values())
    assert numbers == ["2", "3"], chosen
