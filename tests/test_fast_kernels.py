"""amp_utils.fast_kernels: ops computed in the precision that is fast on the device."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_utils import fast_kernels
from amp_utils.fast_kernels import fp16_on_cpu, scaled_dot_product_attention
from amp_utils.precision import ONEDNN_CACHE_VARIABLE
from benchmarks.cuda_policy import cuda_fp32_ops
from recipes.asr.model import ConformerCTC, SelfAttention
from recipes.speaker.model import XVector
from tests.recipe_helpers import REPO_ROOT


def _qkv(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    shape = (2, 4, 7, 8)
    return tuple(torch.randn(shape, generator=generator).to(device, dtype) for _ in range(3))


def _computing_dtype(input: torch.Tensor, *args, **kwargs) -> torch.dtype:
    """The dtype an ``F`` call computes in: autocast's where it is on (it casts below ``F``;
    SDPA and convolutions are on its lower-precision list), else the input's."""
    device = input.device.type
    autocast = torch.is_autocast_enabled(device)
    return torch.get_autocast_dtype(device) if autocast else input.dtype


def _dropout_p(input: torch.Tensor, p: float = 0.5, *args, **kwargs) -> float:
    """The ``p`` an ``F.dropout`` call was given."""
    return p


def _recording(monkeypatch, name: str, record=_computing_dtype) -> list:
    """Patch ``F.<name>`` (what ``fast_kernels`` and ``nn.ConvNd`` call) so that the test sees
    ``record(...)`` of each call's arguments: by default the dtype it computes in."""
    seen: list = []
    real = getattr(F, name)

    def recording(*args, **kwargs):
        seen.append(record(*args, **kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, name, recording)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_attention_in_reduced_precision_runs_in_fp32_and_returns_its_dtype(monkeypatch, dtype):
    seen = _recording(monkeypatch, "scaled_dot_product_attention")
    query, key, value = _qkv(dtype)
    mask = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    mask[0, ..., 5:] = False  # padded keys of the first utterance
    with torch.autocast("cpu", dtype=dtype):  # as in a model under autocast
        out = scaled_dot_product_attention(query, key, value, attn_mask=mask)
    assert seen == [torch.float32] and out.dtype == dtype
    reference = F.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask
    )
    assert torch.equal(out, reference.to(dtype))  # exactly fp32 attention, rounded once


def test_fp32_attention_is_passed_through_unchanged(monkeypatch):
    seen = _recording(monkeypatch, "scaled_dot_product_attention")
    query, key, value = _qkv(torch.float32)
    out = scaled_dot_product_attention(query, key, value)
    assert seen == [torch.float32]
    assert torch.equal(out, F.scaled_dot_product_attention(query, key, value))


def test_conformer_attention_under_cpu_bf16_autocast_uses_fp32_attention(monkeypatch):
    """The ASR model's attention block gets the fp32 core; its projections stay bf16."""
    seen = _recording(monkeypatch, "scaled_dot_product_attention")
    block = SelfAttention(d_model=16, num_heads=4, dropout=0.0).eval()
    x = torch.randn(2, 5, 16)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = block(x, mask)
    assert seen == [torch.float32] and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), block(x, mask), atol=0.05, rtol=0.05)


def test_backward_through_the_fp32_core_reaches_reduced_precision_inputs():
    query, key, value = (t.requires_grad_() for t in _qkv(torch.bfloat16))
    scaled_dot_product_attention(query, key, value).sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in (query, key, value))


@pytest.mark.gpu
def test_cuda_attention_keeps_its_reduced_precision(cuda_device, monkeypatch):
    seen = _recording(monkeypatch, "scaled_dot_product_attention")
    query, key, value = _qkv(torch.bfloat16, device=str(cuda_device))
    assert scaled_dot_product_attention(query, key, value).dtype == torch.bfloat16
    assert seen == [torch.bfloat16]


# --- convolutions: fp32 on a CPU under fp16 ------------------------------------------------


CONVS = {  # F's function the conv calls: the fast conv, its torch class, an input shape
    "conv1d": (
        lambda: fast_kernels.Conv1d(6, 4, 5, padding=2),  # as the x-vector's TDNN layers
        nn.Conv1d,
        (3, 6, 11),
    ),
    "conv2d": (
        lambda: fast_kernels.Conv2d(1, 4, 3, stride=2),  # as the Conformer's subsampling
        nn.Conv2d,
        (3, 1, 9, 10),
    ),
}


