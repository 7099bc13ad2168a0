"""``Brain``: the training loop, with the API of SpeechBrain's ``speechbrain.core.Brain``.

A recipe subclasses ``Brain`` and overrides ``compute_forward`` and ``compute_objectives``
(and usually ``on_stage_end`` for metrics and checkpoints). This module holds the hooks and
the fit/evaluate loops; each mechanism they call lives in its own module:

* ``amp_step.py``: scaled backward and the optimizer step (unscale -> clip all parameter
  groups -> skip on the device -> step -> scaler update), ``ScalerState``;
* ``step_ledger.py``: the lagged read-back of step values (running training loss,
  non-finite patience, step counters, per-step TensorBoard scalars);
* ``interruption.py``: SIGTERM/SIGINT and the mid-epoch checkpoint policy;
* ``compile.py``: ``torch.compile`` of whole modules or regions, CUDA-graph modes;
* ``distributed.py``: DDP wrapping, SyncBatchNorm, ``no_sync`` for accumulation;
* ``step_graphs.py``: the whole step captured as a CUDA graph per batch shape
  (``graph_step``), each shape's warm-up checked for host reads by ``host_reads.py``;
  ``brain_graphs.py``: the Brain's side of it, for training steps and validation
  (``GraphedSteps``, a base class of ``Brain``);
* ``train_stats.py``: the run's training totals (time, utterances, audio, data wait),
  restored from checkpoints and summed over DDP ranks;
* ``accumulation_window.py``: an unfinished gradient-accumulation window saved with a
  mid-epoch checkpoint and put back on resume.

Precision rules (learned from SpeechBrain, with its gaps fixed): forward + objectives run
under ``TorchAutocast(device_type=<"cuda"|"cpu">, dtype=...)``; training uses
``precision``, evaluation ``eval_precision``; backward and the optimizer step run outside
autocast; a ``GradScaler`` is enabled only for fp16; the LR scheduler is not stepped when
the step was skipped.

Distributed rules (DDP): the logged loss, its finiteness (so every rank skips the same
steps), evaluation losses and throughput are reduced over the ranks; the decisions to
checkpoint mid-epoch or to stop on a signal are taken together; only rank 0 shows progress
bars and writes checkpoints (``Checkpointer`` is rank-aware).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm  # not tqdm.auto: its asyncio variant creates a second loader iterator

from amp_utils.accumulation_window import (
    optimized_params,
    rank_window,
    restore_window,
    window_state,
)
from amp_utils.amp_step import AMPOptimizerStep, ScalerState
from amp_utils.autocast import AMPConfig, TorchAutocast
from amp_utils.brain_graphs import GraphedSteps
from amp_utils.checkpoint import Checkpoint, Checkpointer, CheckpointError
from amp_utils.compile import compile_modules
from amp_utils.distributed import (
    all_reduce_counts,
    all_reduce_max,
    all_reduce_sum,
    any_rank,
    convert_sync_batchnorm,
    init_distributed,
    no_sync,
    wrap_ddp,
)
from amp_utils.epoch_counter import EpochCounter
from amp_utils.interruption import (
    MidEpochCheckpointPolicy,
    StopSignals,
    TrainingInterrupted,
    interrupted_error,
    run_phase,
)
from amp_utils.loaders import (
    EpochBatches,
    epoch_fingerprint,
    make_loader,
    replays_its_order,
    seeded_generator,
    shut_down_workers,
    start_epoch,
    streams_epochs,
    timed_batches,
)
from amp_utils.memory import peak_memory_mb, release_cached_memory, reset_peak_memory
from amp_utils.precision import (
    AUTO,
    check_precision_supported,
    configure_onednn_cache,
    configure_tf32,
    make_grad_scaler,
    resolve_device,
    resolve_precision,
    warn_if_emulated,
)
from amp_utils.rng_state import capture_rng_state, restore_rng_state
from amp_utils.run_options import RunOptions
from amp_utils.running_mean import RunningMean
from amp_utils.stage import Stage
from amp_utils.stall_watchdog import StallWatchdog
from amp_utils.step_graphs import CapturableOptimizers, StepGraphs
from amp_utils.step_ledger import NonFiniteLossError, StepInfo, StepLedger
from amp_utils.train_stats import (
    TRAIN_STATS,
    DataWaitReport,
    count_as_warmup,
    global_train_stats,
    restored_train_stats,
)
from amp_utils.weight_casts import WeightCasts

logger = logging.getLogger(__name__)

__all__ = ["Brain", "NonFiniteLossError", "Stage", "TrainingInterrupted"]

INTRA_EPOCH_FLAG = "intra_epoch"


def _run_option(name: str) -> property:
    """A read-only ``Brain`` attribute for ``run_opts.<name>``, as SpeechBrain's are."""
    return property(lambda self: getattr(self.run_opts, name), doc=f"``run_opts.{name}``.")


