"""The AMP optimizer step of ``Brain.fit_batch``, checked against plain PyTorch.

One step of the loop must give the parameters (and optimizer state) of the textbook step:
``torch.autocast`` forward, ``GradScaler.scale(loss).backward()``, ``unscale_``,
``clip_grad_norm_``, ``scaler.step(optimizer)``, ``scaler.update()``. Counting steps is not
enough: a step that is silently dropped, or clipped on scaled gradients, still counts.

A skipped step (an fp16 overflow, a non-finite loss, or with ``skip_nonfinite_grads`` a
non-finite gradient) must leave parameters and optimizer state bit-for-bit as they were and
must not advance the LR scheduler.

Everything runs on the CPU in milliseconds (CPU autocast does fp16 and bf16).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from amp_utils import Brain

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: fp16 loss scale for these tests: the default 2**16 overflows on the first step here, so
#: no update would be applied; 2**10 leaves the scaled fp16 gradients finite.
INIT_SCALE = 2.0**10
MAX_GRAD_NORM = 0.5  # below the gradient norm of the first batch: clipping is active
#: Brain and the reference run the same operations in the same order on the CPU, so they
#: agree to float32 rounding; a dropped or wrongly scaled update is off by ~1e-3 or more.
RTOL, ATOL = 1e-5, 1e-6
IMPLS = ["fused", "foreach"]


class InfGrad(torch.autograd.Function):
    """Identity forward, infinite gradient backward: a finite loss with non-finite grads."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


class StepBrain(Brain):
    """MSE regression; ``hparams.bad`` maps a batch index (``self.step``) to a fault."""

    def compute_forward(self, batch, stage):
        return self.modules.model(batch[0])

    def compute_objectives(self, predictions, batch, stage):
        loss = torch.nn.functional.mse_loss(predictions.float(), batch[1])
        fault = self.hparams.bad.get(self.step) if self.hparams else None
        if fault == "inf_grad":
            return InfGrad.apply(loss)
        if fault == "nan_loss":  # the loss is NaN, its gradients stay finite
            return loss + torch.tensor(float("nan"))
        return loss


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def make_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 8, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


def adamw(impl: str):
    flags = {"fused": True} if impl == "fused" else {"foreach": True}
    return lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, **flags)


def sgd(impl: str):
    flags = {"fused": True} if impl == "fused" else {"foreach": True}
    return lambda params: torch.optim.SGD(params, lr=1.0, **flags)


def make_brain(model, opt_class, precision, bad=None, **opts) -> StepBrain:
    hparams = {
        "bad": bad or {},
        "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    }
    run_opts = {"device": "cpu", "precision": precision, "max_grad_norm": MAX_GRAD_NORM, **opts}
    brain = StepBrain({"model": model}, opt_class, hparams=hparams, run_opts=run_opts)
    if brain.scaler.is_enabled():
        brain.scaler.load_state_dict(reference_scaler(precision).state_dict())
    brain.init_optimizers()
    brain.modules.train()
    return brain


def reference_scaler(precision: str) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, enabled=precision == "fp16")


def brain_step(brain: StepBrain, batch) -> None:
    """One batch as the fit loop drives it, with its values read back."""
    brain.step += 1
    brain.fit_batch(batch)
    brain.flush_pending()


def reference_step(model, opt, scaler, batch, precision: str) -> torch.Tensor:
    """The plain PyTorch AMP step; returns the (unscaled, pre-clipping) gradient norm."""
    x, y = batch
    dtype = DTYPES[precision]
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    return norm


