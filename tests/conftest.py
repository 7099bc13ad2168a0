"""Shared fixtures: the real FSDD copy (never downloaded), composed configs, CUDA skips.

FSDD is found through the environment variable FSDD_ROOT, else at
``<repo>/../shared/datasets/fsdd`` (CI clones the repo with ``shared/`` beside it). Without
it the tests that need it are skipped, except under CI (``CI=true``), where a missing copy
fails them: a CI run must not pass by skipping its end-to-end tests.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from data.fsdd import find_fsdd_recordings

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FSDD_ROOT = REPO_ROOT / ".." / "shared" / "datasets" / "fsdd"


def running_in_ci() -> bool:
    """Whether the environment says this is a CI run (``CI=true``, as CI services set)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def fsdd_root() -> Path:
    """Folder holding FSDD's ``recordings/``; skips the test if it is absent."""
    root = Path(os.environ.get("FSDD_ROOT", DEFAULT_FSDD_ROOT)).resolve()
    if find_fsdd_recordings(root) is None:
        message = (
            f"FSDD recordings not found under {root}; set FSDD_ROOT=PATH to a folder "
            "holding FSDD v1.0.10's recordings/ to run this test."
        )
        if running_in_ci():
            pytest.fail(f"CI=true: {message}", pytrace=False)
        pytest.skip(message)
    return root


@pytest.fixture(scope="session")
def fsdd_recordings(fsdd_root: Path) -> Path:
    """FSDD's recordings folder."""
    recordings = find_fsdd_recordings(fsdd_root)
    assert recordings is not None
    return recordings


@pytest.fixture(autouse=True)
def _hydra_config_reset() -> Iterator[None]:
    """Each test starts and ends without a global Hydra config.

    ``HydraConfig.instance().set_config`` (a test standing in for a job) lives on in the
    xdist worker: later tests' ``hydra_task_overrides()`` and ``in_single_process_sweep()``
    then read that job's config, and pass or fail by which files the worker ran before.
    """
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().cfg = None
    yield
    HydraConfig.instance().cfg = None


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def pytest_collection_modifyitems(config, items):
    """Skip GPU tests cleanly when there is no CUDA, even when selected with -m gpu."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
