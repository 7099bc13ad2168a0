"""Fixtures for the data tests: FSDD utterances and small generated data sets.

``fsdd_root`` and ``fsdd_recordings`` come from ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from data.connected_digits import prepare_connected_digits
from data.fsdd import fsdd_utterances
from data.manifest import Utterance


@pytest.fixture(scope="session")
def fsdd_utts(fsdd_recordings: Path) -> list[Utterance]:
    """All 3000 FSDD utterances (read once per session)."""
    return fsdd_utterances(fsdd_recordings)


@pytest.fixture(scope="session")
def small_num_utterances() -> dict[str, int]:
    """Utterances per split of the small connected-digit set (small keeps tests fast)."""
    return {"train": 20, "valid": 5, "test": 5}


@pytest.fixture(scope="session")
def small_connected(
    fsdd_root: Path, small_num_utterances: dict[str, int], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Manifests of a small connected-digit set, built once per session."""
    out_dir = tmp_path_factory.mktemp("connected")
    return prepare_connected_digits(
        fsdd_root, out_dir, num_utterances=small_num_utterances, download=False
    )