def params(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def assert_state_close(actual: dict, expected: dict, exact: bool = False) -> None:
    """Optimizer ``state_dict()['state']`` entries: every tensor (moments, step) alike."""
    assert actual.keys() == expected.keys()
    for index, entry in expected.items():
        assert actual[index].keys() == entry.keys(), index
        for key, value in entry.items():
            if exact:
                assert torch.equal(actual[index][key], value), (index, key)
            else:
                torch.testing.assert_close(actual[index][key], value, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_one_step_matches_the_plain_pytorch_amp_step(precision, impl):
    model = make_model()
    ref_model = copy.deepcopy(model)
    before = params(model)
    brain = make_brain(model, adamw(impl), precision)
    ref_opt = adamw(impl)(ref_model.parameters())
    ref_scaler = reference_scaler(precision)
    batch = make_batch(1)

    brain_step(brain, batch)
    ref_norm = reference_step(ref_model, ref_opt, ref_scaler, batch, precision)

    assert ref_norm > 2 * MAX_GRAD_NORM  # the step is clipped
    assert (brain.optimizer_step, brain.skipped_steps) == (1, 0)
    assert brain.last_grad_norm == pytest.approx(ref_norm.item(), rel=RTOL)
    for p, q, p0 in zip(model.parameters(), ref_model.parameters(), before, strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
        assert (p.detach() - p0).abs().min() > 1e-3  # every weight really moved
    assert_state_close(brain.optimizer.state_dict()["state"], ref_opt.state_dict()["state"])
    assert brain.lr_scheduler.last_epoch == 1
    if precision == "fp16":
        assert brain.scaler.get_scale() == ref_scaler.get_scale() == INIT_SCALE


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_clips_the_unscaled_gradients_and_logs_their_norm(impl):
    """SGD with lr 1 moves the weights by exactly the clipped gradient the step used."""
    model = make_model()
    ref_model = copy.deepcopy(model)
    before = torch.cat([p.flatten() for p in params(model)])
    brain = make_brain(model, sgd(impl), "fp16")
    batch = make_batch(1)

    brain_step(brain, batch)
    ref_norm = reference_step(
        ref_model, sgd(impl)(ref_model.parameters()), reference_scaler("fp16"), batch, "fp16"
    ).item()

    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert brain.optimizer_step == 1
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(MAX_GRAD_NORM, rel=1e-4)
    assert ref_norm > 2 * MAX_GRAD_NORM
    assert brain.last_grad_norm == pytest.approx(ref_norm, rel=RTOL)  # not INIT_SCALE times it


class Snapshot:
    """Parameters, optimizer state, learning rate and scheduler position of a brain."""

    def __init__(self, brain: StepBrain) -> None:
        self.params = params(brain.modules)
        self.optimizer = copy.deepcopy(brain.optimizer.state_dict())
        self.lr = brain.optimizer.param_groups[0]["lr"]
        self.last_epoch = brain.lr_scheduler.last_epoch

    def assert_unchanged(self, brain: StepBrain) -> None:
        """Bit for bit: a skipped step must not touch anything."""
        for p, q in zip(brain.modules.parameters(), self.params, strict=True):
            assert torch.equal(p.detach(), q)
        state = brain.optimizer.state_dict()
        assert_state_close(state["state"], self.optimizer["state"], exact=True)
        assert state["param_groups"] == self.optimizer["param_groups"]
        assert brain.optimizer.param_groups[0]["lr"] == self.lr
        assert brain.lr_scheduler.last_epoch == self.last_epoch


#: precision and fault of each case: every one must skip the step.
SKIP_CASES = {
    "fp16-inf_grad": ("fp16", "inf_grad"),
    "fp16-overflow": ("fp16", "overflow"),  # finite loss, scaled fp16 gradients overflow
    "fp32-nan_loss": ("fp32", "nan_loss"),
    "bf16-nan_loss": ("bf16", "nan_loss"),
    "fp16-nan_loss": ("fp16", "nan_loss"),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", SKIP_CASES.keys())
def test_skipped_step_changes_no_parameter_no_optimizer_state_no_lr(case, impl):
    precision, fault = SKIP_CASES[case]
    model = make_model()
    brain = make_brain(model, adamw(impl), precision, bad={2: fault})
    brain_step(brain, make_batch(1))  # a good step first: the optimizer has state
    saved = Snapshot(brain)
    x, y = make_batch(2)
    if fault == "overflow":  # a finite loss whose scaled fp16 gradients overflow
        x, y = x * 300, y * 300

    brain_step(brain, (x, y))

    assert (brain.optimizer_step, brain.skipped_steps) == (1, 1)
    assert brain.nonfinite_count == (fault == "nan_loss")  # else the gradients alone skip it
    saved.assert_unchanged(brain)
    if precision == "fp16":
        assert brain.scaler.get_scale() == INIT_SCALE / 2  # the scaler backed off
    brain_step(brain, make_batch(3))  # and training goes on
    assert (brain.optimizer_step, brain.skipped_steps) == (2, 1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("skip_nonfinite_grads", [True, False])
def test_skip_nonfinite_grads_decides_a_bf16_step_with_a_finite_loss(skip_nonfinite_grads, impl):
    model = make_model()
    brain = make_brain(
        model, adamw(impl), "bf16", bad={2: "inf_grad"}, skip_nonfinite_grads=skip_nonfinite_grads
    )
    brain_step(brain, make_batch(1))
    saved = Snapshot(brain)

    brain_step(brain, make_batch(2))

    assert brain.nonfinite_count == 0 and math.isfinite(brain.avg_train_loss)  # finite loss
    assert not math.isfinite(brain.last_grad_norm)
    if skip_nonfinite_grads:
        assert (brain.optimizer_step, brain.skipped_steps) == (1, 1)
        saved.assert_unchanged(brain)
    else:  # applied as asked: the non-finite gradient reaches the weights
        assert (brain.optimizer_step, brain.skipped_steps) == (2, 0)
        assert all(not torch.isfinite(p).all() for p in brain.modules.parameters())
        assert brain.lr_scheduler.last_epoch == 2


# --- AMPOptimizerStep and ScalerState used directly (what Brain drives) --------------------
# These pin down the parts the Brain tests above never reach: gradient accumulation, a
# window of several losses, measuring without clipping, no observed loss, no gradients, the
# device-side skip of fused optimizers, the fp16 loss scale and the scaler's checkpoint.

from amp_utils.amp_step import AMPOptimizerStep, ScalerState, _step_unless  # noqa: E402


def direct_step(precision="fp32", max_grad_norm=MAX_GRAD_NORM, skip_nonfinite_grads=False):
    return AMPOptimizerStep(reference_scaler(precision), max_grad_norm, skip_nonfinite_grads)


def mse(model, seed):
    x, y = make_batch(seed)
    return torch.nn.functional.mse_loss(model(x), y)


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def test_backward_divides_the_loss_by_the_accumulation_factor():
    model, ref = make_model(), make_model()
    mse(ref, 1).backward()
    expected = grads(ref)
    amp = direct_step()

    amp.backward(mse(model, 1))  # default: no accumulation, the plain gradient
    for g, e in zip(grads(model), expected, strict=True):
        torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)
    model.zero_grad(set_to_none=True)
    amp.backward(mse(model, 1), accumulation=4)
    for g, e in zip(grads(model), expected, strict=True):
        torch.testing.assert_close(g, e / 4, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("bad_first", [True, False])
def test_a_nonfinite_loss_anywhere_in_the_accumulation_window_skips_the_step(bad_first):
    model = make_model()
    opt = adamw("foreach")(model.parameters())
    before = params(model)
    amp = direct_step()
    losses = [torch.tensor(float("nan")), torch.tensor(1.0)]
    for loss in losses if bad_first else losses[::-1]:
        amp.observe_loss(loss)
    amp.backward(mse(model, 1))

    info = amp.step([opt])

    assert bool(info.skipped)
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), before, strict=True))
    # The window starts afresh after a step: two finite losses do not skip.
    amp.observe_loss(torch.tensor(1.0))
    amp.observe_loss(torch.tensor(2.0))
    amp.backward(mse(model, 1))
    assert not bool(amp.step([opt]).skipped)


@pytest.mark.parametrize("impl", IMPLS)
def test_step_without_observed_loss_applies_and_returns_a_bool_scalar_flag(impl):
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt = adamw(impl)(model.parameters())
    amp = direct_step(skip_nonfinite_grads=True)
    amp.backward(mse(model, 1))

    info = amp.step([opt])  # observe_loss never called: nothing says skip

    assert info.skipped.dtype == torch.bool and info.skipped.shape == ()
    assert not bool(info.skipped)
    ref_opt = adamw(impl)(ref_model.parameters())
    mse(ref_model, 1).backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), MAX_GRAD_NORM)
    ref_opt.step()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)
    assert all(p.grad is None for p in model.parameters())  # zeroed with set_to_none


