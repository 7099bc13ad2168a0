"""Numerics report (issue 14): planted overflow and precision loss are flagged with the fix,
the recipe's own model is not, and ``precision.fp32_modules`` pins modules to fp32."""

from __future__ import annotations

import json
import math
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_utils import Brain, fwd_default_precision
from amp_utils.module_precision import UnknownModulePatternError, apply_fp32_modules
from amp_utils.numerics import (
    FORMATS,
    ActivationProbe,
    GradientProbe,
    probe_training_batches,
    range_counts,
)
from amp_utils.numerics_report import (
    ERROR_TOLERANCE_ROUNDOFFS,
    FINE,
    KEEP_FP32,
    PREFER_BF16,
    build_report,
    format_markdown,
)
from tests.conftest import REPO_ROOT

REDUCED = {"fp16": torch.float16, "bf16": torch.bfloat16}


class Overflowing(nn.Module):
    """A linear layer whose outputs reach ~1e5: above fp16's 65504, easy for bf16."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        with torch.no_grad():
            self.linear.weight.fill_(2.0e4)
            self.linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Cancelling(nn.Module):
    """Adds a large offset in a matmul, then subtracts it: the small signal is rounded away.

    In fp16 the spacing of numbers near 1000 is 0.5, in bf16 it is 4; the signal is ~0.1.
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        with torch.no_grad():
            self.linear.weight.normal_(0.0, 0.03)
            self.linear.bias.fill_(1000.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) - 1000.0


def planted_model() -> nn.ModuleDict:
    torch.manual_seed(0)
    return nn.ModuleDict(
        {
            "healthy": nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8)),
            "overflowing": Overflowing(),
            "cancelling": Cancelling(),
        }
    )


def probe(modules: nn.ModuleDict, precision: str, batches: int = 2):
    """Run ``batches`` forwards of every planted module under ``precision``; the report."""
    activations = ActivationProbe(modules)
    inputs = torch.randn(batches, 32, 8)
    autocast = torch.autocast("cpu", dtype=REDUCED.get(precision), enabled=precision != "fp32")
    with activations, autocast:
        for x in inputs:
            for module in modules.values():
                module(x)
    return build_report(activations, None, precision, batches, "none")


def verdicts(report) -> dict[str, str]:
    return {m.name: m.verdict for m in report.modules}


def test_overflow_is_flagged_under_fp16_and_not_under_bf16():
    fp16 = probe(planted_model(), "fp16")
    module = next(m for m in fp16.modules if m.name == "overflowing")
    assert module.verdict == PREFER_BF16
    assert "overflow" in module.reason and module.max_abs > FORMATS["fp16"].max_finite
    assert module.nonfinite_autocast_share > 0  # it really came out inf under fp16
    assert module.fix.startswith("precision=bf16") and "fp32_modules=[overflowing]" in module.fix
    assert not fp16.fp16_safe
    assert fp16.modules[0].verdict != FINE  # worst first

    bf16 = probe(planted_model(), "bf16")
    assert verdicts(bf16)["overflowing"] == FINE
    assert verdicts(bf16)["overflowing.linear"] == FINE
    assert not bf16.fp16_safe  # the fp16 range check still sees the values above 65504


def test_fp32_run_predicts_the_fp16_overflow_from_the_ranges():
    report = probe(planted_model(), "fp32")
    assert verdicts(report)["overflowing"] == PREFER_BF16
    assert verdicts(report)["cancelling"] == FINE  # its error needs a reduced-precision run
    assert all(m.relative_error == 0.0 for m in report.modules)
    assert not report.fp16_safe and report.bf16_safe
    assert "error not measured" in report.overall["bf16"]


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_precision_loss_is_flagged_with_the_fix_line(precision):
    report = probe(planted_model(), precision)
    module = next(m for m in report.modules if m.name == "cancelling")
    tolerance = ERROR_TOLERANCE_ROUNDOFFS * FORMATS[precision].unit_roundoff
    assert module.verdict == KEEP_FP32 and "relative error" in module.reason
    assert module.relative_error > tolerance == module.tolerance
    assert module.fix == "precision.fp32_modules=[cancelling]"
    assert "cancelling" in report.fix_line()
    # the healthy layers lose a little precision, well within the tolerance
    for name in ("healthy", "healthy.0", "healthy.2"):
        healthy = next(m for m in report.modules if m.name == name)
        assert healthy.verdict == FINE and 0 < healthy.relative_error < tolerance / 4


def test_the_fix_line_pins_the_innermost_flagged_modules_not_their_containers():
    """A container inherits its child's error: it is flagged too, but pinning it would
    run all it holds in fp32 (here the whole model)."""
    torch.manual_seed(0)
    inner = planted_model()
    model = nn.ModuleDict({"model": nn.Sequential(inner.healthy, inner.cancelling)})
    report = probe(model, "bf16")
    flagged = {m.name for m in report.flagged()}
    assert {"model", "model.1"} <= flagged  # the container inherits the error
    assert report.fix_line() == "precision.fp32_modules=[model.1]"


class BlowUpAndBack(nn.Module):
    """A feed-forward whose first layer's outputs reach ~1e5 (beyond fp16) and whose second
    layer brings them back to ~1: the recipe's FFN with its first linear layer scaled up."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 8), nn.SiLU(), nn.Linear(8, 8))
        with torch.no_grad():
            self.net[0].weight.fill_(2.0e4)
            self.net[0].bias.zero_()
            self.net[2].weight.normal_(0.0, 1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_the_fp32_alternative_to_an_fp16_overflow_contains_it():
    """Pinning only the layer that overflows keeps its output in fp32, and the next fp16
    layer casts it back: the printed alternative left the outputs inf (the recipe's loss
    NaN). It names the innermost container whose output fits fp16, which, applied as
    printed, leaves no inf/NaN."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"ffn": BlowUpAndBack()})
    report = probe(model, "fp16")
    culprit = next(m for m in report.modules if m.name == "ffn.net.0")
    assert culprit.verdict == PREFER_BF16 and "overflow" in culprit.reason
    pattern = re.search(r"precision\.fp32_modules=\[([^\]]+)\]", culprit.fix).group(1)
    assert pattern == "ffn.net"  # ffn.net.0 alone would hand 1e5 to ffn.net.2 in fp16
    torch.manual_seed(0)
    alone = nn.ModuleDict({"ffn": BlowUpAndBack()})
    apply_fp32_modules(alone, ["ffn.net.0"])
    assert not probe(alone, "fp16").fp16_safe  # the overflow moves on to ffn.net.2
    apply_fp32_modules(model, [pattern])
    after = probe(model, "fp16")
    assert after.fp16_safe, after.overall["fp16"]
    assert all(m.nonfinite_autocast_share == 0 for m in after.modules)