@pytest.mark.parametrize("kind", sorted(CONVS))
def test_cpu_fp16_autocast_convolution_runs_in_fp32_and_returns_fp16(monkeypatch, kind):
    make, _, shape = CONVS[kind]
    torch.manual_seed(0)
    conv, x = make(), torch.randn(shape)
    seen = _recording(monkeypatch, kind)
    with torch.autocast("cpu", dtype=torch.float16):
        out = conv(x)
    assert seen == [torch.float32] and out.dtype == torch.float16
    assert torch.equal(out, conv(x).to(torch.float16))  # exactly fp32's conv, rounded once


@pytest.mark.parametrize("kind", sorted(CONVS))
def test_fp16_module_on_cpu_without_autocast_computes_in_fp32(monkeypatch, kind):
    """A model cast with ``.half()`` on a CPU: fp16 in, fp16 out, fp32 arithmetic."""
    make, _, shape = CONVS[kind]
    conv = make().half()
    seen = _recording(monkeypatch, kind)
    out = conv(torch.randn(shape).half())
    assert seen == [torch.float32] and out.dtype == torch.float16


@pytest.mark.parametrize("kind", sorted(CONVS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp32_and_bf16_convolutions_are_those_of_torch(monkeypatch, kind, dtype):
    """Only fp16 changes: bf16 convolutions are fast on CPUs and keep their dtype."""
    make, torch_class, shape = CONVS[kind]
    torch.manual_seed(0)
    conv, x = make(), torch.randn(shape)
    plain = torch_class(**_conv_args(conv))
    plain.load_state_dict(conv.state_dict())
    seen = _recording(monkeypatch, kind)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out, expected = conv(x), plain(x)
    assert seen == [dtype, dtype] and out.dtype == dtype
    assert torch.equal(out, expected)


def _conv_args(conv: nn.Module) -> dict:
    return {
        "in_channels": conv.in_channels,
        "out_channels": conv.out_channels,
        "kernel_size": conv.kernel_size,
        "stride": conv.stride,
        "padding": conv.padding,
        "groups": conv.groups,
    }


@pytest.mark.parametrize("kind", sorted(CONVS))
def test_fast_convolution_is_a_torch_convolution_with_its_state_dict(kind):
    """Checkpoints of models with ``nn.ConvNd`` load into the fast ones and back."""
    make, torch_class, _ = CONVS[kind]
    conv = make()
    plain = torch_class(**_conv_args(conv))
    assert isinstance(conv, torch_class)
    assert list(conv.state_dict()) == list(plain.state_dict())
    conv.load_state_dict(plain.state_dict())
    plain.load_state_dict(conv.state_dict())


def test_gradients_of_the_fp32_convolution_reach_weights_and_fp16_inputs():
    conv = fast_kernels.Conv1d(4, 4, 3, padding=1, groups=4)
    x = torch.randn(2, 4, 7, dtype=torch.float16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        conv(x).float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float16
    assert conv.weight.grad is not None and conv.weight.grad.dtype == torch.float32
    assert torch.isfinite(conv.weight.grad).all() and conv.weight.grad.abs().sum() > 0


def test_fp16_on_cpu_reads_device_dtype_and_autocast_state():
    fp32, fp16 = torch.zeros(1), torch.zeros(1, dtype=torch.float16)
    assert not fp16_on_cpu(fp32) and fp16_on_cpu(fp16)
    with torch.autocast("cpu", dtype=torch.float16):
        assert fp16_on_cpu(fp32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not fp16_on_cpu(fp32)
    with torch.autocast("cpu", dtype=torch.float16, enabled=False):
        assert not fp16_on_cpu(fp32)


@pytest.mark.parametrize(
    "model", [ConformerCTC(d_model=16, num_layers=1, num_heads=2, ffn_dim=32), XVector(channels=8)]
)
def test_the_recipes_models_use_only_the_fast_convolutions(model):
    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    assert convs and all(isinstance(m, (fast_kernels.Conv1d, fast_kernels.Conv2d)) for m in convs)


def _depthwise(**kwargs) -> tuple[fast_kernels.Conv1d, nn.Conv1d]:
    """A fast depthwise conv (the Conformer's) and an ``nn.Conv1d`` with the same weights."""
    torch.manual_seed(0)
    args = {"in_channels": 6, "out_channels": 6, "kernel_size": 5, "padding": 2, "groups": 6}
    args.update(kwargs)
    conv, plain = fast_kernels.Conv1d(**args), nn.Conv1d(**args)
    plain.load_state_dict(conv.state_dict())
    return conv, plain


def _conv2d_input(input: torch.Tensor, *args, **kwargs) -> tuple:
    """What an ``F.conv2d`` call computes on: dtype (autocast's where on) and layout."""
    return (_computing_dtype(input), input.is_contiguous(memory_format=torch.channels_last))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_depthwise_conv1d_computes_in_fp32_channels_last_and_returns_autocasts_dtype(
    monkeypatch, dtype
):
    """oneDNN's depthwise conv is 2x faster channels-last in fp32 than on torch's default
    layout, and its bf16/fp16 channels-last kernel hangs on some shapes (module docstring)."""
    conv, plain = _depthwise(stride=2, dilation=2, padding=4)
    x = torch.randn(3, 11, 6).transpose(1, 2)  # time-major, as the Conformer passes it
    seen = _recording(monkeypatch, "conv2d", record=_conv2d_input)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = conv(x)
    assert seen == [(torch.float32, True)] and out.dtype == dtype
    expected = plain(x)  # torch's fp32 convolution, outside autocast
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:  # fp32 arithmetic rounded once to the autocast dtype
        assert torch.equal(out, out.float().to(dtype))
        torch.testing.assert_close(out, expected.to(dtype), rtol=1e-2, atol=1e-2)
    assert out.transpose(1, 2).is_contiguous()  # the Conformer's transpose back is free


def test_cpu_depthwise_conv1d_of_an_fp16_module_without_autocast_returns_fp16(monkeypatch):
    conv, plain = _depthwise()
    seen = _recording(monkeypatch, "conv2d", record=_conv2d_input)
    x = torch.randn(2, 6, 9)
    out = conv.half()(x.half())
    assert seen == [(torch.float32, True)] and out.dtype == torch.float16
    torch.testing.assert_close(out, plain(x.half().float()).half(), rtol=1e-3, atol=1e-3)


def test_cpu_depthwise_conv1d_gradients_are_torch_s():
    conv, plain = _depthwise(bias=False)
    x = torch.randn(2, 9, 6).transpose(1, 2)
    x_fast, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    conv(x_fast).square().sum().backward()
    plain(x_plain).square().sum().backward()
    torch.testing.assert_close(x_fast.grad, x_plain.grad)
    torch.testing.assert_close(conv.weight.grad, plain.weight.grad)
    assert conv.weight.grad.shape == conv.weight.shape


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        ({"groups": 2, "out_channels": 4}, (2, 6, 9)),  # grouped, not depthwise
        ({"padding": "same"}, (2, 6, 9)),  # string padding
        ({"padding_mode": "reflect"}, (2, 6, 9)),
        ({"in_channels": 1, "out_channels": 1, "groups": 1}, (2, 1, 9)),  # one channel
        ({}, (6, 9)),  # unbatched input
    ],
)
def test_conv1d_outside_the_depthwise_case_is_torch_s(monkeypatch, kwargs, shape):
    conv, plain = _depthwise(**kwargs)
    seen = _recording(monkeypatch, "conv2d", record=_conv2d_input)
    x = torch.randn(shape)
    assert torch.equal(conv(x), plain(x)) and seen == []


def test_depthwise_conv1d_under_torch_compile_is_torch_s(monkeypatch):
    """Inductor generates its own convolution call: the fast path stays out of its graph."""
    conv, _ = _depthwise()
    seen = _recording(monkeypatch, "conv2d", record=_conv2d_input)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    conv(torch.randn(2, 6, 9))
    assert seen == []


def test_conformer_fp16_cpu_training_step_finishes_on_the_shapes_that_hung():
    """Regression: on an Intel Xeon with AVX512-FP16 but no AMX-FP16 (torch 2.11), oneDNN's
    fp16 depthwise convolution never returned for these batch shapes (its kernel generator
    loops forever), so an fp16 CPU run hung in its first step (2026-11-25). Its bf16
    channels-last kernel hangs on the first shape too (``[1, 32, 58]``, kernel 15), so bf16
    runs here as well: the depthwise conv must stay in fp32 on a CPU. A hung native
    kernel ignores signals, hence a subprocess with a timeout. On CPUs without AVX512-FP16
    the old code was slow (emulated fp16), not stuck; this test passes there either way."""
    script = textwrap.dedent(
        """
        import torch
        from recipes.asr.model import ConformerCTC
        torch.manual_seed(0)
        model = ConformerCTC(n_mels=40, d_model=32, num_layers=1, num_heads=2, ffn_dim=64)
        shapes = ((1, 236), (25, 236), (7, 404))  # 58, 100 frames at the conv
        for dtype in (torch.float16, torch.bfloat16):
            for batch, frames in shapes:
                feats = torch.randn(batch, frames, 40)
                lens = torch.full((batch,), frames)
                with torch.autocast("cpu", dtype=dtype):
                    logits, out_lens = model(feats, lens)
                logits.float().sum().backward()
        print("done")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0 and "done" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("how", ["channels_last", "unfold"])
@pytest.mark.parametrize(
    "stride, padding, dilation, multiplier",
    [(1, 2, 1, 1), (2, 2, 1, 1), (1, 4, 2, 1), (1, 0, 1, 1), (1, 2, 1, 3), (2, 1, 2, 2)],
)
def test_cuda_depthwise_ways_are_torch_s_with_time_major_strides(
    how, stride, padding, dilation, multiplier
):
    """``device.cuda_depthwise``'s cudnn (channels-last) and unfold arithmetic, checked on a
    CPU in fp32 (oneDNN's bf16 channels-last depthwise kernel hangs on some shapes): values
    and gradients of ``F.conv1d`` for strides, paddings, dilations and several filters per
    channel (``Conv1d(C, M * C, groups=C)``: unfold refused them), and an output whose
    ``transpose(1, 2)`` needs no copy."""
    conv_fn = getattr(fast_kernels, f"depthwise_conv1d_{how}")
    conv, plain = _depthwise(
        bias=True, stride=stride, padding=padding, dilation=dilation, out_channels=6 * multiplier
    )
    x = torch.randn(2, 11, 6).transpose(1, 2)  # [B, C, T] of a [B, T, C] tensor
    x_fast, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = conv_fn(x_fast, conv.weight, conv.bias, stride, padding, dilation)
    expected = plain(x_plain)
    torch.testing.assert_close(out, expected)
    assert out.transpose(1, 2).is_contiguous()
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(x_fast.grad, x_plain.grad)
    torch.testing.assert_close(conv.weight.grad, plain.weight.grad)
    torch.testing.assert_close(conv.bias.grad, plain.bias.grad)


def test_unfolded_depthwise_conv1d_compiles_as_one_graph():
    """For inductor to fuse it inside the compiled Conformer blocks, the window sums must
    trace without a graph break (``fullgraph``), with dynamic lengths."""
    torch._dynamo.reset()
    conv, plain = _depthwise(bias=True)
    compiled = torch.compile(
        fast_kernels.depthwise_conv1d_unfold, backend="aot_eager", fullgraph=True, dynamic=True
    )
    for frames in (9, 13):
        x = torch.randn(2, frames, 6).transpose(1, 2)
        torch.testing.assert_close(compiled(x, conv.weight, conv.bias, 1, 2), plain(x))
    torch._dynamo.reset()


def test_unfolded_depthwise_conv1d_computes_in_autocasts_dtype():
    conv, plain = _depthwise(bias=True)
    x = torch.randn(2, 6, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast_kernels.depthwise_conv1d_unfold(x, conv.weight, conv.bias, 1, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), plain(x), rtol=2e-2, atol=2e-2)


def test_cuda_depthwise_marks_the_conformers_depthwise_convolutions_only():
    """``device.cuda_depthwise`` reaches every depthwise conv the recipe builds, and nothing
    else; on a CPU the marked convolutions compute as before; a typo names the choices."""
    from recipes.modules import build_modules
    from tests.recipe_helpers import compose_config

    def marked(modules):
        return {
            name: module.cuda_depthwise
            for key, root in modules.items()
            for name, module in root.named_modules(prefix=key)
            if getattr(module, "cuda_depthwise", "torch") != "torch"
        }

    cfg = compose_config(["device=cpu", "model.num_layers=2"])
    assert marked(build_modules(cfg, ("s",))) == {}
    for how in ("cudnn", "unfold"):
        cfg = compose_config(["device=cpu", "model.num_layers=2", f"device.cuda_depthwise={how}"])
        names = marked(build_modules(cfg, ("s",)))
        assert len(names) == 2 and set(names.values()) == {how}
        assert all(name.endswith(".depthwise") for name in names)
    conv, plain = _depthwise()
    conv.cuda_depthwise = "unfold"
    x = torch.randn(2, 6, 9)
    torch.testing.assert_close(conv(x), plain(x))  # a CPU: the CPU path, as unmarked
    with pytest.raises(Exception) as typo:  # Hydra's, as for every typed choice
        compose_config(["device=cpu", "device.cuda_depthwise=cudn"])
    message = f"{typo.value} {typo.value.__cause__}"
    assert "Invalid value 'cudn', expected one of [torch, cudnn, unfold]" in message


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["cudnn", "unfold"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_depthwise_runs_no_torch_depthwise_kernel(cuda_device, dtype, how, monkeypatch):
    """With ``cuda_depthwise`` cudnn or unfold, a Conformer-M-sized depthwise conv runs no
    ``conv_depthwise2d`` kernel (PyTorch's own: ~6 ms of a Conformer-M step on the H200),
    and gives ``nn.Conv1d``'s values and gradients to the dtype's rounding."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    args = {"in_channels": 256, "out_channels": 256, "kernel_size": 31, "padding": 15}
    conv = fast_kernels.Conv1d(**args, groups=256).to(cuda_device)
    plain = nn.Conv1d(**args, groups=256).to(cuda_device)
    plain.load_state_dict(conv.state_dict())
    conv.cuda_depthwise = how
    x = torch.randn(96, 100, 256, device=cuda_device).transpose(1, 2)
    x_fast, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype != torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with autocast:
            out = conv(x_fast)
        out.float().square().sum().backward()
        torch.cuda.synchronize()
    kernels = [event.key for event in prof.key_averages()]
    assert not any("conv_depthwise2d" in key for key in kernels), kernels
    with autocast:
        expected = plain(x_plain)
    expected.float().square().sum().backward()
    bf16 = dtype == torch.bfloat16
    # bf16: both sides round to 8 bits, so two results may be ~2 ulps (2 ** -6 relative)
    # apart: the H200 found 11 of 2.5 M input gradients up to 0.0146 apart at atol 1e-2.
    tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-4, "atol": 1e-4}
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out.float(), expected.float(), **tol)
    torch.testing.assert_close(x_fast.grad, x_plain.grad, **tol)
    weight_tol = {"rtol": 2e-2, "atol": 2e-1} if bf16 else {"rtol": 1e-4, "atol": 1e-2}
    torch.testing.assert_close(conv.weight.grad, plain.weight.grad, **weight_tol)


@pytest.mark.gpu
def test_cuda_fp16_convolution_keeps_fp16(cuda_device, monkeypatch):
    seen = _recording(monkeypatch, "conv1d")
    conv = fast_kernels.Conv1d(4, 4, 3, padding=1, groups=4).to(cuda_device)
    with torch.autocast("cuda", dtype=torch.float16):
        out = conv(torch.randn(2, 4, 7, device=cuda_device))
    assert seen == [torch.float16] and out.dtype == torch.float16


# --- dropout: 16 random bits per element on a CPU -------------------------------------------

LEVELS = 2**16


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_cpu_dropout_drops_each_element_with_probability_p_and_keeps_the_mean(monkeypatch, p):
    seen = _recording(monkeypatch, "dropout", record=_dropout_p)
    torch.manual_seed(0)
    count = 1_000_003  # not a multiple of four: the last 64-bit draw is cut
    out = fast_kernels.dropout(torch.ones(count), p)
    rate = round(p * LEVELS) / LEVELS
    dropped = (out == 0).double().mean().item()
    sigma = (rate * (1 - rate) / count) ** 0.5
    assert abs(dropped - rate) < 5 * sigma
    kept = out[out != 0]
    assert torch.all(kept == torch.tensor(1 / (1 - rate), dtype=torch.float32))
    assert abs(out.double().mean().item() - 1.0) < 5 * sigma / (1 - rate)
    assert seen == []  # its own mask, not F.dropout's


def test_every_16_bit_lane_of_a_64_bit_draw_is_uniform():
    """Four elements share a 64-bit draw; each must see uniform bits. (int64 ``random_()``
    without a range fills 63 bits only: the top lane would never be dropped.)"""
    torch.manual_seed(1)
    p, rows = 0.25, 250_000
    dropped = (fast_kernels.dropout(torch.ones(rows, 4), p) == 0).double().mean(dim=0)
    sigma = (p * (1 - p) / rows) ** 0.5
    assert torch.all((dropped - p).abs() < 5 * sigma), dropped


def test_dropout_gradient_is_the_scaled_mask():
    torch.manual_seed(2)
    x = torch.randn(64, 33, requires_grad=True)
    out = fast_kernels.dropout(x, 0.3)
    out.backward(torch.ones_like(out))
    keep = out.detach() != 0
    assert torch.equal(x.grad, keep.float() * (LEVELS / (LEVELS - round(0.3 * LEVELS))))
    assert torch.allclose(out.detach(), x.detach() * x.grad)


def test_dropout_masks_replay_from_the_generator_state():
    """Exact resume restores ``torch.get_rng_state()``: the masks must come from it."""
    x = torch.ones(40, 41)
    torch.manual_seed(3)
    first = fast_kernels.dropout(x, 0.2)
    state = torch.get_rng_state()
    second = fast_kernels.dropout(x, 0.2)
    torch.set_rng_state(state)
    assert torch.equal(fast_kernels.dropout(x, 0.2), second)
    assert not torch.equal(first, second)


def test_dropout_under_bf16_autocast_keeps_the_dtype_and_inplace_writes_the_input():
    torch.manual_seed(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fast_kernels.dropout(nn.Linear(8, 8)(torch.randn(16, 8)), 0.1)
    assert out.dtype == torch.bfloat16
    x = torch.ones(100, 10)
    returned = fast_kernels.dropout(x, 0.5, inplace=True)
    assert returned is x and 0 < int((x == 0).sum()) < 1000


@pytest.mark.parametrize(
    ("p", "training", "compiling"),
    [
        (0.1, False, False),
        (0.0, True, False),
        (1.0, True, False),
        (1e-6, True, False),
        (0.1, True, True),
    ],
)
def test_dropout_falls_back_to_torch_where_its_mask_does_not_apply(
    monkeypatch, p, training, compiling
):
    """Eval mode, p of 0 or 1, a p that rounds to no level, and torch.compile (inductor draws
    its own fast masks) are F.dropout's."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    seen = _recording(monkeypatch, "dropout", record=_dropout_p)
    x = torch.ones(50, 20)
    out = fast_kernels.dropout(x, p, training)
    assert seen == [p]
    if not training or p == 0.0:
        assert torch.equal(out, x)
    if training and p == 1.0:
        assert torch.equal(out, torch.zeros_like(x))


def test_dropout_rejects_a_probability_out_of_range_as_torch_does():
    with pytest.raises(ValueError, match="dropout probability"):
        fast_kernels.dropout(torch.ones(3), 1.5)
    with pytest.raises(ValueError, match="dropout probability"):
        fast_kernels.Dropout(-0.1)


def test_dropout_module_follows_train_and_eval():
    drop = fast_kernels.Dropout(0.5)
    x = torch.ones(200, 50)
    assert torch.equal(drop.eval()(x), x)
    assert 0 < int((drop.train()(x) == 0).sum()) < x.numel()
    assert drop.state_dict() == {}


def test_the_conformer_uses_only_the_fast_dropout():
    model = ConformerCTC(d_model=16, num_layers=2, num_heads=2, ffn_dim=32)
    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    assert len(drops) == 1 + 2 * 6 and all(isinstance(m, fast_kernels.Dropout) for m in drops)


@pytest.mark.gpu
def test_cuda_dropout_is_torch_dropout(cuda_device, monkeypatch):
    seen = _recording(monkeypatch, "dropout", record=_dropout_p)
    out = fast_kernels.dropout(torch.ones(100, device=cuda_device), 0.1)
    assert seen == [0.1] and out.device.type == "cuda"


#: Three convolution shapes, three times over, after some torch work; argv[1]: the cache size
#: given to configure_onednn_cache.
CACHE_PROBE = """
import sys
import torch
from amp_utils.precision import configure_onednn_cache
torch.randn(64, 64) @ torch.randn(64, 64)  # torch already at work: the setting still applies
configure_onednn_cache(int(sys.argv[1]))
weight = torch.randn(8, 4, 3, 3)
for _ in range(3):
    for size in (16, 17, 18):
        torch.nn.functional.conv2d(torch.randn(2, 4, size, size), weight)
"""


def onednn_kernels_created(capacity: int) -> int:
    """oneDNN kernel creations (cache misses, from its verbose log) in ``CACHE_PROBE``."""
    env = {k: v for k, v in os.environ.items() if k != ONEDNN_CACHE_VARIABLE}
    result = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE, str(capacity)],
        cwd=REPO_ROOT,
        env={**env, "ONEDNN_VERBOSE": "2"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    if "onednn_verbose" not in result.stdout:
        pytest.skip("this torch build runs CPU convolutions without oneDNN")
    return result.stdout.count("cache_miss")


def test_onednn_cache_capacity_set_in_process_reaches_onednn():
    """A cache of 1 regenerates every kernel; one of 16 creates each shape's kernels once."""
    kept = onednn_kernels_created(16)
    assert kept > 0
    assert onednn_kernels_created(1) >= 2 * kept


def test_unfolded_depthwise_conv1d_returns_autocasts_dtype_under_cudas_fp32_sum():
    """CUDA's autocast sums in fp32 (CPU's does not): the unfold depthwise returned fp32
    under CUDA's bf16 autocast, a defect only the GPU test saw (d02f673). The CPU runs it
    here with CUDA's fp32 ops emulated (``benchmarks/cuda_policy.py``)."""
    conv, plain = _depthwise(bias=True)
    x = torch.randn(2, 6, 9)
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_fp32_ops() as policy:
        out = fast_kernels.depthwise_conv1d_unfold(x, conv.weight, conv.bias, 1, 2)
    assert policy.calls > 0, "the emulated fp32 sum was not reached"
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), plain(x), rtol=2e-2, atol=2e-2)


def test_cuda_fp32_ops_emulation_compiles_once():
    """Compiled code under the emulation of CUDA's fp32 ops (``train_cuda_policy`` with
    ``trainer.compile=true``) computes them in fp32 and compiles once: counting each call
    made TorchDynamo guard on the counter's value and recompile at every call (7
    recompiles in a 2-block Conformer's epoch)."""
    from amp_utils.compile import RECOMPILES

    torch._dynamo.reset()
    RECOMPILES.install()

    def summed(x: torch.Tensor) -> torch.Tensor:
        return (x @ x).sum(-1)

    compiled = torch.compile(summed, backend="aot_eager", fullgraph=True)
    before = RECOMPILES.count
    with torch.autocast("cpu", dtype=torch.bfloat16), cuda_fp32_ops():
        outs = [compiled(torch.randn(4, 4)) for _ in range(3)]
    assert RECOMPILES.count == before
    assert all(out.dtype == torch.float32 for out in outs)  # CUDA's fp32 sum
    torch._dynamo.reset()


def test_cuda_kernel_choices_apply_inside_the_block_only():
    """``benchmarks.cuda_policy.cuda_kernel_choices``: CUDA's dropout (a bool mask), 16-bit
    attention and fp32 LayerNorms inside; the CPU's choices back after, also after an error."""
    from amp_utils import module_precision
    from benchmarks.cuda_policy import cuda_dropout, cuda_kernel_choices

    before = fast_kernels.dropout
    with pytest.raises(RuntimeError), cuda_kernel_choices():
        assert fast_kernels.dropout is cuda_dropout and fast_kernels._SLOW_ON_CPU == ()
        assert module_precision.autocast_runs_norms_in_fp32("cpu")  # CUDA's LayerNorms
        raise RuntimeError
    assert fast_kernels.dropout is before and torch.bfloat16 in fast_kernels._SLOW_ON_CPU
    assert not module_precision.autocast_runs_norms_in_fp32("cpu")
    assert module_precision.autocast_runs_norms_in_fp32("cuda")
