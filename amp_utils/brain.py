"""``Brain``: the training loop, with the API of SpeechBrain's ``speechbrain.core.Brain``.

A recipe subclasses ``Brain`` and overrides ``compute_forward`` and ``compute_objectives``
(and usually ``on_stage_end`` for metrics and checkpoints); everything else lives here:
autocast, loss scaling, gradient clipping over all parameter groups, gradient accumulation,
non-finite loss handling, checkpoint/resume (also mid-epoch), progress bars, debug mode,
``torch.compile``, per-step TensorBoard scalars and DistributedDataParallel when the
process was started by ``torchrun`` (or as a task of a multi-task SLURM job).

Precision rules (learned from SpeechBrain, with its gaps fixed):

* forward + objectives run under ``TorchAutocast(device_type=<"cuda"|"cpu">, dtype=...)``;
  training uses ``precision``, evaluation ``eval_precision``; backward and the optimizer
  step run outside autocast.
* a ``torch.amp.GradScaler`` is enabled only for fp16; per optimizer step:
  ``unscale_`` -> clip **all** parameter groups -> ``scaler.step`` -> ``update`` -> zero grads.
  Fused/foreach optimizers work, clipping included.
* the LR scheduler is not stepped when the scaler skipped the optimizer step.

Distributed rules (DDP): modules with trainable parameters are wrapped in
``DistributedDataParallel`` (optionally with SyncBatchNorm); gradient accumulation runs
the non-stepping batches under ``no_sync``; the logged loss, its finiteness (so every rank
skips the same steps), evaluation losses and throughput are reduced over the ranks; the
decisions to checkpoint mid-epoch or to stop on a signal are taken together; only rank 0
shows progress bars and writes checkpoints (``Checkpointer`` is rank-aware).
"""

from __future__ import annotations

import logging
import math
import random
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, nullcontext
from enum import Enum, auto
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm  # not tqdm.auto: its asyncio variant creates a second loader iterator

from amp_utils.autocast import AMPConfig, TorchAutocast
from amp_utils.checkpoint import Checkpoint, Checkpointer
from amp_utils.distributed import (
    DistributedConfigError,
    all_reduce_counts,
    all_reduce_max,
    all_reduce_sum,
    any_rank,
    init_distributed,
)
from amp_utils.epoch_counter import EpochCounter
from amp_utils.host_values import HostValues
from amp_utils.memory import peak_memory_mb, reset_peak_memory
from amp_utils.precision import (
    AUTO,
    check_precision_supported,
    configure_tf32,
    make_grad_scaler,
    resolve_device,
    resolve_precision,
    warn_if_emulated,
)
from amp_utils.run_options import RunOptions

logger = logging.getLogger(__name__)

INTRA_EPOCH_FLAG = "intra_epoch"
#: torch.compile modes that replay CUDA graphs (cudagraph trees) on CUDA.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP and ``torch.compile`` wrappers (for its own methods)."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod"):  # torch.compile's OptimizedModule
            module = module._orig_mod
        else:
            return module


def compile_regions(module: torch.nn.Module, **options: Any) -> int:
    """Compile each block of the ``ModuleList``s in ``module`` in place; returns how many.

    Regional compilation (PyTorch's recipe for repeated layers): the blocks share their
    code, so one compile serves all of them -- seconds instead of minutes for a deep
    encoder (measured on an H100: 16 Conformer blocks, 15-40 s instead of 250 s for the
    whole model with dynamic shapes). ``Module.compile`` keeps the state-dict keys, so
    checkpoints load with and without it. Only blocks of the user's own classes count
    (TorchDynamo does not trace into ``torch.nn`` containers compiled in place); without
    such blocks the whole module is compiled in place.
    """
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()  # modules within a block already chosen (nested lists)
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and id(child) not in inside:
            own = [block for block in child if not type(block).__module__.startswith("torch.")]
            blocks.extend(own)
            inside.update(id(m) for block in own for m in block.modules())
    for block in blocks or [module]:
        block.compile(**options)
    return len(blocks) or 1