def test_an_overflow_no_container_holds_is_pinned_alone_with_a_warning():
    report = probe(planted_model(), "fp16")
    for name in ("overflowing", "overflowing.linear"):  # the wrapper's output overflows too
        module = next(m for m in report.modules if m.name == name)
        assert f"precision.fp32_modules=[{name}]" in module.fix
        assert "runs in fp32 too" in module.fix


class ScalesBetweenLayers(nn.Module):
    """Two healthy layers with an overflowing multiplication between them, in its own
    forward: the recipe's ``x * sqrt(d_model)`` after a front end whose outputs reach 1e4."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        with torch.no_grad():
            self.first.weight.fill_(1.0e3)
            self.second.weight.normal_(0.0, 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * 100.0)


def test_an_inf_made_in_a_modules_own_code_is_said_to_come_from_there():
    report = probe(nn.ModuleDict({"model": ScalesBetweenLayers()}), "fp16")
    flagged = {m.name: m for m in report.flagged()}
    assert "model.first" not in flagged  # its outputs (~1e4) fit fp16
    assert "model's own forward code" in flagged["model"].reason


def test_fix_line_applied_removes_the_flag():
    model = planted_model()
    assert verdicts(probe(model, "bf16"))["cancelling"] == KEEP_FP32
    assert apply_fp32_modules(model, ["cancelling"]) == ["cancelling"]
    after = probe(model, "bf16")
    fixed = next(m for m in after.modules if m.name == "cancelling")
    assert fixed.verdict == FINE and fixed.relative_error == 0.0
    inner = next(m for m in after.modules if m.name == "cancelling.linear")  # runs in fp32 too
    assert inner.relative_error == 0.0 and inner.range_checked == []


def test_an_fp16_run_does_not_call_gradients_that_came_out_zero_safe():
    """Under fp16 autocast the same underflow arrives as exact zeros, which the underflow
    share leaves out: the report called fp16 safe while all of tiny.weight's gradient was
    lost. It now says it cannot tell, and how to find out."""
    torch.manual_seed(0)
    tiny, normal = nn.Linear(64, 64), nn.Linear(64, 64)
    model = nn.ModuleDict({"tiny": tiny, "normal": normal})
    scale = 2.0**16
    gradients = GradientProbe(model, loss_scale=scale, grads_are_scaled=True)
    x = torch.randn(4, 64)
    with gradients:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = 1e-13 * tiny(x).float().sum() + normal(x).float().pow(2).mean()
        (loss * scale).backward()  # what GradScaler.scale(loss).backward() does
    report = build_report(ActivationProbe(model), gradients, "fp16", 1, "GradScaler")
    assert {p.name: p for p in report.parameters}["tiny.weight"].zero_share == 1.0
    assert not report.fp16_safe
    assert report.overall["fp16"].startswith("fp16: unsure: 2 parameter(s) have mostly zero")
    assert "diagnose with precision=fp32" in report.overall["fp16"]


def test_gradients_that_underflow_fp16_at_the_loss_scale_are_flagged():
    tiny, normal = nn.Linear(64, 64), nn.Linear(64, 64)
    model = nn.ModuleDict({"tiny": tiny, "normal": normal})
    gradients = GradientProbe(model, loss_scale=2.0**16)
    x = torch.randn(4, 64)
    with gradients:
        # d loss / d tiny.weight ~ 1e-13: times 2^16 ~ 7e-9, below fp16's 2^-24 / 2
        (1e-13 * tiny(x).sum() + normal(x).pow(2).mean()).backward()
    report = build_report(ActivationProbe(model), gradients, "fp32", 1, "assumed")
    by_name = {p.name: p for p in report.parameters}
    assert by_name["tiny.weight"].verdict == PREFER_BF16
    assert by_name["tiny.weight"].fp16_underflow_share > 0.9
    assert by_name["normal.weight"].verdict == FINE
    assert by_name["normal.weight"].fp16_underflow_share == 0.0
    expected = math.log2(65504 / float(normal.weight.grad.abs().max() * 2.0**16))
    assert by_name["normal.weight"].headroom_bits == pytest.approx(expected, rel=1e-5)
    assert report.parameters[0].verdict == PREFER_BF16  # worst first
    assert not report.fp16_safe and report.bf16_safe


def test_report_json_round_trips():
    report = probe(planted_model(), "fp16")
    data = json.loads(json.dumps(report.to_json()))
    assert data["precision"] == "fp16"
    assert {m["name"] for m in data["modules"]} >= {"healthy", "overflowing", "cancelling"}


class ScoresOverflow(nn.Module):
    """Attention-like: its scores overflow fp16 inside it, its output is finite in fp32.

    No fp32 output of any module is beyond fp16's range; the inf appears inside this one
    under fp16 and every module that holds it shares its verdict and infinite error.
    """

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        with torch.no_grad():
            self.q.weight.fill_(30.0)
            self.q.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x)  # ~240: fine in fp16; q @ q^T ~ 4.6e5 is not
        scores = (q @ q.transpose(-1, -2)).float()
        return torch.softmax(scores - scores.amax(-1, keepdim=True), -1) @ x


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = ScoresOverflow()
        self.ff = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x + self.attn(x))


def test_the_module_that_made_an_inf_ranks_first_is_named_and_gets_a_fix():
    """Its containers share its verdict and infinite error: sorted by name they came first,
    the summary named three of them and not it, counted each twice (overflow and lose
    precision) and, all being "prefer bf16", the fix line was None ("fix: none needed")."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(Residual(), Residual()), nn.Linear(8, 4))
    activations = ActivationProbe({"model": model})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), activations:
        model(torch.ones(2, 5, 8))
    report = build_report(activations, None, "fp16", 1, "none")
    flagged = [m.name for m in report.flagged()]
    assert flagged == ["model.0.0.attn", "model.0.0", "model.0", "model"]  # innermost first
    assert all(m.verdict == PREFER_BF16 for m in report.flagged())
    sentence = report.overall["fp16"]
    assert "1 module(s) output inf/NaN under fp16 while fp32 is finite (model.0.0.attn)" in (
        sentence
    )
    assert "3 module(s) that hold these inherit their error" in sentence
    assert "lose precision" not in sentence and "overflow" not in sentence
    assert not report.fp16_safe
    assert report.fix_line() == "precision=bf16"


