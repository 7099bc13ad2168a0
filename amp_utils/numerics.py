"""Numerics probes: how each module's activations and gradients fare in fp16/bf16.

Two probes watch a model while it trains a few batches under autocast:

- ``ActivationProbe`` (forward hooks): for every module, recomputes its forward in fp32
  (autocast off, fp32 copies of the same inputs) and compares. It records the largest
  |activation|, the share of the fp32 outputs that fp16 and bf16 cannot hold (overflow
  above the largest finite value; underflow: nonzero values that flush to zero, and
  subnormals, which keep fewer significant bits), outputs that came out non-finite under
  autocast while the fp32 ones are finite, and the relative error
  ``||y_autocast - y_fp32|| / ||y_fp32||``.
- ``GradientProbe`` (hooks on the gradient flowing into each parameter): for every
  parameter and backward pass, the share of gradient values that fp16 flushes to zero at
  the loss scale in use, and the largest |grad * scale| (the headroom before overflow).
  Each backward's own gradient is measured, not ``param.grad``, which under gradient
  accumulation holds the running sum of the window's micro-batches.

``probe_training_batches`` runs both over a Brain's training batches; the verdicts and the
report are ``amp_utils.numerics_report``'s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Self

import torch
from torch import nn

from amp_utils.module_precision import FP32_MARK, named_modules_of

# ---------------------------------------------------------------- formats and thresholds


@dataclass(frozen=True)
class FloatFormat:
    """Range and precision of a floating-point format (from ``torch.finfo``)."""

    name: str
    max_finite: float  # larger magnitudes overflow to inf
    smallest_normal: float  # below it: subnormal, fewer significant bits
    smallest_subnormal: float  # nonzero magnitudes below about half of it flush to 0
    unit_roundoff: float  # largest relative error of one rounding (eps / 2)

    @classmethod
    def of(cls, name: str, dtype: torch.dtype) -> FloatFormat:
        info = torch.finfo(dtype)
        return cls(
            name, info.max, info.smallest_normal, info.smallest_normal * info.eps, info.eps / 2
        )

    # A cast rounds to nearest (ties to even), so the limits lie half a unit in the last
    # place beyond the representable extremes: fp16 rounds 65519 down to 65504 and 65520 up
    # to inf; 2^-25 (half its smallest subnormal) ties to 0, anything above it to 2^-24.

    @property
    def overflow_threshold(self) -> float:
        """Magnitudes from here on round to inf: ``max_finite`` plus half its ulp."""
        exponent = math.frexp(self.max_finite)[1] - 1  # max_finite = 1.xxx * 2^exponent
        return self.max_finite + 2.0 * self.unit_roundoff * 2.0**exponent / 2

    @property
    def flush_threshold(self) -> float:
        """Nonzero magnitudes up to and including this round to 0: half the smallest
        subnormal (the tie goes to the even neighbour, 0)."""
        return self.smallest_subnormal / 2

    @property
    def normal_threshold(self) -> float:
        """Magnitudes from here on round to a normal number: ``smallest_normal`` less half
        a subnormal step (the tie goes to the even neighbour, the smallest normal)."""
        return self.smallest_normal - self.smallest_subnormal / 2


#: fp16: max 65504, normal from 2^-14, subnormal from 2^-24; bf16: fp32's range, 8 bits.
FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat.of("fp16", torch.float16),
    "bf16": FloatFormat.of("bf16", torch.bfloat16),
}

#: Loss scale an fp16 run starts with (``torch.amp.GradScaler``'s ``init_scale``): used to
#: predict fp16 gradients from an fp32 or bf16 run.
DEFAULT_FP16_LOSS_SCALE = 2.0**16
#: Values per tensor sent to TensorBoard histograms (a random subset of larger tensors).
HISTOGRAM_SAMPLES = 100_000

# -------------------------------------------------------------------- measurements


@dataclass
class RangeCounts:
    """How many values of a tensor a format overflows, flushes to zero or denormalizes."""

    overflow: int = 0  # |x| >= max finite + ulp / 2 (rounds to inf)
    flush_to_zero: int = 0  # 0 < |x| <= smallest subnormal / 2 (rounds to 0)
    subnormal: int = 0  # rounds to a nonzero subnormal (fewer significant bits)

    def add(self, other: RangeCounts) -> None:
        self.overflow += other.overflow
        self.flush_to_zero += other.flush_to_zero
        self.subnormal += other.subnormal


def range_counts(values: torch.Tensor, fmt: FloatFormat) -> RangeCounts:
    """Count the finite ``values`` that ``fmt`` cannot hold (see ``RangeCounts``).

    The boundaries are those of a round-to-nearest cast (``FloatFormat``'s thresholds), so
    a value counts where ``values.to(dtype)`` puts it: 65519 fits fp16, 2^-25 flushes.
    """
    magnitude = values.detach().abs().float()
    nonzero = magnitude > 0
    flush = nonzero & (magnitude <= fmt.flush_threshold)
    return RangeCounts(
        overflow=int((magnitude >= fmt.overflow_threshold).sum()),
        flush_to_zero=int(flush.sum()),
        subnormal=int((nonzero & ~flush & (magnitude < fmt.normal_threshold)).sum()),
    )


@dataclass
class ModuleStats:
    """What the activation probe saw of one module over all measured batches."""

    name: str
    kind: str  # class name
    calls: int = 0
    values: int = 0  # finite fp32 output values seen
    nonzero: int = 0
    max_abs: float = 0.0  # largest |fp32 output|
    max_abs_autocast: float = 0.0  # largest |output| under autocast (inf if it overflowed)
    nonfinite_autocast: int = 0  # non-finite under autocast where fp32 is finite
    relative_error: float = 0.0  # worst call's ||y - y_fp32|| / ||y_fp32||
    reduced_calls: int = 0  # calls whose output came out in fp16/bf16 (not pinned to fp32)
    pinned_fp32: bool = False  # it, or a module holding it, runs in fp32 under autocast
    ranges: dict[str, RangeCounts] = field(
        default_factory=lambda: {name: RangeCounts() for name in FORMATS}
    )

    def share(self, count: int, of_nonzero: bool = False) -> float:
        total = self.nonzero if of_nonzero else self.values
        return count / total if total else 0.0


@dataclass
class ParameterStats:
    """Gradient values of one parameter, scaled by the fp16 loss scale, over all batches."""

    name: str
    values: int = 0
    zero: int = 0  # exactly zero gradients (in an fp16 run, underflowed ones are here too)
    fp16_flush_to_zero: int = 0  # nonzero but |grad * scale| below fp16's subnormal range
    max_abs_scaled: float = 0.0  # max finite |grad * scale|
    nonfinite: int = 0
    backwards: int = 0  # backward passes seen
    overflow_backwards: int = 0  # of which had inf/NaN gradients (the scaler skips those steps)

    @property
    def underflow_share(self) -> float:
        nonzero = self.values - self.zero - self.nonfinite
        return self.fp16_flush_to_zero / nonzero if nonzero > 0 else 0.0

    @property
    def headroom_bits(self) -> float:
        """log2(65504 / max finite |grad * scale|): doublings of the scale that still fit.

        ``-inf`` when every nonzero gradient overflowed (no finite one to measure: no
        headroom at all, the worst case); ``inf`` when all were exactly zero.
        """
        if self.max_abs_scaled == 0:
            return -math.inf if self.nonfinite else math.inf
        return math.log2(FORMATS["fp16"].max_finite / self.max_abs_scaled)


def runs_in_fp32(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs outside autocast: pinned by
    ``precision.fp32_modules`` (``amp_utils.module_precision``) or in code, its forward
    decorated with ``fwd_default_precision`` (inputs cast to a dtype, autocast off)."""
    if getattr(module, FP32_MARK, False):
        return True
    forward = getattr(module.forward, "__func__", module.forward)
    return getattr(forward, "cast_inputs", None) in (torch.float32, torch.float64)


def fp32_pinned_names(named: Mapping[str, nn.Module]) -> set[str]:
    """The names of the modules that run in fp32 under autocast: those ``runs_in_fp32``
    says so of, and every module inside one (called with autocast off)."""
    pinned = [name for name, module in named.items() if runs_in_fp32(module)]
    return {
        name
        for name in named
        if any(name == root or name.startswith(f"{root}.") for root in pinned)
    }


def _float_tensors(value: Any) -> list[torch.Tensor]:
    """The floating-point tensors in a (nested) module output, in order."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _float_tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _float_tensors(v)]
    return []


def _to_fp32(value: Any) -> Any:
    """``value`` with every floating tensor copied to fp32 (detached), structure kept.

    Always a copy, so that a module that writes into its input during the fp32 re-run
    cannot change the activations of the real forward.
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float32, copy=True) if value.is_floating_point() else value
    if isinstance(value, Mapping):
        return {k: _to_fp32(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_to_fp32(v) for v in value)
    return value


def _sample(values: torch.Tensor, count: int = HISTOGRAM_SAMPLES) -> torch.Tensor:
    flat = values.detach().flatten().float()
    if flat.numel() <= count:
        return flat
    index = torch.randint(flat.numel(), (count,), device=flat.device)
    return flat[index]


class _HookedProbe:
    """A context manager that registers a probe's hooks on enter and removes them on exit.

    Subclasses implement ``_register``: register the hooks, return their handles.
    """

    def __enter__(self) -> Self:
        self._handles = self._register()
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in getattr(self, "_handles", []):
            handle.remove()
        self._handles = []

    def _register(self) -> list[Any]:
        raise NotImplementedError


class ActivationProbe(_HookedProbe):
    """Forward hooks that compare every module under autocast with its fp32 forward.

    Use as a context manager around forward passes run under autocast. The fp32
    recomputation runs without gradients, with autocast off, on fp32 copies of the same
    inputs; hooks do not measure inside another module's recomputation. Turn dropout off
    while probing (``probe_mode``): it draws different masks in each call (and, on CUDA,
    differently per dtype), which a comparison would count as error. BatchNorm in train
    mode normalizes the re-run with the same batch's statistics (``probe_mode`` restores
    the running statistics both calls update). The inputs are those the hook sees after the
    forward: a module that modifies its input in place is compared on the modified input.

    Args:
        modules: one module or a mapping of them (a Brain's ``modules``).
        keep_samples: keep a sample of each module's fp32 output for histograms.
    """

    def __init__(self, modules: Mapping[str, nn.Module] | nn.Module, keep_samples: bool = True):
        self.named = named_modules_of(modules)
        pinned = fp32_pinned_names(self.named)
        self.stats = {
            name: ModuleStats(name, type(module).__name__, pinned_fp32=name in pinned)
            for name, module in self.named.items()
        }
        self.samples: dict[str, torch.Tensor] = {}
        self.keep_samples = keep_samples
        self._recomputing = False

    def _register(self) -> list[Any]:
        return [
            module.register_forward_hook(self._hook(name), with_kwargs=True)
            for name, module in self.named.items()
        ]

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if self._recomputing:
                return
            outputs = _float_tensors(output)
            if not outputs:
                return
            reference = _float_tensors(self._fp32_forward(module, args, kwargs, outputs[0]))
            self._record(name, outputs, reference)

        return hook

    def _fp32_forward(self, module: nn.Module, args: tuple, kwargs: dict, like: torch.Tensor):
        self._recomputing = True
        try:
            with torch.no_grad(), torch.autocast(like.device.type, enabled=False):
                return module(*_to_fp32(args), **_to_fp32(kwargs))
        finally:
            self._recomputing = False

    def _record(
        self, name: str, outputs: list[torch.Tensor], reference: list[torch.Tensor]
    ) -> None:
        stats = self.stats[name]
        stats.calls += 1
        if any(out.dtype in (torch.float16, torch.bfloat16) for out in outputs):
            stats.reduced_calls += 1
        error_sq = reference_sq = 0.0
        for out, ref in zip(outputs, reference, strict=False):
            out, ref = out.detach().float(), ref.detach().float()
            finite = torch.isfinite(ref)
            ref_values = ref[finite]
            out_values = out[finite]
            stats.values += ref_values.numel()
            stats.nonzero += int((ref_values != 0).sum())
            if ref_values.numel():
                stats.max_abs = max(stats.max_abs, float(ref_values.abs().max()))
                stats.max_abs_autocast = max(stats.max_abs_autocast, float(out_values.abs().max()))
            broken = ~torch.isfinite(out_values)
            stats.nonfinite_autocast += int(broken.sum())
            for fmt_name, fmt in FORMATS.items():
                stats.ranges[fmt_name].add(range_counts(ref_values, fmt))
            error_sq += float((out_values - ref_values).double().pow(2).sum())
            reference_sq += float(ref_values.double().pow(2).sum())
            if self.keep_samples and ref_values.numel():
                self.samples[name] = _sample(ref_values)
        if reference_sq > 0:
            error = math.sqrt(error_sq / reference_sq) if math.isfinite(error_sq) else math.inf
        else:
            error = 0.0 if error_sq == 0 else math.inf
        stats.relative_error = max(stats.relative_error, error)


class GradientProbe(_HookedProbe):
    """Gradient hooks that measure each parameter's gradient against fp16.

    A hook on the parameter (``Tensor.register_hook``) sees the gradient of one backward
    pass, before it is added to ``param.grad``: with gradient accumulation each
    micro-batch is measured on its own, as fp16 holds it (one micro-batch that overflows
    counts once, and a sum of finite ones is no overflow). That gradient is
    ``grad * scale`` when a GradScaler scales the loss (fp16), else the true gradient,
    multiplied here by ``scale``: both give what fp16 would hold at that scale. Call
    ``set_scale`` before each backward.

    Args:
        modules: one module or a mapping of them (a Brain's ``modules``).
        loss_scale: the loss scale in use (fp16) or that fp16 would start with.
        grads_are_scaled: True when the backward already multiplies by ``loss_scale``.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module] | nn.Module,
        loss_scale: float = DEFAULT_FP16_LOSS_SCALE,
        grads_are_scaled: bool = False,
    ) -> None:
        roots = modules.items() if isinstance(modules, Mapping) else [("", modules)]
        self.parameters = {
            f"{key}.{name}" if key else name: param
            for key, root in roots
            for name, param in root.named_parameters()
            if param.requires_grad
        }
        self.stats = {name: ParameterStats(name) for name in self.parameters}
        self.samples: dict[str, torch.Tensor] = {}
        self.loss_scale = loss_scale
        self.grads_are_scaled = grads_are_scaled

    def set_scale(self, loss_scale: float) -> None:
        """The loss scale of the coming backward."""
        self.loss_scale = loss_scale

    def _register(self) -> list[Any]:
        return [param.register_hook(self._hook(name)) for name, param in self.parameters.items()]

    def _hook(self, name: str):
        def hook(incoming: torch.Tensor) -> None:  # returns None: the gradient is unchanged
            grad = incoming.detach().float()
            scaled = grad if self.grads_are_scaled else grad * self.loss_scale
            magnitude = scaled.abs()
            finite = torch.isfinite(magnitude)
            stats = self.stats[name]
            stats.values += magnitude.numel()
            stats.backwards += 1
            nonfinite = int((~finite).sum())
            stats.nonfinite += nonfinite
            stats.overflow_backwards += nonfinite > 0
            stats.zero += int((magnitude == 0).sum())
            limit = FORMATS["fp16"].flush_threshold
            stats.fp16_flush_to_zero += int(((magnitude > 0) & (magnitude <= limit)).sum())
            if finite.any():
                stats.max_abs_scaled = max(stats.max_abs_scaled, float(magnitude[finite].max()))
            self.samples[name] = _sample(scaled[finite])

        return hook


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Put ``module`` in eval mode for the block, then restore each submodule's mode."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, training in modes.items():
            m.training = training


@contextmanager
def probe_mode(module: nn.Module) -> Iterator[None]:
    """Dropout off, BatchNorm as in training, for the block; the model unchanged after it.

    Every submodule goes to eval mode (no dropout: it would draw other masks for the fp32
    re-run, counted as error), except BatchNorm layers, which stay in train mode and
    normalize with the batch's statistics, as training does: their running statistics
    are near their initial values in a model trained a few steps, and would give ranges
    training never sees. The BatchNorm buffers the forward passes update (running mean
    and variance, ``num_batches_tracked``) are put back afterwards, as is every mode.
    """
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = [
        {name: buf.detach().clone() for name, buf in norm.named_buffers(recurse=False)}
        for norm in norms
    ]
    with eval_mode(module):  # every mode restored after it
        for norm in norms:
            norm.train()
        try:
            yield
        finally:
            with torch.no_grad():
                for norm, buffers in zip(norms, saved, strict=True):
                    for name, value in buffers.items():
                        getattr(norm, name).copy_(value)


@dataclass
class Probes:
    """The measurements of a diagnosis (for the report and the histograms)."""

    activations: ActivationProbe
    gradients: GradientProbe
    batches: int
    loss_scale_source: str


def probe_training_batches(brain: Any, batches: Iterable[Any], num_batches: int) -> Probes:
    """Train ``brain`` on up to ``num_batches`` batches, measuring every module and gradient.

    For each batch: a forward under the training precision with the activation probe
    (no gradients, no optimizer step; dropout off, BatchNorm on batch statistics as in
    training: ``probe_mode``), then the Brain's own training step (``fit_batch``:
    autocast, loss scaling, clipping, step) with the gradient probe.

    Args:
        brain: an ``amp_utils.Brain`` (optimizers are built here if it has none).
        batches: training batches (e.g. the train DataLoader).
        num_batches: how many to use.
    """
    from amp_utils.autocast import TorchAutocast
    from amp_utils.brain import Stage

    if brain.optimizer is None:
        brain.init_optimizers()
    scaled = brain.scaler.is_enabled()
    activations = ActivationProbe(brain.modules)
    gradients = GradientProbe(brain.modules, grads_are_scaled=scaled)
    brain.modules.train()
    done = 0
    for batch in itertools.islice(batches, num_batches):
        on_device = batch.to(brain.device) if hasattr(batch, "to") else batch
        with (
            torch.no_grad(),
            probe_mode(brain.modules),
            TorchAutocast(device_type=brain.device_type, dtype=brain.amp.dtype),
            activations,
        ):
            brain.compute_forward(on_device, Stage.VALID)
        gradients.set_scale(brain.scaler.get_scale() if scaled else DEFAULT_FP16_LOSS_SCALE)
        with gradients:
            brain.train_step(batch)
        done += 1
    brain.flush_pending()
    source = "GradScaler, last batch" if scaled else "fp16's initial scale; this run has none"
    return Probes(activations, gradients, done, source)
