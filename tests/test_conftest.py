"""The test suite itself: without FSDD, data tests skip for users and fail under CI."""

from __future__ import annotations

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