class LogOfTiny(nn.Module):
    """log of a matmul whose result (1e-9) flushes to zero in fp16: -inf by underflow."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((8, 8), 1e-10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x @ self.w)


def test_inf_outputs_caused_by_underflow_are_not_called_overflow():
    model = nn.Sequential(LogOfTiny())
    activations = ActivationProbe({"model": model})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16), activations:
        model(torch.ones(4, 8))
    report = build_report(activations, None, "fp16", 1, "none")
    culprit = report.modules[0]
    assert culprit.name == "model.0" and culprit.max_abs < 100  # far inside fp16's range
    assert culprit.reason == "100.00% of outputs inf/NaN under fp16 while fp32 is finite"
    assert "overflow" not in report.overall["fp16"]
    assert "inf/NaN under fp16 while fp32 is finite (model.0)" in report.overall["fp16"]
    # a real overflow keeps its own reason (fp32 values above 65504)
    overflowing = next(m for m in probe(planted_model(), "fp16").modules if m.name == "overflowing")
    assert overflowing.reason.startswith("fp16 overflow: max |activation|")


class PinnedInCode(Overflowing):
    """``Overflowing`` with its forward pinned to fp32 in code."""

    @fwd_default_precision
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def test_an_fp32_run_does_not_flag_modules_that_run_in_fp32_under_autocast():
    """An fp16 run skips them (their output stays fp32); an fp32 run flagged them and
    proposed the pin that was already applied."""
    model = planted_model()
    model["in_code"] = PinnedInCode()
    apply_fp32_modules(model, ["overflowing"])
    for precision in ("fp32", "fp16"):
        report = probe(model, precision)
        by_name = {m.name: m for m in report.modules}
        for name in ("overflowing", "overflowing.linear", "in_code", "in_code.linear"):
            assert by_name[name].verdict == FINE and by_name[name].range_checked == [], name
        assert "overflow" not in report.overall["fp16"]
    assert report.fix_line() == "precision.fp32_modules=[cancelling]"  # the fp16 run
    fp32 = probe(model, "fp32")
    assert fp32.fp16_safe and fp32.fix_line() is None
    assert {m.name: m for m in fp32.modules}["healthy.0"].range_checked == ["fp16", "bf16"]


def test_only_a_forward_cast_to_fp32_or_fp64_runs_in_fp32():
    from amp_utils.autocast import fwd_default_precision
    from amp_utils.numerics import runs_in_fp32

    def module_casting_to(dtype: torch.dtype | None) -> nn.Module:
        class Cast(nn.Linear):
            @fwd_default_precision(cast_inputs=dtype)
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x)

        return Cast(2, 2)

    assert runs_in_fp32(module_casting_to(torch.float32))
    assert runs_in_fp32(module_casting_to(torch.float64))
    assert not runs_in_fp32(module_casting_to(torch.float16))  # a 16-bit forward is checked
    assert not runs_in_fp32(module_casting_to(None)) and not runs_in_fp32(nn.Linear(2, 2))


def test_gradient_accumulation_measures_each_micro_batch_not_the_running_sum():
    """The post-accumulate hook read param.grad, the window's running sum: one overflowing
    micro-batch counted in both, and two gradients of 40000 (which fit fp16) as 80000."""
    linear = nn.Linear(4, 1, bias=False)
    gradients = GradientProbe({"m": linear}, grads_are_scaled=True)  # as in an fp16 run
    with gradients:
        linear(torch.full((1, 4), float("inf"))).sum().backward()  # overflows
        linear(torch.full((1, 4), 40000.0)).sum().backward()  # no zero_grad: accumulates
    stats = gradients.stats["m.weight"]
    assert (stats.backwards, stats.overflow_backwards, stats.nonfinite) == (2, 1, 4)
    assert stats.max_abs_scaled == 40000.0
    linear.weight.grad = None
    gradients = GradientProbe({"m": linear}, grads_are_scaled=True)
    with gradients:
        for _ in range(2):
            linear(torch.full((1, 4), 40000.0)).sum().backward()
    stats = gradients.stats["m.weight"]
    assert stats.max_abs_scaled == 40000.0 and stats.overflow_backwards == 0
    assert stats.headroom_bits == pytest.approx(math.log2(65504 / 40000))
    assert torch.equal(linear.weight.grad, torch.full((1, 4), 80000.0))  # grads untouched


def test_a_parameter_whose_gradients_all_overflowed_has_no_headroom_and_comes_first():
    overflowed, healthy = nn.Linear(4, 1, bias=False), nn.Linear(4, 1, bias=False)
    modules = nn.ModuleDict({"overflowed": overflowed, "healthy": healthy})
    gradients = GradientProbe(modules, grads_are_scaled=True)
    with gradients:
        overflowed(torch.full((1, 4), float("inf"))).sum().backward()
        healthy(torch.full((1, 4), 30000.0)).sum().backward()
    report = build_report(ActivationProbe(modules), gradients, "fp16", 1, "GradScaler")
    assert [p.name for p in report.parameters] == ["overflowed.weight", "healthy.weight"]
    assert report.parameters[0].headroom_bits == -math.inf
    assert report.parameters[1].headroom_bits == pytest.approx(math.log2(65504 / 30000))
    assert "| overflowed.weight | fine | 0.00% | 0.00% | overflowed | 1/1 |" in (
        format_markdown(report)
    )
    assert report.to_json()["parameters"][0]["headroom_bits"] == "-inf"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_range_counts_agree_with_what_a_cast_does(precision):
    """Overflow, flush to zero and subnormal are where a round-to-nearest cast puts a
    value: fp16 rounds [65504, 65520) to 65504 and exactly 2^-25 to 0."""
    dtype, fmt = REDUCED[precision], FORMATS[precision]
    largest = torch.tensor(fmt.max_finite, dtype=dtype)
    ulp = float(largest - torch.nextafter(largest, torch.tensor(0.0, dtype=dtype)))
    # the midpoints a cast rounds across, and the representable extremes
    edges = [fmt.max_finite + ulp / 2, fmt.smallest_subnormal / 2]
    edges += [fmt.smallest_normal - fmt.smallest_subnormal / 2]
    edges += [fmt.max_finite, fmt.smallest_normal, fmt.smallest_subnormal]
    values = []
    for edge in torch.tensor(edges, dtype=torch.float32):
        below = torch.nextafter(edge, torch.tensor(0.0))
        above = torch.nextafter(edge, torch.tensor(math.inf))
        values += [below, edge, above, torch.nextafter(below, torch.tensor(0.0))]
    values = torch.stack(values)
    values = values[torch.isfinite(values)]
    for value in values:
        cast = value.to(dtype).float().abs()
        counts = range_counts(value.reshape(1), fmt)
        expected = (
            int(torch.isinf(cast)),
            int(cast == 0),
            int(0 < cast < fmt.smallest_normal),
        )
        assert (counts.overflow, counts.flush_to_zero, counts.subnormal) == expected, value
    fp16 = FORMATS["fp16"]
    assert range_counts(torch.tensor([65519.0, 65520.0]), fp16).overflow == 1
    assert range_counts(torch.tensor([2.0**-25]), fp16).flush_to_zero == 1


class BatchNormBrain(Brain):
    def compute_forward(self, batch, stage):
        return self.modules.model(batch[0].to(self.device))

    def compute_objectives(self, predictions, batch, stage):
        return predictions.float().square().mean()


def test_activations_are_measured_with_batchnorm_on_batch_statistics():
    """In eval mode a BatchNorm of a model trained a few steps normalizes with running
    statistics near their initial (0, 1): ranges that training, on batch statistics,
    never sees (here ~1000x larger). The probe leaves the running statistics alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    brain = BatchNormBrain(
        {"model": model},
        lambda params: torch.optim.SGD(params, lr=0.0),
        run_opts={"device": "cpu", "noprogressbar": True},
    )
    batches = [(1000.0 * torch.randn(32, 8) + 5000.0,) for _ in range(2)]
    probes = probe_training_batches(brain, batches, 2)
    norm = probes.activations.stats["model.1"]
    assert norm.max_abs < 10  # normalized by the batch, as in training
    assert probes.activations.stats["model.2"].relative_error == 0.0  # no dropout
    from amp_utils.numerics import probe_mode

    norm_module = model[1]
    before = {k: v.clone() for k, v in norm_module.state_dict().items()}
    model.train()
    with torch.no_grad(), probe_mode(model):
        assert norm_module.training and not model[2].training and not model.training
        model(batches[0][0])
    assert model.training and model[2].training
    assert all(torch.equal(v, norm_module.state_dict()[k]) for k, v in before.items())


