"""Cluster launchers through hydra-submitit-launcher: submitit_local runs, slurm composes.

``hydra/launcher=submitit_local`` really runs here (each job in its own process, also
as a 2-task DDP job, which is how a multi-GPU SLURM job starts); ``hydra/launcher=slurm``
cannot run without a cluster, so its config is turned into the sbatch script submitit
would submit, and the script is checked.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.utils import instantiate

from recipes.resolvers import register_resolvers
from recipes.schema import register_schemas
from tests.recipe_helpers import CONF_DIR, FAST, run_cli
from tests.test_recipes import prepared_digits  # noqa: F401 - session fixture

submitit = pytest.importorskip("submitit")  # a core dependency; absent on bare GPU hosts


def summary_rows(sweep: Path) -> list[dict[str, str]]:
    with open(sweep / "summary.csv", newline="") as file:
        return list(csv.DictReader(file))


def run_local_sweep(sweep: Path, fsdd_root: Path, prepared: Path, *extra: str):
    result = run_cli(
        "train.py",
        [
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=10",
            *FAST,
            "trainer.debug_epochs=1",
            f"data.prepared_dir={prepared}",
            f"hydra.sweep.dir={sweep}",
            *extra,
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_submitit_local_sweep_runs_jobs_and_writes_summary(
    tmp_path,
    fsdd_root,
    prepared_digits,  # noqa: F811
):
    sweep = tmp_path / "sweep"
    result = run_local_sweep(sweep, fsdd_root, prepared_digits, "precision=fp32,bf16")
    rows = summary_rows(sweep)
    assert [r["precision"] for r in rows] == ["fp32", "bf16"]
    assert all(r["status"] == "ok" and r["processes"] == "1" for r in rows)
    assert rows[0]["speed-up vs fp32"] == "1.00x" and rows[1]["speed-up vs fp32"].endswith("x")
    assert "speed-up vs fp32" in result.stdout + result.stderr  # printed at the end
    job_logs = list((sweep / ".submitit").rglob("*_log.out"))
    assert len(job_logs) == 2  # each job ran in its own submitit process


def test_submitit_job_with_two_tasks_trains_with_ddp(
    tmp_path,
    fsdd_root,
    prepared_digits,  # noqa: F811
):
    sweep = tmp_path / "sweep"
    run_local_sweep(sweep, fsdd_root, prepared_digits, "hydra.launcher.tasks_per_node=2")
    (row,) = summary_rows(sweep)
    assert row["status"] == "ok" and row["processes"] == "2"


@pytest.fixture
def slurm_launcher_config(tmp_path):
    register_resolvers()
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="train"):
        yield compose(
            config_name="config",
            overrides=[
                "hydra/launcher=slurm",
                "hydra.launcher.partition=gpu",
                "hydra.launcher.gpus_per_node=4",
                "hydra.launcher.nodes=2",
                f"hydra.sweep.dir={tmp_path / 'sweep'}",
            ],
            return_hydra_config=True,
        )


def test_slurm_launcher_config_makes_a_valid_sbatch_script(slurm_launcher_config, monkeypatch):
    """The launcher's own code path up to submission, with sbatch replaced by a recorder."""
    scripts: list[str] = []

    class RecordingExecutor(submitit.AutoExecutor):
        def map_array(self, fn, *iterable):
            scripts.append(self._executor._make_submission_file_text("python -u job.py", "0"))
            return []

    monkeypatch.setattr(submitit, "AutoExecutor", RecordingExecutor)
    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", staticmethod(lambda: 1))
    cfg = slurm_launcher_config
    launcher = instantiate(cfg.hydra.launcher)
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    launcher.launch([["precision=fp32"], ["precision=bf16"]], initial_job_idx=0)

    (script,) = scripts
    for option in (
        "--partition=gpu",
        "--nodes=2",
        "--gpus-per-node=4",
        "--ntasks-per-node=4",  # one DDP rank per GPU
        "--cpus-per-task=8",
        "--time=240",
        "--signal=USR2@120",  # submitit requeues on it; the run resumes from its checkpoints
    ):
        assert f"#SBATCH {option}" in script, script
