"""Numerics report: verdicts per module and parameter, overall per format, and the fix.

``build_report`` turns the probes' measurements (``amp_utils.numerics``) into a verdict per
module (fine / keep in fp32 / prefer bf16), ranked worst first, each with the config line
that applies the fix (``precision.fp32_modules=[...]``, ``amp_utils.module_precision``), and
a verdict per format (is fp16 safe for this model? bf16?). ``format_markdown`` writes it for
people, ``NumericsReport.to_json`` for tools, ``log_histograms`` to TensorBoard.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from amp_utils.numerics import (
    DEFAULT_FP16_LOSS_SCALE,
    FORMATS,
    ActivationProbe,
    GradientProbe,
    ModuleStats,
    ParameterStats,
)

#: A module's relative error may reach this many unit roundoffs of the format before it
#: is flagged "keep in fp32". Rounding its inputs and its output costs up to 1 u each, and
#: errors add up over the layers of a block: measured on FSDD, the recipes' single layers
#: stay below 1 u and the whole Conformer-CTC model at ~2 u, in fp16 and in bf16. 32 u (1.6 %
#: for fp16, 12.5 % for bf16) leaves a wide margin above that (deeper models add up more)
#: and stays far below what precision-sensitive arithmetic gives: a cancellation of nearly
#: equal numbers (the tests' planted module) loses 100 % of its signal.
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
#: In an fp16 run, a parameter with more than this share of exactly-zero gradients makes
#: the fp16 verdict "unsure" (underflow or true zeros; e.g. ReLU's dead inputs give the
#: default recipe's frontend 2 % of true zeros): only an fp32 run can tell them apart.
MOSTLY_ZERO_SHARE = 0.5

FINE, KEEP_FP32, PREFER_BF16 = "fine", "keep in fp32", "prefer bf16"
VERDICT_RANK = {KEEP_FP32: 0, PREFER_BF16: 1, FINE: 2}  # worst first


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
        """The overrides that fix what the report flags; None when nothing is flagged.

        ``precision=bf16`` when a module or parameter would rather run in bf16 (fp16's
        range does not hold it) and the run is not bf16 already; then one
        ``precision.fp32_modules=[...]`` for the innermost modules to keep in fp32: a module
        that contains a flagged one inherits its error, and pinning it too would run all
        it holds in fp32 (the whole model, for the root). So an unsafe run always gets a
        fix, also when all its verdicts are "prefer bf16".
        """
        parts = []
        verdicts = [v.verdict for v in [*self.modules, *self.parameters]]
        if self.precision != "bf16" and PREFER_BF16 in verdicts:
            parts.append("precision=bf16")
        innermost = innermost_names([m.name for m in self.modules if m.verdict == KEEP_FP32])
        if innermost:
            parts.append(fp32_modules_line(innermost))
        return " ".join(parts) or None

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


def holds(container: str, name: str) -> bool:
    """Whether module ``name`` lies inside module ``container`` (dotted names)."""
    return name.startswith(f"{container}.")


def innermost_names(names: list[str]) -> list[str]:
    """``names`` less those that hold another of them (in order)."""
    return [name for name in names if not any(holds(name, other) for other in names)]


def fp32_modules_line(names: list[str]) -> str:
    """The override that keeps ``names`` in fp32, e.g. ``precision.fp32_modules=[a,b]``."""
    return f"precision.fp32_modules=[{','.join(names)}]"


def module_verdict(stats: ModuleStats, precision: str) -> ModuleVerdict:
    """Fine / keep in fp32 / prefer bf16 for one module run under ``precision``.

    Range (from the fp32 outputs, for the format in use): overflow -> prefer bf16 when
    bf16 holds the values (else keep in fp32); flush to zero above the limit -> prefer
    bf16 (fp16) or keep in fp32 (bf16). Outputs that came out inf/NaN under autocast
    while fp32's are finite, with no fp32 value beyond the range (e.g. log of a value
    that flushed to zero, or an overflow inside the module), likewise, with their own
    reason. Precision (measured under ``precision``): a relative error above the
    tolerance -> keep in fp32. An fp32 run has no error to measure; its range check
    covers both formats.
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
    fits_bf16 = overflow["bf16"] <= OVERFLOW_SHARE_LIMIT
    for name in judged:
        if overflow[name] > OVERFLOW_SHARE_LIMIT:
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
    if verdict == FINE and fmt is not None and nonfinite_share > 0:
        verdict = PREFER_BF16 if precision == "fp16" and fits_bf16 else KEEP_FP32
        reason = f"{nonfinite_share:.2%} of outputs inf/NaN under {precision} while fp32 is finite"
    if verdict == FINE and tolerance is not None and stats.relative_error > tolerance:
        verdict = KEEP_FP32
        reason = (
            f"{precision} relative error {stats.relative_error:.3g} > tolerance "
            f"{tolerance:.3g} ({ERROR_TOLERANCE_ROUNDOFFS:g} unit roundoffs)"
        )
    if verdict == FINE and fmt is not None and not checked:
        reason = "output stays fp32 under autocast; error within tolerance"
    elif verdict == FINE and not checked:
        reason = "runs in fp32 under autocast (pinned): no range to fit"
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

    Under autocast, a module whose output stays fp32 (pinned in code, e.g. with
    ``fwd_default_precision``, or an op autocast keeps in fp32) stores nothing in the
    reduced format: no range applies (its error is still measured). An fp32 run predicts
    both formats from the fp32 values, except for the modules that would run in fp32
    under autocast anyway (``precision.fp32_modules`` or pinned in code, and the modules
    inside them): flagging those would propose a pin that is already applied.
    """
    if precision not in FORMATS:
        return [] if stats.pinned_fp32 else list(FORMATS)
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


def contain_fp16_overflows(modules: list[ModuleVerdict]) -> None:
    """Point the fp32 alternative of each fp16 overflow at a module whose output fits fp16.

    Pinning only the module that overflows keeps its output in fp32, values beyond 65504
    included, and the fp16 layers that take that output cast it back to fp16: the overflow
    moves one layer on (measured on the recipe: a feed-forward's first linear layer scaled
    up, pinned alone, left the loss NaN, now from the second linear layer). So the
    alternative names the innermost module, the overflowing one or a container of it, whose
    fp32 output fits fp16: all the out-of-range values stay inside the fp32 region. When no
    container fits (the values leave the model, e.g. its output layer), it names the module
    itself and says that what takes its output must run in fp32 too. Changes ``fix`` in place.
    """
    by_name = {m.name: m for m in modules}
    limit = FORMATS["fp16"].overflow_threshold
    for m in modules:
        if m.verdict != PREFER_BF16 or not m.overflow_share["fp16"] > OVERFLOW_SHARE_LIMIT:
            continue
        containers = sorted((n for n in by_name if holds(n, m.name)), key=len, reverse=True)
        fitting = next((n for n in containers if by_name[n].max_abs < limit), None)
        if fitting is not None:
            m.fix = (
                f"precision=bf16  (or keep fp16 elsewhere: {fp32_modules_line([fitting])}, the "
                f"innermost module holding {m.name} whose output fits fp16; {m.name} alone "
                "would hand its out-of-range fp32 output to fp16 layers)"
            )
        else:
            m.fix = (
                f"precision=bf16  (or keep fp16 elsewhere: {fp32_modules_line([m.name])}, if "
                "what takes its output runs in fp32 too: no module around it fits fp16)"
            )


def locate_own_code_nonfinite(modules: list[ModuleVerdict]) -> None:
    """Say so when a module's inf/NaN outputs come from its own forward code.

    A module flagged for inf/NaN outputs, none of whose submodules makes inf/NaN from
    finite inputs, made them between its submodules: in an operation of its own
    ``forward`` that is no module (on the recipe: ``x * sqrt(d_model)`` in
    ``ConformerCTC.forward`` overflowing fp16 once the front end's outputs reach ~1e4). The
    reason said only that ``model`` outputs inf/NaN, which reads as "somewhere in the whole
    model". Changes ``reason`` in place.
    """
    broken = [m.name for m in modules if m.nonfinite_autocast_share > 0]
    names = [m.name for m in modules]
    for m in modules:
        if m.verdict == FINE or m.nonfinite_autocast_share == 0 or "inf/NaN" not in m.reason:
            continue
        has_children = any(holds(m.name, other) for other in names)
        if has_children and not any(holds(m.name, other) for other in broken):
            m.reason += (
                f"; no module inside it makes inf/NaN from finite inputs: it arises in "
                f"{m.name}'s own forward code, between its submodules"
            )


def _module_sort_key(m: ModuleVerdict, flagged: list[str]) -> tuple:
    """Worst verdict first; within one, the modules that made the problem before those
    that only hold one that did (a module around a culprit shares its verdict and its
    infinite error, and would otherwise come first by name), then the larger share out of
    range, the larger error, and, among inf/NaN outputs, the deeper module first."""
    shares = [m.overflow_share[f] for f in m.range_checked]
    shares += [m.flush_to_zero_share[f] for f in m.range_checked]
    worst_share = max(shares, default=0.0)
    holds_flagged = any(holds(m.name, other) for other in flagged)
    depth = m.name.count(".") if m.nonfinite_autocast_share > 0 else 0
    return (
        VERDICT_RANK[m.verdict],
        holds_flagged,
        -worst_share,
        -_finite_or_big(m.relative_error),
        -depth,
        m.name,
    )


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
    modules = [module_verdict(s, precision) for s in activations.stats.values() if s.calls]
    contain_fp16_overflows(modules)
    locate_own_code_nonfinite(modules)
    flagged = [m.name for m in modules if m.verdict != FINE]
    modules.sort(key=lambda m: _module_sort_key(m, flagged))
    params = [parameter_verdict(s) for s in (gradients.stats.values() if gradients else [])]
    # headroom -inf (every gradient overflowed) sorts before any finite headroom
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
    """One sentence on whether ``fmt`` is safe for the model, and the boolean.

    Each problem names the innermost modules that have it (worst first), each module
    once, under its first problem in the order overflow, flush to zero, inf/NaN outputs,
    precision: a module that holds a flagged one inherits its error (an inf output gives
    an infinite error) and is only counted, at the end.
    """
    limit = FORMATS[fmt]
    measured = fmt == precision
    kinds = {
        "overflow": [
            m.name
            for m in modules
            if fmt in m.range_checked and m.overflow_share[fmt] > OVERFLOW_SHARE_LIMIT
        ],
        "underflow": [
            m.name
            for m in modules
            if fmt in m.range_checked and m.flush_to_zero_share[fmt] > UNDERFLOW_SHARE_LIMIT
        ],
        "nonfinite": [m.name for m in modules if measured and m.nonfinite_autocast_share > 0],
        "imprecise": [
            m.name
            for m in modules
            if measured and m.tolerance is not None and m.relative_error > m.tolerance
        ],
    }
    flagged = {name for names in kinds.values() for name in names}
    named: dict[str, list[str]] = {}
    seen: set[str] = set()
    for kind, names in kinds.items():
        named[kind] = [
            n for n in names if n not in seen and not any(holds(n, other) for other in flagged)
        ]
        seen.update(names)
    holders = len(flagged) - sum(len(names) for names in named.values())
    grads = [p.name for p in params if p.verdict != FINE] if fmt == "fp16" else []
    problems = []
    if named["overflow"]:
        overflows = named["overflow"]
        problems.append(
            f"{len(overflows)} module(s) overflow {limit.max_finite:.4g} ({_few(overflows)})"
        )
    if named["underflow"]:
        underflows = named["underflow"]
        problems.append(f"{len(underflows)} module(s) flush values to zero ({_few(underflows)})")
    if named["nonfinite"]:
        broken = named["nonfinite"]
        problems.append(
            f"{len(broken)} module(s) output inf/NaN under {fmt} while fp32 is finite "
            f"({_few(broken)})"
        )
    if named["imprecise"]:
        imprecise = named["imprecise"]
        problems.append(f"{len(imprecise)} module(s) lose precision ({_few(imprecise)})")
    if holders:
        problems.append(f"{holders} module(s) that hold these inherit their error")
    if grads:
        problems.append(f"{len(grads)} parameter(s) have gradients that underflow ({_few(grads)})")
    # In an fp16 run an underflowed gradient arrives as an exact zero, which cannot be told
    # from a gradient that is zero in fp32 too: only an fp32 run measures the underflow.
    zeros = (
        [p.name for p in params if p.zero_share > MOSTLY_ZERO_SHARE]
        if fmt == precision == "fp16"
        else []
    )
    unsure = (
        f"{len(zeros)} parameter(s) have mostly zero gradients in this fp16 run "
        f"({_few(zeros)}): underflowed, or zero in fp32 too, which an fp16 run cannot tell "
        "apart; diagnose with precision=fp32, which measures fp16's underflow at the loss scale"
    )
    if problems:
        return f"{fmt}: unsafe: " + "; ".join(
            [*problems, *([unsure] if zeros else [])]
        ) + ".", False
    if zeros:
        return f"{fmt}: unsure: {unsure}.", False
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
            f"| {_headroom(p.headroom_bits)} | {p.overflow_backwards} |"
        )
    lines += [
        "",
        f"Tolerances: relative error <= {ERROR_TOLERANCE_ROUNDOFFS:g} unit roundoffs of the "
        f"format (fp16 {ERROR_TOLERANCE_ROUNDOFFS * FORMATS['fp16'].unit_roundoff:.2g}, bf16 "
        f"{ERROR_TOLERANCE_ROUNDOFFS * FORMATS['bf16'].unit_roundoff:.2g}); no overflow; at most "
        f"{UNDERFLOW_SHARE_LIMIT:.0%} of nonzero activations and "
        f"{GRAD_UNDERFLOW_SHARE_LIMIT:.0%} of nonzero gradients flushed to zero. Errors are "
        "measured without dropout (BatchNorm on batch statistics, as in training) against an "
        "fp32 forward of the same module on "
        "the same inputs. Headroom: log2(65504 / largest finite |gradient x scale|); negative, "
        "or overflowed backward passes, mean the scaler skips that step and halves the scale "
        "(dynamic loss scaling at work, not a fault); underflow is what it cannot fix.",
    ]
    return "\n".join(lines) + "\n"


def _headroom(bits: float) -> str:
    """Headroom in bits for the table; ``overflowed`` when no gradient was finite."""
    return "overflowed" if bits == -math.inf else f"{bits:.1f}"


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