# ------------------------------------------------------------------ fp32_modules


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.ffn = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attn(x), self.ffn(x)


def encoder() -> nn.Module:
    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block()])
    return model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_named_modules_run_in_fp32_under_autocast_the_others_do_not(dtype):
    modules = {"model": encoder()}
    matched = apply_fp32_modules(modules, ["model.blocks.*.attn"])
    assert matched == ["model.blocks.0.attn", "model.blocks.1.attn"]
    x = torch.randn(3, 8, dtype=dtype)  # a reduced-precision input is cast to fp32 too
    with torch.autocast("cpu", dtype=dtype):
        for block in modules["model"].blocks:
            attn, ffn = block(x)
            assert attn.dtype == torch.float32
            assert ffn.dtype == dtype
    assert modules["model"].blocks[0].attn(x.float()).dtype == torch.float32  # no autocast


def test_fp32_modules_leave_the_state_dict_alone(tmp_path):
    pinned = encoder()
    apply_fp32_modules(pinned, ["blocks.0.*"])
    torch.save(pinned.state_dict(), tmp_path / "pinned.pt")
    plain = encoder()
    assert pinned.state_dict().keys() == plain.state_dict().keys()
    # trained with the option, loaded without it (strict: same keys, same values)
    plain.load_state_dict(torch.load(tmp_path / "pinned.pt", weights_only=True))
    for key, value in pinned.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value)
    # and the other way round
    other = encoder()
    pinned.load_state_dict(other.state_dict())
    assert torch.equal(pinned.blocks[0].attn.weight, other.blocks[0].attn.weight)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pinned.blocks[0].attn(torch.randn(2, 8)).dtype == torch.float32  # still pinned


def test_applying_twice_wraps_once():
    model = encoder()
    apply_fp32_modules(model, ["blocks.0.attn"])
    wrapped = model.blocks[0].attn.forward
    assert apply_fp32_modules(model, ["blocks.0.attn"]) == ["blocks.0.attn"]
    assert model.blocks[0].attn.forward is wrapped
    assert "forward" not in vars(model.blocks[1].attn)  # the others keep the class forward


def test_unknown_pattern_fails_naming_module_names():
    with pytest.raises(UnknownModulePatternError) as err:
        apply_fp32_modules({"model": encoder()}, ["model.blocks.*.attention"])
    message = str(err.value)
    assert "'model.blocks.*.attention' matches no module" in message
    assert "model.blocks.0.attn" in message and "\n" not in message


# ------------------------------------------------------- the recipe, end to end


def diagnose_recipe(tmp_path, fsdd_root, precision: str, *extra: str):
    """recipes/diagnose.py's ``diagnose`` on the real config: ASR, 2 small FSDD batches."""
    from hydra import compose, initialize_config_dir

    from recipes.diagnose import diagnose
    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas
    from tests.recipe_helpers import CONF_DIR, FAST

    register_resolvers()
    register_schemas()
    out = tmp_path / f"diagnose_{precision}"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="diagnose",
            overrides=[
                *FAST,
                "data.max_batch_seconds=4",
                f"data.root={fsdd_root}",
                f"data.prepared_dir={tmp_path / 'prepared'}",
                f"output_dir={out}",
                "diagnose.batches=2",
                f"precision={precision}",
                *extra,
            ],
        )
    return diagnose(cfg), out


@pytest.fixture(scope="module")
def fp16_recipe_report(tmp_path_factory, fsdd_root):
    return diagnose_recipe(tmp_path_factory.mktemp("numerics"), fsdd_root, "fp16")


def assert_no_false_alarm(report) -> None:
    """No module of the recipe is flagged: a false alarm is a "keep in fp32" (or "prefer
    bf16") verdict on a module whose error is within the tolerance and whose values fit
    the format's range. The digit model's layers measure a few unit roundoffs."""
    assert report.flagged() == [], [(m.name, m.reason) for m in report.flagged()]
    assert report.fp16_safe and report.bf16_safe
    assert report.fix_line() is None


