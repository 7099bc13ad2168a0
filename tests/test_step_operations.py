"""Operations of one training step by precision (``amp_utils.step_operations``)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from amp_utils import Brain
from amp_utils.module_precision import apply_low_precision_norms, run_in_fp32
from amp_utils.step_operations import (
    count_step_operations,
    step_operations,
    training_step_operations,
)
from amp_utils.weight_casts import WeightCasts


class Block(nn.Module):
    """Two linear layers around a LayerNorm kept in fp32 (as CUDA's autocast keeps it)."""

    def __init__(self, low_precision_norms: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.second = nn.Linear(8, 4)
        if low_precision_norms:
            apply_low_precision_norms(self)
        else:
            run_in_fp32(self.norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.norm(self.first(x)))


def _loss(model: nn.Module, x: torch.Tensor):
    return lambda: model(x).float().square().mean()


def test_fp32_runs_no_cast_and_bf16_casts_weights_activations_and_gradients():
    model, x = Block(), torch.randn(3, 8)
    fp32 = count_step_operations(model, _loss(model, x), "cpu", None)
    bf16 = count_step_operations(model, _loss(model, x), "cpu", torch.bfloat16)
    assert fp32.casts == 0 and fp32.total > 0
    # the 4 linear parameters, once each; the LayerNorm's stay fp32
    assert bf16.weight_casts == 4 and bf16.fusable_weights == 4
    # x down for `first`; its output up for the fp32 norm; the norm's output down for
    # `second`; the loss's .float() up
    assert bf16.activation_casts == {"Linear": 2, "LayerNorm": 1, "(outside modules: the loss)": 1}
    assert bf16.backward_casts >= 4 + 3  # each weight's gradient, and the activations'
    assert bf16.total > fp32.total
    assert bf16.casts == 4 + 4 + bf16.backward_casts


def test_the_fusable_weights_are_those_weight_casts_casts_together():
    model, x = Block(), torch.randn(3, 8)
    counted = count_step_operations(model, _loss(model, x), "cpu", torch.bfloat16)
    casts = WeightCasts(model, torch.bfloat16)
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False), casts.during_forward():
        model(x)
    assert counted.fusable_weights == len(casts.parameters) == 4


def test_counting_leaves_the_gradients_and_the_dropout_masks_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1)).train()
    x = torch.randn(4, 8)
    model(x).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    report = step_operations(model, _loss(model, x), "cpu", "bf16", torch.bfloat16)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), before, strict=True))
    # both passes draw the same masks: the same operations but the casts
    assert report.low.total - report.low.casts == report.fp32.total - report.fp32.casts


def test_the_report_says_what_each_option_removes():
    model, x = Block(), torch.randn(3, 8)
    report = step_operations(model, _loss(model, x), "cpu", "bf16", torch.bfloat16, False)
    text = report.markdown()
    assert text.startswith("# Operations of one training step: fp32 and bf16")
    assert (
        f"| operations | {report.fp32.total} | {report.low.total} ({report.ratio:.2f}x) |" in text
    )
    assert "4 parameters are only cast by the forward pass" in text
    assert "`precision.fused_weight_casts` (off in this run)" in text
    assert f": {report.low.total - 8 + 4} operations" in text
    assert "1 activation casts are made by LayerNorms" in text
    data = json.loads(json.dumps(report.to_json()))
    assert data["bf16"]["fusable_weights"] == 4 and data["fused_weight_casts"] is False
    assert data["with_fused_weight_casts"] == report.low.total - 4


def test_low_precision_norms_remove_the_layer_norms_casts():
    x = torch.randn(3, 8)
    plain, low = Block(), Block(low_precision_norms=True)
    with_fp32_norm = count_step_operations(plain, _loss(plain, x), "cpu", torch.bfloat16)
    with_low_norm = count_step_operations(low, _loss(low, x), "cpu", torch.bfloat16)
    assert "LayerNorm" in with_fp32_norm.activation_casts
    assert with_low_norm.activation_casts.get("LayerNorm", 0) == 0
    # the norm's input and output stay bf16; its weight and bias are cast instead, and
    # qualify for fused_weight_casts
    assert sum(with_low_norm.activation_casts.values()) == 2
    assert sum(with_fp32_norm.activation_casts.values()) == 4
    assert with_low_norm.fusable_weights == 6
    assert (
        "LayerNorms"
        not in step_operations(low, _loss(low, x), "cpu", "bf16", torch.bfloat16).markdown()
    )


class RandomBranch(nn.Module):
    """Takes an extra operation when its host draw says so (like augmentation)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) < 0.5:
            x = x.exp()
        return self.layer(x)


def test_both_passes_take_the_same_random_branches():
    model, x = RandomBranch(), torch.randn(3, 8)
    torch.manual_seed(0)  # draws 0.496, then 0.768: different branches without the reset
    report = step_operations(model, _loss(model, x), "cpu", "bf16", torch.bfloat16)
    assert report.low.total - report.low.casts == report.fp32.total - report.fp32.casts


def test_frozen_weights_count_as_weights_and_same_dtype_copies_are_no_casts():
    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(8, 8).requires_grad_(False)
            self.trained = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.trained(self.frozen(x.to(torch.float32, copy=True)))

    model, x = Frozen(), torch.randn(3, 8)
    ops = count_step_operations(model, _loss(model, x), "cpu", torch.bfloat16)
    assert ops.weight_casts == 4 and ops.fusable_weights == 2  # frozen ones are not fused
    assert ops.activation_casts == {"Linear": 1, "(outside modules: the loss)": 1}


def test_views_and_autograd_bookkeeping_are_not_operations():
    from amp_utils.step_operations import is_operation

    aten = torch.ops.aten
    views = [aten.view.default, aten.t.default, aten.detach.default, aten._unsafe_view.default]
    assert not any(map(is_operation, views))
    assert all(map(is_operation, [aten.mm.default, aten._to_copy.default, aten.cat.default]))


class BlockBrain(Brain):
    def compute_forward(self, batch, stage):
        return self.modules.model(batch.to(self.device))

    def compute_objectives(self, predictions, batch, stage):
        return predictions.float().square().mean()


@pytest.mark.parametrize("compile_modules", [False, True])
def test_the_report_says_whether_training_fuses_the_weight_casts(compile_modules):
    """Training turns ``fused_weight_casts`` off under ``trainer.compile`` (torch.compile
    fuses the casts itself): the report said "on in this run" from the option alone."""
    brain = BlockBrain(
        {"model": Block()},
        lambda params: torch.optim.SGD(params, lr=0.1),
        run_opts={
            "device": "cpu",
            "noprogressbar": True,
            "precision": "bf16",
            "compile": compile_modules,
            "fused_weight_casts": True,
        },
    )
    report = training_step_operations(brain, torch.randn(3, 8))
    assert report.low.fusable_weights == 4
    assert report.fused_weight_casts is not compile_modules
    state = "off" if compile_modules else "on"
    assert f"`precision.fused_weight_casts` ({state} in this run)" in report.markdown()