class Brain(GraphedSteps):
    """Brain class abstracts away the details of data loops.

    Args:
        modules: name -> ``torch.nn.Module``; moved to the run device, available as
            ``self.modules.<name>``.
        opt_class: called with the modules' parameters to build the optimizer.
        hparams: any values; available with dot access as ``self.hparams.<name>``.
        run_opts: a ``RunOptions`` or a dict of its fields (device, precision, ...); a
            field a dict leaves out is taken from ``hparams`` when it has that key (as in
            SpeechBrain), else its default.
        checkpointer: an ``amp_utils.Checkpointer``; the loop registers the modules (unless
            already registered), its own state, the optimizer, the scaler and the scheduler.
        lr_scheduler: a callable ``optimizer -> scheduler``; the scheduler is stepped once
            per applied (not skipped) optimizer step and is ``self.lr_scheduler``. For
            SpeechBrain compatibility, ``hparams["lr_scheduler"]`` is used when this is None.
        tensorboard: an ``amp_utils.TensorBoardLogger`` for per-step scalars (loss, lr,
            gradient norm, loss scale, skipped steps, throughput); ``self.tensorboard``.
            For SpeechBrain compatibility, ``hparams["tensorboard"]`` is used when None.

    Tools that drive single training steps themselves (benchmarks) call
    :meth:`train_step` and then :meth:`flush_pending`, never the private state.

    Example:
        >>> from torch.optim import SGD
        >>> class SimpleBrain(Brain):
        ...     def compute_forward(self, batch, stage):
        ...         return self.modules.model(batch[0])
        ...     def compute_objectives(self, predictions, batch, stage):
        ...         return torch.nn.functional.l1_loss(predictions, batch[0])
        >>> model = torch.nn.Linear(in_features=10, out_features=10)
        >>> brain = SimpleBrain({"model": model}, opt_class=lambda x: SGD(x, 0.1))
        >>> brain.fit(range(1), ([torch.rand(10, 10), torch.rand(10, 10)],))
    """

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module] | None = None,
        opt_class: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
        hparams: Mapping[str, Any] | None = None,
        run_opts: Mapping[str, Any] | RunOptions | None = None,
        checkpointer: Checkpointer | None = None,
        lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        tensorboard: Any = None,
    ) -> None:
        # Options missing from run_opts come from hparams, as in SpeechBrain.
        self.run_opts = RunOptions.from_dict(run_opts, hparams)
        device = resolve_device(self.run_opts.device)
        self.distributed = init_distributed(self.run_opts.distributed_backend, device.type)
        if self.distributed.enabled and device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # set for this rank
        self.device = device
        self.device_type = self.device.type
        self.amp = self._resolve_amp(self.run_opts.precision, "precision")
        self.eval_amp = self._resolve_amp(self.run_opts.eval_precision, "eval_precision")
        warn_if_emulated(self.amp, self.device)
        if self.eval_amp.name != self.amp.name:  # validation and test run in it
            warn_if_emulated(self.eval_amp, self.device, key="precision.eval_precision")
        configure_tf32(self.device, self.run_opts.allow_tf32)
        configure_onednn_cache(self.run_opts.onednn_cache_capacity)

        modules = dict(modules or {})
        if self.run_opts.sync_batchnorm:
            modules = convert_sync_batchnorm(modules, self.distributed.world_size, self.device)
        self.modules = torch.nn.ModuleDict(modules)
        self.modules.to(self.device)
        self.opt_class = opt_class
        self.hparams = SimpleNamespace(**dict(hparams)) if hparams is not None else None
        # Explicit arguments first; the hparams keys are SpeechBrain's way to pass them.
        if lr_scheduler is None and hparams is not None:
            lr_scheduler = hparams.get("lr_scheduler")
        if tensorboard is None and hparams is not None:
            tensorboard = hparams.get("tensorboard")
        self.lr_scheduler_factory = lr_scheduler
        self.checkpointer = checkpointer
        self.scaler = make_grad_scaler(self.amp, self.device)
        self.amp_step = AMPOptimizerStep(
            self.scaler, self.run_opts.max_grad_norm, self.run_opts.skip_nonfinite_grads
        )
        self.ledger = StepLedger(
            self.run_opts.nonfinite_patience,
            on_applied_step=self._step_lr_scheduler,
            tensorboard=tensorboard,
            log_interval_steps=self.run_opts.log_interval_steps,
            extra_scalars=self._rate_scalars,
        )
        self.checkpoint_policy = MidEpochCheckpointPolicy(
            interval_steps=self.run_opts.ckpt_interval_steps,
            interval_minutes=self.run_opts.ckpt_interval_minutes,
            world_size=self.distributed.world_size,
            decide_every=self.run_opts.log_interval_steps,
        )
        self.stop_signals = StopSignals()
        self.stall_watchdog = StallWatchdog(self.run_opts.stall_warning_minutes, self._position)

        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizers_dict: dict[str, torch.optim.Optimizer] = {}
        self.lr_scheduler: Any = None
        self.step = 0  # batches done in the current stage
        self.train_stats = dict(TRAIN_STATS)
        self._session_warmed_up = False  # this process has trained an epoch (see TRAIN_STATS)
        self._epoch_trained_before = (0, 0.0)  # utterances and audio when the epoch started
        # (loader, epoch, its batches) started before the last epoch's validation
        self._next_epoch: tuple[DataLoader, int, EpochBatches] | None = None
        self._resume_step = 0  # training batches already done in the interrupted epoch
        self._resume_grads: dict[str, Any] | None = None  # its unfinished window's gradients
        self._epoch_plan: str | None = None  # the training epoch's batch plan (its digest)
        self._resume_plan: str | None = None  # the interrupted epoch's, from the checkpoint
        # (processes, grad_accumulation_factor or None if unrecorded) of the loaded checkpoint
        self._resumed_layout: tuple[int, int | None] | None = None
        self._trained_batches = 0  # training batches of the epoch last trained
        self._stop_flag: torch.Tensor | None = None  # DDP: this rank caught a signal (0/1)
        self._ranks_signalled: torch.Tensor | None = None  # the batch's sum over the ranks
        self._unrecorded_step: StepInfo | None = None  # optimizers_step's, for train_step
        self._epoch_start = time.perf_counter()
        self._epoch_train_s = 0.0  # the last training epoch's time (this session's part)
        self._epoch_counter: Any = None
        self._stage: Stage | None = None  # the stage running, and its epoch (stall warning)
        self._stage_epoch: int | None = None
        self.evaluated_checkpoint: Checkpoint | None = None  # what the last evaluate loaded
        self._compiled = False
        self._cudagraphs = False  # compiled modules replay CUDA graphs: mark each step
        self._ddp_modules: list[DistributedDataParallel] = []
        #: True while a step that may be captured as a CUDA graph runs (``graph_step``):
        #: recipes then compute from device tensors only (no host syncs, no host values).
        self.graph_safe_step = False
        self._data_wait = DataWaitReport()  # warns once a run
        self._step_graphs: StepGraphs | None = None
        # Why a capture failed in this run (any session): later sessions train eagerly too.
        self._step_graphs_failed: str | None = None
        #: Validation's forward passes and losses, one CUDA graph per batch shape
        #: (``graph_eval``, with ``graph_step``); the metrics are scored on the host after.
        self._eval_graphs: StepGraphs | None = None
        self._weight_casts: WeightCasts | None = None  # fused_weight_casts, once set up
        self._eval_casts: WeightCasts | None = None  # the same for evaluation
        self._capturable: CapturableOptimizers | None = None

        if self.checkpointer is not None:
            registered = [id(obj) for obj in self.checkpointer.recoverables.values()]
            for name, module in self.modules.items():
                if id(module) not in registered:  # the uncompiled module: stable state keys
                    self.checkpointer.add_recoverable(f"module.{name}", module)
            self.checkpointer.add_recoverable("brain", self)
            self.checkpointer.add_recoverable("scaler", ScalerState(self.scaler))
            writes = self.run_opts.checkpoint_writes
            if writes != "auto" or self.device.type == "cuda":
                # auto: in the background on CUDA, where the loop mostly waits for the GPU
                # while the writer thread serialises, hashes and syncs (~0.1 s per epoch of
                # the default recipe on an H200, whose epochs train ~0.15 s). On a CPU the
                # save is ~1 % of an epoch (0.13 s of ~12 s, 2 cores) and a writer thread
                # would compete with training for the cores: foreground.
                self.checkpointer.background_writes = writes != "foreground"

    # The step ledger's books, under the names SpeechBrain and the recipes use.
    @property
    def optimizer_step(self) -> int:
        """Optimizer steps applied in the whole run (read back one step late)."""
        return self.ledger.optimizer_step

    @optimizer_step.setter
    def optimizer_step(self, value: int) -> None:
        self.ledger.optimizer_step = value

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (non-finite loss or gradients, fp16 overflow)."""
        return self.ledger.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.ledger.skipped_steps = value

    @property
    def nonfinite_count(self) -> int:
        """Consecutive non-finite training losses so far."""
        return self.ledger.nonfinite_count

    @nonfinite_count.setter
    def nonfinite_count(self, value: int) -> None:
        self.ledger.nonfinite_count = value

    @property
    def avg_train_loss(self) -> float:
        """Running mean of this epoch's finite training losses (up to the last flush)."""
        return self.ledger.avg_train_loss

    @property
    def tensorboard(self) -> Any:
        """The ``TensorBoardLogger`` of the per-step scalars (None: not logged)."""
        return self.ledger.tensorboard

    @tensorboard.setter
    def tensorboard(self, logger: Any) -> None:
        self.ledger.tensorboard = logger

    @property
    def last_grad_norm(self) -> float | None:
        """Gradient norm (before clipping) of the last optimizer step read back."""
        return self.ledger.last_grad_norm

    # SpeechBrain's Brain attributes, for code written against it (read-only here: the
    # options live in ``run_opts``; the precisions are those in use, auto resolved).
    @property
    def precision(self) -> str:
        """The training precision in use (``"fp32"``, ``"fp16"``, ``"bf16"``)."""
        return self.amp.name

    @property
    def eval_precision(self) -> str:
        """The validation/test precision in use."""
        return self.eval_amp.name

    # Every other run option SpeechBrain's RunOptions has too (``device`` is the
    # ``torch.device`` in use).
    max_grad_norm = _run_option("max_grad_norm")
    grad_accumulation_factor = _run_option("grad_accumulation_factor")
    skip_nonfinite_grads = _run_option("skip_nonfinite_grads")
    nonfinite_patience = _run_option("nonfinite_patience")
    noprogressbar = _run_option("noprogressbar")
    ckpt_interval_minutes = _run_option("ckpt_interval_minutes")
    ckpt_interval_steps = _run_option("ckpt_interval_steps")
    debug = _run_option("debug")
    debug_batches = _run_option("debug_batches")
    debug_epochs = _run_option("debug_epochs")
    compile = _run_option("compile")
    compile_module_keys = _run_option("compile_module_keys")
    compile_mode = _run_option("compile_mode")
    distributed_backend = _run_option("distributed_backend")
    find_unused_parameters = _run_option("find_unused_parameters")

    @property
    def training_ctx(self) -> TorchAutocast:
        """Autocast of the training precision, for a ``fit_batch`` override's forward pass
        (``with self.training_ctx: ...``), as in SpeechBrain."""
        return TorchAutocast(device_type=self.device_type, dtype=self.amp.dtype)

    @property
    def evaluation_ctx(self) -> TorchAutocast:
        """Autocast of the evaluation precision, as in SpeechBrain."""
        return TorchAutocast(device_type=self.device_type, dtype=self.eval_amp.dtype)

    def freeze_optimizers(
        self, optimizers: dict[str, torch.optim.Optimizer]
    ) -> dict[str, torch.optim.Optimizer]:
        """The optimizers that step this time (SpeechBrain's hook): all of them by default;
        override it to leave some out (e.g. a frozen encoder's during warm-up). An
        override turns whole-step CUDA graphs off (a capture would freeze its choice)."""
        return optimizers

    def overrides_freeze_optimizers(self) -> bool:
        """Whether the recipe chooses the optimizers a step uses (``freeze_optimizers``)."""
        return type(self).freeze_optimizers is not Brain.freeze_optimizers

    def _stepped_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers a step updates: ``freeze_optimizers`` of all of them."""
        return list(self.freeze_optimizers(self.optimizers_dict).values())

    def _resolve_amp(self, name: str, option: str) -> AMPConfig:
        """AMPConfig of a precision name (``auto``: the device's native one, logged)."""
        resolved, reason = resolve_precision(name, self.device)
        if name == AUTO:
            logger.info("%s=auto -> %s (%s)", option, resolved, reason)
        amp = AMPConfig.from_name(resolved)
        check_precision_supported(amp, self.device)
        return amp

    # ------------------------------------------------------------ to override
    def compute_forward(self, batch: Any, stage: Stage) -> Any:
        """Forward pass, from the batch to the predictions. Override this."""
        raise NotImplementedError

    def compute_objectives(self, predictions: Any, batch: Any, stage: Stage) -> torch.Tensor:
        """Loss from the predictions and the targets. Override this."""
        raise NotImplementedError

    def score_predictions(self, predictions: Any, batch: Any, stage: Stage) -> None:
        """Add one evaluated batch's metrics, on the host, from ``compute_forward``'s
        predictions. Optional.

        SpeechBrain's recipes score inside ``compute_objectives``. A recipe that scores
        here instead, and leaves it out of ``compute_objectives`` while ``graph_safe_step``
        is set, lets validation replay CUDA graphs (``trainer.graph_eval``): the captured
        part is the forward pass and the loss, and this runs on their outputs after each
        replay. Without it, validation runs eagerly. On the 2026-11-27 H200 the default
        recipe's eager validation took 77 ms an epoch in fp32 and 107 ms in bf16, against
        132 / 111 ms of training.
        """
        raise NotImplementedError

    def scores_predictions(self) -> bool:
        """Whether the recipe scores evaluated batches in :meth:`score_predictions`."""
        return type(self).score_predictions is not Brain.score_predictions

    def on_stage_start(self, stage: Stage, epoch: int | None = None) -> None:
        """Called when a stage (train, valid, test) starts; e.g. reset metric trackers."""

    def on_stage_end(self, stage: Stage, stage_loss: float, epoch: int | None = None) -> None:
        """Called when a stage ends; e.g. compute metrics and save a checkpoint. The VALID
        and TEST stages' end runs under ``torch.no_grad()``, as in SpeechBrain."""

    def on_fit_batch_start(self, batch: Any, should_step: bool) -> None:
        """Called before each training batch."""

    def on_fit_batch_end(
        self, batch: Any, outputs: Any, loss: torch.Tensor, should_step: bool
    ) -> None:
        """Called after each training batch."""

    def batch_stats(self, batch: Any) -> tuple[int, float]:
        """(utterances, audio seconds) of a batch, for throughput; override for audio.

        The default counts the leading dimension of the batch (or of its first tensor).
        """
        first = batch[0] if isinstance(batch, list | tuple) and batch else batch
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            return int(first.shape[0]), 0.0
        try:
            return len(batch), 0.0
        except TypeError:
            return 1, 0.0

    # ------------------------------------------------------------------ setup
    def on_fit_start(self) -> None:
        """Wrap modules for DDP, compile them, build optimizers and resume if possible."""
        if self.distributed.enabled and not self._ddp_modules:
            # The checkpointer keeps the unwrapped modules: same keys with and without DDP.
            self._ddp_modules = wrap_ddp(
                self.modules, self.device, self.run_opts.find_unused_parameters
            )
        self._compile()
        self._set_up_weight_casts()
        self.init_optimizers()
        if not self.optimizers_dict and self.optimizer is not None:
            # An init_optimizers override written for SpeechBrain before optimizers_dict
            # sets self.optimizer only; SpeechBrain steps that optimizer, and so does this.
            self.optimizers_dict = {"optimizer": self.optimizer}
        if self.checkpointer is not None:
            with run_phase("loading the checkpoint to resume from"):  # a signal's message
                ckpt = self.checkpointer.recover_if_possible(map_location=self.device)
            if ckpt is not None:
                self._after_resume(ckpt)
            else:  # from step 1: what a session killed before any checkpoint logged goes
                start_over = getattr(self.tensorboard, "start_over", None)
                if start_over is not None:
                    start_over()
        self._set_up_step_graphs()
        self._set_up_eval_graphs()

    def _after_resume(self, ckpt: Checkpoint) -> None:
        if self._resume_step > 0 and isinstance(self._epoch_counter, EpochCounter):
            # The interrupted epoch is re-entered and its finished batches skipped.
            self._epoch_counter.current -= 1
        resume_at = getattr(self.tensorboard, "resume_at", None)
        if resume_at is not None:  # what a killed session logged after the checkpoint goes
            resume_at(self.ledger.steps_taken + 1)
        logger.info(
            "Resumed from %s (optimizer step %d, %d batches into the epoch)",
            ckpt.path,
            self.optimizer_step,
            self._resume_step,
        )
        self._report_batch_layout_change()

    def _report_batch_layout_change(self) -> None:
        """Warn (rank 0) when this session trains on another number of batches per optimizer
        step than the session that saved the checkpoint it resumed from.

        A run may be resumed under another number of processes (``docs/scaling.md``): each
        step then averages the gradients of another number of batches (processes times
        ``grad_accumulation_factor``), so the effective batch changes halfway through the
        run. That is allowed, but it was silent: the log named neither the change nor the
        factor that keeps the effective batch.
        """
        if self._resumed_layout is None or not self.distributed.is_main:
            return
        saved_procs, saved_factor = self._resumed_layout
        procs, factor = self.distributed.world_size, self.run_opts.grad_accumulation_factor
        if saved_factor is None:  # a checkpoint from before the factor was recorded
            if saved_procs == procs:
                return
            logger.warning(
                "Resumed a checkpoint saved by %d process(es) with %d process(es): each "
                "optimizer step now sums the gradients of %d process(es) x "
                "trainer.grad_accumulation_factor=%d batches (the checkpoint does not record "
                "its factor), so the effective batch may have changed.",
                saved_procs,
                procs,
                procs,
                factor,
            )
            return
        saved_batches, batches = saved_procs * saved_factor, procs * factor
        if saved_batches == batches:
            if saved_procs != procs:
                logger.info(
                    "Resumed a checkpoint of %d process(es) x grad_accumulation_factor %d "
                    "with %d x %d: the same %d batches per optimizer step.",
                    saved_procs,
                    saved_factor,
                    procs,
                    factor,
                    batches,
                )
            return
        keep = (
            f"To keep it, run with trainer.grad_accumulation_factor={saved_batches // procs}."
            if saved_batches % procs == 0
            else f"No factor keeps it with {procs} process(es)."
        )
        logger.warning(
            "The effective batch changed on resume: the checkpoint was trained with %d "
            "process(es) x trainer.grad_accumulation_factor=%d = %d batches per optimizer "
            "step, this session trains %d x %d = %d. %s",
            saved_procs,
            saved_factor,
            saved_batches,
            procs,
            factor,
            batches,
            keep,
        )

    def init_optimizers(self) -> None:
        """Build the optimizer (and LR scheduler) and register them for checkpointing."""
        if self.opt_class is None:
            return
        self.optimizer = self.opt_class(self.modules.parameters())
        self.optimizers_dict = {"opt_class": self.optimizer}
        if self.lr_scheduler_factory is not None:
            self.lr_scheduler = self.lr_scheduler_factory(self.optimizer)
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("optimizer", self.optimizer)
            if self.lr_scheduler is not None:
                self.checkpointer.add_recoverable("lr_scheduler", self.lr_scheduler)

    def _step_lr_scheduler(self) -> None:
        """Step the LR scheduler (the ledger calls it once per applied optimizer step)."""
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def no_sync(self, use: bool = True) -> Any:
        """Context that skips DDP's gradient all-reduce (gradient-accumulation batches)."""
        return no_sync(self._ddp_modules, use)

    def _compile(self) -> None:
        """``torch.compile`` the selected modules once (see ``amp_utils.compile``)."""
        if not self.run_opts.compile or self._compiled:
            return
        self._cudagraphs = compile_modules(self.modules, self.run_opts, self.device)
        self._compiled = True

    def mark_step(self) -> None:
        """Tell cudagraph trees that a new step starts (the last step's outputs may be reused).

        ``fit_batch`` and ``evaluate_batch`` call it; a loop of its own that runs the
        compiled modules (e.g. a benchmark) calls it before each step.
        """
        if self._cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradients of every optimizer."""
        for opt in self.optimizers_dict.values():
            opt.zero_grad(set_to_none=set_to_none)

    def make_dataloader(
        self, dataset: Any, stage: Stage, ckpt_prefix: str = "dataloader-", **loader_kwargs: Any
    ) -> DataLoader:
        """Wrap a dataset in a DataLoader with its own seeded generator.

        The loader's own generator keeps loader start-up from consuming the global RNG, so
        a resumed run sees the same random stream as an uninterrupted one. Under DDP, a
        training loader without its own sampler gets a ``DistributedSampler`` (each rank a
        disjoint, equally long shard, reshuffled per epoch when ``shuffle=True``).
        """
        return make_loader(
            dataset,
            self.run_opts.seed,
            self.distributed,
            shard=stage == Stage.TRAIN,
            **loader_kwargs,
        )

    # ------------------------------------------------------------- one batch
    def train_step(self, batch: Any) -> torch.Tensor:
        """One training batch as ``fit`` runs it: count it, then ``fit_batch``.

        The public seam for tools that drive the loop one step at a time (benchmarks):
        the step, gradient accumulation and the lagged bookkeeping behave as in ``fit``.
        Call :meth:`flush_pending` afterwards to bring the counters and running loss up
        to date. Returns the batch's loss as a detached device tensor.
        """
        self.step += 1
        records, self._unrecorded_step = self.ledger.records, None
        loss = self.fit_batch(batch)
        if self.ledger.records == records:
            # A fit_batch overridden the SpeechBrain way (forward, backward,
            # optimizers_step(), return the loss) without Brain.fit_batch: its loss and step
            # are accounted here, as the built-in step accounts its own (running loss, step
            # counts, non-finite patience, LR schedule).
            loss = torch.as_tensor(loss).detach()
            self.ledger.record(self.step, loss, self._unrecorded_step, self.amp_step.loss_scale())
        return loss

    def fit_batch(self, batch: Any) -> torch.Tensor:
        """Train on one batch: autocast forward, scaled backward, step every N batches.

        Nothing here waits for the device: the loss comes back as a device tensor, a step
        with a non-finite loss (or, with ``skip_nonfinite_grads``, non-finite gradients) is
        skipped on the device, and the bookkeeping that needs values (running loss,
        non-finite patience, step counters, LR schedule) runs one step later, when they
        are ready. This keeps the GPU queue full for small, launch-bound speech models.
        """
        should_step = self.step % self.run_opts.grad_accumulation_factor == 0
        self.on_fit_batch_start(batch, should_step)
        if self._step_graphs is not None:
            graphed_loss = self._fit_batch_graphed(batch)
            if graphed_loss is not None:
                return graphed_loss
        self.mark_step()
        with self.no_sync(not should_step):
            outputs, loss = self._forward_backward(batch)
        # Under DDP: the mean over the ranks, so all of them log, count and skip alike.
        global_loss = self._mean_over_ranks(loss.detach())  # and any rank's stop signal
        self.amp_step.observe_loss(global_loss)
        if should_step:
            step_info = self.optimizers_step()  # reads the previous batch's values first
        else:
            step_info = None
            if self.distributed.world_size > 1:
                # Inside an accumulation window too, the ranks read the previous batch's
                # stop flag (its work is done while this batch's is queued), so that a
                # signal stops them together within a batch, not at the window's end.
                self.flush_pending()
        signalled, self._ranks_signalled = self._ranks_signalled, None
        self.ledger.record(self.step, global_loss, step_info, self.amp_step.loss_scale(), signalled)
        self.on_fit_batch_end(batch, outputs, loss, should_step)
        return loss.detach()

    def _forward_backward(
        self, batch: Any, autocast_cache: bool | None = None
    ) -> tuple[Any, torch.Tensor]:
        """Autocast forward and objectives, then the scaled backward: (outputs, loss).

        ``autocast_cache`` (None: torch's default) passes to ``torch.autocast``. With
        ``fused_weight_casts`` the weights are cast together (:class:`WeightCasts`); the
        pass that observes which qualify keeps the step's own cache setting, so the first
        step of a session (of a resumed run too) casts as every other step does.
        """
        weight_casts = self._weight_casts
        with (
            TorchAutocast(
                device_type=self.device_type, dtype=self.amp.dtype, cache_enabled=autocast_cache
            ),
            weight_casts.during_forward() if weight_casts is not None else nullcontext(),
        ):
            outputs = self.compute_forward(batch, Stage.TRAIN)
            loss = self.compute_objectives(outputs, batch, Stage.TRAIN)
        self.amp_step.backward(loss, self.run_opts.grad_accumulation_factor)
        if weight_casts is not None:
            weight_casts.settle_gradients()
        return outputs, loss

    def weight_casts_off_reason(self) -> str | None:
        """Why training does not cast the weights together although ``fused_weight_casts``
        asks for it with a 16-bit precision; None when it does, or when it is not asked
        for (the option off, or fp32)."""
        if self.run_opts.compile:
            return "torch.compile fuses autocast's casts itself (trainer.compile)"
        if self.distributed.world_size > 1:
            return (
                "under DDP the gradients would reach the all-reduce only at the end of the "
                "backward pass, not overlapped with it"
            )
        return None

    def _asks_for_weight_casts(self) -> bool:
        """``fused_weight_casts`` with a 16-bit precision."""
        return bool(self.run_opts.fused_weight_casts and self.amp.dtype != torch.float32)

    def fuses_weight_casts(self) -> bool:
        """Whether training casts the weights together (``fused_weight_casts`` with a 16-bit
        precision, and nothing turns it off: ``weight_casts_off_reason``)."""
        return self._asks_for_weight_casts() and self.weight_casts_off_reason() is None

    def _set_up_weight_casts(self) -> None:
        """With ``fused_weight_casts`` and a 16-bit precision, cast the weights together."""
        if not self._asks_for_weight_casts() or self._weight_casts is not None:
            return
        reason = self.weight_casts_off_reason()
        if reason is None:
            self._weight_casts = WeightCasts(self.modules, self.amp.dtype)
            return
        logger.info("precision.fused_weight_casts: off, %s.", reason)

    def _eval_weight_casts(self) -> WeightCasts | None:
        """``fused_weight_casts`` for validation and test forward passes (16-bit
        ``eval_precision``, modules not compiled for evaluation): observed on the first
        evaluated batch, as training's are on the first training batch."""
        if self._eval_casts is None and (
            self.run_opts.fused_weight_casts
            and self.eval_amp.dtype != torch.float32
            and not (self._compiled and self.run_opts.compile_eval)
        ):
            self._eval_casts = WeightCasts(self.modules, self.eval_amp.dtype)
        return self._eval_casts

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a batch's loss over the ranks; under DDP the same all-reduce also
        carries whether any rank has caught a stop signal (read at the next flush).

        The ranks must stop after the same batch. They learn of a signal together, without
        waiting for the device or a collective of their own: each batch's loss all-reduce
        sums a sticky flag too, which the step ledger reads one step later like the loss,
        at the same flush on every rank; so a SIGTERM stops the run within a step or two
        instead of at the next joint decision (every ``log_interval_steps`` steps).
        """
        if self.distributed.world_size == 1:
            return value
        if self._stop_flag is None:
            self._stop_flag = torch.zeros((), device=value.device)
        if self.stop_signals.received is not None:
            self._stop_flag.fill_(1.0)
        summed = all_reduce_sum(torch.stack([value.float(), self._stop_flag]))
        self._ranks_signalled = summed[1]
        return summed[0] / self.distributed.world_size

    def check_loss_isfinite(self, loss: torch.Tensor) -> bool:
        """True if the loss is finite; counts non-finite ones for ``nonfinite_patience``.

        SpeechBrain's API, for a ``fit_batch`` overridden its way (which calls it on each
        batch's loss): the batch is then not counted a second time when the loop reads its
        loss back. The built-in ``fit_batch`` does not call it; it counts each batch's loss
        one step later, without waiting for the device.

        Raises:
            NonFiniteLossError: after more than ``nonfinite_patience`` consecutive ones.
        """
        return self.ledger.check_loss(float(loss.detach()), self.step)

    def optimizers_step(self) -> StepInfo | None:
        """Unscale, clip all parameter groups, step through the scaler, then zero grads.

        Returns the step's gradient norm and whether it was skipped, both as device
        tensors (read later by the step ledger, so that nothing waits here).
        """
        self.flush_pending()  # the previous step's values are ready by now
        step_info = self.amp_step.step(self._stepped_optimizers())
        self._unrecorded_step = step_info  # for a fit_batch override (see train_step)
        return step_info

    def flush_pending(self) -> None:
        """Account for the batches whose values are pending (syncs with the device).

        The fit loop calls it at the end of each epoch and before a checkpoint; call it
        after driving ``train_step`` yourself to get its counters and running loss up to date.
        """
        self.ledger.flush()

    def _rate_scalars(self) -> dict[str, float]:
        """Learning rate and training throughput, for the ledger's per-step scalars."""
        scalars: dict[str, float] = {}
        if self.optimizer is not None:
            scalars["train/lr"] = self.optimizer.param_groups[0]["lr"]
        elapsed = self.train_stats["time_s"] + time.perf_counter() - self._epoch_start
        if elapsed > 0:  # under DDP: rank 0's rate times the world size (cheap estimate)
            rate = self.train_stats["utterances"] / elapsed
            scalars["train/utterances_per_s"] = rate * self.distributed.world_size
        return scalars

    @torch.no_grad()
    def evaluate_batch(self, batch: Any, stage: Stage) -> torch.Tensor:
        """Evaluate one batch under ``eval_precision``; returns the detached loss.

        Validation batches replay their shape's CUDA graph where ``graph_eval`` is on
        (see :meth:`score_predictions`); the test, run once, stays eager.
        """
        self.mark_step()
        if stage == Stage.VALID and self._eval_graphs is not None:
            loss = self._evaluate_batch_graphed(batch)
            if loss is not None:
                return loss
        _, loss = self._eval_forward(batch, stage)
        return loss.detach().cpu()

    def _eval_forward(
        self, batch: Any, stage: Stage, autocast_cache: bool | None = None
    ) -> tuple[Any, torch.Tensor]:
        """Forward pass and objectives of an evaluation batch: (predictions, loss)."""
        eager = self._compiled and not self.run_opts.compile_eval
        weight_casts = self._eval_weight_casts()
        with (
            torch.compiler.set_stance("force_eager") if eager else nullcontext(),
            TorchAutocast(
                device_type=self.device_type,
                dtype=self.eval_amp.dtype,
                cache_enabled=autocast_cache,
            ),
            weight_casts.during_forward() if weight_casts is not None else nullcontext(),
        ):
            predictions = self.compute_forward(batch, stage)
            loss = self.compute_objectives(predictions, batch, stage)
        return predictions, loss

    def update_average(self, loss: torch.Tensor, avg_loss: float) -> float:
        """Running mean of the loss over the ``self.step`` batches of this stage.

        SpeechBrain's API, kept for recipes written against it; the loops themselves use
        ``RunningMean`` (which also leaves non-finite losses out of the count).
        """
        if torch.isfinite(loss):
            avg_loss -= avg_loss / self.step
            avg_loss += float(loss) / self.step
        return avg_loss

    # ------------------------------------------------------------------- loops
    def fit(
        self,
        epoch_counter: Iterable[int],
        train_set: Any,
        valid_set: Any = None,
        progressbar: bool | None = None,
        train_loader_kwargs: Mapping[str, Any] | None = None,
        valid_loader_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Train for the epochs of ``epoch_counter``, validating after each one.

        Datasets that are not DataLoaders go through ``make_dataloader``. With a
        checkpointer the run resumes from its latest checkpoint, mid-epoch too.
        """
        made: list[DataLoader] = []  # loaders made here: their workers end with fit
        if not isinstance(train_set, DataLoader):
            train_set = self.make_dataloader(train_set, Stage.TRAIN, **(train_loader_kwargs or {}))
            made.append(train_set)
        if valid_set is not None and not isinstance(valid_set, DataLoader):
            valid_set = self.make_dataloader(valid_set, Stage.VALID, **(valid_loader_kwargs or {}))
            made.append(valid_set)
        try:
            self._fit(epoch_counter, train_set, valid_set, progressbar)
        except BaseException:
            self._wait_for_checkpoint_write(raise_error=False)  # on disk before it goes up
            raise
        finally:
            self._next_epoch = None  # an epoch started for a fit that ended: dropped
            for loader in made:
                shut_down_workers(loader)

    def _wait_for_checkpoint_write(self, raise_error: bool) -> None:
        """Return once a checkpoint written in the background is on disk. Its error ends
        ``fit``; while ``fit`` is ending on another error, it is logged instead."""
        if self.checkpointer is None:
            return
        try:
            self.checkpointer.wait()
        except Exception:
            if raise_error:
                raise
            logger.exception("The last checkpoint could not be written")

    def _fit(
        self,
        epoch_counter: Iterable[int],
        train_set: DataLoader,
        valid_set: DataLoader | None,
        progressbar: bool | None,
    ) -> None:
        """``fit``'s epochs on its loaders."""
        for loader in (train_set, valid_set):
            if loader is not None and loader.generator is None:
                # Keep iterator start-up off the global RNG, so resumes replay exactly.
                loader.generator = seeded_generator(self.run_opts.seed)
        if self.checkpointer is not None and not replays_its_order(train_set):
            logger.warning(
                "The training DataLoader shuffles with torch's RandomSampler, whose order a "
                "resumed run cannot draw again: after a resume some examples would be "
                "trained twice and others not at all. Pass the dataset itself with "
                "train_loader_kwargs={'shuffle': True} (Brain.make_dataloader shuffles each "
                "epoch from seed + epoch), or a sampler with set_epoch(epoch), such as "
                "amp_utils.loaders.ReproducibleRandomSampler."
            )
        self._epoch_counter = epoch_counter
        if (
            self.checkpointer is not None
            and isinstance(epoch_counter, EpochCounter)
            and not any(obj is epoch_counter for obj in self.checkpointer.recoverables.values())
        ):
            self.checkpointer.add_recoverable("epoch_counter", epoch_counter)
        self.on_fit_start()
        enable = self._progressbar(progressbar)
        # a new job's window: what an earlier job left (a sweep's, in one process) released
        release_cached_memory(self.device)
        reset_peak_memory(self.device)
        # Debug mode runs debug_epochs epochs. An EpochCounter numbers them from the run's
        # start, so a resumed debug run ends where the uninterrupted one does (counting this
        # call's epochs, it trained debug_epochs more); other iterables (range(n)) count
        # this call's epochs.
        counted = isinstance(epoch_counter, EpochCounter)
        with self.stop_signals, self.stall_watchdog:
            for epochs_run, epoch in enumerate(epoch_counter, start=1):
                debug_epoch = epoch if counted else epochs_run
                if self.run_opts.debug and debug_epoch > self.run_opts.debug_epochs:
                    epoch_counter.current = epoch - 1  # type: ignore[union-attr] (did not run)
                    break
                last_debug_epoch = self.run_opts.debug and debug_epoch >= self.run_opts.debug_epochs
                self._fit_train(train_set, epoch, enable)
                # (a loader that also validates would take the started epoch's batches)
                if (
                    not last_debug_epoch
                    and valid_set is not train_set
                    and self._trains_after(epoch_counter, epoch)
                ):
                    self._start_next_epoch(train_set, epoch + 1)
                self._fit_valid(valid_set, epoch, enable)
                if last_debug_epoch:
                    break
            # The last checkpoint on disk before fit returns (the test loads it), while a
            # signal is still held off.
            self._wait_for_checkpoint_write(raise_error=True)

    def _streams_validation(self, valid_set: DataLoader) -> bool:
        """Whether ``fit`` runs its validations as one iteration of the validation loader
        (``amp_utils.loaders.start_epoch``), its workers loading the next validation's first
        batches while the epoch trains. Only where that gives every validation the batches
        a restarted loader gives: ``trainer.prefetch_next_epoch``, a loader that
        ``streams_epochs``, a sampler that does not shuffle (a shuffling one would draw
        another epoch's batches each time; the recipes' validation samplers do not). A hook
        that changes the validation sampler in ``on_stage_start(VALID)`` would come too late:
        its first batches are drawn during the validation before.
        """
        return (
            bool(self.run_opts.prefetch_next_epoch)
            and streams_epochs(valid_set)
            and getattr(valid_set.batch_sampler, "shuffle", True) is False
        )

    def _trains_after(self, epoch_counter: Iterable[int], epoch: int) -> bool:
        """Whether ``fit`` trains epoch ``epoch + 1`` next, as far as it can tell now (an
        :class:`EpochCounter` below its limit, no stop signal; ``fit`` knows a debug run's
        last epoch)."""
        return (
            self.run_opts.prefetch_next_epoch
            and isinstance(epoch_counter, EpochCounter)
            and epoch < epoch_counter.limit
            and self.stop_signals.received is None
        )

    def _start_next_epoch(self, train_set: DataLoader, epoch: int) -> None:
        """Start epoch ``epoch`` of ``train_set`` now, before validating the last one.

        Its loader workers load the first batches while validation runs, instead of after
        it: on an H200 each epoch's first batch waited ~17-20 ms (workers resumed, a batch
        read and collated), 12 % of the default recipe's 20 graphed steps. The order is the
        one ``start_epoch`` draws at the epoch's start (the sampler's seed and epoch, the
        loader's own generator), so training is the same; only the batches' loading moves.
        A loader whose epochs stream (``amp_utils.loaders.streams_epochs``: persistent
        workers and a ``DurationBatchSampler``) goes further: its workers are already
        loading them during the last training steps, and this only continues its iteration.
        A hook that changes the sampler in ``on_stage_start(TRAIN)`` would come too late
        for either (a streaming loader draws the next epoch's first batches during the last
        steps of the one before): ``trainer.prefetch_next_epoch=false`` starts each epoch
        there instead.
        """
        self._next_epoch = (
            train_set,
            epoch,
            start_epoch(train_set, epoch, last_epoch=self._last_epoch()),
        )

    def _last_epoch(self) -> int | None:
        """The last epoch ``fit`` trains, where its epoch counter has a limit (an
        :class:`EpochCounter`): a loader streaming its epochs loads nothing past it."""
        counter = self._epoch_counter
        return counter.limit if isinstance(counter, EpochCounter) else None

    def epoch_label(self, epoch: int | None) -> str:
        """``"3/30"``: the epoch and the number of epochs (when the epoch counter has one).

        In debug mode an :class:`EpochCounter`'s run ends after ``debug_epochs`` (``fit``),
        and the label says so: ``"1/15"`` promised epochs a debug run never trains.
        """
        counter = self._epoch_counter
        limit = getattr(counter, "limit", None)
        if limit is not None and self.run_opts.debug and isinstance(counter, EpochCounter):
            limit = min(limit, self.run_opts.debug_epochs)
        return f"{epoch}/{limit}" if limit is not None and epoch is not None else str(epoch)

    def _position(self) -> str:
        """Where the loop is, for the stall warning: ``"epoch 3/30, TRAIN batch 13 started"``.

        ``self.step`` counts the stage's batches started; the warning's stack tells a batch
        stuck in the model from a loader stuck before the next one.
        """
        stage = self._stage.name if self._stage is not None else "?"
        return f"epoch {self.epoch_label(self._stage_epoch)}, {stage} batch {self.step} started"

    def _progressbar(self, requested: bool | None) -> bool:
        """Whether to show progress bars: as requested, and only on rank 0."""
        enable = (not self.run_opts.noprogressbar) if requested is None else requested
        return enable and self.distributed.is_main

    def _fit_train(self, train_set: DataLoader, epoch: int, enable: bool) -> None:
        self._stage, self._stage_epoch = Stage.TRAIN, epoch  # for the stall warning
        self.on_stage_start(Stage.TRAIN, epoch)
        self.modules.train()
        # the last epoch's unfinished accumulation window is dropped (gradients None, as after
        # a step: a zero gradient would let AdamW move a parameter the next window skips) ...
        self.zero_grad(set_to_none=True)
        self.amp_step.clear_window()  # ... with its losses' finite flag
        skip = self._resume_step
        self.step = skip
        self._restore_pending_grads()
        if skip == 0:
            self.ledger.train_loss = RunningMean()
        self._epoch_start = time.perf_counter()
        started, self._next_epoch = self._next_epoch, None
        if started is not None and started[0] is train_set and started[1] == epoch and not skip:
            batches, total = started[2]  # started before the last epoch's validation
        else:
            batches, total = start_epoch(
                train_set,
                epoch,
                skip,
                stream=self.run_opts.prefetch_next_epoch,
                last_epoch=self._last_epoch(),
            )
        self._epoch_plan = epoch_fingerprint(train_set)
        self._check_resumed_plan(skip)
        if self.run_opts.debug and total is not None:
            total = min(total, self.run_opts.debug_batches)
        wait_before = self.train_stats["data_wait_s"]
        self._epoch_trained_before = (self.train_stats["utterances"], self.train_stats["audio_s"])

        def waited(seconds: float) -> None:
            self.train_stats["data_wait_s"] += seconds

        # The bar counts the whole epoch and starts at the resume position.
        with tqdm(
            timed_batches(batches, waited),
            initial=skip,
            total=total,
            dynamic_ncols=True,
            disable=not enable,
            desc=f"epoch {self.epoch_label(epoch)} train",
        ) as bar:
            for batch in bar:
                if self.run_opts.debug and self.step >= self.run_opts.debug_batches:
                    break
                utterances, audio_s = self.batch_stats(batch)
                self.train_step(batch)
                self.stall_watchdog.beat()
                self.train_stats["utterances"] += utterances
                self.train_stats["audio_s"] += audio_s
                self._resume_step = self.step
                if self.step % self.run_opts.log_interval_steps == 0:
                    bar.set_postfix(train_loss=f"{self.avg_train_loss:.4f}", refresh=False)
                # After a signal the run saves inside an accumulation window too (with
                # the window's gradients) instead of at the window's end: a single
                # process at once, DDP ranks together once they have read the flag.
                stop = self._stop_now(self.ledger.stop_requested)
                if self.step % self.run_opts.grad_accumulation_factor == 0 or stop:
                    self._maybe_save_intra_epoch()
        self.flush_pending()
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        self._epoch_train_s = 0.0
        if self.step > skip:  # a session resumed past the epoch's last batch trained none
            epoch_time = self._epoch_train_s = time.perf_counter() - self._epoch_start
            self.train_stats["time_s"] += epoch_time
            epoch_wait = self.train_stats["data_wait_s"] - wait_before
            self._data_wait.report(
                self.epoch_label(epoch),
                epoch_wait,
                epoch_time,
                getattr(train_set, "num_workers", None),
                self.tensorboard,
                self.ledger.steps_taken,
            )
            if not self._session_warmed_up:
                self._session_warmed_up = True
                count_as_warmup(self.train_stats, self._epoch_trained_before, epoch_time)
        self._trained_batches = self.step  # a signal in validation resumes past them
        self._resume_step = 0
        self.on_stage_end(Stage.TRAIN, self.avg_train_loss, epoch)
        self.step = 0

    def _check_resumed_plan(self, skip: int) -> None:
        """Warn when an epoch resumed in its middle has another batch plan than the one
        its checkpoint was saved in: skipping the batches trained before then leaves other
        utterances out (some trained twice in the epoch, others not at all)."""
        saved, self._resume_plan = self._resume_plan, None
        if skip == 0 or saved is None or self._epoch_plan is None or saved == self._epoch_plan:
            return
        logger.warning(
            "epoch %s resumes %d batches in, but its batches are not those of the run that "
            "saved the checkpoint (the data, their durations, the seed or the batching "
            "options changed): the rest of this epoch trains other utterances than the "
            "interrupted run would have, and the resumed run is not exact. The epochs after "
            "it are as planned now.",
            self.epoch_label(self._stage_epoch),
            skip,
        )

    def _fit_valid(self, valid_set: DataLoader | None, epoch: int, enable: bool) -> None:
        if valid_set is None:
            if self.tensorboard is not None:  # the epoch's only timed part
                self.tensorboard.log_scalars(
                    {"time/train_s": self._epoch_train_s}, step=self.ledger.steps_taken
                )
            return
        started = time.perf_counter()
        avg_valid_loss = self._run_eval_loop(valid_set, Stage.VALID, epoch, enable)
        validated = time.perf_counter()
        self.train_stats["valid_time_s"] += validated - started
        with torch.no_grad():  # as in SpeechBrain: evaluation's hooks build no graph
            self.on_stage_end(Stage.VALID, avg_valid_loss, epoch)  # saves the epoch's checkpoint
        ended = time.perf_counter() - validated  # counted from the next checkpoint on
        self.train_stats["epoch_end_time_s"] += ended
        self.step = 0
        if self.tensorboard is not None:  # where this epoch's time went
            self.tensorboard.log_scalars(
                {
                    "time/train_s": self._epoch_train_s,
                    "time/valid_s": validated - started,
                    "time/epoch_end_s": ended,
                },
                step=self.ledger.steps_taken,
            )

    def _stop_in_validation(self, epoch: int, agreed: bool = False) -> None:
        """A signal during validation: save the trained epoch and exit now.

        The epoch's checkpoint is written at the end of validation, which may outlast a
        scheduler's grace period (a large validation set, decoding): the epoch's training
        would be lost with it. Instead the run saves a mid-epoch checkpoint positioned after
        the epoch's last training batch; the resumed run skips them all and validates the
        epoch from its start. A single process stops on its own signal; DDP ranks stop
        when ``agreed`` (any rank caught one: the validation loop asks after every round of
        :meth:`_validation_rounds`), all after the same round, since saving is a collective.
        """
        if not self._stop_now(agreed) or self.checkpointer is None:
            return
        self._resume_step = self._trained_batches
        try:
            self._save_intra_epoch_ckpt()
            self._wait_for_checkpoint_write(raise_error=True)  # "saved" must be true
        finally:
            self._resume_step = 0
        raise interrupted_error(self.stop_signals.received, epoch, self._trained_batches)

    def _validation_rounds(self, loader: DataLoader) -> int | None:
        """Under DDP, how many validation batches every rank steps through (the most any
        rank has: evaluation shards may differ by a batch), so that the ranks can ask each
        other after every batch whether to stop; None where that cannot be agreed (one
        process, no checkpointer, a loader without a length)."""
        if self.distributed.world_size == 1 or self.checkpointer is None:
            return None
        try:
            batches = len(loader)
        except TypeError:  # an iterable dataset: its length is not known
            batches = -1
        if self.run_opts.debug:
            batches = min(batches, self.run_opts.debug_batches)
        most, minus_fewest = all_reduce_max(torch.tensor([batches, -batches])).tolist()
        return None if minus_fewest > 0 else int(most)

    def _run_eval_loop(
        self, loader: DataLoader, stage: Stage, epoch: int | None, enable: bool
    ) -> float:
        self._stage, self._stage_epoch = stage, epoch  # for the stall warning
        self.on_stage_start(stage, epoch)
        self.modules.eval()
        self.step = 0
        stage_loss = RunningMean()
        nonfinite = 0  # batches whose loss the mean leaves out (inf/NaN)
        desc = f"epoch {self.epoch_label(epoch)} {stage.name.lower()}" if epoch else "test"
        validating = stage == Stage.VALID and epoch is not None
        batches: Iterable[Any] = loader
        total = None  # tqdm's: len(loader)
        if validating and self._streams_validation(loader):
            # its validations stream as the training loader's epochs do: the next one's
            # first batches load during training, instead of a restart here every epoch
            batches, total = start_epoch(loader, epoch, last_epoch=self._last_epoch())
        rounds = self._validation_rounds(loader) if validating else None
        if rounds is not None:  # every rank the same number of rounds (None: no batch left)
            batches = itertools.islice(itertools.chain(batches, itertools.repeat(None)), rounds)
            total = rounds
        with torch.no_grad():
            for batch in tqdm(
                batches, total=total, dynamic_ncols=True, disable=not enable, desc=desc
            ):
                if batch is not None:
                    if self.run_opts.debug and self.step >= self.run_opts.debug_batches:
                        break
                    self.step += 1
                    loss = self.evaluate_batch(batch, stage)
                    nonfinite += not stage_loss.add(float(loss))
                if rounds is not None:
                    (agreed,) = any_rank(self.stop_signals.received is not None)
                    self._stop_in_validation(epoch, agreed=agreed)
                elif validating:
                    self._stop_in_validation(epoch)
                self.stall_watchdog.beat()
        mean = stage_loss.mean
        if self.distributed.world_size > 1:  # each rank saw its own shard of the split
            totals = all_reduce_counts(
                {
                    "loss": stage_loss.mean * stage_loss.count,
                    "batches": stage_loss.count,
                    "nonfinite": nonfinite,
                }
            )
            mean, nonfinite = totals["loss"] / max(totals["batches"], 1), int(totals["nonfinite"])
        if nonfinite:
            logger.warning(
                "%s: %d evaluated batch(es) had a non-finite loss (inf/NaN, e.g. an overflow "
                "in %s): the %s loss is the mean of the other batches only; the metrics "
                "(CER, accuracy, ...) still score every utterance.",
                desc,
                nonfinite,
                self.eval_amp.name,
                stage.name.lower(),
            )
        return mean

    def on_evaluate_start(self, max_key: str | None = None, min_key: str | None = None) -> None:
        """Load the best checkpoint by ``max_key``/``min_key`` (else the latest) before testing.

        The run's own counters (steps, throughput) are kept: the best checkpoint may be
        older than the end of training. The checkpoint loaded is ``evaluated_checkpoint``.
        """
        if self.checkpointer is None:
            return
        counters = (self.optimizer_step, self.skipped_steps, dict(self.train_stats))
        self.evaluated_checkpoint = self.checkpointer.recover_if_possible(
            max_key=max_key, min_key=min_key, map_location=self.device
        )
        self.optimizer_step, self.skipped_steps, self.train_stats = counters
        self._resume_step = 0

    def evaluate(
        self,
        test_set: Any,
        max_key: str | None = None,
        min_key: str | None = None,
        progressbar: bool | None = None,
        test_loader_kwargs: Mapping[str, Any] | None = None,
    ) -> float:
        """Evaluate on ``test_set`` with the best checkpoint; returns the average test loss."""
        made = not isinstance(test_set, DataLoader)
        if made:
            test_set = self.make_dataloader(test_set, Stage.TEST, **(test_loader_kwargs or {}))
        self.on_evaluate_start(max_key=max_key, min_key=min_key)
        enable = self._progressbar(progressbar)
        try:
            with self.stall_watchdog:
                avg_test_loss = self._run_eval_loop(test_set, Stage.TEST, None, enable)
        finally:
            if made:  # a loader made here: its workers end with the evaluation
                shut_down_workers(test_set)
        with torch.no_grad():  # as in SpeechBrain, and as the VALID stage's end
            self.on_stage_end(Stage.TEST, avg_test_loss, None)
        self.step = 0
        return avg_test_loss

    # ------------------------------------------------------------ checkpoints
    def _stop_now(self, agreed: bool) -> bool:
        """Whether a signal stops the run after this batch: this process's own signal when
        alone; under DDP ``agreed``, what the ranks learnt together at the same batch (the
        loss all-reduce's flag in training, ``any_rank`` in validation)."""
        if self.distributed.world_size == 1:
            return self.stop_signals.received is not None
        return agreed

    def _maybe_save_intra_epoch(self) -> None:
        """Save mid-epoch when the policy says so; after a signal, save and exit."""
        decision = self.checkpoint_policy.decide(
            updates=self.step // self.run_opts.grad_accumulation_factor,
            optimizer_step=self.optimizer_step,
            signal_received=self.stop_signals.received is not None,
            can_save=self.checkpointer is not None,
            agreed_stop=self.ledger.stop_requested,
        )
        if decision.save:
            self._save_intra_epoch_ckpt()
        if decision.stop:
            # On disk before the message says so, and while a second signal is held off.
            self._wait_for_checkpoint_write(raise_error=True)
            epoch = getattr(self._epoch_counter, "current", "?")
            raise interrupted_error(self.stop_signals.received, epoch, self.step)

    def _save_intra_epoch_ckpt(self) -> None:
        """Save a mid-epoch checkpoint, keeping only the newest mid-epoch one."""
        if self.checkpointer is None:
            return
        self.flush_pending()
        self.checkpointer.save_and_keep_only(
            meta={INTRA_EPOCH_FLAG: True},
            end_of_epoch=False,
            num_to_keep=1,
            predicate=lambda ckpt: bool(ckpt.meta.get(INTRA_EPOCH_FLAG)),
        )
        self.checkpoint_policy.saved()

    def state_dict(self) -> dict[str, Any]:
        """Loop position, counters and RNG states, saved with every checkpoint."""
        train_stats = dict(self.train_stats)
        if self._resume_step > 0 and self._stage == Stage.TRAIN:
            # mid-epoch: the epoch's training time so far counts too (in validation the
            # trained epoch's time is already in train_stats) ...
            partial_s = time.perf_counter() - self._epoch_start
            train_stats["time_s"] += partial_s
            if not self._session_warmed_up:  # ... and in a session's first, as its warm-up
                count_as_warmup(train_stats, self._epoch_trained_before, partial_s)
        state = {
            "step": self._resume_step,
            "world_size": self.distributed.world_size,
            # with world_size, the batches per optimizer step (a resume reports a change)
            "grad_accumulation_factor": self.run_opts.grad_accumulation_factor,
            "optimizer_step": self.optimizer_step,
            "skipped_steps": self.skipped_steps,
            "nonfinite_count": self.nonfinite_count,  # a streak of non-finite losses so far
            "step_graphs_failed": self._step_graphs_failed,  # then a resume trains eagerly
            "avg_train_loss": self.avg_train_loss,
            "avg_train_loss_count": self.ledger.train_loss.count,
            "precision": self.amp.name,
            "train_stats": train_stats,
            "rng": capture_rng_state(),
            "pending_grads": self._pending_grads() if self._resume_step > 0 else None,
            # inside an epoch: its batch plan, which a resume skipping into it must find
            "epoch_plan": self._epoch_plan if self._resume_step > 0 else None,
        }
        if self.distributed.world_size > 1:
            # Each rank's generators drew for its own batches (dropout, SpecAugment), it
            # counted its own utterances and, inside an accumulation window, holds its own
            # gradients (no_sync), so each rank needs its own state back; every rank calls
            # this (the checkpointer collects on all ranks, rank 0 writes).
            pending = state.pop("pending_grads")
            ranks: list[Any] = [None] * self.distributed.world_size
            torch.distributed.all_gather_object(ranks, (state["rng"], train_stats, pending))
            state["rank_rng"] = [rng for rng, _, _ in ranks]
            state["rank_train_stats"] = [stats for _, stats, _ in ranks]
            state["rank_pending_grads"] = [grads for _, _, grads in ranks]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        # Rank r trains batches r, r + W, ... of the epoch's batch list: after k batches
        # per rank, the first k * W are done. A new world size W' goes on from there when
        # W' divides k * W; otherwise it would train a batch twice (or skip one): refused.
        saved_world_size = int(state.get("world_size", 1))
        done = int(state["step"]) * saved_world_size
        world_size = self.distributed.world_size
        if done % world_size:
            raise CheckpointError(
                f"The mid-epoch checkpoint was saved after {done} batches of its epoch by "
                f"{saved_world_size} process(es); {world_size} processes cannot go on from "
                f"there without training a batch twice or skipping one ({done} is not a "
                f"multiple of {world_size}). Resume it with {saved_world_size} process(es) "
                "(or a number that divides the batches done); the world size may change "
                "at an epoch end."
            )
        self._resume_step = done // world_size
        factor = state.get("grad_accumulation_factor")
        self._resumed_layout = (saved_world_size, None if factor is None else int(factor))
        self._resume_plan = state.get("epoch_plan")
        self._resume_grads = rank_window(state, saved_world_size, self.distributed)
        self.optimizer_step = int(state["optimizer_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.nonfinite_count = int(state.get("nonfinite_count", 0))
        self._step_graphs_failed = state.get("step_graphs_failed")
        self.ledger.train_loss = RunningMean(
            float(state["avg_train_loss"]), int(state.get("avg_train_loss_count", 0))
        )
        self.train_stats = restored_train_stats(state, self.train_stats, self.distributed)
        if state.get("precision") not in (None, self.amp.name):
            logger.warning(
                "Resuming a %s checkpoint with precision=%s.", state["precision"], self.amp.name
            )
        rank_rng = state.get("rank_rng")
        if rank_rng is not None and len(rank_rng) == world_size:
            restore_rng_state(rank_rng[self.distributed.rank])
        else:  # a single-process checkpoint, or another world size: rank 0's generators
            restore_rng_state(state["rng"])

    def _optimized_params(self) -> list[torch.nn.Parameter]:
        """Every optimizer's parameters, in a fixed order (the order they were built in)."""
        return optimized_params(self.optimizers_dict.values())

    def _pending_grads(self) -> dict[str, Any] | None:
        """An unfinished accumulation window's gradients, for a mid-epoch checkpoint
        (``amp_utils.accumulation_window``); None at a step boundary. Under DDP every rank
        calls it."""
        return window_state(self._optimized_params(), self.amp_step, self.distributed.world_size)

    def _restore_pending_grads(self) -> None:
        """Put a resumed accumulation window's gradients back (after the epoch's zero_grad)."""
        pending, self._resume_grads = self._resume_grads, None
        if pending is not None:
            restore_window(self._optimized_params(), pending, self.amp_step, self.device)

    def global_train_stats(self) -> dict[str, float]:
        """Training time, utterances, audio seconds and data wait of all ranks together.

        Utterances and audio add up over the ranks; the times are the slowest rank's.
        """
        return global_train_stats(self.train_stats, self.distributed)

    def peak_memory_mb(self) -> float:
        """Peak memory of the run so far (GPU allocations on CUDA, process RSS on CPU)."""
        return peak_memory_mb(self.device)