def test_recipe_report_fp16_has_no_false_alarms_and_writes_its_files(fp16_recipe_report):
    report, out = fp16_recipe_report
    assert_no_false_alarm(report)
    names = {m.name for m in report.modules}
    assert {"model", "model.blocks.0.attention", "model.output", "features"} <= names
    errors = {m.name: m.relative_error for m in report.modules}
    tolerance = ERROR_TOLERANCE_ROUNDOFFS * FORMATS["fp16"].unit_roundoff
    # measured, not assumed: fp16 layers err by a few roundoffs, fp32-pinned ones not at all
    assert 0 < errors["model.blocks.0.attention.qkv"] < tolerance
    assert 0 < errors["model"] < tolerance
    assert errors["features"] == 0.0
    assert any(p.headroom_bits < math.inf for p in report.parameters)
    data = json.loads((out / "numerics.json").read_text())
    assert data["precision"] == "fp16" and data["batches"] == 2
    assert len(data["modules"]) == len(report.modules)
    assert {"name", "verdict", "relative_error", "fix"} <= set(data["modules"][0])
    markdown = (out / "numerics.md").read_text()
    assert markdown.startswith("# Numerics report (fp16, 2 training batches)")
    assert "fp16: safe (range and error checked)" in markdown
    assert list((out / "tb").glob("*/events.out.tfevents.*"))  # a run per diagnosis
    # why fp16 saves less than half the activation memory: measured, fp32 holders named
    memory = json.loads((out / "activation_memory.json").read_text())
    assert memory["precision"] == "fp16" and 0.5 < memory["ratio"] < 1.0, memory["ratio"]
    assert memory["state_bytes"] > 0 and memory["ratio"] < memory["peak_ratio"] < 1.0
    assert memory["fp16"]["by_dtype"]["fp32"] > 0 and "fp16" not in memory["fp32"]["by_dtype"]
    memory_md = (out / "activation_memory.md").read_text()
    assert memory_md.startswith("# Activation memory: fp16 against fp32")
    assert "| `model.blocks.0.attention" in memory_md or "| `model.blocks.0" in memory_md
    # why fp16 runs more operations than fp32: counted, the casts sorted
    operations = json.loads((out / "step_operations.json").read_text())
    assert operations["precision"] == "fp16" and operations["ratio"] > 1.0
    assert operations["fp32"]["casts"] <= 2 < operations["fp16"]["weight_casts"]
    assert 0 < operations["fp16"]["fusable_weights"] <= operations["fp16"]["weight_casts"]
    assert operations["with_fused_weight_casts"] < operations["fp16"]["total"]
    assert "fused_weight_casts` (on in this run)" in (out / "step_operations.md").read_text()


@pytest.mark.slow  # one more diagnosis of the recipe: ~30 s on 2 cores
def test_recipe_report_fp32_predicts_both_formats(tmp_path, fsdd_root):
    report, out = diagnose_recipe(tmp_path, fsdd_root, "fp32")
    assert_no_false_alarm(report)
    assert all(m.relative_error == 0.0 for m in report.modules)  # nothing to compare in fp32
    # the log-mel front end (and all in it) runs in fp32 under autocast, pinned in code: no
    # range to fit; every other module is checked against both formats
    in_features = {m.name for m in report.modules if m.name.split(".")[0] == "features"}
    assert "features" in in_features
    assert {m.name for m in report.modules if not m.range_checked} == in_features
    assert all(m.range_checked == ["fp16", "bf16"] for m in report.modules if m.range_checked)
    assert "error not measured (diagnose with precision=fp16)" in report.overall["fp16"]
    assert report.loss_scale == 2.0**16
    assert json.loads((out / "numerics.json").read_text())["precision"] == "fp32"


@pytest.mark.slow  # one more diagnosis of the recipe: ~30 s on 2 cores
def test_recipe_report_speaker_model_bf16_has_no_false_alarms(tmp_path, fsdd_root):
    report, out = diagnose_recipe(tmp_path, fsdd_root, "bf16", "model=xvector")
    assert_no_false_alarm(report)
    errors = {m.name: m.relative_error for m in report.modules}
    tolerance = ERROR_TOLERANCE_ROUNDOFFS * FORMATS["bf16"].unit_roundoff
    assert 0 < errors["model.tdnn.0"] < tolerance
    assert "bf16: safe (range and error checked)" in (out / "numerics.md").read_text()


@pytest.mark.slow  # one more diagnosis of the recipe: ~30 s on 2 cores
def test_recipe_fp32_modules_fix_runs_those_modules_in_fp32(
    tmp_path, fsdd_root, fp16_recipe_report
):
    before = {m.name: m for m in fp16_recipe_report[0].modules}
    report, _ = diagnose_recipe(
        tmp_path, fsdd_root, "fp16", "precision.fp32_modules=[model.blocks.*.attention]"
    )
    assert report.fp32_modules == [f"model.blocks.{i}.attention" for i in range(4)]
    after = {m.name: m for m in report.modules}
    for name in ("model.blocks.0.attention", "model.blocks.3.attention.qkv"):
        assert before[name].relative_error > 0 and before[name].range_checked
        assert after[name].relative_error == 0.0 and after[name].range_checked == []
    assert after["model.blocks.0.ffn1"].relative_error > 0  # the others still in fp16


@pytest.mark.slow  # one more diagnosis of the recipe: ~30 s on 2 cores
def test_recipe_diagnosis_with_compile_says_it_runs_eagerly(tmp_path, fsdd_root, caplog):
    """The diagnosis steps eagerly (its probes hook every module) and training turns
    ``fused_weight_casts`` off under compile: it said neither."""
    with caplog.at_level("WARNING", logger="recipes.diagnose"):
        _, out = diagnose_recipe(tmp_path, fsdd_root, "fp16", "trainer.compile=true")
    assert "runs the model eagerly (uncompiled)" in caplog.text
    assert "fused_weight_casts` (off in this run)" in (out / "step_operations.md").read_text()
    assert json.loads((out / "step_operations.json").read_text())["fused_weight_casts"] is False


def test_recipe_unknown_fp32_module_pattern_fails_naming_modules():
    from recipes.experiment import build_modules
    from tests.recipe_helpers import compose_config

    modules = build_modules(compose_config(["device=cpu"]), speakers=("spk",))
    with pytest.raises(UnknownModulePatternError) as err:
        apply_fp32_modules(modules, ["model.blocks.*.attn"])
    assert "model.blocks.0.attention" in str(err.value)  # the names at that depth
    assert apply_fp32_modules(modules, ["model.blocks.*.attention"])[0] == (
        "model.blocks.0.attention"
    )


def test_documented_diagnose_commands_compose_and_validate():
    """Every ``recipes/diagnose.py`` command of README.md and docs/*.md composes."""
    from hydra import compose, initialize_config_dir

    from recipes.diagnose import training_config
    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas
    from tests.recipe_helpers import CONF_DIR
    from tests.test_readme import documented_commands

    commands = [
        line.split("#")[0].split("recipes/diagnose.py", 1)[1].split()
        for block in documented_commands()
        for line in block.splitlines()
        if "recipes/diagnose.py" in line
    ]
    assert len(commands) >= 3
    register_resolvers()
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for args in commands:
            overrides = [arg.strip("'") for arg in args]
            cfg = compose(config_name="diagnose", overrides=[*overrides, "output_dir=unused"])
            training_config(cfg)
            assert "fp32_modules" in cfg.precision


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("diagnose.batches=0", "diagnose.batches=0 must be 1 or more"),
        ("trainer.epochs=0", "epochs"),
    ],
)
def test_bad_diagnose_values_fail_before_any_work(override, message):
    from hydra import compose, initialize_config_dir

    from recipes.config import ConfigError
    from recipes.diagnose import training_config
    from recipes.resolvers import register_resolvers
    from tests.recipe_helpers import CONF_DIR

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="diagnose", overrides=[override, "output_dir=unused"])
    with pytest.raises(ConfigError, match=message):
        training_config(cfg)


