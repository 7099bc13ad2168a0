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

from pathlib import Path

import hydra
from omegaconf import DictConfig

from amp_utils.interruption import run_phase
from recipes.config import exit_on_unknown_override_keys
from recipes.experiment import sweep_objective, train
from recipes.resolvers import register_resolvers
from recipes.schema import Config, register_schemas
from recipes.sweep_jobs import resume_hint, run_job

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")
register_resolvers()
register_schemas()


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Hydra entry point; returns the tested checkpoint's validation CER (ASR) or accuracy
    (speaker ID), the value a sweeper such as Optuna optimises (``hparams_search=...``).

    In a ``-m`` sweep a job that fails (bad input, a diverged loss, a bug) ends alone: its
    folder keeps the error, the sweep goes on with the other jobs, the summary lists it as
    failed and the sweep exits with status 1; a sweeper gets the worst value for its
    direction (``sweep_jobs.failed_job_value``), and the search goes on.
    """
    return run_job(lambda: sweep_objective(cfg, train(cfg)))


if __name__ == "__main__":
    # a key typo, or a key of another option: one line naming the fix
    exit_on_unknown_override_keys(Config, config_name="config")
    # SIGTERM/SIGINT end the command with one line saying what they interrupted and how to
    # resume, from here to the sweep's summary (in the epochs: after a checkpoint).
    with run_phase("starting the run", hint=resume_hint, install=True):
        main()
