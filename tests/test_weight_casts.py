"""Autocast's weight casts made together (``precision.fused_weight_casts``): the same values
as autocast's own casts, in a few kernels instead of two per weight."""

from __future__ import annotations

import collections
import logging

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader, TensorDataset

from amp_utils import Brain, Checkpointer, EpochCounter, Stage
from amp_utils.module_precision import apply_low_precision_norms
from amp_utils.weight_casts import WeightCasts
from recipes.asr.model import ConformerCTC
from tests.test_brain import StopAfter, dying_before

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class OpCounts(TorchDispatchMode):
    """How many times each aten operation ran (casts are ``_to_copy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Mixed(nn.Module):
    """One parameter of each kind: only ``proj``, ``conv`` and ``penalised.bias`` are only
    cast by autocast."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)  # used by layer_norm itself (CPU autocast keeps it)
        self.twice = nn.Linear(8, 8)  # applied twice: two casts without the weight cache
        self.penalised = nn.Linear(8, 8)  # its weight is also used in fp32 (a penalty)
        self.reshaped = nn.Parameter(torch.randn(64))  # viewed before the matmul
        self.frozen = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(self.proj(x).transpose(1, 2)).transpose(1, 2)
        x = self.twice(self.twice(self.norm(x)))
        x = self.penalised(x) + self.penalised.weight.square().mean()
        return self.frozen(x @ self.reshaped.view(8, 8))


def _names(model: nn.Module, params: list[nn.Parameter]) -> set[str]:
    ids = {id(p) for p in params}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def _forward(
    model: nn.Module, casts: WeightCasts, x: torch.Tensor, cache: bool = False
) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=cache), casts.during_forward():
        return model(x).float().square().mean()


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "weight-cache"])
def test_only_weights_that_the_forward_pass_only_casts_are_cast_together(cache):
    """With autocast's weight cache, ``twice``'s one cast serves two uses: left out too."""
    model = Mixed()
    casts = WeightCasts(model, torch.bfloat16)
    assert not casts.observed and casts.parameters == []
    _forward(model, casts, torch.randn(2, 5, 8), cache)
    assert casts.observed
    assert _names(model, casts.parameters) == {
        "proj.weight",
        "proj.bias",
        "conv.weight",
        "conv.bias",
        "penalised.bias",
    }


@pytest.mark.parametrize("cache", [False, True], ids=["no-cache", "weight-cache"])
def test_casting_together_gives_autocasts_values_and_gradients_bit_for_bit(cache):
    x = torch.randn(2, 5, 8)
    plain, fused = Mixed(), Mixed()
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=cache):
        expected = plain(x).float().square().mean()
    expected.backward()
    casts = WeightCasts(fused, torch.bfloat16)
    for _ in range(2):  # the first pass observes, the second casts together
        fused.zero_grad(set_to_none=True)
        loss = _forward(fused, casts, x, cache)
        loss.backward()
    assert torch.equal(loss, expected)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert p.grad.dtype == torch.float32 and torch.equal(p.grad, q.grad), name


def test_the_modules_get_their_parameters_back_after_the_forward_pass_even_on_error():
    model = Mixed()
    before = dict(model.named_parameters())
    casts = WeightCasts(model, torch.bfloat16)
    _forward(model, casts, torch.randn(2, 5, 8))
    with (
        pytest.raises(RuntimeError, match="boom"),
        torch.autocast("cpu", torch.bfloat16),
        casts.during_forward(),
    ):
        assert model.proj.weight.dtype == torch.bfloat16  # the view, during the pass
        raise RuntimeError("boom")
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] and isinstance(after[k], nn.Parameter) for k in after)


def test_a_tied_weight_is_replaced_in_every_module_that_holds_it():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.unused = nn.Linear(4, 4)  # holds the weight first, never runs
            self.used = nn.Linear(4, 4)
            self.used.weight = self.unused.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = Tied()
    casts = WeightCasts(model, torch.bfloat16)
    x = torch.randn(3, 4)
    _forward(model, casts, x)
    assert id(model.used.weight) in {id(p) for p in casts.parameters}
    with torch.autocast("cpu", torch.bfloat16), casts.during_forward():
        assert model.used.weight is model.unused.weight
        assert model.used.weight.dtype == torch.bfloat16