@pytest.mark.slow  # the command line, end to end: ~30 s on 2 cores
def test_diagnoses_of_two_corpora_get_two_folders():
    """data.root was left out of the diagnose folder's name (as for training runs, where a
    run may move): a diagnosis of another corpus overwrote the first one's report."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig

    folders = []
    for root in ("/corpus/A", "/corpus/B"):
        with initialize_config_dir(config_dir=str(REPO_ROOT / "conf"), version_base="1.3"):
            cfg = compose("diagnose", [f"data.root={root}"], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            folders.append(cfg.hydra.run.dir)
    assert folders[0] != folders[1] and "corpus_A" in folders[0]


def test_diagnose_command_line_writes_the_report(tmp_path, fsdd_root):
    """The report, and with trainer.compile=true what the compiled model keeps (by dtype:
    compiled regions are one autograd node each)."""
    import os

    from tests.recipe_helpers import FAST, recipe_command, run_command

    run_dir = tmp_path / "run"
    args = [
        *FAST,
        "data.max_batch_seconds=4",
        f"data.prepared_dir={tmp_path / 'prepared'}",
        "diagnose.batches=1",
        "trainer.compile=true",
        "trainer.compile_backend=aot_eager",  # the partitioner without code generation
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "FSDD_ROOT": str(fsdd_root), "PYTHONPATH": str(REPO_ROOT)}
    result = run_command(recipe_command("diagnose.py", args), env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fp16: safe" in result.stderr + result.stdout
    assert json.loads((run_dir / "numerics.json").read_text())["batches"] == 1
    assert (run_dir / "numerics.md").read_text().startswith("# Numerics report (fp32")
    assert f"fsdd_digits ({fsdd_root})" in (run_dir / "numerics.md").read_text()
    assert len(list((run_dir / "tb").glob("*/events.out.tfevents.*"))) == 1  # a run of its own
    eager = json.loads((run_dir / "activation_memory.json").read_text())
    compiled = json.loads((run_dir / "activation_memory_compiled.json").read_text())
    assert eager["by_module"] and not compiled["by_module"]
    assert set(compiled["fp32"]["by_module"]) == {""} and compiled["fp32"]["by_dtype"]["fp32"] > 0
    assert compiled["state_bytes"] == eager["state_bytes"] > 0
    assert "Counted by dtype only" in (run_dir / "activation_memory_compiled.md").read_text()
    assert "activation memory compiled as training compiles the model" in result.stdout
    hydra_config = (run_dir / ".hydra" / "config.yaml").read_text()  # written on acceptance
    assert "batches: 1" in hydra_config and "fp16: safe" in (run_dir / "diagnose.log").read_text()
    bad = run_command(recipe_command("diagnose.py", [*args, "precision.fp32_modules=[nope]"]), env)
    assert bad.returncode == 1
    assert (
        bad.stderr.strip()
        .splitlines()[-1]
        .startswith("error: precision.fp32_modules: pattern 'nope' matches no module")
    )
    assert (run_dir / ".hydra" / "config.yaml").read_text() == hydra_config  # the refused one's not


# ------------------------------------------------------------------ low_precision_norms


def norm_block() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.norm = nn.LayerNorm(16)
    model.pinned = nn.Sequential(nn.LayerNorm(16))
    return model


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_norms_normalize_a_copy_in_the_autocast_dtype(dtype):
    """Under autocast the norm takes a bf16/fp16 copy of its (fp32) input: its output is in
    that dtype, within that format's rounding of the fp32 norm, and what backward keeps is
    half of fp32's; the weight and bias still get fp32 gradients. Modules pinned to fp32
    stay fp32; outside autocast nothing changes."""
    from amp_utils.module_precision import apply_low_precision_norms
    from amp_utils.saved_activations import dtype_name, measure_saved

    model, reference = norm_block(), norm_block()
    apply_fp32_modules(model, ["pinned"])
    assert apply_low_precision_norms(model) == ["norm"]
    assert apply_low_precision_norms(model) == ["norm"]  # applied once
    x = torch.randn(64, 16) * 3 + 1
    with torch.autocast("cpu", dtype=dtype):
        out = model.norm(x)
        assert model.pinned(x).dtype == torch.float32
    assert out.dtype == dtype
    expected = reference.norm(x)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), expected, rtol=4 * eps, atol=4 * eps)
    out.float().square().sum().backward()
    assert model.norm.weight.grad.dtype == torch.float32
    assert model.norm.bias.grad is not None
    low = measure_saved(model.norm, lambda: model.norm(x), "cpu", dtype)
    full = measure_saved(reference.norm, lambda: reference.norm(x), "cpu", None)
    assert low.by_dtype.get(dtype_name(dtype), 0) * 2 >= x.nbytes  # the input's copy
    assert sum(low.by_dtype.values()) < 0.6 * sum(full.by_dtype.values())
    assert torch.equal(model.norm(x), reference.norm(x))  # no autocast: the usual norm
    assert model.state_dict().keys() == reference.state_dict().keys()


def recipe_models_with_marked_norms(option: str, mark: str):
    """The recipe's bf16 model built plain and with ``option=true`` (same weights), after
    checking that the option marked every LayerNorm of the second and none of the first:
    ``(plain, changed, config of changed, its LayerNorms)``."""
    from recipes.modules import build_modules
    from tests.recipe_helpers import compose_config

    plain = build_modules(compose_config(["precision=bf16"]), ("s",))["model"]
    cfg = compose_config(["precision=bf16", f"{option}=true"])
    changed = build_modules(cfg, ("s",))["model"]
    changed.load_state_dict(plain.state_dict())
    norms = [m for m in changed.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(getattr(m, mark, False) for m in norms)
    assert not any(getattr(m, mark, False) for m in plain.modules())
    return plain, changed, cfg, norms


def test_low_precision_norms_from_the_config_reach_every_layer_norm():
    """precision.low_precision_norms=true: every LayerNorm of the recipe's model is changed
    and the model's bf16 logits stay close. (On a CPU autocast already runs LayerNorm on its
    bf16 input and the model's residual stream is bf16, so nothing is saved there; on CUDA
    autocast runs it in fp32: the GPU test measures that.)"""
    from amp_utils.module_precision import LOW_PRECISION_NORM_MARK

    plain, changed, cfg, _ = recipe_models_with_marked_norms(
        "precision.low_precision_norms", LOW_PRECISION_NORM_MARK
    )
    plain.eval(), changed.eval()
    feats, lens = torch.randn(2, 80, cfg.data.features.n_mels), torch.tensor([80, 60])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = plain(feats, lens)[0].float(), changed(feats, lens)[0].float()
    assert (a - b).norm() / a.norm() < 0.02


# ------------------------------------------------------------------ norm_saves_16bit


def affine_norm_block(shape: int | tuple[int, ...] = 16, **norm_kwargs) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.norm = nn.LayerNorm(shape, **norm_kwargs)
    model.pinned = nn.Sequential(nn.LayerNorm(shape, **norm_kwargs))
    for norm in (model.norm, model.pinned[0]):
        with torch.no_grad():
            if norm.weight is not None:
                norm.weight.uniform_(0.5, 1.5)
            if norm.bias is not None:
                norm.bias.uniform_(-1.0, 1.0)
    return model


def grads_of(model: nn.Module, x: torch.Tensor, dtype: torch.dtype, grad: torch.Tensor):
    """The norm's output under ``dtype`` autocast and the gradients of x, weight, bias."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        out = model.norm(x)
    out.backward(grad)
    params = [p.grad for p in model.norm.parameters()]
    return out, [x.grad, *params]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, kwargs",
    [(16, {}), ((4, 8), {}), (16, {"bias": False}), (16, {"elementwise_affine": False})],
    ids=["affine", "two_dims", "no_bias", "no_affine"],
)
def test_norm_saves_16bit_keeps_the_forward_and_halves_what_backward_keeps(dtype, shape, kwargs):
    """Under autocast a LayerNorm on an fp32 input computes in fp32 as before, bit for bit;
    backward keeps a 16-bit normalized input (half the input's bytes) and the gradients of
    the input, weight and bias stay within that format's rounding of fp32's. Pinned modules
    are left alone; outside autocast and without gradients nothing changes."""
    from amp_utils.module_precision import apply_norm_saves_16bit
    from amp_utils.saved_activations import dtype_name, measure_saved

    model, reference = affine_norm_block(shape, **kwargs), affine_norm_block(shape, **kwargs)
    apply_fp32_modules(model, ["pinned"])
    assert apply_norm_saves_16bit(model) == ["norm"]
    assert apply_norm_saves_16bit(model) == ["norm"]  # applied once
    normalized = (shape,) if isinstance(shape, int) else shape
    x = torch.randn(64, 5, *normalized) * 3 + 1
    grad = torch.randn_like(x)
    out, grads = grads_of(model, x, dtype, grad)
    expected_out, expected = grads_of(reference, x, dtype, grad)
    assert out.dtype == torch.float32 and torch.equal(out, expected_out)
    assert len(grads) == len(expected) == 1 + sum(1 for _ in reference.norm.parameters())
    names = ["input", *(name for name, _ in reference.norm.named_parameters())]
    for name, got, want in zip(names, grads, expected, strict=True):
        assert got.dtype == want.dtype == torch.float32
        if name == "bias":  # the sum of the output's gradient: nothing rounded
            assert torch.equal(got, want)
        else:  # from the rounded normalized input
            assert 0 < (got - want).norm() <= 2 * torch.finfo(dtype).eps * want.norm()
    xg = x.clone().requires_grad_()  # backward keeps something without weights too
    saved = measure_saved(model.norm, lambda: model.norm(xg), "cpu", dtype)
    full = measure_saved(reference.norm, lambda: reference.norm(xg), "cpu", dtype)
    assert saved.by_dtype[dtype_name(dtype)] == x.numel() * 2  # the normalized copy
    assert saved.total < 0.6 * full.total
    pinned = measure_saved(model.pinned, lambda: model.pinned(xg), "cpu", dtype)
    assert pinned.by_dtype == full.by_dtype  # pinned to fp32: unchanged
    assert torch.equal(model.norm(x), reference.norm(x))  # no autocast: the usual norm
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert torch.equal(model.norm(x), reference.norm(x))
    assert model.state_dict().keys() == reference.state_dict().keys()