def compile_stats() -> dict[str, int]:
    """Process-wide ``torch.compile`` counters: graphs compiled, recompiles, CUDA-graph skips."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": int(sum(counters["recompiles"].values())),
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


class Stage(Enum):
    """Simple enum to track stage of experiments."""

    TRAIN = auto()
    VALID = auto()
    TEST = auto()


class NonFiniteLossError(RuntimeError):
    """Too many consecutive non-finite losses: training cannot continue."""


class TrainingInterrupted(SystemExit):
    """SIGTERM/SIGINT arrived; a checkpoint was saved and the run can be resumed."""


class _StepInfo(NamedTuple):
    """Device-side results of an optimizer step, read by the lagged bookkeeping."""

    grad_norm: torch.Tensor
    skipped: torch.Tensor  # bool scalar


class _PendingBatch(NamedTuple):
    """A trained batch whose loss (and step results) are on their way to the host.

    ``values`` holds the loss, then (if the batch ended with an optimizer step) the
    gradient norm and the skipped flag, then (fp16) the loss scale after the step.
    """

    step: int
    values: HostValues
    stepped: bool


def _step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """``optimizer.step()`` unless ``skip``; without a host sync for fused optimizers.

    Fused Adam/AdamW/SGD read ``found_inf`` (the GradScaler protocol) and skip the update
    inside the kernel; other optimizers need the flag on the host.
    """
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale = None
        optimizer.found_inf = skip.to(torch.float32)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf, optimizer.grad_scale
    elif not bool(skip):
        optimizer.step()


class _ScalerState:
    """Checkpoint adapter for the GradScaler that tolerates precision changes on resume.

    Resuming an fp16 run as bf16/fp32 (or the reverse) starts with a fresh scaler instead
    of failing: the loss scale only means something for fp16.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": self.scaler.is_enabled(), "state": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("enabled") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["state"])
        elif state.get("enabled") != self.scaler.is_enabled():
            logger.warning(
                "Precision changed since the checkpoint: the fp16 loss scaler state is dropped "
                "and a fresh one is used."
            )


