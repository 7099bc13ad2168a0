"""Helpers of the recipe tests: compose the real config, run the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from recipes.resolvers import register_resolvers
from recipes.schema import register_schemas

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"

#: Small, CPU-only, quick: a couple of batches, a couple of epochs, no progress bars
#: (``conf/debug/fast.yaml``, which users can run too).
FAST = ["debug=fast"]


#: data=manifest over FSDD files (8 kHz), for tests that write their own manifests.
MANIFEST_8K = [
    "data=manifest",
    "data.sample_rate=8000",
    "data.features.n_fft=256",
    "data.features.win_length=200",
    "data.features.hop_length=80",
]


def manifest_config(manifests: dict[str, Path], output_dir: Path, *extra: str) -> DictConfig:
    """The fast config over the given train/valid/test manifests."""
    return compose_config(
        [
            *FAST,
            *MANIFEST_8K,
            *(f"data.{s}={p}" for s, p in manifests.items()),
            f"output_dir={output_dir}",
            *extra,
        ]
    )


def compose_config(overrides: list[str]) -> DictConfig:
    """The real composed config with ``overrides`` (as ``recipes/train.py`` would get it)."""
    register_resolvers()
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def recipe_command(
    script: str, args: list[str], nproc: int = 1, torchrun: bool | None = None
) -> list[str]:
    """``recipes/<script>`` in one process, or under torchrun (default: if ``nproc`` > 1)."""
    launcher = [sys.executable]
    if torchrun or (torchrun is None and nproc > 1):
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, str(REPO_ROOT / "recipes" / script), *args]


def run_command(command: list[str], env: dict[str, str], timeout: int = 600):
    """Run ``command`` from the repo root to its end, capturing its output as text."""
    return subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def run_cli(script: str, args: list[str], fsdd_root: Path, timeout: int = 600):
    """Run ``recipes/<script>`` in a subprocess from the repo root; returns the result."""
    env = {**os.environ, "FSDD_ROOT": str(fsdd_root), "PYTHONUNBUFFERED": "1"}
    return run_command(recipe_command(script, args), env, timeout)


def run_recipe(script: str, tmp_path: Path, fsdd_root: Path, *overrides: str) -> Path:
    """Run ``recipes/<script>`` with ``overrides`` into ``tmp_path/run`` (manifests prepared
    into ``tmp_path/prepared``); checks that it succeeded and returns the run folder."""
    run = tmp_path / "run"
    args = [*overrides, f"data.prepared_dir={tmp_path / 'prepared'}", f"hydra.run.dir={run}"]
    result = run_cli(script, args, fsdd_root)
    assert result.returncode == 0, result.stderr[-3000:]
    return run