def test_norm_saves_16bit_backward_is_layer_norms_backward_from_the_normalized_input():
    """Kept in fp32 (no rounding), the normalized input with mean 0 and inverse standard
    deviation 1, scaled back by the kept one, gives aten's LayerNorm gradients exactly."""
    from amp_utils.module_precision import _LayerNormSaving16Bit

    torch.manual_seed(1)
    norm = affine_norm_block((4, 8)).norm
    x = (torch.randn(6, 7, 4, 8) * 5 - 2).requires_grad_()
    y = x.detach().clone().requires_grad_()
    grad = torch.randn_like(x)
    norm(x).backward(grad)
    expected = [x.grad, *(p.grad.clone() for p in norm.parameters())]
    norm.zero_grad()
    out = _LayerNormSaving16Bit.apply(y, norm.weight, norm.bias, (4, 8), norm.eps, torch.float32)
    out.backward(grad)
    for got, want in zip([y.grad, *(p.grad for p in norm.parameters())], expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_norm_saves_16bit_on_a_16bit_input_follows_the_devices_autocast(monkeypatch):
    """A bf16 input: where autocast computes LayerNorm in fp32 (CUDA, emulated here) the
    norm computes it in fp32 too, bit for bit, and keeps the 16-bit normalized copy; where
    it computes in the input's dtype (a CPU) the usual norm runs, as it keeps 16 bits already."""
    import amp_utils.module_precision as module_precision

    model, reference = affine_norm_block(), affine_norm_block()
    module_precision.apply_norm_saves_16bit(model)
    x = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model.norm(x), reference.norm(x))  # CPU autocast: bf16 norm
        assert model.norm(x).dtype == torch.bfloat16
    monkeypatch.setattr(module_precision, "autocast_runs_norms_in_fp32", lambda device: True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.norm(x)
    n = reference.norm
    assert out.dtype == torch.float32
    assert torch.equal(out, F.layer_norm(x.float(), n.normalized_shape, n.weight, n.bias, n.eps))
    out.sum().backward()
    assert x.grad.dtype == torch.bfloat16


def test_norm_saves_16bit_compiles_without_a_graph_break():
    """Inside a compiled region (the fast path compiles Conformer blocks) the norm traces
    into one graph and gives the eager output and gradients."""
    from amp_utils.module_precision import apply_norm_saves_16bit

    model = affine_norm_block()
    apply_norm_saves_16bit(model)
    compiled = torch.compile(model.norm, backend="aot_eager", fullgraph=True)
    x = torch.randn(64, 16) * 3 + 1
    grad = torch.randn_like(x)
    eager_out, eager_grads = grads_of(model, x, torch.bfloat16, grad)
    model.zero_grad()
    x2 = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x2)
    out.backward(grad)
    assert torch.equal(out, eager_out)
    for got, want in zip(
        [x2.grad, *(p.grad for p in model.norm.parameters())], eager_grads, strict=True
    ):
        torch.testing.assert_close(got, want)