@pytest.mark.parametrize("max_grad_norm", [0.0, -1.0])
def test_max_grad_norm_of_zero_or_less_measures_without_clipping(max_grad_norm):
    model = make_model()
    ref_model = copy.deepcopy(model)
    opt, ref_opt = sgd("foreach")(model.parameters()), sgd("foreach")(ref_model.parameters())
    amp = direct_step(max_grad_norm=max_grad_norm)
    amp.observe_loss(torch.tensor(1.0))
    amp.backward(mse(model, 1))

    info = amp.step([opt])

    mse(ref_model, 1).backward()
    ref_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_model.parameters()])
    ref_opt.step()
    assert ref_norm > 2 * MAX_GRAD_NORM  # clipping would have changed the update
    assert info.grad_norm.item() == pytest.approx(ref_norm.item(), rel=RTOL)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL)


def test_step_with_no_gradient_or_no_optimizer_returns_none():
    model = make_model()
    opt = adamw("foreach")(model.parameters())
    amp = direct_step()
    assert amp.step([]) is None
    assert amp.step([opt]) is None  # nothing has a gradient yet: nothing to step, no error


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_optimizer_whose_parameters_have_no_gradient_is_left_alone(precision):
    """Two optimizers (SpeechBrain's optimizers_dict), a window whose loss reached only the
    first one's parameters: the first steps as alone, the second keeps its state. fp16's
    scaler refused the step ('No inf checks were recorded for this optimizer')."""
    model, other = make_model(), make_model()
    ref_model = copy.deepcopy(model)
    opt, other_opt = sgd("foreach")(model.parameters()), sgd("foreach")(other.parameters())
    ref_opt = sgd("foreach")(ref_model.parameters())
    amp, ref_amp = direct_step(precision), direct_step(precision)
    before = params(other)
    for step, (a, optimizers) in enumerate([(amp, [opt, other_opt]), (ref_amp, [ref_opt])]):
        a.observe_loss(torch.tensor(1.0))
        a.backward(mse(ref_model if step else model, 1))
        info = a.step(optimizers)
        assert info is not None and not bool(info.skipped)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert all(torch.equal(p.detach(), q) for p, q in zip(other.parameters(), before, strict=True))
    # The next window reaches both: both step.
    amp.backward(mse(model, 2) + mse(other, 2))
    assert not bool(amp.step([opt, other_opt]).skipped)
    assert not all(
        torch.equal(p.detach(), q) for p, q in zip(other.parameters(), before, strict=True)
    )


