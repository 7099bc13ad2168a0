"""amp_utils against the installed SpeechBrain, side by side on the same inputs.

``amp_utils.autocast`` and ``amp_utils.Brain`` promise SpeechBrain's API and behaviour
(``speechbrain.utils.autocast``, ``speechbrain.core.Brain``). These tests run both on
identical inputs and compare what a user can observe; the differences that are on purpose
(docs/library.md) are left out. Skipped where SpeechBrain is not installed (the ``bench``
extra; CI installs ``dev`` only).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

import pytest
import torch

import amp_utils
from amp_utils import autocast as our_autocast

speechbrain = pytest.importorskip("speechbrain")
sb_core = pytest.importorskip("speechbrain.core")
sb_autocast = pytest.importorskip("speechbrain.utils.autocast")

IMPLEMENTATIONS = {"speechbrain": sb_autocast, "amp_utils": our_autocast}


def _outcome(call: Any) -> Any:
    """What ``call()`` returns, or the type of what it raises."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001 (the type is what is compared)
        return type(err)


def _both(call: Any) -> tuple[Any, Any]:
    """``call(module)`` with SpeechBrain's autocast module, then with ours."""
    return tuple(_outcome(lambda m=m: call(m)) for m in IMPLEMENTATIONS.values())


@pytest.mark.parametrize("name", [None, "fp32", "fp16", "bf16", "fp8", "", "BF16", 16])
def test_ampconfig_from_name(name):
    theirs, ours = _both(lambda m: m.AMPConfig.from_name(name).dtype)
    assert ours == theirs


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"dtype": torch.float32},
        {"dtype": torch.bfloat16},
        {"dtype": torch.float16},
        {"dtype": None},
        {"dtype": torch.bfloat16, "enabled": False},
        {"dtype": torch.bfloat16, "cache_enabled": False},
    ],
)
def test_torch_autocast_on_cpu(kwargs):
    def inside(m: Any) -> tuple:
        with m.TorchAutocast(device_type="cpu", **kwargs):
            with m.TorchAutocast(device_type="cpu", dtype=torch.float32):  # nested no-op
                nested = torch.is_autocast_enabled("cpu")
            out = torch.nn.Linear(2, 2)(torch.ones(1, 2))
            return torch.is_autocast_enabled("cpu"), nested, out.dtype

    theirs, ours = _both(inside)
    assert ours == theirs
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("cast_inputs", [torch.float32, None, torch.float64])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("force", [False, True])
def test_fwd_default_precision_on_a_module(cast_inputs, autocast, force):
    """The decorated forward of a module, positional and keyword tensors, fp32 and bf16
    inputs: the dtypes it computes on and whether autocast is on inside."""

    def run(m: Any) -> list:
        class Module(torch.nn.Module):
            @m.fwd_default_precision(cast_inputs=cast_inputs)
            def forward(self, x, y=None):
                return x.dtype, y.dtype, torch.is_autocast_enabled("cpu"), (x @ x.T).dtype

        seen = []
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.ones(2, 2, dtype=dtype)
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=bool(autocast)):
                seen.append(Module()(x, y=x[0], force_allow_autocast=force))
        return seen

    theirs, ours = _both(run)
    assert ours == theirs


def _brain_run(
    brain_base: type, stage_enum: Any, run_opts: dict, losses: list[float] | None = None
) -> tuple[dict, list]:
    """Train and test a small model with ``brain_base``; what the run shows and its hooks."""
    log: list = []
    factors = list(losses or [])

    class Recorded(brain_base):
        def compute_forward(self, batch, stage):
            log.append(("forward", stage.name, self.step, torch.is_autocast_enabled("cpu")))
            return self.modules.model(batch[0])

        def compute_objectives(self, predictions, batch, stage):
            loss = torch.nn.functional.mse_loss(predictions.float(), batch[1])
            if stage == stage_enum.TRAIN and factors:
                loss = loss * factors.pop(0)
            return loss

        def on_stage_start(self, stage, epoch=None):
            log.append(("stage_start", stage.name, epoch))

        def on_stage_end(self, stage, stage_loss, epoch=None):
            finite = stage_loss == stage_loss
            log.append(("stage_end", stage.name, epoch, finite, torch.is_grad_enabled()))

        def on_fit_batch_start(self, batch, should_step):
            log.append(("batch_start", self.step, should_step))

        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            log.append(("batch_end", self.step, should_step, loss.requires_grad))

    torch.manual_seed(0)
    brain = Recorded(
        {"model": torch.nn.Linear(4, 4)},
        opt_class=lambda params: torch.optim.SGD(params, lr=0.1),
        run_opts=dict(run_opts),
    )
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)) for _ in range(6)]
    brain.fit(range(1, 3), data, valid_set=data[:2], progressbar=False)
    test_loss = brain.evaluate(data[:2], progressbar=False)
    shown = {
        "weight": brain.modules.model.weight.detach().clone(),
        "test_loss": test_loss,
        "test_loss_type": type(test_loss),
        "step": brain.step,
        "precisions": (brain.precision, brain.eval_precision),
        "options": (brain.max_grad_norm, brain.grad_accumulation_factor),
    }
    return shown, log