def _conformer(low_precision_norms: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = ConformerCTC(n_mels=40, d_model=64, num_layers=2, num_heads=4, ffn_dim=128).train()
    if low_precision_norms:
        apply_low_precision_norms(model)
    return model


@pytest.mark.parametrize("low_precision_norms", [False, True])
def test_the_conformers_step_runs_a_few_casts_instead_of_two_per_weight(low_precision_norms):
    feats, lens = torch.randn(2, 80, 40), torch.full((2,), 80)

    def casts_in_a_step(fused: bool) -> tuple[int, int]:
        model = _conformer(low_precision_norms)
        casts = WeightCasts(model, torch.bfloat16)
        _forward_ctc(model, casts if fused else None, feats, lens)  # observes
        with OpCounts() as ops:
            _forward_ctc(model, casts if fused else None, feats, lens).backward()
        return ops.counts["_to_copy"], len(casts.parameters)

    plain, _ = casts_in_a_step(fused=False)
    fused, together = casts_in_a_step(fused=True)
    # every weight cast together saves its forward cast and its gradient's cast back;
    # the group costs one cast each way
    assert together > 20
    assert fused == plain - 2 * together + 2


def _forward_ctc(model, casts, feats, lens) -> torch.Tensor:
    with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
        if casts is None:
            return model(feats, lens)[0].float().square().mean()
        with casts.during_forward():
            return model(feats, lens)[0].float().square().mean()


class ConformerBrain(Brain):
    def compute_forward(self, batch, stage):
        feats, lens, _ = batch
        return self.modules.model(feats.to(self.device), lens.to(self.device))[0]

    def compute_objectives(self, predictions, batch, stage):
        return torch.nn.functional.mse_loss(predictions.float(), batch[2].to(self.device))


def _train(
    precision: str, fused: bool, steps: int = 4, device: str = "cpu", **options
) -> tuple[list, Brain]:
    model = _conformer()
    brain = ConformerBrain(
        {"model": model},
        opt_class=lambda params: torch.optim.AdamW(params, lr=1e-2),
        run_opts={
            "device": device,
            "noprogressbar": True,
            "precision": precision,
            "fused_weight_casts": fused,
            **options,
        },
    )
    brain.on_fit_start()
    gen = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        feats = torch.randn(2, 80, 40, generator=gen)
        target = torch.randn(2, 19, 29, generator=gen)  # 4x subsampled frames, CTC classes
        losses.append(brain.train_step((feats, torch.full((2,), 80), target)))
    brain.flush_pending()
    return losses, brain


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_with_the_casts_together_is_bit_for_bit_training_without(precision):
    torch.manual_seed(7)  # dropout masks: both runs draw the same ones
    expected, plain = _train(precision, fused=False)
    torch.manual_seed(7)
    losses, fused = _train(precision, fused=True)
    assert fused._weight_casts is not None and len(fused._weight_casts.parameters) > 20
    assert plain._weight_casts is None
    assert [float(x) for x in losses] == [float(x) for x in expected]
    trained = fused.modules.model.state_dict()
    for name, value in plain.modules.model.state_dict().items():
        assert torch.equal(trained[name], value), name
    assert fused.optimizer_step == plain.optimizer_step == 4


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_on_cuda_the_casts_together_train_as_autocasts_own(cuda_device, precision, monkeypatch):
    """CUDA's autocast policy differs from the CPU's (LayerNorm in fp32): the same check on
    CUDA. Bit for bit where two plain runs agree bit for bit (deterministic kernels)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    runs = {}
    for name, fused in (("plain", False), ("again", False), ("fused", True)):
        torch.manual_seed(7)
        losses, brain = _train(precision, fused=fused, device=str(cuda_device))
        runs[name] = torch.stack(losses).cpu()
    assert len(brain._weight_casts.parameters) > 20
    if torch.equal(runs["plain"], runs["again"]):
        assert torch.equal(runs["fused"], runs["plain"])
    else:  # the kernels themselves vary from run to run: as close as two plain runs
        spread = (runs["plain"] - runs["again"]).abs().max()
        assert (runs["fused"] - runs["plain"]).abs().max() <= 2 * spread


def test_fp32_compiled_and_ddp_runs_leave_the_casts_to_autocast(caplog):
    from amp_utils.distributed import DistributedInfo

    _, fp32 = _train("fp32", fused=True, steps=1, eval_precision="fp32")
    batch = (torch.randn(2, 80, 40), torch.full((2,), 80), torch.zeros(2, 19, 29))
    fp32.evaluate_batch(batch, Stage.VALID)
    assert fp32._weight_casts is None and fp32._eval_casts is None
    with caplog.at_level(logging.INFO, logger="amp_utils.brain"):
        compiled = ConformerBrain(
            {"model": _conformer()},
            run_opts={"device": "cpu", "precision": "bf16", "compile": True},
        )
        compiled._set_up_weight_casts()  # the decision only: nothing is compiled here
        ddp = ConformerBrain({"model": _conformer()}, run_opts={"precision": "bf16"})
        ddp.distributed = DistributedInfo(world_size=2, backend="gloo")
        ddp._set_up_weight_casts()
        alone = ConformerBrain({"model": _conformer()}, run_opts={"precision": "bf16"})
        alone._set_up_weight_casts()
    assert compiled._weight_casts is None and ddp._weight_casts is None
    for compile_eval in (True, False):  # compiled evaluation: inductor fuses its casts
        evaluating = ConformerBrain(
            {"model": _conformer()},
            run_opts={"precision": "bf16", "eval_precision": "bf16", "compile_eval": compile_eval},
        )
        evaluating._compiled = True  # as after _compile(), without compiling here
        assert (evaluating._eval_weight_casts() is None) == compile_eval
    assert alone._weight_casts is not None
    assert "fused_weight_casts: off, torch.compile fuses" in caplog.text
    assert "fused_weight_casts: off, under DDP the gradients" in caplog.text


def test_evaluation_casts_together_too_with_the_same_losses():
    torch.manual_seed(7)
    _, plain = _train("bf16", fused=False, steps=2, eval_precision="bf16")
    torch.manual_seed(7)
    _, fused = _train("bf16", fused=True, steps=2, eval_precision="bf16")
    plain.modules.eval(), fused.modules.eval()  # as the evaluation loop sets them
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):  # the first observes, the second casts together
        feats = torch.randn(2, 80, 40, generator=gen)
        batch = (feats, torch.full((2,), 80), torch.zeros(2, 19, 29))
        with torch.no_grad():
            expected = plain.evaluate_batch(batch, Stage.VALID)
            loss = fused.evaluate_batch(batch, Stage.VALID)
        assert torch.equal(loss, expected)
    assert plain._eval_casts is None and len(fused._eval_casts.parameters) > 20
    model = fused.modules.model
    assert all(isinstance(p, nn.Parameter) for p in model.parameters())


def test_the_brains_usual_step_observes_with_the_weight_cache_and_leaves_a_shared_weight():
    """The usual step runs with autocast's weight cache, its observing first step too: a
    weight used twice is cast once there, and is still left to autocast (a captured step,
    without the cache, casts it twice and sums its gradients in fp32)."""

    class MixedBrain(Brain):
        def compute_forward(self, batch, stage):
            return self.modules.model(batch)

        def compute_objectives(self, predictions, batch, stage):
            return predictions.float().square().mean()

    model = Mixed()
    brain = MixedBrain(
        {"model": model},
        opt_class=lambda params: torch.optim.SGD(params, lr=0.1),
        run_opts={"device": "cpu", "noprogressbar": True, "precision": "bf16"},
    )
    brain.on_fit_start()
    caches = []
    model.register_forward_pre_hook(lambda *_: caches.append(torch.is_autocast_cache_enabled()))
    brain.train_step(torch.randn(2, 5, 8))
    assert caches == [True]
    assert _names(model, brain._weight_casts.parameters) == {
        "proj.weight",
        "proj.bias",
        "conv.weight",
        "conv.bias",
        "penalised.bias",
    }


class OptionalHead(nn.Module):
    """``twice`` is applied twice (left to autocast); ``aux`` serves only batches whose
    first feature is positive (an optional head, a dropped layer)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.twice = nn.Linear(16, 16)
        self.out = nn.Linear(16, 1)
        self.aux = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.twice(torch.tanh(self.twice(torch.tanh(self.inp(x)))))
        out = self.out(h)
        return out + self.aux(h) if bool(x[0, 0] > 0) else out


def _fit_optional_head(folder, fused: bool, stop_before: int | None = None) -> nn.Module:
    """One epoch of 8 batches (the head serves batches 2, 5 and 8), a checkpoint after every
    batch; ``stop_before``: the run dies before that batch."""

    class HeadBrain(Brain):
        def compute_forward(self, batch, stage):
            return self.modules.model(batch[0])

        def compute_objectives(self, predictions, batch, stage):
            return nn.functional.mse_loss(predictions.float(), batch[1])

    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    x[:, 0] = -x[:, 0].abs()
    x[4::12, 0] = 1.0
    brain = dying_before(HeadBrain, stop_before)(
        {"model": OptionalHead()},
        opt_class=lambda params: torch.optim.AdamW(params, lr=1e-2),
        run_opts={
            "device": "cpu",
            "noprogressbar": True,
            "precision": "bf16",
            "fused_weight_casts": fused,
            "ckpt_interval_steps": 1,
        },
        checkpointer=Checkpointer(folder),
    )
    brain.fit(EpochCounter(1), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4))
    return brain.modules.model


