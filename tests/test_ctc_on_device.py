"""The device-side CTC loss (whole-step CUDA graphs) against ``F.ctc_loss``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from amp_utils.compile import RECOMPILES, compile_stats
from recipes.asr.ctc_on_device import (
    alpha_step,
    alpha_step_for,
    compiled_or_eager,
    ctc_loss_on_device,
)


def _case() -> dict[str, torch.Tensor]:
    """Six utterances: full and short outputs, a repeated label, an empty target, an
    impossible alignment (5 distinct labels in 3 frames) and an empty output."""
    gen = torch.Generator().manual_seed(0)
    batch, frames, vocab, max_tokens = 6, 30, 29, 7
    tokens = torch.randint(1, vocab, (batch, max_tokens), generator=gen)
    tokens[0, 1] = tokens[0, 0]  # "aa" needs a blank between the two
    tokens[3, :5] = torch.tensor([1, 2, 3, 4, 5])
    token_lens = torch.tensor([7, 5, 0, 5, 3, 2])
    for i, n in enumerate(token_lens.tolist()):
        tokens[i, n:] = 0
    return {
        "logits": torch.randn(batch, frames, vocab, generator=gen),
        "out_lens": torch.tensor([30, 25, 10, 3, 12, 0]),
        "tokens": tokens,
        "token_lens": token_lens,
    }


def _loss_and_grad(loss_fn, case: dict[str, torch.Tensor]):
    logits = case["logits"].clone().requires_grad_()
    log_probs = logits.log_softmax(-1)
    loss = loss_fn(log_probs, case["out_lens"], case["tokens"], case["token_lens"])
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, grad


def _reference(log_probs, out_lens, tokens, token_lens):
    return F.ctc_loss(
        log_probs.transpose(0, 1),
        tokens,
        out_lens,
        token_lens,
        reduction="mean",
        zero_infinity=True,
    )


def test_loss_and_logit_gradients_equal_pytorchs_ctc_loss() -> None:
    case = _case()
    expected, expected_grad = _loss_and_grad(_reference, case)
    loss, grad = _loss_and_grad(ctc_loss_on_device, case)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)


def test_the_frames_gradients_are_gathered_once_not_per_frame() -> None:
    """Backward stacks the per-frame emission gradients once (``unbind``). Indexing
    ``emit[:, t]`` gave every frame a zero-filled gradient of the whole ``[B, T, S]``
    emissions and an add into it: ~3 more kernels a frame in a captured step, for the
    default recipe's ~100 frames a few hundred of its kernels (the same values)."""
    from benchmarks.kernel_count_cuda_policy import OperationCount

    case = _case()
    logits = case["logits"].clone().requires_grad_()
    loss = ctc_loss_on_device(
        logits.log_softmax(-1), case["out_lens"], case["tokens"], case["token_lens"]
    )
    with OperationCount() as backward:
        loss.backward()
    assert backward.counts["select_backward"] == 0  # (one a frame with the indexing)
    assert backward.counts["stack"] == 1  # the frames' gradients, gathered once


def test_each_utterance_equals_pytorchs_negative_log_likelihood() -> None:
    case = _case()
    log_probs = case["logits"].log_softmax(-1)
    for i in range(len(case["out_lens"])):
        one = {k: v[i : i + 1] for k, v in case.items() if k != "logits"}
        expected = _reference(log_probs[i : i + 1], **one)
        got = ctc_loss_on_device(log_probs[i : i + 1], **one)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_impossible_alignments_and_empty_outputs_add_zero_loss_and_zero_gradient() -> None:
    """As ``zero_infinity``: no inf, no NaN, nothing for the utterances without a path."""
    case = _case()
    loss, grad = _loss_and_grad(ctc_loss_on_device, case)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[3].abs().max() == 0 and grad[5].abs().max() == 0  # impossible, empty output
    assert grad[0].abs().max() > 0


