"""Peer training loops for the benchmark: SpeechBrain's ``Brain`` and Lightning's ``Trainer``.

Each peer trains *our* modules with *our* forward + loss (``forward_loss(modules, batch)``,
supplied by the caller) on *our* batches, with the same AdamW settings and gradient
clipping, and is driven the way its own documentation says, so that a benchmark row
"ours / SpeechBrain" or "ours / Lightning" compares loops, not models. Both toolkits live
in the optional extra ``bench`` (``pip install -e ".[bench]"``); when one is missing,
:func:`run_peer` returns a result with status ``"skipped"`` and never fails.

How each peer is driven:

* **SpeechBrain** (``speechbrain.core.Brain``): a subclass whose ``compute_forward`` moves
  the batch to the device (``batch.to(self.device)``, as its recipes do) and calls
  ``forward_loss``; ``compute_objectives`` returns that loss. ``run_opts`` are
  ``{"device", "precision" (fp32/fp16/bf16), "max_grad_norm", "noprogressbar"}`` and
  ``opt_class`` builds AdamW with our settings. Outside ``Brain.fit`` we do what ``fit`` does
  before its first batch: ``on_fit_start()`` (compile/DDP wrapping, both off here, and
  ``init_optimizers``), ``modules.train()``, ``zero_grad()`` and ``nonfinite_count = 0``;
  then one step is ``brain.step += 1; brain.fit_batch(batch)``: SpeechBrain's own autocast,
  GradScaler (fp16 on CUDA only), ``unscale_``, clipping, non-finite loss check and
  optimizer step. It is timed by ``recipes.step_timing.time_steps``, like our loops.
* **Lightning** (``lightning.pytorch.Trainer``): a ``LightningModule`` whose
  ``training_step`` returns ``forward_loss`` and whose ``configure_optimizers`` returns
  AdamW; ``transfer_batch_to_device`` is overridden for our batch type, as Lightning's docs
  ask for custom batch classes. ``Trainer(precision="32-true" | "16-mixed" | "bf16-mixed",
  gradient_clip_val=max_grad_norm, max_steps=warmup + steps, ...)`` with logging,
  checkpointing, progress bar and model summary off runs ``fit`` over a list of the
  batches. Lightning owns the loop, so a ``Callback`` times the steps (CUDA events, or
  ``time.perf_counter`` on the CPU, at ``on_train_batch_start`` and after the last
  ``on_train_batch_end``) and returns the same statistics as ``time_steps``.

What differs from our loop (also returned per run as ``PeerResult.notes``):

* Lightning refuses gradient clipping with an optimizer that unscales inside its step
  (``fused=True`` AdamW) under ``16-mixed`` *and* ``bf16-mixed``; with clipping on it gets
  ``foreach`` AdamW instead. Its fp16 ``GradScaler.step`` then reads ``found_inf`` on the
  host: one device sync per step.
* Lightning's mixed precision runs ``torch.autocast(..., cache_enabled=False)``: no cache of
  weight casts within a forward (ours keeps PyTorch's default, the cache on).
* Lightning turns ``precision="16-mixed"`` on the CPU into ``bf16-mixed`` (with a warning),
  and SpeechBrain refuses fp16 on the CPU; both report ``"unsupported"`` for that case,
  while our loop runs it (CPU autocast + ``GradScaler("cpu")``).
* Lightning moves the model to the CPU at the end of ``fit``; the modules are moved back to
  the device afterwards, so the caller can go on using them.
* SpeechBrain syncs the host twice per step: ``if not torch.isfinite(loss)`` and
  ``loss.detach().cpu()`` in ``fit_batch``.
* SpeechBrain documents a negative ``max_grad_norm`` as "disable", but 1.1.2 passes it to
  ``clip_grad_norm_``, which then flips the gradients' sign; clipping off
  (``max_grad_norm <= 0``) is passed as ``inf`` instead. It clips the first parameter
  group of each optimizer (ours: all groups; the same here, with one group).
* Importing ``speechbrain.core`` turns TF32 on for the whole process (its ``allow_tf32``
  quirk, so its users' "fp32" is TF32 on Ampere+). :func:`import_speechbrain` restores the
  caller's TF32 setting, so a peer's fp32 row runs under the same TF32 setting as ours.

The peers train the given modules in place (as the benchmark's bare loop does); pass a
copy if the weights must stay untouched.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from types import ModuleType
from typing import Any

import torch

from amp_utils.autocast import PRECISIONS
from amp_utils.memory import release_cached_memory, reset_peak_memory
from recipes.step_timing import step_stats, time_steps

#: The peers :func:`run_peer` knows, by name.
PEERS: tuple[str, ...] = ("speechbrain", "lightning")

#: How to install the peers; shown when one is missing.
INSTALL_HINT = "pip install -e '.[bench]'"

#: Our precision names -> Lightning's ``Trainer(precision=...)``.
LIGHTNING_PRECISIONS: dict[str, str] = {"fp32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}

#: The distribution that must be installed for each peer.
_DISTRIBUTIONS: dict[str, str] = {"speechbrain": "speechbrain", "lightning": "lightning"}

#: ``forward_loss(modules, batch) -> loss``: the recipe's forward pass and loss, run under
#: the peer's autocast (features, augmentation, model and loss, as in our loop).
ForwardLoss = Callable[[torch.nn.ModuleDict, Any], torch.Tensor]


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer settings every loop of a comparison shares.

    Attributes:
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: clip the global gradient norm to this; ``<= 0`` turns clipping off.
        fused: fused AdamW kernels (``fused=True``) rather than ``foreach=True``.
    """

    lr: float
    weight_decay: float = 0.0
    max_grad_norm: float = 5.0
    fused: bool = True

    def adamw(self, params: Iterable[Any], fused: bool | None = None) -> torch.optim.AdamW:
        """AdamW over ``params`` with these settings (``fused`` overrides ``self.fused``)."""
        fused = self.fused if fused is None else fused
        return torch.optim.AdamW(
            params,
            lr=self.lr,
            weight_decay=self.weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )


@dataclass
class PeerResult:
    """What :func:`run_peer` reports for one peer and precision.

    Attributes:
        peer: ``"speechbrain"`` or ``"lightning"``.
        precision: ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        status: ``"ran"``; ``"skipped"`` (the package is not installed); or
            ``"unsupported"`` (the peer refuses or silently changes this precision/device).
        reason: why it was skipped or unsupported (empty when it ran).
        version: the peer's installed version, or ``None``.
        notes: what the peer did differently from our loop in this run.
        stats: when it ran, the statistics in ``recipes.step_timing.time_steps``' format
            (steps, seconds, steps_per_s, utterances, audio_seconds, p50_step_ms,
            p90_step_ms, peak_memory_mb); otherwise ``None``.
    """

    peer: str
    precision: str
    status: str
    reason: str = ""
    version: str | None = None
    notes: list[str] = field(default_factory=list)
    stats: dict[str, Any] | None = None


def peer_version(name: str) -> str | None:
    """Installed version of peer ``name``, or ``None`` when it cannot be imported.

    Raises:
        ValueError: ``name`` is not one of :data:`PEERS`.
    """
    _check_name(name)
    if importlib.util.find_spec(name) is None:
        return None
    try:
        return importlib.metadata.version(_DISTRIBUTIONS[name])
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def unsupported_reason(name: str, precision: str, device: torch.device) -> str | None:
    """Why peer ``name`` cannot run ``precision`` on ``device`` as asked, or ``None``.

    Raises:
        ValueError: an unknown peer or precision name.
    """
    _check_name(name)
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}; valid: {', '.join(PRECISIONS)}.")
    if device.type not in ("cpu", "cuda"):
        return f"{name} peer: only cpu and cuda devices are wired up (got {device.type})"
    if precision == "fp16" and device.type == "cpu":
        if name == "speechbrain":
            return "SpeechBrain refuses precision=fp16 on the CPU (Brain raises ValueError)"
        return "Lightning turns precision='16-mixed' on the CPU into 'bf16-mixed'"
    return None