def test_a_weight_that_a_batch_does_not_use_gets_no_gradient_as_under_autocast(tmp_path):
    """The head's slice of the flat cast's gradient is zeros: AdamW would move the head
    (its moments, weight decay) on batches that never used it."""
    model = OptionalHead()
    casts = WeightCasts(model, torch.bfloat16)
    with_head, without = torch.ones(2, 8), -torch.ones(2, 8)
    _forward(model, casts, with_head)  # observes: the head's weights are only cast
    assert {"aux.weight", "aux.bias"} <= _names(model, casts.parameters)
    _forward(model, casts, without).backward()
    casts.settle_gradients()
    assert model.aux.weight.grad is None and model.aux.bias.grad is None
    assert model.out.weight.grad is not None
    plain = _fit_optional_head(tmp_path / "plain", fused=False).state_dict()
    fused = _fit_optional_head(tmp_path / "fused", fused=True).state_dict()
    for name, value in plain.items():
        assert torch.equal(fused[name], value), name


def test_a_resumed_run_trains_as_the_uninterrupted_one(tmp_path):
    """Every step runs with autocast's cache off, not only the observing first step of a
    session: ``twice``'s two casts would otherwise differ on the first step after a resume;
    and the session that resumes observes on a batch without the head."""
    expected = _fit_optional_head(tmp_path / "whole", fused=True).state_dict()
    with pytest.raises(StopAfter):
        _fit_optional_head(tmp_path / "run", fused=True, stop_before=4)
    resumed = _fit_optional_head(tmp_path / "run", fused=True).state_dict()
    for name, value in expected.items():
        assert torch.equal(resumed[name], value), name