@pytest.mark.parametrize("skip", [True, False])
def test_fused_optimizer_skips_on_the_device_through_found_inf(skip):
    """A fused optimizer always runs its kernel: ``found_inf`` (not a host sync) skips it."""
    model = make_model()
    opt = adamw("fused")(model.parameters())
    assert opt._step_supports_amp_scaling
    mse(model, 1).backward()
    before = params(model)
    seen = []
    real_step = opt.step

    def spy_step(*args, **kwargs):
        seen.append((opt.grad_scale, opt.found_inf.clone()))
        return real_step(*args, **kwargs)

    opt.step = spy_step

    _step_unless(opt, torch.tensor(skip))

    assert len(seen) == 1  # the kernel ran, even when skipping
    grad_scale, found_inf = seen[0]
    assert grad_scale is None
    assert found_inf.dtype == torch.float32 and found_inf.item() == float(skip)
    after = model.parameters()
    moved = [not torch.equal(p.detach(), q) for p, q in zip(after, before, strict=True)]
    assert all(moved) if not skip else not any(moved)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")


@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_loss_scale_is_the_fp16_scale_and_none_otherwise(precision):
    amp = direct_step(precision)
    amp.scaler.scale(torch.tensor(1.0))  # the scaler makes its scale tensor lazily
    scale = amp.loss_scale()
    if precision == "fp16":
        assert isinstance(scale, torch.Tensor) and scale.item() == INIT_SCALE
    else:
        assert scale is None


def saved_scaler(precision: str) -> torch.amp.GradScaler:
    """A scaler whose loss scale (fp16) differs from a fresh one's."""
    return torch.amp.GradScaler("cpu", init_scale=INIT_SCALE / 8, enabled=precision == "fp16")


def test_scaler_state_round_trips_the_fp16_loss_scale(caplog):
    source = saved_scaler("fp16")
    state = ScalerState(source).state_dict()
    assert state["enabled"] is True and state["state"]["scale"] == INIT_SCALE / 8

    target = reference_scaler("fp16")
    ScalerState(target).load_state_dict(state)

    assert target.get_scale() == INIT_SCALE / 8
    assert "Precision changed" not in caplog.text


@pytest.mark.parametrize(("saved", "resumed"), [("fp16", "bf16"), ("bf16", "fp16")])
def test_scaler_state_of_another_precision_is_dropped_with_a_warning(saved, resumed, caplog):
    source = saved_scaler(saved)
    state = ScalerState(source).state_dict()
    assert state["enabled"] is (saved == "fp16")
    target = reference_scaler(resumed)

    ScalerState(target).load_state_dict(state)

    if resumed == "fp16":
        assert target.get_scale() == INIT_SCALE  # fresh, not the saved (absent) one
    assert (
        "Precision changed since the checkpoint: the fp16 loss scaler state is dropped "
        "and a fresh one is used." in caplog.messages
    )


def test_scaler_state_of_the_same_disabled_precision_loads_silently(caplog):
    state = ScalerState(reference_scaler("bf16")).state_dict()
    ScalerState(reference_scaler("fp32")).load_state_dict(state)
    assert caplog.messages == []


def test_an_fp16_window_without_parameter_gradients_leaves_the_next_step_working():
    """A window whose loss reached no parameter: the step returns None without unscaling,
    so fp16's scaler accepts the next step (unscale_ without update() made it raise
    "unscale_() has already been called on this optimizer since the last update()")."""
    from amp_utils.amp_step import AMPOptimizerStep

    torch.manual_seed(1)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = AMPOptimizerStep(torch.amp.GradScaler("cpu"), 1.0, False)

    def window(uses_params: bool) -> None:
        x = torch.randn(4, 8, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x) if uses_params else x * 2).float().pow(2).mean()
        step.backward(loss)
        step.observe_loss(loss)

    window(True)
    assert step.step([opt]) is not None
    window(False)
    assert step.step([opt]) is None
    window(True)
    before = model.weight.detach().clone()
    info = step.step([opt])
    assert info is not None and not bool(info.skipped)
    assert not torch.equal(model.weight, before)
