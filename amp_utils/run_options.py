"""Run options of the training loop, as a typed dataclass (SpeechBrain's ``run_opts``).

Recipes fill them from the Hydra ``trainer``/``precision``/``device`` nodes; plain dicts work
too. Unknown keys fail early with a message that lists the valid ones, so a typo never
silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from amp_utils.distributed import BACKENDS

logger = logging.getLogger(__name__)

#: ``checkpoint_writes``: where a checkpoint is written (``Checkpointer.background_writes``).
CHECKPOINT_WRITES = ("auto", "background", "foreground")


@dataclass
class RunOptions:
    """Options that control the loop, with the defaults a run gets when a key is absent."""

    device: str = "cpu"  # "auto", "cpu", "cuda" or "cuda:N"
    precision: str = "fp32"  # training autocast precision: fp32, fp16, bf16 or auto
    eval_precision: str = "fp32"  # validation/test autocast precision (auto: as precision=auto)
    max_grad_norm: float = 5.0  # clip the global gradient norm (all param groups); <= 0: off
    grad_accumulation_factor: int = 1  # batches per optimizer step
    skip_nonfinite_grads: bool = False  # skip (do not apply) steps whose gradients are not finite
    nonfinite_patience: int = 3  # consecutive non-finite losses tolerated before stopping
    noprogressbar: bool = False  # hide the tqdm progress bars
    ckpt_interval_minutes: float = 0.0  # intra-epoch checkpoint every N minutes (0: off)
    ckpt_interval_steps: int = 0  # intra-epoch checkpoint every N optimizer steps (0: off)
    stall_warning_minutes: float = 10.0  # no batch for N minutes: warn with the stack (0: off)
    prefetch_next_epoch: bool = True  # load the next epoch's first batches before it starts
    checkpoint_writes: str = "auto"  # auto (background on CUDA), background or foreground
    debug: bool = False  # run only a few batches and epochs
    debug_batches: int = 2  # batches per stage in debug mode
    debug_epochs: int = 2  # epochs in debug mode
    compile: bool = False  # wrap modules with torch.compile
    compile_module_keys: list[str] | None = None  # modules to compile (None: all)
    compile_mode: str = "default"  # torch.compile mode
    compile_backend: str = "inductor"  # torch.compile backend (aot_eager: no code generation)
    compile_regions: bool = False  # compile each ModuleList block (one compile for all) in place
    compile_eval: bool = False  # also run validation/test compiled (else eagerly: no capture)
    graph_step: bool = False  # capture each batch shape's whole training step as a CUDA graph
    graph_step_warmup: int = 2  # eager steps of the first batch shape before its capture
    graph_step_later_warmup: int | None = None  # of each later shape (None: 1; with compile 2)
    graph_step_max_shapes: int = 64  # batch shapes captured at most (later ones run eagerly)
    graph_eval: bool = True  # with graph_step: validation's forward passes as CUDA graphs too
    log_interval_steps: int = 10  # per-step scalars (loss, lr, grad norm, scale) every N steps
    allow_tf32: bool = False  # let fp32 matmuls/convs use TF32 on Ampere+ GPUs
    fused_weight_casts: bool = True  # autocast's weight casts once per step, together (same values)
    onednn_cache_capacity: int | None = None  # CPU kernels oneDNN keeps (None: its own 1024)
    seed: int = 1234  # seed of the data loader's own generator
    distributed_backend: str = "auto"  # DDP backend: auto (nccl on CUDA, gloo on CPU), nccl, gloo
    sync_batchnorm: bool = False  # under DDP, BatchNorm statistics over all ranks (CUDA only)
    find_unused_parameters: bool = False  # DDP: allow parameters without gradients in a step

    @classmethod
    def from_dict(
        cls,
        options: Mapping[str, Any] | RunOptions | None,
        hparams: Mapping[str, Any] | None = None,
    ) -> RunOptions:
        """Build from a mapping, rejecting unknown keys with a message naming the valid ones.

        An option that ``options`` (a mapping) leaves out is taken from ``hparams`` when it
        holds that key, as SpeechBrain's ``Brain`` does: its recipes set ``precision``,
        ``max_grad_norm`` or ``grad_accumulation_factor`` in their hparams YAML. Each such
        option is logged. A ``RunOptions`` instance is complete and taken as it is.
        """
        if isinstance(options, RunOptions):
            return dataclasses.replace(options)
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"Unknown run option(s) {unknown}; valid options are: {', '.join(valid)}."
            )
        for name in valid:
            if name not in options and hparams is not None and name in hparams:
                options[name] = hparams[name]
                logger.info("Run option %s=%r comes from hparams.", name, hparams[name])
        opts = cls(**options)
        opts.validate()
        return opts

    def validate(self) -> None:
        """Check value ranges; raises ValueError naming the option and the fix."""
        if self.grad_accumulation_factor < 1:
            raise ValueError(
                f"grad_accumulation_factor must be >= 1, got {self.grad_accumulation_factor}."
            )
        if self.nonfinite_patience < 0:
            raise ValueError(f"nonfinite_patience must be >= 0, got {self.nonfinite_patience}.")
        if self.debug and (self.debug_batches < 1 or self.debug_epochs < 1):
            raise ValueError("debug_batches and debug_epochs must be >= 1 in debug mode.")
        if self.onednn_cache_capacity is not None and self.onednn_cache_capacity < 0:
            raise ValueError(
                f"onednn_cache_capacity must be >= 0 (0: no cache) or None (oneDNN's own "
                f"default), got {self.onednn_cache_capacity}."
            )
        if self.checkpoint_writes not in CHECKPOINT_WRITES:
            raise ValueError(
                f"checkpoint_writes must be one of {', '.join(CHECKPOINT_WRITES)}; "
                f"got {self.checkpoint_writes!r}."
            )
        if self.distributed_backend not in BACKENDS:
            raise ValueError(
                f"distributed_backend must be one of {', '.join(BACKENDS)}; "
                f"got {self.distributed_backend!r}."
            )
        later = self.graph_step_later_warmup
        if self.graph_step_warmup < 1 or self.graph_step_max_shapes < 1 or (later or 1) < 1:
            raise ValueError(
                "graph_step_warmup, graph_step_later_warmup and graph_step_max_shapes must be "
                f">= 1, got {self.graph_step_warmup}, {later} and {self.graph_step_max_shapes}."
            )
        if self.log_interval_steps < 1:
            raise ValueError(f"log_interval_steps must be >= 1, got {self.log_interval_steps}.")