def test_a_weight_stored_transposed_keeps_autocasts_cast_and_its_strides():
    torch.manual_seed(0)
    layer = nn.Linear(8, 4)
    layer.weight = nn.Parameter(torch.randn(8, 4).t())  # non-contiguous storage
    casts = WeightCasts(layer, torch.bfloat16)
    _forward(layer, casts, torch.randn(3, 8))
    assert _names(layer, casts.parameters) == {"bias"}


def test_the_kernel_count_benchmark_shows_fewer_casts_with_each_option():
    """benchmarks/kernel_count_cuda_policy.py on a tiny Conformer: the casts made together
    remove two casts per weight; low_precision_norms removes the LayerNorms' activation
    casts; norm_saves_16bit adds a cast of each LayerNorm's normalized input down and up
    again; bf16 and fp16 cast the same tensors under CUDA's choices."""
    from benchmarks.cuda_policy import cuda_kernel_choices
    from benchmarks.kernel_count_cuda_policy import count_step

    sizes = dict(n_mels=40, d_model=32, num_layers=2, num_heads=4, ffn_dim=64, conv_kernel=7)
    with cuda_kernel_choices():
        casts = {
            variant: count_step(sizes, *variant).counts["_to_copy"]
            for variant in [
                ("fp32", False, "autocast"),
                ("bf16", False, "autocast"),
                ("bf16", True, "autocast"),
                ("bf16", True, "low_precision"),
                ("bf16", True, "saves_16bit"),
                ("fp16", True, "autocast"),
            ]
        }
    weights = sum(1 for _ in _conformer().parameters())  # an upper bound on weights cast
    assert casts[("fp32", False, "autocast")] <= 2
    saved = casts[("bf16", False, "autocast")] - casts[("bf16", True, "autocast")]
    assert 40 < saved < 2 * weights
    assert casts[("bf16", True, "low_precision")] < casts[("bf16", True, "autocast")] / 4
    norms = 2 * 6  # LayerNorms of the two blocks
    assert casts[("bf16", True, "saves_16bit")] == casts[("bf16", True, "autocast")] + 2 * norms
    # the same tensors cast, plus 4 scalar casts of the loss scaler's bookkeeping
    assert casts[("fp16", True, "autocast")] == casts[("bf16", True, "autocast")] + 4


