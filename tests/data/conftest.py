"""Fixtures for the data tests: FSDD utterances and small generated data sets.

``fsdd_root`` and ``fsdd_recordings`` come from ``tests/conftest.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from data.connected_digits import (
    ConnectedUtterance,
    RecordingBank,
    load_connected_digits,
    plan_sources,
    prepare_connected_digits,
)
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
    """Plans of a small connected-digit set, prepared once per session."""
    out_dir = tmp_path_factory.mktemp("connected")
    return prepare_connected_digits(
        fsdd_root, out_dir, num_utterances=small_num_utterances, download=False
    )


@pytest.fixture(scope="session")
def small_connected_plans(
    small_connected: dict[str, Path], fsdd_root: Path
) -> dict[str, list[ConnectedUtterance]]:
    """The small set's plans per split, read and checked as before training."""
    splits, skipped, _ = load_connected_digits(small_connected, fsdd_root, skip_bad_files=False)
    assert not skipped
    return splits


@pytest.fixture(scope="session")
def small_bank(
    small_connected_plans: dict[str, list[ConnectedUtterance]], fsdd_recordings: Path
) -> RecordingBank:
    """The source recordings of the small set, in memory at 8 kHz."""
    used = plan_sources(utt for plans in small_connected_plans.values() for utt in plans)
    return RecordingBank.load(fsdd_recordings, used, 8000)