@pytest.mark.parametrize(
    "run_opts",
    [
        {"device": "cpu"},
        {"device": "cpu", "precision": "bf16"},
        {"device": "cpu", "precision": "bf16", "eval_precision": "bf16"},
        {"device": "cpu", "grad_accumulation_factor": 3, "max_grad_norm": 0.05},
    ],
)
def test_brain_trains_evaluates_and_calls_its_hooks_as_speechbrain(run_opts, caplog):
    caplog.set_level(logging.ERROR)
    theirs, their_log = _brain_run(sb_core.Brain, speechbrain.Stage, run_opts)
    ours, our_log = _brain_run(amp_utils.Brain, amp_utils.Stage, run_opts)
    torch.testing.assert_close(ours.pop("weight"), theirs.pop("weight"))
    assert ours.pop("test_loss") == pytest.approx(theirs.pop("test_loss"))
    assert ours == theirs
    assert our_log == their_log


def test_a_speechbrain_style_fit_batch_with_nonfinite_losses_trains_as_speechbrain(caplog):
    """SpeechBrain's own fit_batch (it calls check_loss_isfinite), non-finite losses
    within the patience and skip_nonfinite_grads: the same weights. (optimizer_step
    differs on purpose: SpeechBrain counts skipped steps too.)"""
    caplog.set_level(logging.ERROR)

    def fit_batch(self, batch):
        stage = amp_utils.Stage if isinstance(self, amp_utils.Brain) else speechbrain.Stage
        should_step = (self.step % self.grad_accumulation_factor) == 0
        self.on_fit_batch_start(batch, should_step)
        with self.no_sync(not should_step):
            with self.training_ctx:
                outputs = self.compute_forward(batch, stage.TRAIN)
                loss = self.compute_objectives(outputs, batch, stage.TRAIN)
            scaled_loss = self.scaler.scale(loss / self.grad_accumulation_factor)
            self.check_loss_isfinite(scaled_loss)
            scaled_loss.backward()
        if should_step:
            self.optimizers_step()
        self.on_fit_batch_end(batch, outputs, loss, should_step)
        return loss.detach().cpu()

    run_opts = {"device": "cpu", "skip_nonfinite_grads": True, "nonfinite_patience": 3}
    nan = float("nan")
    results = []
    for base, stage_enum in (
        (sb_core.Brain, speechbrain.Stage),
        (amp_utils.Brain, amp_utils.Stage),
    ):
        styled = type("SpeechBrainStyle", (base,), {"fit_batch": fit_batch})
        results.append(_brain_run(styled, stage_enum, run_opts, losses=[1, nan, nan, nan, 1, 1]))
    (theirs, their_log), (ours, our_log) = results
    torch.testing.assert_close(ours["weight"], theirs["weight"])
    assert [entry for entry in our_log if entry[0] != "stage_end"] == [
        entry for entry in their_log if entry[0] != "stage_end"
    ]


def test_stage_members_match():
    assert [(s.name, s.value) for s in amp_utils.Stage] == [
        (s.name, s.value) for s in speechbrain.Stage
    ]


def test_brain_signatures_match():
    """The parameters SpeechBrain's public Brain methods take, by name, order and default
    (ours may add keyword parameters after them)."""
    import inspect

    def params(func: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(func).parameters.values()]

    public = [
        name
        for name in dir(sb_core.Brain)
        if not name.startswith("_") and callable(getattr(sb_core.Brain, name))
    ]
    missing = {"check_gradients", "print_trainable_parameters"}  # docs/library.md
    for name in itertools.chain(["__init__"], sorted(set(public) - missing)):
        theirs, ours = params(getattr(sb_core.Brain, name)), params(getattr(amp_utils.Brain, name))
        # SpeechBrain's mutable {} defaults (which its evaluate fills in) are None here
        theirs = [(n, None if isinstance(d, dict) else d) for n, d in theirs]
        assert ours[: len(theirs)] == theirs, name