def check_compiled_norm_saves_16bit(input_dtype: torch.dtype, device: torch.device) -> None:
    """Compile (inductor) a LayerNorm with ``norm_saves_16bit`` and the layer after it, as in
    a Conformer block, and check what it keeps and computes under bf16 autocast on
    ``device`` (a CPU: inside ``cuda_kernel_choices``, CUDA's LayerNorm rule)."""
    import torch.nn.functional as F

    from amp_utils.module_precision import apply_norm_saves_16bit
    from amp_utils.saved_activations import measure_saved

    torch._dynamo.reset()
    model = affine_norm_block()
    model.linear = nn.Linear(16, 16)
    model = model.to(device)
    apply_norm_saves_16bit(model)

    def block(x: torch.Tensor) -> torch.Tensor:
        y = model.norm(x)
        return model.linear(y) if x.dtype == torch.float32 else F.silu(y)

    def autocasts_norm(x: torch.Tensor) -> torch.Tensor:  # CUDA autocast's fp32 LayerNorm
        with torch.autocast(device.type, enabled=False):
            norm = model.norm
            return F.silu(F.layer_norm(x.float(), (16,), norm.weight, norm.bias, norm.eps))

    compiled = torch.compile(block, backend="inductor", fullgraph=True, dynamic=False)
    x = (torch.randn(512, 16) * 3 + 1).to(device, input_dtype).requires_grad_()
    grad = torch.randn(512, 16, device=device)
    exact = input_dtype == torch.float32
    saved = measure_saved(model, lambda: compiled(x), device.type, torch.bfloat16, False)
    outputs, grads = [], []
    for run in (block if exact else autocasts_norm, compiled):
        model.zero_grad()
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = run(x)
        out.float().backward(grad)
        outputs.append(out)
        grads.append([x.grad, model.norm.weight.grad, model.norm.bias.grad])
    torch._dynamo.reset()
    assert saved.by_dtype.get("fp32", 0) < x.numel()  # rstd, not an fp32 copy (4 x numel)
    assert saved.by_dtype["bf16"] >= x.numel() * 2
    tolerance = dict(rtol=1e-4, atol=1e-4) if exact else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(outputs[1], outputs[0], **tolerance)
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, **tolerance)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_saves_16bit_compiled_by_inductor_keeps_16_bits(input_dtype):
    """Compiled by inductor (the fast path compiles the Conformer's blocks), under CUDA's
    LayerNorm rule, what the norm and the layer after it keep is 16-bit, as in the blocks:
    an fp32 input (the residual stream) followed by a Linear keeps the bf16 normalized copy,
    not an fp32 one (inductor folded the plain autograd function's casts down and up into
    one fp32 cast and kept fp32 values); a bf16 input followed by SiLU (the conv module's
    norm) keeps no fp32 tensor of the input's size (the opaque operation kept its fp32
    output for the SiLU). Output and gradients: the eager option's for an fp32 input,
    autocast's fp32 LayerNorm's (x's gradient rounded to bf16) for a bf16 one."""
    from benchmarks.cuda_policy import cuda_kernel_choices

    with cuda_kernel_choices():
        check_compiled_norm_saves_16bit(input_dtype, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_saves_16bit_compiled_by_inductor_keeps_16_bits_on_cuda(input_dtype, cuda_device):
    """The same on CUDA, with CUDA's own autocast and Triton kernels."""
    check_compiled_norm_saves_16bit(input_dtype, cuda_device)


def test_norm_saves_16bit_from_the_config_keeps_the_models_loss_under_cudas_norms(monkeypatch):
    """precision.norm_saves_16bit=true marks every LayerNorm of the recipe's model. With
    LayerNorms computed in fp32 as on CUDA (emulated), a bf16 training forward pass gives
    the plain model's loss bit for bit and gradients within bf16's rounding; on a CPU (whose
    autocast keeps the Conformer's residual stream in bf16) nothing changes at all."""
    import amp_utils.module_precision as module_precision
    from amp_utils.module_precision import NORM_SAVES_16BIT_MARK
    from benchmarks.cuda_policy import cuda_fp32_ops

    plain, changed, cfg, norms = recipe_models_with_marked_norms(
        "precision.norm_saves_16bit", NORM_SAVES_16BIT_MARK
    )
    torch.manual_seed(0)
    feats, lens = torch.randn(3, 90, cfg.data.features.n_mels), torch.tensor([90, 70, 50])

    def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        torch.manual_seed(5)  # the same dropout masks
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(feats, lens)[0].float().square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    calls = []
    apply = module_precision._LayerNormSaving16Bit.apply
    monkeypatch.setattr(
        module_precision._LayerNormSaving16Bit,
        "apply",
        lambda *args: calls.append(1) or apply(*args),
    )
    cpu_loss, cpu_grads = loss_and_grads(plain)
    assert torch.equal(loss_and_grads(changed)[0], cpu_loss) and not calls
    monkeypatch.setattr(module_precision, "autocast_runs_norms_in_fp32", lambda device: True)
    with cuda_fp32_ops() as cuda_ops:  # CUDA autocast's fp32 ops (layer_norm among them)
        plain_loss, plain_grads = loss_and_grads(plain)
        changed_loss, changed_grads = loss_and_grads(changed)
    assert cuda_ops.calls > 0
    assert len(calls) == len(norms)  # every norm on CUDA's path once
    assert torch.equal(changed_loss, plain_loss)
    flat = torch.cat([g.flatten() for g in plain_grads])
    diff = torch.cat([(a - b).flatten() for a, b in zip(changed_grads, plain_grads, strict=True)])
    assert 0 < diff.norm() < 0.02 * flat.norm()


def test_a_recipe_trains_on_a_cpu_with_cudas_autocast_choices(tmp_path, fsdd_root):
    """benchmarks/train_cuda_policy.py: recipes/train.py's command line, trained with CUDA
    autocast's fp32 ops emulated (reached, and counted at the end), results written."""
    from tests.recipe_helpers import FAST, run_command

    out = tmp_path / "run"
    result = run_command(
        [
            sys.executable,
            "-m",
            "benchmarks.train_cuda_policy",
            *FAST,
            "precision=bf16",
            "precision.norm_saves_16bit=true",
            f"data.root={fsdd_root}",
            f"hydra.run.dir={out}",
        ],
        {**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    calls = re.search(r"CUDA's autocast choices emulated: (\d+) calls", result.stdout)
    assert calls and int(calls.group(1)) > 0, result.stdout[-1000:]
    results = json.loads((out / "results.json").read_text())
    assert results["precision"] == "bf16" and math.isfinite(results["test_metrics"]["loss"])