def test_reduced_precision_inputs_are_computed_in_fp32() -> None:
    case = _case()
    log_probs = case["logits"].log_softmax(-1)
    args = (case["out_lens"], case["tokens"], case["token_lens"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ctc_loss_on_device(log_probs.to(torch.bfloat16), *args)
    expected = _reference(log_probs.to(torch.bfloat16).float(), *args)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_frames_after_an_utterances_end_do_not_count() -> None:
    case = _case()
    log_probs = case["logits"].log_softmax(-1)
    args = (case["out_lens"], case["tokens"], case["token_lens"])
    changed = log_probs.clone()
    changed[1, 25:] = torch.randn(5, changed.shape[-1]).log_softmax(-1)  # out_lens[1] = 25
    torch.testing.assert_close(
        ctc_loss_on_device(changed, *args), ctc_loss_on_device(log_probs, *args)
    )


def test_one_compile_of_the_update_serves_every_frame_and_shape() -> None:
    """The compiled update (CUDA's) equals the eager one, and the compiles of the first
    batch serve every later frame (a view at another offset) and batch shape (CPU inductor
    here). The first batch compiles more than once: where a frame's view sits at an offset
    equal to a size (frame 1: the batch size; frame 2 here: 2 x 15 states = 30 frames), duck
    sizing ties the two together, and the next frame unties them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    RECOMPILES.install()
    compiled = torch.compile(alpha_step, dynamic=True)
    case = _case()
    graphs = []
    for size in (6, 4):
        one = {k: v[:size] for k, v in case.items()}
        expected, expected_grad = _loss_and_grad(_reference, one)
        recompiles = compile_stats()["recompiles"]
        loss, grad = _loss_and_grad(lambda *args: ctc_loss_on_device(*args, step=compiled), one)
        recompiles = compile_stats()["recompiles"] - recompiles
        graphs.append((counters["stats"]["unique_graphs"], recompiles))
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-6)
    (first_graphs, _), (second_graphs, second_recompiles) = graphs
    assert second_recompiles == 0 and second_graphs == first_graphs
    torch._dynamo.reset()


#: Batch sizes and frames of the default recipe's ten captured shapes on the H200
#: (2026-11-27-h200-evening default_runs, bf16 log), and its 16-token target width.
RECIPE_SHAPES = [(26, 229), (98, 61), (111, 54), (153, 40), (131, 46), (208, 29)]


def test_after_its_trial_the_update_serves_every_recipe_shape_without_a_compile() -> None:
    """Whole-step graphs capture a new batch shape after one eager warm-up step, which runs
    compiled code eagerly (``HostReads``): the capture is then the update's first call with
    that shape, and a recompile there would fail the capture (inductor cannot compile
    inside one) and turn the run's graphs off. So the trial compile on its tiny input, then
    the recipe's shapes (forward and backward, and forward without gradients: validation's
    captured loss) must need no compile at all."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    step = compiled_or_eager(torch.device("cpu"))  # CUDA's compile and trial, on the CPU
    assert step is not alpha_step
    graphs_before = counters["stats"]["unique_graphs"]
    recompiles_before = compile_stats()["recompiles"]
    gen = torch.Generator().manual_seed(0)
    for batch, frames in RECIPE_SHAPES:
        logits = torch.randn(batch, frames, 12, generator=gen, requires_grad=True)
        tokens = torch.randint(1, 12, (batch, 16), generator=gen)
        token_lens = torch.randint(1, 6, (batch,), generator=gen)
        out_lens = torch.randint(frames // 2, frames + 1, (batch,), generator=gen)
        loss = ctc_loss_on_device(logits.log_softmax(-1), out_lens, tokens, token_lens, step=step)
        loss.backward()
        assert torch.isfinite(logits.grad).all()
        with torch.no_grad():  # validation's captured loss (trainer.graph_eval)
            args = (logits.log_softmax(-1), out_lens, tokens, token_lens)
            assert ctc_loss_on_device(*args, step=step) == loss.detach()
    assert compile_stats()["recompiles"] == recompiles_before
    assert counters["stats"]["unique_graphs"] == graphs_before
    torch._dynamo.reset()


def test_the_per_frame_update_is_compiled_on_cuda_only() -> None:
    assert alpha_step_for(torch.device("cpu")) is alpha_step


def test_the_compile_and_its_trial_wait_for_a_call_outside_dispatch_modes(monkeypatch):
    """Under a dispatch mode (HostReads' check, WeightCasts' observing step: the first
    warm-up step of a whole-step graph) compiled code runs eagerly, so the trial compiled
    nothing and passed, and a compiler failure came a step later, outside the fallback."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from recipes.asr import ctc_on_device

    class AnyMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    trials = []
    monkeypatch.setattr(ctc_on_device, "_compiled_steps", {})
    monkeypatch.setattr(ctc_on_device, "compiled_or_eager", lambda device: trials.append(1) or "c")
    cuda = torch.device("cuda")
    with AnyMode():
        assert alpha_step_for(cuda) is alpha_step
    assert trials == []
    assert alpha_step_for(cuda) == "c" and alpha_step_for(cuda) == "c"
    assert trials == [1]


def test_an_update_that_does_not_compile_runs_eagerly_with_a_warning(monkeypatch, caplog):
    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("triton: no such compiler")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING"):
        assert compiled_or_eager(torch.device("cpu")) is alpha_step
    assert "could not be compiled (RuntimeError: triton: no such compiler)" in caplog.text


@pytest.mark.gpu
def test_the_compiled_update_on_cuda_equals_pytorchs_ctc_loss(cuda_device) -> None:
    case = {k: v.to(cuda_device) for k, v in _case().items()}
    expected, expected_grad = _loss_and_grad(_reference, case)
    loss, grad = _loss_and_grad(ctc_loss_on_device, case)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-3, atol=1e-5)