class Brain:
    """Brain class abstracts away the details of data loops.

    Args:
        modules: name -> ``torch.nn.Module``; moved to the run device, available as
            ``self.modules.<name>``.
        opt_class: called with the modules' parameters to build the optimizer.
        hparams: any values; available with dot access as ``self.hparams.<name>``. Two keys
            are understood by the loop itself: ``lr_scheduler`` (a callable
            ``optimizer -> scheduler`` stepped once per applied optimizer step) and
            ``tensorboard`` (an ``amp_utils.TensorBoardLogger`` for per-step scalars).
        run_opts: a ``RunOptions`` or a dict of its fields (device, precision, ...).
        checkpointer: an ``amp_utils.Checkpointer``; the loop registers the modules (unless
            already registered), its own state, the optimizer, the scaler and the scheduler.

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
    ) -> None:
        self.run_opts = RunOptions.from_dict(run_opts)
        for name, value in vars(self.run_opts).items():
            setattr(self, name, value)
        device = resolve_device(self.run_opts.device)
        self.distributed = init_distributed(self.run_opts.distributed_backend, device.type)
        if self.distributed.enabled and device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # set for this rank
        self.device = device
        self.device_type = self.device.type
        self.amp = self._resolve_amp(self.run_opts.precision, "precision")
        self.eval_amp = self._resolve_amp(self.run_opts.eval_precision, "eval_precision")
        warn_if_emulated(self.amp, self.device)
        configure_tf32(self.device, self.run_opts.allow_tf32)

        self.modules = torch.nn.ModuleDict(self._sync_batchnorm(dict(modules or {})))
        self.modules.to(self.device)
        self.opt_class = opt_class
        self.hparams = SimpleNamespace(**dict(hparams)) if hparams is not None else None
        self.tensorboard = (hparams or {}).get("tensorboard")
        self.checkpointer = checkpointer
        self.scaler = make_grad_scaler(self.amp, self.device)

        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizers_dict: dict[str, torch.optim.Optimizer] = {}
        self.lr_scheduler: Any = None
        self.step = 0  # batches done in the current stage
        self.optimizer_step = 0  # optimizer steps applied in the whole run
        self.skipped_steps = 0  # steps the scaler or the non-finite check skipped
        self.nonfinite_count = 0  # consecutive non-finite losses
        self.avg_train_loss = 0.0
        self.last_grad_norm: float | None = None  # of the last optimizer step read back
        self.train_stats = {"time_s": 0.0, "utterances": 0, "audio_s": 0.0}
        self._resume_step = 0  # training batches already done in the interrupted epoch
        self._pending: list[_PendingBatch] = []  # batches whose values are not read yet
        self._window_finite: torch.Tensor | None = None  # all losses finite since last step
        self._avg_count = 0  # finite losses in the running average
        self._epoch_start = time.perf_counter()
        self._epoch_counter: Any = None
        self._stop_signal: int | None = None
        self._last_ckpt_time = time.time()
        self.evaluated_checkpoint: Checkpoint | None = None  # what the last evaluate loaded
        self._compiled = False
        self._cudagraphs = False  # compiled modules replay CUDA graphs: mark each step
        self._ddp_modules: list[DistributedDataParallel] = []

        if self.checkpointer is not None:
            registered = [id(obj) for obj in self.checkpointer.recoverables.values()]
            for name, module in self.modules.items():
                if id(module) not in registered:  # the uncompiled module: stable state keys
                    self.checkpointer.add_recoverable(f"module.{name}", module)
            self.checkpointer.add_recoverable("brain", self)
            self.checkpointer.add_recoverable("scaler", _ScalerState(self.scaler))

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

    def on_stage_start(self, stage: Stage, epoch: int | None = None) -> None:
        """Called when a stage (train, valid, test) starts; e.g. reset metric trackers."""

    def on_stage_end(self, stage: Stage, stage_loss: float, epoch: int | None = None) -> None:
        """Called when a stage ends; e.g. compute metrics and save a checkpoint."""

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
        self._wrap_distributed()
        self._compile()
        self.init_optimizers()
        if self.checkpointer is not None:
            ckpt = self.checkpointer.recover_if_possible(map_location=self.device)
            if ckpt is not None:
                self._after_resume(ckpt)

    def _after_resume(self, ckpt: Checkpoint) -> None:
        if self._resume_step > 0 and isinstance(self._epoch_counter, EpochCounter):
            # The interrupted epoch is re-entered and its finished batches skipped.
            self._epoch_counter.current -= 1
        logger.info(
            "Resumed from %s (optimizer step %d, %d batches into the epoch)",
            ckpt.path,
            self.optimizer_step,
            self._resume_step,
        )

    def init_optimizers(self) -> None:
        """Build the optimizer (and LR scheduler) and register them for checkpointing."""
        if self.opt_class is None:
            return
        self.optimizer = self.opt_class(self.modules.parameters())
        self.optimizers_dict = {"opt_class": self.optimizer}
        factory = getattr(self.hparams, "lr_scheduler", None) if self.hparams else None
        if factory is not None:
            self.lr_scheduler = factory(self.optimizer)
        if self.checkpointer is not None:
            self.checkpointer.add_recoverable("optimizer", self.optimizer)
            if self.lr_scheduler is not None:
                self.checkpointer.add_recoverable("lr_scheduler", self.lr_scheduler)

    def _sync_batchnorm(self, modules: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
        """With ``sync_batchnorm`` under DDP, BatchNorm layers become SyncBatchNorm."""
        if not (self.run_opts.sync_batchnorm and self.distributed.world_size > 1):
            return modules
        if self.device.type != "cuda":
            raise DistributedConfigError(
                "trainer.sync_batchnorm=true needs CUDA: PyTorch's SyncBatchNorm runs on GPUs "
                "only. Fix: set trainer.sync_batchnorm=false for CPU (gloo) runs."
            )
        return {
            name: torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
            for name, module in modules.items()
        }

    def _wrap_distributed(self) -> None:
        """Wrap every module with trainable parameters in DistributedDataParallel.

        The checkpointer keeps the unwrapped modules, so checkpoints have the same keys
        with and without DDP and load either way.
        """
        if not self.distributed.enabled or self._ddp_modules:
            return
        for name, module in self.modules.items():
            if not any(p.requires_grad for p in module.parameters()):
                continue  # e.g. feature extraction: nothing to synchronise
            wrapped = DistributedDataParallel(
                module,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
                find_unused_parameters=self.run_opts.find_unused_parameters,
            )
            self.modules[name] = wrapped
            self._ddp_modules.append(wrapped)

    @contextmanager
    def no_sync(self, use: bool = True) -> Iterator[None]:
        """Skip DDP's gradient all-reduce inside the block (accumulation batches)."""
        with ExitStack() as stack:
            if use:
                for module in self._ddp_modules:
                    stack.enter_context(module.no_sync())
            yield

    def _compile(self) -> None:
        """``torch.compile`` the selected modules (dynamic shapes: one compile per module).

        With a CUDA-graph mode (``reduce-overhead``) on CUDA, each distinct batch shape is
        captured once and replayed afterwards, which removes the launch overhead of small
        kernels; batches padded to bucket edges keep the set of shapes small. A graph that
        cannot be captured runs without CUDA graphs, and PyTorch logs why.
        """
        if not self.run_opts.compile or self._compiled:
            return
        keys = self.run_opts.compile_module_keys or list(self.modules.keys())
        unknown = sorted(set(keys) - set(self.modules.keys()))
        if unknown:
            raise ValueError(
                f"compile_module_keys {unknown} are not modules; valid: {list(self.modules)}."
            )
        backend = self.run_opts.compile_backend
        regions = self.run_opts.compile_regions and (
            self.device.type == "cuda" or backend != "inductor"
        )
        if self.run_opts.compile_regions and not regions:
            # torch 2.11's CPU inductor miscompiles regionally compiled Conformer blocks
            # under dynamic shapes (a mask's symbolic stride is baked in: NaN gradients or
            # a stride assertion on the second batch shape); the whole module compiles right.
            logger.warning(
                "compile_regions with the inductor backend applies on CUDA only; on %s the "
                "whole modules are compiled (and recompiled for new batch shapes).",
                self.device,
            )
        options = {"mode": self.run_opts.compile_mode, "dynamic": True}
        if backend != "inductor":
            options = {"backend": backend, "dynamic": True}  # modes are inductor's
        for key in keys:
            if regions:
                compile_regions(unwrap_module(self.modules[key]), **options)
            else:
                self.modules[key] = torch.compile(self.modules[key], **options)
        self._compiled = True
        self._cudagraphs = (
            self.device.type == "cuda" and self.run_opts.compile_mode in CUDAGRAPH_MODES
        )

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
        if "generator" not in loader_kwargs:
            loader_kwargs["generator"] = torch.Generator().manual_seed(self.run_opts.seed)
        has_sampler = {"sampler", "batch_sampler"} & set(loader_kwargs)
        if stage == Stage.TRAIN and self.distributed.world_size > 1 and not has_sampler:
            loader_kwargs["sampler"] = DistributedSampler(
                dataset,
                num_replicas=self.distributed.world_size,
                rank=self.distributed.rank,
                shuffle=bool(loader_kwargs.pop("shuffle", False)),
                seed=self.run_opts.seed,
                drop_last=True,
            )
        return DataLoader(dataset, **loader_kwargs)

    # ------------------------------------------------------------- one batch
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
        self.mark_step()
        with self.no_sync(not should_step):
            with TorchAutocast(device_type=self.device_type, dtype=self.amp.dtype):
                outputs = self.compute_forward(batch, Stage.TRAIN)
                loss = self.compute_objectives(outputs, batch, Stage.TRAIN)
            self.scaler.scale(loss / self.run_opts.grad_accumulation_factor).backward()
        # Under DDP: the mean over the ranks, so all of them log, count and skip alike.
        global_loss = self._mean_over_ranks(loss.detach())
        finite = torch.isfinite(global_loss)
        self._window_finite = (
            finite if self._window_finite is None else self._window_finite & finite
        )
        step_info = self.optimizers_step() if should_step else None
        values = [global_loss]
        if step_info is not None:
            values += [step_info.grad_norm, step_info.skipped]
        if self.scaler.is_enabled():
            values.append(self.scaler._get_scale_async())  # the tensor, no sync
        self._pending.append(_PendingBatch(self.step, HostValues(values), step_info is not None))
        self.on_fit_batch_end(batch, outputs, loss, should_step)
        return loss.detach()

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        if self.distributed.world_size == 1:
            return value
        return all_reduce_sum(value.float()) / self.distributed.world_size

    def check_loss_isfinite(self, loss: torch.Tensor) -> bool:
        """True if the loss is finite; counts non-finite ones (the step is skipped).

        Raises:
            NonFiniteLossError: after more than ``nonfinite_patience`` consecutive ones.
        """
        return self._count_nonfinite(float(loss.detach()), self.step)

    def _count_nonfinite(self, loss: float, step: int) -> bool:
        if math.isfinite(loss):
            self.nonfinite_count = 0
            return True
        self.nonfinite_count += 1
        logger.warning(
            "Non-finite loss (%s) at batch %d: step skipped (%d in a row, patience %d).",
            loss,
            step,
            self.nonfinite_count,
            self.run_opts.nonfinite_patience,
        )
        if self.nonfinite_count > self.run_opts.nonfinite_patience:
            raise NonFiniteLossError(
                f"The loss was not finite for {self.nonfinite_count} consecutive batches "
                f"(nonfinite_patience={self.run_opts.nonfinite_patience}); training stopped. "
                "Try a lower learning rate, precision=bf16 instead of fp16, a smaller "
                "trainer.max_grad_norm, or check the input data for silent/corrupt audio."
            )
        return False

    def _trained_parameters(self) -> list[torch.Tensor]:
        return [
            p
            for opt in self.optimizers_dict.values()
            for group in opt.param_groups
            for p in group["params"]
            if p.grad is not None
        ]

    def optimizers_step(self) -> _StepInfo | None:
        """Unscale, clip all parameter groups, step through the scaler, then zero grads.

        Returns the step's gradient norm and whether it was skipped, both as device
        tensors (read later by the bookkeeping, so that nothing waits here).
        """
        self.flush_pending()  # the previous step's values are ready by now
        window_finite, self._window_finite = self._window_finite, None
        if not self.optimizers_dict:
            return None
        for opt in self.optimizers_dict.values():
            self.scaler.unscale_(opt)
        params = self._trained_parameters()
        if not params:
            self.zero_grad(set_to_none=True)
            return None
        if self.run_opts.max_grad_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, self.run_opts.max_grad_norm)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        # Skip on a non-finite loss in the window (and non-finite gradients if asked);
        # fp16's scaler additionally skips any step with inf/NaN gradients.
        skip = (
            ~window_finite
            if window_finite is not None
            else torch.zeros((), dtype=torch.bool, device=grad_norm.device)
        )
        if self.run_opts.skip_nonfinite_grads or self.scaler.is_enabled():
            skip = skip | ~torch.isfinite(grad_norm)
        for opt in self.optimizers_dict.values():
            if self.scaler.is_enabled():
                # The scaler checks the gradients only: a non-finite loss whose gradients
                # are finite must skip too, so its flag joins the scaler's (on the device;
                # the scaler then also backs off as after an overflow).
                found = self.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
                for flag in found.values():
                    torch.maximum(flag, skip.to(flag), out=flag)
                self.scaler.step(opt)
            else:
                _step_unless(opt, skip)
        self.scaler.update()
        self.zero_grad(set_to_none=True)
        return _StepInfo(grad_norm.detach(), skip)

    def flush_pending(self) -> None:
        """Account for the batches whose values are pending (syncs with the device).

        The fit loop calls it at the end of each epoch and before a checkpoint; call it
        after driving ``fit_batch`` yourself to get its counters and running loss up to date.
        """
        pending, self._pending = self._pending, []
        for item in pending:
            self._account(item)

    def _account(self, item: _PendingBatch) -> None:
        values = item.values.get()  # the one read of this batch's values from the device
        loss = values[0]
        if self._count_nonfinite(loss, item.step):
            self._avg_count += 1
            self.avg_train_loss += (loss - self.avg_train_loss) / self._avg_count
        if item.stepped:
            grad_norm, skipped = values[1], values[2] > 0.5
            if skipped:
                self.skipped_steps += 1
            else:
                self.optimizer_step += 1
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self.last_grad_norm = grad_norm
        scale = values[-1] if self.scaler.is_enabled() else None
        self._log_train_step(item, loss, scale)

    @torch.no_grad()
    def evaluate_batch(self, batch: Any, stage: Stage) -> torch.Tensor:
        """Evaluate one batch under ``eval_precision``; returns the detached loss."""
        self.mark_step()
        eager = self._compiled and not self.run_opts.compile_eval
        with (
            torch.compiler.set_stance("force_eager") if eager else nullcontext(),
            TorchAutocast(device_type=self.device_type, dtype=self.eval_amp.dtype),
        ):
            outputs = self.compute_forward(batch, stage)
            loss = self.compute_objectives(outputs, batch, stage)
        return loss.detach().cpu()

    def update_average(self, loss: torch.Tensor, avg_loss: float) -> float:
        """Running mean of the loss over the ``self.step`` batches of this stage."""
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
        if not isinstance(train_set, DataLoader):
            train_set = self.make_dataloader(train_set, Stage.TRAIN, **(train_loader_kwargs or {}))
        if valid_set is not None and not isinstance(valid_set, DataLoader):
            valid_set = self.make_dataloader(valid_set, Stage.VALID, **(valid_loader_kwargs or {}))
        for loader in (train_set, valid_set):
            if loader is not None and loader.generator is None:
                # Keep iterator start-up off the global RNG, so resumes replay exactly.
                loader.generator = torch.Generator().manual_seed(self.run_opts.seed)
        self._epoch_counter = epoch_counter
        if (
            self.checkpointer is not None
            and isinstance(epoch_counter, EpochCounter)
            and not any(obj is epoch_counter for obj in self.checkpointer.recoverables.values())
        ):
            self.checkpointer.add_recoverable("epoch_counter", epoch_counter)
        self.on_fit_start()
        enable = self._progressbar(progressbar)
        reset_peak_memory(self.device)
        with self._stop_signals_caught():
            for epochs_run, epoch in enumerate(epoch_counter, start=1):
                self._fit_train(train_set, epoch, enable)
                self._fit_valid(valid_set, epoch, enable)
                if self.run_opts.debug and epochs_run >= self.run_opts.debug_epochs:
                    break

    def epoch_label(self, epoch: int | None) -> str:
        """``"3/30"``: the epoch and the number of epochs (when the epoch counter has one)."""
        limit = getattr(self._epoch_counter, "limit", None)
        return f"{epoch}/{limit}" if limit is not None and epoch is not None else str(epoch)

    def _progressbar(self, requested: bool | None) -> bool:
        """Whether to show progress bars: as requested, and only on rank 0."""
        enable = (not self.run_opts.noprogressbar) if requested is None else requested
        return enable and self.distributed.is_main

    def _set_loader_epoch(self, loader: DataLoader, epoch: int, skip: int) -> bool:
        """Tell an epoch-aware sampler the epoch; True if it will skip ``skip`` batches."""
        sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        for candidate in (sampler, getattr(sampler, "sampler", None)):
            if hasattr(candidate, "set_epoch"):
                candidate.set_epoch(epoch)
                if skip and hasattr(candidate, "skip_batches"):
                    candidate.skip_batches(skip)
                    return True
        return False

    def _fit_train(self, train_set: DataLoader, epoch: int, enable: bool) -> None:
        self.on_stage_start(Stage.TRAIN, epoch)
        self.modules.train()
        self.zero_grad()
        skip = self._resume_step
        skipped_by_sampler = self._set_loader_epoch(train_set, epoch, skip)
        self.step = skip
        if skip == 0:
            self.avg_train_loss, self._avg_count = 0.0, 0
        # The bar counts the whole epoch and starts at the resume position: a sampler that
        # skips leaves the finished batches out of len(), else they are skipped here.
        total = len(train_set) if hasattr(train_set, "__len__") else None
        if total is not None and skipped_by_sampler:
            total += skip
        if self.run_opts.debug and total is not None:
            total = min(total, self.run_opts.debug_batches)
        self._epoch_start = time.perf_counter()
        batches = iter(train_set)
        if skip and not skipped_by_sampler:
            for _ in range(skip):
                next(batches)
        with tqdm(
            batches,
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
                self.step += 1
                self.fit_batch(batch)
                self.train_stats["utterances"] += utterances
                self.train_stats["audio_s"] += audio_s
                self._resume_step = self.step
                if self.step % self.run_opts.log_interval_steps == 0:
                    bar.set_postfix(train_loss=f"{self.avg_train_loss:.4f}", refresh=False)
                if self.step % self.run_opts.grad_accumulation_factor == 0:
                    self._maybe_save_intra_epoch()
        self.flush_pending()
        if self.device_type == "cuda":
            torch.cuda.synchronize(self.device)
        self.train_stats["time_s"] += time.perf_counter() - self._epoch_start
        self._resume_step = 0
        self.on_stage_end(Stage.TRAIN, self.avg_train_loss, epoch)
        self.step = 0

    def _log_train_step(self, item: _PendingBatch, loss: float, scale: float | None) -> None:
        if self.tensorboard is None or item.step % self.run_opts.log_interval_steps:
            return
        scalars: dict[str, float] = {"train/loss": loss}
        if self.optimizer is not None:
            scalars["train/lr"] = self.optimizer.param_groups[0]["lr"]
        if item.stepped and self.last_grad_norm is not None:
            scalars["train/grad_norm"] = self.last_grad_norm
        if scale is not None:
            scalars["train/loss_scale"] = scale
        scalars["train/skipped_steps"] = self.skipped_steps
        elapsed = self.train_stats["time_s"] + time.perf_counter() - self._epoch_start
        if elapsed > 0:  # under DDP: rank 0's rate times the world size (cheap estimate)
            rate = self.train_stats["utterances"] / elapsed
            scalars["train/utterances_per_s"] = rate * self.distributed.world_size
        self.tensorboard.log_scalars(scalars, step=self.optimizer_step + self.skipped_steps)

    def _fit_valid(self, valid_set: DataLoader | None, epoch: int, enable: bool) -> None:
        if valid_set is None:
            return
        avg_valid_loss = self._run_eval_loop(valid_set, Stage.VALID, epoch, enable)
        self.on_stage_end(Stage.VALID, avg_valid_loss, epoch)
        self.step = 0

    def _run_eval_loop(
        self, loader: DataLoader, stage: Stage, epoch: int | None, enable: bool
    ) -> float:
        self.on_stage_start(stage, epoch)
        self.modules.eval()
        self.step = 0
        avg_loss = 0.0
        desc = f"epoch {self.epoch_label(epoch)} {stage.name.lower()}" if epoch else "test"
        with torch.no_grad():
            for batch in tqdm(loader, dynamic_ncols=True, disable=not enable, desc=desc):
                if self.run_opts.debug and self.step >= self.run_opts.debug_batches:
                    break
                self.step += 1
                loss = self.evaluate_batch(batch, stage)
                avg_loss = self.update_average(loss, avg_loss)
        if self.distributed.world_size > 1:  # each rank saw its own shard of the split
            totals = all_reduce_counts({"loss": avg_loss * self.step, "batches": self.step})
            avg_loss = totals["loss"] / max(totals["batches"], 1)
        return avg_loss

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
        if not isinstance(test_set, DataLoader):
            test_set = self.make_dataloader(test_set, Stage.TEST, **(test_loader_kwargs or {}))
        self.on_evaluate_start(max_key=max_key, min_key=min_key)
        enable = self._progressbar(progressbar)
        avg_test_loss = self._run_eval_loop(test_set, Stage.TEST, None, enable)
        self.on_stage_end(Stage.TEST, avg_test_loss, None)
        self.step = 0
        return avg_test_loss

    # ------------------------------------------------------------ checkpoints
    def _maybe_save_intra_epoch(self) -> None:
        stop = self._stop_signal is not None
        by_time = (
            self.checkpointer is not None
            and self.run_opts.ckpt_interval_minutes > 0
            and time.time() - self._last_ckpt_time >= self.run_opts.ckpt_interval_minutes * 60
        )
        if self.distributed.world_size > 1:
            # Ranks receive signals and read clocks at different moments: they decide
            # together, every log_interval_steps optimizer steps, so that all of them
            # save (and stop) after the same batch.
            updates = self.step // self.run_opts.grad_accumulation_factor
            if updates % self.run_opts.log_interval_steps:
                stop = by_time = False
            else:
                stop, by_time = any_rank(stop, by_time)
        if stop:
            self._save_intra_epoch_ckpt()
            signum = self._stop_signal or signal.SIGTERM  # another rank's signal
            name = signal.Signals(signum).name
            raise TrainingInterrupted(
                f"Received {name}: saved a checkpoint at epoch "
                f"{getattr(self._epoch_counter, 'current', '?')}, batch {self.step}. "
                "Run the same command again to resume where it stopped."
            )
        if self.checkpointer is None:
            return
        by_steps = (
            self.run_opts.ckpt_interval_steps > 0
            and self.optimizer_step > 0
            and self.optimizer_step % self.run_opts.ckpt_interval_steps == 0
        )
        if by_steps or by_time:
            self._save_intra_epoch_ckpt()

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
        self._last_ckpt_time = time.time()

    def _stop_signals_caught(self) -> Any:
        """Context in which SIGTERM/SIGINT request a checkpoint and a clean exit."""
        brain = self

        class _Catch:
            def __enter__(self) -> None:
                self.previous = {}
                if threading.current_thread() is not threading.main_thread():
                    return
                for sig in (signal.SIGTERM, signal.SIGINT):
                    self.previous[sig] = signal.signal(sig, self._handle)

            @staticmethod
            def _handle(signum: int, frame: Any) -> None:
                if brain._stop_signal is not None:  # second signal: stop now
                    raise KeyboardInterrupt
                brain._stop_signal = signum
                logger.warning("Received signal %d: checkpointing after this batch.", signum)

            def __exit__(self, *exc: Any) -> None:
                for sig, handler in self.previous.items():
                    signal.signal(sig, handler)

        return _Catch()

    def state_dict(self) -> dict[str, Any]:
        """Loop position, counters and RNG states, saved with every checkpoint."""
        train_stats = dict(self.train_stats)
        if self._resume_step > 0:  # mid-epoch: the epoch's training time so far counts too
            train_stats["time_s"] += time.perf_counter() - self._epoch_start
        state = {
            "step": self._resume_step,
            "world_size": self.distributed.world_size,
            "optimizer_step": self.optimizer_step,
            "skipped_steps": self.skipped_steps,
            "avg_train_loss": self.avg_train_loss,
            "precision": self.amp.name,
            "train_stats": train_stats,
            "rng": {
                "python": random.getstate(),
                "torch": torch.get_rng_state(),
            },
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["rng"]["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        # Rank r trains batches r, r + W, ... of the epoch's batch list: after k batches
        # per rank, the first k * W are done, whatever the new world size is.
        done = int(state["step"]) * int(state.get("world_size", 1))
        self._resume_step = done // self.distributed.world_size
        self.optimizer_step = int(state["optimizer_step"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.avg_train_loss = float(state["avg_train_loss"])
        self.train_stats = dict(state.get("train_stats", self.train_stats))
        if state.get("precision") not in (None, self.amp.name):
            logger.warning(
                "Resuming a %s checkpoint with precision=%s.", state["precision"], self.amp.name
            )
        random.setstate(state["rng"]["python"])
        torch.set_rng_state(state["rng"]["torch"].cpu())
        if "cuda" in state["rng"] and torch.cuda.is_available():
            states = state["rng"]["cuda"][: torch.cuda.device_count()]
            torch.cuda.set_rng_state_all([s.cpu() for s in states])

    def global_train_stats(self) -> dict[str, float]:
        """Training time, utterances and audio seconds of all ranks together.

        Utterances and audio add up over the ranks; the time is the slowest rank's.
        """
        if self.distributed.world_size == 1:
            return dict(self.train_stats)
        totals = all_reduce_counts(
            {"utterances": self.train_stats["utterances"], "audio_s": self.train_stats["audio_s"]}
        )
        slowest = all_reduce_max(torch.tensor([self.train_stats["time_s"]], dtype=torch.float64))
        return {**totals, "time_s": float(slowest[0])}

    def peak_memory_mb(self) -> float:
        """Peak memory of the run so far (GPU allocations on CUDA, process RSS on CPU)."""
        return peak_memory_mb(self.device)
