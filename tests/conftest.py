"""Shared fixtures: where the real FSDD copy lives, and the CUDA skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def fsdd_path() -> Path:
    """FSDD root for tests: $FSDD_ROOT, else ../shared/datasets/fsdd beside the repo."""
    return Path(os.environ.get("FSDD_ROOT", REPO_ROOT.parent / "shared" / "datasets" / "fsdd"))


@pytest.fixture(scope="session")
def fsdd_root() -> Path:
    root = fsdd_path()
    if not (root / "recordings").is_dir() and not root.glob("*.wav"):
        pytest.skip(f"FSDD not found at {root}; set FSDD_ROOT")
    return root


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