def import_speechbrain() -> ModuleType:
    """``speechbrain.core``, imported without keeping its process-wide TF32 switch.

    SpeechBrain's import applies its "quirks", among them ``allow_tf32`` (TF32 matmuls and
    cuDNN convolutions on), which would silently turn every later fp32 measurement of the
    process into TF32. The caller's settings are restored afterwards.

    Raises:
        ModuleNotFoundError: SpeechBrain is not installed.
    """
    matmul_precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    try:
        import speechbrain.core
    finally:
        torch.set_float32_matmul_precision(matmul_precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32
    return speechbrain.core


@dataclass
class SpeechBrainPeer:
    """A SpeechBrain ``Brain`` over our modules; :meth:`step` is one training step.

    Attributes:
        brain: the ``speechbrain.core.Brain`` (its ``modules`` hold our modules).
        notes: what differs from our loop.
        name: ``"speechbrain"``.
    """

    brain: Any
    notes: list[str]
    name: str = "speechbrain"

    def step(self, batch: Any) -> None:
        """One optimizer step on ``batch``, as ``Brain.fit`` runs it."""
        self.brain.step += 1
        self.brain.fit_batch(batch)


def speechbrain_peer(
    modules: torch.nn.ModuleDict,
    forward_loss: ForwardLoss,
    precision: str,
    device: torch.device,
    settings: OptimizerSettings,
) -> SpeechBrainPeer:
    """A SpeechBrain ``Brain`` that trains ``modules`` with ``forward_loss``, ready to step.

    Raises:
        ModuleNotFoundError: SpeechBrain is not installed.
        ValueError: SpeechBrain refuses the precision on this device (see
            :func:`unsupported_reason`).
    """
    sb_core = import_speechbrain()
    notes = [
        "SpeechBrain: fit_batch syncs the host twice per step (isfinite check, loss.cpu())",
    ]
    max_grad_norm = settings.max_grad_norm
    if max_grad_norm <= 0:
        max_grad_norm = float("inf")
        notes.append(
            "SpeechBrain: clipping off passed as max_grad_norm=inf (a negative value, its "
            "documented 'off', flips the gradients' sign in 1.1.2)"
        )

    class PeerBrain(sb_core.Brain):
        """Our forward + loss in SpeechBrain's two hooks."""

        def compute_forward(self, batch: Any, stage: Any) -> torch.Tensor:
            batch = batch.to(self.device, non_blocking=True)
            return forward_loss(self.modules, batch)

        def compute_objectives(self, predictions: torch.Tensor, batch: Any, stage: Any):
            return predictions

    brain = PeerBrain(
        modules=dict(modules.items()),
        opt_class=settings.adamw,
        run_opts={
            "device": str(device),
            "precision": precision,
            "max_grad_norm": max_grad_norm,
            "noprogressbar": True,
        },
    )
    # What Brain.fit does before its first batch.
    brain.on_fit_start()
    brain.modules.train()
    brain.zero_grad()
    brain.nonfinite_count = 0
    return SpeechBrainPeer(brain=brain, notes=notes)


def _batch_sizes(batches: Iterable[Any]) -> tuple[int, float]:
    """Utterances and audio seconds of ``batches`` (durations counted where on the host)."""
    utterances, audio_s = 0, 0.0
    for batch in batches:
        utterances += len(batch)
        durations = getattr(batch, "durations", None)
        if isinstance(durations, torch.Tensor) and durations.device.type == "cpu":
            audio_s += float(durations.sum())
    return utterances, audio_s


def _lightning_step_timer(warmup: int, steps: int, device: torch.device) -> Any:
    """A Lightning ``Callback`` that times steps ``warmup .. warmup + steps - 1``."""
    from lightning.pytorch.callbacks import Callback

    cuda = device.type == "cuda"

    class StepTimer(Callback):
        """Marks the start of every timed step and the end of the last one."""

        def __init__(self) -> None:
            self.marks: list[Any] = []
            self.start = 0.0
            self.total = 0.0

        def _mark(self) -> None:
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                self.marks.append(time.perf_counter())

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == warmup:
                if cuda:
                    torch.cuda.synchronize(device)
                reset_peak_memory(device)
                self.start = time.perf_counter()
            if batch_idx >= warmup:
                self._mark()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if batch_idx == warmup + steps - 1:
                self._mark()
                if cuda:
                    torch.cuda.synchronize(device)
                self.total = time.perf_counter() - self.start

        def per_step_s(self) -> list[float]:
            pairs = zip(self.marks, self.marks[1:], strict=False)
            if cuda:
                return [a.elapsed_time(b) / 1e3 for a, b in pairs]
            return [b - a for a, b in pairs]

    return StepTimer()


class _Batches:
    """Batches as one iterable for ``Trainer.fit``: a plain list is read as a list of loaders."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


@dataclass
class LightningPeer:
    """A ``LightningModule`` over our modules and the ``Trainer`` settings to fit it.

    Attributes:
        module: the ``LightningModule``.
        trainer_kwargs: ``Trainer`` arguments (precision, clipping, device; no logging).
        device: where the modules live (Lightning moves them to the CPU after ``fit``).
        notes: what differs from our loop.
        name: ``"lightning"``.
    """

    module: Any
    trainer_kwargs: dict[str, Any]
    device: torch.device
    notes: list[str]
    name: str = "lightning"

    def run(self, batches: Iterator[Any], warmup: int, steps: int) -> dict[str, Any]:
        """``Trainer.fit`` over ``warmup + steps`` batches; statistics of the last ``steps``.

        Returns:
            The statistics in ``recipes.step_timing.time_steps``' format.
        """
        import lightning.pytorch as pl

        if steps < 1 or warmup < 0:
            raise ValueError(f"Need steps >= 1 and warmup >= 0 (got {steps}, {warmup}).")
        planned = list(islice(batches, warmup + steps))
        if len(planned) < warmup + steps:
            raise ValueError(f"Only {len(planned)} batches for {warmup} + {steps} steps.")
        utterances, audio_s = _batch_sizes(planned[warmup:])
        timer = _lightning_step_timer(warmup, steps, self.device)
        release_cached_memory(self.device)  # as time_steps does before its warm-up
        trainer = pl.Trainer(
            **self.trainer_kwargs, max_steps=warmup + steps, max_epochs=1, callbacks=[timer]
        )
        try:
            trainer.fit(self.module, train_dataloaders=_Batches(planned))
        finally:
            self.module.to(self.device)  # Lightning's teardown moved it to the CPU
        if len(timer.marks) != steps + 1:
            raise RuntimeError(
                f"Lightning ran {len(timer.marks) - 1} of {steps} timed steps "
                f"(global_step={trainer.global_step})."
            )
        return step_stats(timer.per_step_s(), timer.total, utterances, audio_s, self.device)


def lightning_peer(
    modules: torch.nn.ModuleDict,
    forward_loss: ForwardLoss,
    precision: str,
    device: torch.device,
    settings: OptimizerSettings,
) -> LightningPeer:
    """A ``LightningModule`` training ``modules`` with ``forward_loss``, and its Trainer setup.

    Raises:
        ModuleNotFoundError: Lightning is not installed.
        ValueError: an unsupported precision or device (see :func:`unsupported_reason`).
    """
    import lightning.pytorch as pl

    reason = unsupported_reason("lightning", precision, device)
    if reason is not None:
        raise ValueError(reason)
    notes: list[str] = []
    clip = settings.max_grad_norm > 0
    fused = settings.fused
    if fused and clip and precision != "fp32":
        fused = False
        notes.append(
            "Lightning: gradient_clip_val with a fused optimizer is refused under "
            f"{LIGHTNING_PRECISIONS[precision]} -> foreach AdamW"
        )
    if precision != "fp32":
        notes.append(
            "Lightning: autocast(cache_enabled=False): weight casts are not cached in a forward"
        )
    if precision == "fp16" and not fused:
        notes.append("Lightning: fp16 GradScaler.step with a non-fused optimizer syncs the host")

    class PeerModule(pl.LightningModule):
        """Our forward + loss as ``training_step``; AdamW with the shared settings."""

        def __init__(self) -> None:
            super().__init__()
            self.net = modules

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return forward_loss(self.net, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return settings.adamw(self.parameters(), fused=fused)

        def transfer_batch_to_device(
            self, batch: Any, device: torch.device, dataloader_idx: int
        ) -> Any:
            if hasattr(batch, "to"):  # our batch class, moved as our loop moves it
                return batch.to(device, non_blocking=True)
            return super().transfer_batch_to_device(batch, device, dataloader_idx)

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        placement: dict[str, Any] = {"accelerator": "gpu", "devices": [index]}
    else:
        placement = {"accelerator": "cpu", "devices": 1}
    trainer_kwargs = {
        **placement,
        "precision": LIGHTNING_PRECISIONS[precision],
        "gradient_clip_val": settings.max_grad_norm if clip else None,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return LightningPeer(
        module=PeerModule(), trainer_kwargs=trainer_kwargs, device=device, notes=notes
    )


def run_peer(
    name: str,
    modules: torch.nn.ModuleDict,
    forward_loss: ForwardLoss,
    batches: Iterator[Any],
    *,
    precision: str,
    device: torch.device,
    settings: OptimizerSettings,
    warmup: int,
    steps: int,
) -> PeerResult:
    """Time ``warmup + steps`` training steps of peer ``name`` on ``batches``.

    ``modules`` must already be on ``device`` and are trained in place; ``batches`` should
    be pre-staged on the device like the bare loop's. A peer that is not installed gives
    status ``"skipped"``, one that refuses the precision on this device ``"unsupported"``;
    neither raises.

    Raises:
        ValueError: an unknown peer or precision name.
    """
    reason = unsupported_reason(name, precision, device)
    version = peer_version(name)
    if version is None:
        return PeerResult(name, precision, "skipped", f"{name} is not installed: {INSTALL_HINT}")
    if reason is not None:
        return PeerResult(name, precision, "unsupported", reason, version)
    if name == "speechbrain":
        peer = speechbrain_peer(modules, forward_loss, precision, device, settings)
        stats = time_steps(peer.step, batches, warmup, steps, device)
        # the batch shapes only our FLOP counter reads; the loader wait of synthetic
        # batches (Lightning's timer cannot see it, so neither peer reports it)
        for key in ("shapes", "wait_ms_mean", "wait_ms_max"):
            stats.pop(key, None)
        return PeerResult(name, precision, "ran", "", version, peer.notes, stats)
    lightning = lightning_peer(modules, forward_loss, precision, device, settings)
    stats = lightning.run(batches, warmup, steps)
    return PeerResult(name, precision, "ran", "", version, lightning.notes, stats)


def _check_name(name: str) -> None:
    if name not in PEERS:
        raise ValueError(f"Unknown peer {name!r}; valid: {', '.join(PEERS)}.")
