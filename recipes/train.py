"""Train a speech model under the chosen precision.

    python recipes/train.py                                   # ASR on FSDD, fp32, best device
    python recipes/train.py precision=bf16 device=cuda        # bf16 autocast on the GPU
    python recipes/train.py model=xvector                     # speaker identification
    python recipes/train.py -m precision=fp32,fp16,bf16       # sweep + comparison table
    torchrun --nproc_per_node=4 recipes/train.py device=cuda  # DDP on 4 GPUs
    python recipes/train.py -m hydra/launcher=slurm precision=fp32,fp16,bf16  # on SLURM

Re-running the same command resumes from the run folder's latest checkpoint.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from amp_utils import (
    CheckpointError,
    DeviceNotAvailableError,
    DistributedConfigError,
    NonFiniteLossError,
    PrecisionNotSupportedError,
)
from data.errors import DataError
from recipes.config import ConfigError, register_resolvers
from recipes.experiment import train

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")
USER_ERRORS = (
    ConfigError,
    DataError,
    CheckpointError,
    NonFiniteLossError,
    PrecisionNotSupportedError,
    DeviceNotAvailableError,
    DistributedConfigError,
)

log = logging.getLogger(__name__)
register_resolvers()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the test loss (for sweepers that optimise it)."""
    try:
        results = train(cfg)
    except USER_ERRORS as err:  # bad input: one line, no traceback
        log.error("%s: %s", type(err).__name__, err)
        sys.exit(f"error: {err}")
    return results["test_metrics"]["loss"]


if __name__ == "__main__":
    main()