class _CompiledBlock(nn.Module):
    """A user-defined block (TorchDynamo does not trace ``torch.nn`` containers in place)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(x))


def test_compiled_code_first_met_in_the_observed_pass_is_compiled_afterwards():
    """The observing pass runs compiled code eagerly, and the code compiles afterwards.

    TorchDynamo skipped a frame it first met under ParameterUses' dispatch mode and never
    compiled it again: on the 2026-11-27 H200 a captured bf16 step with the weights cast
    together ran no compiled code at all (the compiled CTC update: 245 calls per step
    without the casts together, 0 with them).
    """
    torch._dynamo.reset()
    calls: list[int] = []

    def backend(graph_module, example_inputs):  # counts each run of the compiled graph
        def run(*args):
            calls.append(1)
            return graph_module.forward(*args)

        return run

    block = _CompiledBlock()
    block.compile(backend=backend, dynamic=True)
    casts = WeightCasts(block, torch.bfloat16)
    inp = torch.randn(3, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16), casts.during_forward():
        block(inp).float().sum().backward()
    assert casts.observed and calls == [], "compiled code ran under the dispatch mode"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        block(inp)
        block(torch.randn(5, 6))
    assert len(calls) == 2, "compiled code no longer runs after the observed pass"
    torch._dynamo.reset()


def test_the_asr_ctc_loss_under_a_dispatch_mode_gives_the_kernel_lengths_on_its_device():
    """Under any dispatch mode (the pass where WeightCasts observes the weights) torch's
    ``ctc_loss`` calls ``_ctc_loss.Tensor``, whose CUDA kernel wants the lengths on the GPU:
    the recipe's host lengths failed every bf16/fp16 CUDA run's first step on the 2026-11-27
    H200. Here ``meta`` stands for the GPU, and the kernel is replaced by a recording."""
    from recipes.asr.model import ctc_loss

    seen = []

    class KernelLengths(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._ctc_loss.Tensor:
                log_probs = args[0]
                seen.append((args[2].device.type, args[3].device.type))
                batch = log_probs.shape[1]
                return log_probs.new_zeros(batch), log_probs.new_zeros(log_probs.shape)
            return func(*args, **(kwargs or {}))

    log_probs = torch.randn(2, 7, 5, device="meta")
    tokens = torch.ones(2, 3, dtype=torch.long, device="meta")
    with KernelLengths():
        # the loss itself, without fwd_default_precision's autocast (none for "meta")
        ctc_loss.__wrapped__(log_probs, torch.tensor([7, 6]), tokens, torch.tensor([3, 2]))
    assert seen == [("meta", "meta")]
