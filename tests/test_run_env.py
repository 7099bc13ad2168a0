"""Tests of env.txt writing and the atomic file helpers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from amp_utils.atomic import atomic_write_json, atomic_write_text
from amp_utils.run_env import write_env_file


def test_write_env_file(tmp_path: Path) -> None:
    path = tmp_path / "run" / "env.txt"
    write_env_file(path)
    text = path.read_text()
    for expected in ("date:", "python:", "torch:", "torchaudio:", "hydra:", "cuda available:"):
        assert expected in text
    assert "git revision:" in text and "pip freeze:" in text
    assert "torch==" in text  # the package list made it in (pip or the metadata fallback)
    assert [p.name for p in path.parent.iterdir()] == ["env.txt"]  # no temporary file left


def test_atomic_write_replaces_and_keeps_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    atomic_write_json(path, {"x": 1})
    atomic_write_json(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2}
    atomic_write_text(tmp_path / "b.txt", "hello")
    assert (tmp_path / "b.txt").read_text() == "hello"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.txt"]


def test_atomic_write_failure_names_path_and_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    atomic_write_text(path, "old")
    with pytest.raises(TypeError, match="a.json"):
        atomic_write_json(path, {"x": object()})
    with pytest.raises(OSError, match="a.json"):
        atomic_write_text(path, "\udcff")  # lone surrogate: cannot be encoded as UTF-8
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]
