"""Shared library of the recipes: precision, the training loop, checkpoints and logging."""

from amp_utils.autocast import PRECISIONS, AMPConfig, TorchAutocast, fwd_default_precision
from amp_utils.brain import Brain, NonFiniteLossError, Stage, TrainingInterrupted
from amp_utils.checkpoint import Checkpoint, Checkpointer, CheckpointError
from amp_utils.distributed import (
    DistributedConfigError,
    DistributedInfo,
    ddp_barrier,
    if_main_process,
    run_on_main,
)
from amp_utils.epoch_counter import EpochCounter
from amp_utils.host_reads import HostReads
from amp_utils.precision import (
    DeviceNotAvailableError,
    PrecisionNotSupportedError,
    resolve_device,
)
from amp_utils.run_options import RunOptions
from amp_utils.step_graphs import StepGraphs

__all__ = [
    "PRECISIONS",
    "AMPConfig",
    "Brain",
    "Checkpoint",
    "CheckpointError",
    "DeviceNotAvailableError",
    "DistributedConfigError",
    "DistributedInfo",
    "Checkpointer",
    "EpochCounter",
    "HostReads",
    "NonFiniteLossError",
    "PrecisionNotSupportedError",
    "RunOptions",
    "Stage",
    "StepGraphs",
    "TorchAutocast",
    "TrainingInterrupted",
    "ddp_barrier",
    "if_main_process",
    "fwd_default_precision",
    "resolve_device",
    "run_on_main",
]
