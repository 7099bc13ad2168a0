"""TensorBoard in headless Chromium on a finished debug sweep (slow; issue 12).

Runs ``benchmarks/tensorboard_check.py``: both runs and their precision must be visible on
the Time Series and HParams dashboards without clicking. Selenium is not a project
dependency: set ``SELENIUM_PYTHON`` to an interpreter that has it (e.g.
``/tmp/selvenv/bin/python``); without it, or without Chromium, the test is skipped.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _selenium_python() -> str | None:
    """An interpreter that can import selenium, or None."""
    for python in (os.environ.get("SELENIUM_PYTHON"), sys.executable):
        if (
            python
            and subprocess.run([python, "-c", "import selenium"], check=False).returncode == 0
        ):
            return python
    return None


@pytest.mark.slow
def test_tensorboard_shows_both_precisions_without_clicking(tmp_path: Path, fsdd_root) -> None:
    """The check script passes on a fresh ``precision=fp32,bf16`` debug sweep."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    python = _selenium_python()
    if python is None:
        pytest.skip("needs selenium: set SELENIUM_PYTHON to an interpreter that has it")
    result = subprocess.run(
        [python, "benchmarks/tensorboard_check.py", "--python", sys.executable]
        + ["--out", str(tmp_path / "screenshots")],
        cwd=ROOT,
        env={**os.environ, "FSDD_ROOT": str(fsdd_root), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "screenshots" / "hparams.png").stat().st_size > 0
