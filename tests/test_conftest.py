"""The test suite itself: without FSDD, data tests skip for users and fail under CI."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

from tests.recipe_helpers import REPO_ROOT

DATA_TEST = "tests/test_recipes.py::test_speaker_id_run_reports_accuracy"


def run_pytest_without_data(tmp_path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["FSDD_ROOT"] = str(tmp_path / "no_fsdd_here")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", DATA_TEST],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_data_the_data_tests_are_skipped(tmp_path):
    result = run_pytest_without_data(tmp_path, ci=None)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "1 skipped" in result.stdout and "FSDD_ROOT=PATH" in result.stdout


def test_under_ci_missing_data_fails_instead_of_skipping(tmp_path):
    result = run_pytest_without_data(tmp_path, ci="true")
    assert result.returncode != 0
    assert "CI=true: FSDD recordings not found" in result.stdout
    assert "skipped" not in result.stdout


def _tests_that_need_a_gpu() -> list[tuple[str, str, bool]]:
    """(file, test, carries the gpu marker) for each test that takes ``cuda_device``
    or counts the GPUs: read from the test files' syntax trees, so no GPU is needed."""
    found = []
    for path in sorted((REPO_ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
                continue
            body = ast.get_source_segment(source, node) or ""
            takes = {arg.arg for arg in node.args.args}
            if "cuda_device" in takes or "torch.cuda.device_count()" in body:
                marked = any(ast.unparse(d) == "pytest.mark.gpu" for d in node.decorator_list)
                found.append((path.name, node.name, marked))
    return found


def test_every_test_that_needs_a_gpu_carries_the_gpu_marker():
    """CI has no GPU and deselects ``gpu``; an unmarked CUDA test fails there (the nccl
    DDP test lost its marker once and failed CI with torchrun --nproc-per-node 0)."""
    found = _tests_that_need_a_gpu()
    assert len(found) >= 8, found  # the scan sees the CUDA tests
    assert [(f, t) for f, t, marked in found if not marked] == []


def test_a_test_may_set_hydras_global_config():
    """The first of two: it leaves a job's config in Hydra's global singleton."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    HydraConfig.instance().cfg = OmegaConf.create({"hydra": {"job": {"name": "left_behind"}}})
    assert HydraConfig.initialized() and HydraConfig.get().job.name == "left_behind"


def test_the_next_test_starts_without_it():
    """The second: the config of the test before it is gone (in the same xdist worker:
    ``--dist loadfile`` keeps a file in one), so no test passes or fails by which ran first."""
    from hydra.core.hydra_config import HydraConfig

    assert not HydraConfig.initialized()
