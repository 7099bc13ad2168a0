"""Numerics report: which modules overflow, underflow or lose precision in fp16/bf16.

Two probes watch a model while it trains a few batches under autocast:

- ``ActivationProbe`` (forward hooks): for every module, recomputes its forward in fp32
  (autocast off, fp32 copies of the same inputs) and compares. It records the largest
  |activation|, the share of the fp32 outputs that fp16 and bf16 cannot hold (overflow
  above the largest finite value; underflow: nonzero values below the smallest
  subnormal, which flush to zero, and below the smallest normal, which keep fewer
  significant bits), outputs that came out non-finite under autocast while the fp32 ones
  are finite, and the relative error ``||y_autocast - y_fp32|| / ||y_fp32||``.
- ``GradientProbe`` (post-accumulate-grad hooks): for every parameter, the share of
  gradient values that fp16 flushes to zero at the loss scale in use, and the headroom
  ``log2(65504 / max|grad * scale|)`` before they overflow.

``build_report`` turns the measurements into verdicts per module (fine / keep in fp32 /
prefer bf16), ranked worst first, each with the config line that applies the fix
(``precision.fp32_modules=[...]``, ``amp_utils.module_precision``), and an overall verdict
per format; ``format_markdown`` writes it for people, ``NumericsReport.to_json`` for tools.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_utils.module_precision import named_modules_of

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


#: fp16: max 65504, normal from 2^-14, subnormal from 2^-24; bf16: fp32's range, 8 bits.
FORMATS: dict[str, FloatFormat] = {
    "fp16": FloatFormat.of("fp16", torch.float16),
    "bf16": FloatFormat.of("bf16", torch.bfloat16),
}

#: A module's relative error may reach this many unit roundoffs of the format before it
#: is flagged "keep in fp32". Rounding its inputs and its output costs ~1 u each, and the
#: products and sums inside a layer (fp32 accumulation) add a few u more: the recipe's own
#: layers measure 1-6 u (blocks of several layers up to ~10 u). 32 u (1.6 % for fp16, 12.5 %
#: for bf16) is far above that and far below what precision-sensitive arithmetic gives
#: (cancellation of nearly equal numbers, long low-precision sums: 30-100 %+).
ERROR_TOLERANCE_ROUNDOFFS = 32.0
#: Any overflow is flagged: an inf activation turns the loss (and the step) into NaN.
OVERFLOW_SHARE_LIMIT = 0.0
#: Share of a module's nonzero fp32 outputs that may flush to zero in the format before
#: it is flagged. A few tiny values (e.g. SiLU of very negative inputs) lose nothing that
#: matters; when a tenth of the values vanish, the layer's signal lives below the range.
UNDERFLOW_SHARE_LIMIT = 0.10
#: Share of a parameter's nonzero gradient values that may flush to zero in fp16 at the
#: loss scale in use before fp16 is called unsafe for it. Dynamic loss scaling keeps the
#: largest gradients just below 65504; values more than 2^40 smaller still underflow,
#: and when over 1 % do, the update loses a visible part of its direction.
GRAD_UNDERFLOW_SHARE_LIMIT = 0.01
#: Loss scale an fp16 run starts with (``torch.amp.GradScaler``'s ``init_scale``): used to
#: predict fp16 gradients from an fp32 or bf16 run.
DEFAULT_FP16_LOSS_SCALE = 2.0**16
#: Values per tensor sent to TensorBoard histograms (a random subset of larger tensors).
HISTOGRAM_SAMPLES = 100_000

FINE, KEEP_FP32, PREFER_BF16 = "fine", "keep in fp32", "prefer bf16"
VERDICT_RANK = {KEEP_FP32: 0, PREFER_BF16: 1, FINE: 2}  # worst first


# -------------------------------------------------------------------- measurements


@dataclass
class RangeCounts:
    """How many values of a tensor a format overflows, flushes to zero or denormalizes."""

    overflow: int = 0  # |x| > max finite
    flush_to_zero: int = 0  # 0 < |x| < smallest subnormal / 2 (rounds to 0)
    subnormal: int = 0  # smallest subnormal / 2 <= |x| < smallest normal (precision loss)

    def add(self, other: RangeCounts) -> None:
        self.overflow += other.overflow
        self.flush_to_zero += other.flush_to_zero
        self.subnormal += other.subnormal


def range_counts(values: torch.Tensor, fmt: FloatFormat) -> RangeCounts:
    """Count the finite ``values`` that ``fmt`` cannot hold (see ``RangeCounts``)."""
    magnitude = values.detach().abs().float()
    nonzero = magnitude > 0
    flush = nonzero & (magnitude < fmt.smallest_subnormal / 2)
    return RangeCounts(
        overflow=int((magnitude > fmt.max_finite).sum()),
        flush_to_zero=int(flush.sum()),
        subnormal=int((nonzero & ~flush & (magnitude < fmt.smallest_normal)).sum()),
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
        """log2(65504 / max finite |grad * scale|): doublings of the scale that still fit."""
        if self.max_abs_scaled == 0:
            return math.inf
        return math.log2(FORMATS["fp16"].max_finite / self.max_abs_scaled)


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


class ActivationProbe:
    """Forward hooks that compare every module under autocast with its fp32 forward.

    Use as a context manager around forward passes run under autocast. The fp32
    recomputation runs without gradients, with autocast off, on fp32 copies of the same
    inputs; hooks do not measure inside another module's recomputation. Run the model in
    eval mode while probing: dropout draws different masks in each call (and, on CUDA,
    differently per dtype), which a comparison would count as error, and BatchNorm would
    update its running statistics twice. The inputs are those the hook sees after the
    forward: a module that modifies its input in place is compared on the modified input.

    Args:
        modules: one module or a mapping of them (a Brain's ``modules``).
        keep_samples: keep a sample of each module's fp32 output for histograms.
    """

    def __init__(self, modules: Mapping[str, nn.Module] | nn.Module, keep_samples: bool = True):
        self.named = named_modules_of(modules)
        self.stats = {
            name: ModuleStats(name, type(module).__name__) for name, module in self.named.items()
        }
        self.samples: dict[str, torch.Tensor] = {}
        self.keep_samples = keep_samples
        self._handles: list[Any] = []
        self._recomputing = False

    def __enter__(self) -> ActivationProbe:
        for name, module in self.named.items():
            self._handles.append(module.register_forward_hook(self._hook(name), with_kwargs=True))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

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


class GradientProbe:
    """Post-accumulate-grad hooks that measure each parameter's gradient against fp16.

    The gradient a hook sees is ``grad * scale`` when a GradScaler scales the loss
    (fp16), else the true gradient, multiplied here by ``scale``: both give what fp16
    would hold at that scale. Call ``set_scale`` before each backward.

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
        self._handles: list[Any] = []

    def set_scale(self, loss_scale: float) -> None:
        """The loss scale of the coming backward."""
        self.loss_scale = loss_scale

    def __enter__(self) -> GradientProbe:
        for name, param in self.parameters.items():
            self._handles.append(param.register_post_accumulate_grad_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            grad = param.grad.detach().float()
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
            limit = FORMATS["fp16"].smallest_subnormal / 2
            stats.fp16_flush_to_zero += int(((magnitude > 0) & (magnitude < limit)).sum())
            if finite.any():
                stats.max_abs_scaled = max(stats.max_abs_scaled, float(magnitude[finite].max()))
            self.samples[name] = _sample(scaled[finite])

        return hook


# ------------------------------------------------------------------------- verdicts


@dataclass
class ModuleVerdict:
    """The verdict on one module, with the numbers behind it and the fix."""

    name: str
    kind: str
    verdict: str  # FINE, KEEP_FP32 or PREFER_BF16
    reason: str
    fix: str | None  # the config line that applies the fix
    max_abs: float
    max_abs_autocast: float
    relative_error: float
    tolerance: float | None  # the error above which "keep in fp32" applies
    overflow_share: dict[str, float]  # by format
    flush_to_zero_share: dict[str, float]  # of nonzero values, by format
    subnormal_share: dict[str, float]  # of nonzero values, by format
    nonfinite_autocast_share: float
    range_checked: list[str]  # formats whose range applies to the module's output


@dataclass
class ParameterVerdict:
    """fp16 gradient underflow and headroom of one parameter."""

    name: str
    verdict: str
    values: int
    zero_share: float
    fp16_underflow_share: float
    headroom_bits: float
    overflow_backwards: str  # "k/n": backward passes with inf/NaN gradients


@dataclass
class NumericsReport:
    """A numerics report: verdicts per module and parameter, and overall per format."""

    precision: str  # the autocast precision the model ran under
    batches: int
    loss_scale: float  # fp16 loss scale the gradients were measured at
    loss_scale_source: str  # "GradScaler" (fp16 run) or "assumed initial scale"
    overall: dict[str, str]  # format -> verdict sentence
    fp16_safe: bool
    bf16_safe: bool
    modules: list[ModuleVerdict]  # worst first
    parameters: list[ParameterVerdict]  # worst first
    fp32_modules: list[str] = field(default_factory=list)  # modules pinned to fp32 in the run
    context: dict[str, Any] = field(default_factory=dict)  # what was run (model, data, ...)

    def flagged(self) -> list[ModuleVerdict]:
        """The modules whose verdict is not fine, worst first."""
        return [m for m in self.modules if m.verdict != FINE]

    def fix_line(self) -> str | None:
        """One ``precision.fp32_modules=[...]`` line for every module to keep in fp32."""
        names = [m.name for m in self.modules if m.verdict == KEEP_FP32]
        return fp32_modules_line(names) if names else None

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (infinities as strings ``"inf"``/``"-inf"``)."""
        return _json_safe(dataclasses.asdict(self))


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def fp32_modules_line(names: list[str]) -> str:
    """The override that keeps ``names`` in fp32, e.g. ``precision.fp32_modules=[a,b]``."""
    return f"precision.fp32_modules=[{','.join(names)}]"


def module_verdict(stats: ModuleStats, precision: str) -> ModuleVerdict:
    """Fine / keep in fp32 / prefer bf16 for one module run under ``precision``.

    Range (from the fp32 outputs, for the format in use): overflow -> prefer bf16 when
    bf16 holds the values (else keep in fp32); flush to zero above the limit -> prefer
    bf16 (fp16) or keep in fp32 (bf16). Precision (measured under ``precision``): a
    relative error above the tolerance -> keep in fp32. An fp32 run has no error to
    measure; its range check covers both formats.
    """
    overflow = {f: stats.share(stats.ranges[f].overflow) for f in FORMATS}
    flush = {f: stats.share(stats.ranges[f].flush_to_zero, of_nonzero=True) for f in FORMATS}
    subnormal = {f: stats.share(stats.ranges[f].subnormal, of_nonzero=True) for f in FORMATS}
    nonfinite_share = stats.share(stats.nonfinite_autocast)
    fmt = FORMATS.get(precision)
    tolerance = ERROR_TOLERANCE_ROUNDOFFS * fmt.unit_roundoff if fmt else None
    checked = range_checked_formats(stats, precision)
    # The verdict is about the precision in use; an fp32 run predicts both formats.
    judged = [name for name in checked if precision not in FORMATS or name == precision]
    verdict, reason = FINE, "within range and tolerance"
    for name in judged:
        if overflow[name] > OVERFLOW_SHARE_LIMIT or (name == precision and nonfinite_share > 0):
            fits_bf16 = overflow["bf16"] <= OVERFLOW_SHARE_LIMIT
            verdict = PREFER_BF16 if name == "fp16" and fits_bf16 else KEEP_FP32
            reason = (
                f"{name} overflow: max |activation| {stats.max_abs:.4g} > "
                f"{FORMATS[name].max_finite:.4g} ({overflow[name]:.2%} of values)"
            )
            break
        if flush[name] > UNDERFLOW_SHARE_LIMIT:
            verdict = PREFER_BF16 if name == "fp16" else KEEP_FP32
            reason = f"{name} underflow: {flush[name]:.1%} of nonzero values flush to zero"
            break
    if verdict == FINE and tolerance is not None and stats.relative_error > tolerance:
        verdict = KEEP_FP32
        reason = (
            f"{precision} relative error {stats.relative_error:.3g} > tolerance "
            f"{tolerance:.3g} ({ERROR_TOLERANCE_ROUNDOFFS:g} unit roundoffs)"
        )
    if verdict == FINE and fmt is not None and not checked:
        reason = "output stays fp32 under autocast; error within tolerance"
    fix = None
    if verdict == KEEP_FP32:
        fix = fp32_modules_line([stats.name])
    elif verdict == PREFER_BF16:
        fix = f"precision=bf16  (or keep fp16 elsewhere: {fp32_modules_line([stats.name])})"
    return ModuleVerdict(
        name=stats.name,
        kind=stats.kind,
        verdict=verdict,
        reason=reason,
        fix=fix,
        max_abs=stats.max_abs,
        max_abs_autocast=stats.max_abs_autocast,
        relative_error=stats.relative_error,
        tolerance=tolerance,
        overflow_share=overflow,
        flush_to_zero_share=flush,
        subnormal_share=subnormal,
        nonfinite_autocast_share=nonfinite_share,
        range_checked=checked,
    )


def range_checked_formats(stats: ModuleStats, precision: str) -> list[str]:
    """The formats whose range a module's output must fit.

    An fp32 run predicts both formats from the fp32 values. Under autocast, a module
    whose output stays fp32 (pinned in code, e.g. with ``fwd_default_precision``, or an
    op autocast keeps in fp32) stores nothing in the reduced format: no range applies
    (its error is still measured).
    """
    if precision not in FORMATS:
        return list(FORMATS)
    return list(FORMATS) if stats.reduced_calls else []


def parameter_verdict(stats: ParameterStats) -> ParameterVerdict:
    """Prefer bf16 when more than the limit of the gradient values underflow in fp16."""
    bad = stats.underflow_share > GRAD_UNDERFLOW_SHARE_LIMIT
    return ParameterVerdict(
        name=stats.name,
        verdict=PREFER_BF16 if bad else FINE,
        values=stats.values,
        zero_share=stats.zero / stats.values if stats.values else 0.0,
        fp16_underflow_share=stats.underflow_share,
        headroom_bits=stats.headroom_bits,
        overflow_backwards=f"{stats.overflow_backwards}/{stats.backwards}",
    )


def _module_sort_key(m: ModuleVerdict) -> tuple:
    shares = [m.overflow_share[f] for f in m.range_checked]
    shares += [m.flush_to_zero_share[f] for f in m.range_checked]
    worst_share = max(shares, default=0.0)
    return (VERDICT_RANK[m.verdict], -worst_share, -_finite_or_big(m.relative_error), m.name)


def _finite_or_big(value: float) -> float:
    return value if math.isfinite(value) else 1e300


def build_report(
    activations: ActivationProbe,
    gradients: GradientProbe | None,
    precision: str,
    batches: int,
    loss_scale_source: str,
    fp32_modules: list[str] | None = None,
    context: dict[str, Any] | None = None,
) -> NumericsReport:
    """Verdicts from the probes' measurements, ranked worst first, and overall ones."""
    modules = sorted(
        (module_verdict(s, precision) for s in activations.stats.values() if s.calls),
        key=_module_sort_key,
    )
    params = [parameter_verdict(s) for s in (gradients.stats.values() if gradients else [])]
    params.sort(key=lambda p: (VERDICT_RANK[p.verdict], -p.fp16_underflow_share, p.headroom_bits))
    overall, safe = {}, {}
    for fmt in FORMATS:
        overall[fmt], safe[fmt] = _overall(fmt, precision, modules, params)
    return NumericsReport(
        precision=precision,
        batches=batches,
        loss_scale=gradients.loss_scale if gradients else DEFAULT_FP16_LOSS_SCALE,
        loss_scale_source=loss_scale_source,
        overall=overall,
        fp16_safe=safe["fp16"],
        bf16_safe=safe["bf16"],
        modules=modules,
        parameters=params,
        fp32_modules=list(fp32_modules or []),
        context=dict(context or {}),
    )


def _overall(
    fmt: str, precision: str, modules: list[ModuleVerdict], params: list[ParameterVerdict]
) -> tuple[str, bool]:
    """One sentence on whether ``fmt`` is safe for the model, and the boolean."""
    limit = FORMATS[fmt]
    overflows = [
        m.name
        for m in modules
        if fmt in m.range_checked and m.overflow_share[fmt] > OVERFLOW_SHARE_LIMIT
    ]
    if fmt == precision:
        overflows += [
            m.name for m in modules if m.nonfinite_autocast_share > 0 and m.name not in overflows
        ]
    underflows = [
        m.name
        for m in modules
        if fmt in m.range_checked and m.flush_to_zero_share[fmt] > UNDERFLOW_SHARE_LIMIT
    ]
    imprecise = (
        [m.name for m in modules if m.verdict == KEEP_FP32 and "relative error" in m.reason]
        if fmt == precision
        else []
    )
    grads = [p.name for p in params if p.verdict != FINE] if fmt == "fp16" else []
    problems = []
    if overflows:
        problems.append(
            f"{len(overflows)} module(s) overflow {limit.max_finite:.4g} ({_few(overflows)})"
        )
    if underflows:
        problems.append(f"{len(underflows)} module(s) flush values to zero ({_few(underflows)})")
    if imprecise:
        problems.append(f"{len(imprecise)} module(s) lose precision ({_few(imprecise)})")
    if grads:
        problems.append(f"{len(grads)} parameter(s) have gradients that underflow ({_few(grads)})")
    if problems:
        return f"{fmt}: unsafe: " + "; ".join(problems) + ".", False
    measured = (
        "range and error checked"
        if fmt == precision
        else f"range checked; error not measured (diagnose with precision={fmt})"
    )
    return f"{fmt}: safe ({measured}).", True


def _few(names: list[str], count: int = 3) -> str:
    return ", ".join(names[:count]) + (", ..." if len(names) > count else "")


# ------------------------------------------------------------------------- reporting


def format_markdown(report: NumericsReport, max_rows: int = 40) -> str:
    """The report as markdown: overall verdicts, the fix, then modules and parameters."""
    lines = [
        f"# Numerics report ({report.precision}, {report.batches} training batches)",
        "",
    ]
    if report.context:
        lines += [", ".join(f"{k}: {v}" for k, v in report.context.items()), ""]
    if report.fp32_modules:
        lines += [
            f"Modules run in fp32 (precision.fp32_modules): {', '.join(report.fp32_modules)}",
            "",
        ]
    lines += [f"- {sentence}" for sentence in report.overall.values()]
    fix = report.fix_line()
    lines += ["", f"**Fix**: `{fix}`" if fix else "No module needs to be kept in fp32.", ""]
    lines += [
        "## Modules (worst first)",
        "",
        "| module | type | verdict | max abs | rel. error | fp16 overflow | fp16 flush to 0 "
        "| fp16 subnormal | why | fix |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in report.modules[:max_rows]:
        lines.append(
            f"| {m.name} | {m.kind} | {m.verdict} | {m.max_abs:.3g} | {m.relative_error:.2e} "
            f"| {m.overflow_share['fp16']:.2%} | {m.flush_to_zero_share['fp16']:.2%} "
            f"| {m.subnormal_share['fp16']:.2%} | {m.reason} | {f'`{m.fix}`' if m.fix else ''} |"
        )
    if len(report.modules) > max_rows:
        lines.append(f"\n{len(report.modules) - max_rows} more modules, all fine: numerics.json.")
    lines += [
        "",
        f"## Gradients in fp16 at loss scale {report.loss_scale:g} ({report.loss_scale_source})",
        "",
        "| parameter | verdict | zero | fp16 underflow | headroom (bits) | overflowed |",
        "|---|---|---|---|---|---|",
    ]
    for p in report.parameters[:max_rows]:
        lines.append(
            f"| {p.name} | {p.verdict} | {p.zero_share:.2%} | {p.fp16_underflow_share:.2%} "
            f"| {p.headroom_bits:.1f} | {p.overflow_backwards} |"
        )
    lines += [
        "",
        f"Tolerances: relative error <= {ERROR_TOLERANCE_ROUNDOFFS:g} unit roundoffs of the "
        f"format (fp16 {ERROR_TOLERANCE_ROUNDOFFS * FORMATS['fp16'].unit_roundoff:.2g}, bf16 "
        f"{ERROR_TOLERANCE_ROUNDOFFS * FORMATS['bf16'].unit_roundoff:.2g}); no overflow; at most "
        f"{UNDERFLOW_SHARE_LIMIT:.0%} of nonzero activations and "
        f"{GRAD_UNDERFLOW_SHARE_LIMIT:.0%} of nonzero gradients flushed to zero. Errors are "
        "measured in eval mode (no dropout) against an fp32 forward of the same module on "
        "the same inputs. Headroom: log2(65504 / largest finite |gradient x scale|); negative, "
        "or overflowed backward passes, mean the scaler skips that step and halves the scale "
        "(dynamic loss scaling at work, not a fault); underflow is what it cannot fix.",
    ]
    return "\n".join(lines) + "\n"


def log_histograms(
    writer: Any, activations: ActivationProbe, gradients: GradientProbe | None, step: int = 0
) -> int:
    """Write log2|value| histograms of activations and scaled gradients to TensorBoard.

    fp16 holds log2|x| in [-24, 16); bf16 in [-133, 128). Returns the histograms written.
    """
    written = 0
    sources = [("activation", activations.samples)]
    if gradients is not None:
        sources.append(("grad_x_scale", gradients.samples))
    for kind, samples in sources:
        for name, values in samples.items():
            nonzero = values[values != 0].abs()
            if nonzero.numel():
                writer.add_histogram(f"numerics/{kind}_log2/{name}", nonzero.log2(), step)
                written += 1
    return written


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


@dataclass
class Probes:
    """The measurements of a diagnosis (for the report and the histograms)."""

    activations: ActivationProbe
    gradients: GradientProbe
    batches: int
    loss_scale_source: str


def probe_training_batches(brain: Any, batches: Iterable[Any], num_batches: int) -> Probes:
    """Train ``brain`` on up to ``num_batches`` batches, measuring every module and gradient.

    For each batch: an eval-mode forward under the training precision with the
    activation probe (no gradients, no optimizer step), then the Brain's own training
    step (``fit_batch``: autocast, loss scaling, clipping, step) with the gradient probe.

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
            eval_mode(brain.modules),
            TorchAutocast(device_type=brain.device_type, dtype=brain.amp.dtype),
            activations,
        ):
            brain.compute_forward(on_device, Stage.VALID)
        gradients.set_scale(brain.scaler.get_scale() if scaled else DEFAULT_FP16_LOSS_SCALE)
        brain.step += 1
        with gradients:
            brain.fit_batch(batch)
        done += 1
    brain.flush_pending()
    source = "GradScaler, last batch" if scaled else "fp16's initial scale; this run has none"
    return Probes(activations, gradients, done, source)
