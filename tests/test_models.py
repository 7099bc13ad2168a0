"""Tests of the ASR (Conformer-CTC) and speaker (x-vector) models: shapes, masking, autocast,
torch.compile and tiny overfits."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

from amp_utils.compile import compile_options
from recipes.asr.model import ConformerCTC, ConvFeatureLinear, ctc_log_probs, ctc_loss
from recipes.speaker.model import XVector, masked_mean_std

N_MELS = 40
LENGTHS = (61, 47, 23)  # deliberately not multiples of the subsampling factor


def _padded_batch(lengths: tuple[int, ...], pad_value: float = 0.0) -> tuple[torch.Tensor, ...]:
    """Random features ``[B, max(lengths), N_MELS]``, padding filled with ``pad_value``."""
    generator = torch.Generator().manual_seed(0)
    feats = torch.randn(len(lengths), max(lengths), N_MELS, generator=generator)
    for index, length in enumerate(lengths):
        feats[index, length:] = pad_value
    return feats, torch.tensor(lengths, dtype=torch.int64)


def _small_conformer(**kwargs) -> ConformerCTC:
    params = dict(d_model=64, num_layers=2, num_heads=4, ffn_dim=128, vocab_size=12)
    return ConformerCTC(**{**params, **kwargs})


def _greedy_decode(logits: torch.Tensor, out_lens: torch.Tensor) -> list[list[int]]:
    """Best-path CTC decoding (collapse repeats, drop blank 0)."""
    hypotheses = []
    for frame_ids, length in zip(logits.argmax(-1).tolist(), out_lens.tolist(), strict=True):
        tokens, previous = [], None
        for token in frame_ids[:length]:
            if token != previous and token != 0:
                tokens.append(token)
            previous = token
        hypotheses.append(tokens)
    return hypotheses


def test_parameter_counts() -> None:
    conformer = sum(p.numel() for p in ConformerCTC().parameters())
    xvector = sum(p.numel() for p in XVector().parameters())
    print(f"ConformerCTC default: {conformer:,} parameters; XVector default: {xvector:,}")
    assert 1_500_000 <= conformer <= 3_000_000
    assert 500_000 <= xvector <= 1_500_000


@pytest.mark.parametrize("subsampling", [2, 4, 8])
def test_conformer_shapes_and_out_lens(subsampling: int) -> None:
    model = _small_conformer(subsampling=subsampling).eval()
    feats, feat_lens = _padded_batch(LENGTHS)
    logits, out_lens = model(feats, feat_lens)

    expected = feat_lens.clone()
    expected_frames = feats.shape[1]
    for _ in range(subsampling.bit_length() - 1):  # each stride-2 3x3 conv: n -> (n - 1) // 2
        expected = (expected - 1) // 2
        expected_frames = (expected_frames - 1) // 2
    assert logits.shape == (len(LENGTHS), expected_frames, 12)
    assert out_lens.dtype == torch.int64
    assert out_lens.tolist() == expected.tolist()
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("subsampling", [2, 4])
def test_subsampling_relu_after_the_reshape_gives_the_sequential_stack_s_values_and_gradients(
    subsampling: int,
) -> None:
    """The last ReLU runs after the [B, C, T, F] -> [B, T, C*F] reshape, so its backward gets
    a contiguous gradient (a transposed one made the bf16 ReLU backward 7x slower on a CPU,
    benchmarks/results/2026-11-25-cpu-dropout.md); values and gradients are the stack's."""
    torch.manual_seed(0)
    front = ConformerCTC(
        d_model=16, num_layers=1, num_heads=2, ffn_dim=32, subsampling=subsampling
    ).frontend
    feats = torch.randn(3, 37, 40, requires_grad=True)
    lens = torch.tensor([37, 30, 12])
    seen: list[torch.Tensor] = []
    front.convs[-1].register_forward_hook(lambda module, args, out: seen.append(args[0]))
    out, _ = front(feats, lens)
    (grad,) = torch.autograd.grad(out.square().sum(), feats)
    assert len(seen) == 1 and seen[0].dim() == 3 and seen[0].is_contiguous()

    valid = torch.arange(37).view(-1, 1) < lens.view(-1, 1, 1, 1)
    x = front.convs(feats.unsqueeze(1).masked_fill(~valid, 0.0))
    ref = nn.functional.linear(
        x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1), front.out.weight, front.out.bias
    )
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), feats)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("subsampling", [2, 4])
def test_subsampling_on_a_cpu_runs_channels_last_and_flattens_frames_without_a_copy(
    subsampling: int,
) -> None:
    """On a CPU the convolutions run channels-last (oneDNN's fast layout: the ASR recipe's
    bf16 front end 1.3x faster, benchmarks/results/2026-11-25-cpu-channels-last.md) and the
    ReLU + linear read the last conv's output in place; under torch.compile, torch's layout."""
    torch.manual_seed(0)
    front = ConformerCTC(
        d_model=16, num_layers=1, num_heads=2, ffn_dim=32, subsampling=subsampling
    ).frontend
    feats, lens = torch.randn(3, 37, 40), torch.tensor([37, 30, 12])
    convs = [m for m in front.convs if isinstance(m, nn.Conv2d)]
    conv_inputs: list[torch.Tensor] = []
    conv_outputs: list[torch.Tensor] = []
    for conv in convs:
        conv.register_forward_hook(lambda m, args, out: conv_inputs.append(args[0]))
    convs[-1].register_forward_hook(lambda m, args, out: conv_outputs.append(out))
    relu_inputs: list[torch.Tensor] = []
    front.convs[-1].register_forward_hook(lambda m, args, out: relu_inputs.append(args[0]))
    out, _ = front(feats, lens)
    assert all(x.stride(1) == 1 for x in conv_inputs)  # unit channel stride: channels-last
    assert conv_outputs[0].is_contiguous(memory_format=torch.channels_last)
    assert relu_inputs[0].data_ptr() == conv_outputs[0].data_ptr()  # a view, not a copy

    conv_inputs.clear()
    with mock.patch.object(torch.compiler, "is_compiling", return_value=True):
        compiled_layout, _ = front(feats, lens)
    assert conv_inputs[0].is_contiguous()  # [B, 1, T, F] as torch lays it out
    torch.testing.assert_close(compiled_layout, out, rtol=1e-5, atol=1e-6)


def test_conv_feature_linear_reads_features_in_either_order() -> None:
    """``channels_last=True`` takes [F, C]-ordered features: the same outputs as [C, F]
    ones, with nn.Linear's parameters and state-dict keys (checkpoints do not change)."""
    torch.manual_seed(0)
    linear = ConvFeatureLinear(channels=3, freq=5, out_features=4)
    features = torch.randn(2, 7, 3, 5)  # [B, T, C, F]
    by_channel = linear(features.reshape(2, 7, 15))
    by_freq = linear(features.transpose(2, 3).reshape(2, 7, 15), channels_last=True)
    torch.testing.assert_close(by_freq, by_channel)
    plain = nn.Linear(15, 4)
    assert list(linear.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(linear.state_dict())
    torch.testing.assert_close(plain(features.reshape(2, 7, 15)), by_channel)


def test_conformer_rejects_bad_subsampling() -> None:
    with pytest.raises(ValueError, match="power of two"):
        ConformerCTC(subsampling=3)


def test_conformer_padded_batch_matches_single_utterances() -> None:
    """Valid outputs must not depend on padding, even on absurd padding values."""
    torch.manual_seed(0)
    model = _small_conformer().eval()
    feats, feat_lens = _padded_batch(LENGTHS, pad_value=1e3)
    with torch.no_grad():
        logits, out_lens = model(feats, feat_lens)
        for index, length in enumerate(LENGTHS):
            single, single_lens = model(
                feats[index : index + 1, :length], feat_lens[index : index + 1]
            )
            valid = int(out_lens[index])
            assert single_lens.item() == valid == single.shape[1]
            torch.testing.assert_close(logits[index, :valid], single[0], atol=1e-4, rtol=1e-4)


def test_conformer_too_short_utterance_gives_finite_outputs() -> None:
    model = _small_conformer().eval()
    feats, feat_lens = _padded_batch((40, 5))  # 5 frames -> 0 frames after subsampling
    with torch.no_grad():
        logits, out_lens = model(feats, feat_lens)
    assert out_lens.tolist() == [9, 0]
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conformer_autocast_low_precision_logits_fp32_loss(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _small_conformer()
    feats, feat_lens = _padded_batch(LENGTHS)
    tokens = torch.randint(1, 12, (len(LENGTHS), 4))
    token_lens = torch.tensor([4, 3, 2])
    with torch.autocast("cpu", dtype=dtype):
        logits, out_lens = model(feats, feat_lens)
        log_probs = ctc_log_probs(logits)
        loss = ctc_loss(log_probs, out_lens, tokens, token_lens)
    assert logits.dtype == dtype
    assert log_probs.dtype == torch.float32
    assert loss.dtype == torch.float32 and loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conformer_training_step_under_cudas_autocast_choices(dtype: torch.dtype):
    """The captured CUDA step's arithmetic (CUDA's kernel choices: attention, depthwise
    convolutions and dropout as on the GPU; the device CTC loss), run on a CPU under
    autocast with CUDA's fp32 ops emulated (``benchmarks/cuda_policy.py``): it runs,
    the LayerNorms and the residual stream are fp32 and the layers' outputs 16-bit, as on
    the GPU, and every gradient is fp32 and finite. CPU autocast alone keeps sums and
    softmaxes in 16 bits and hid a GPU-only dtype defect (d02f673)."""
    from benchmarks.cuda_policy import cuda_fp32_ops, cuda_kernel_choices
    from recipes.asr.ctc_on_device import alpha_step, ctc_loss_on_device

    torch.manual_seed(0)
    model = _small_conformer().train()
    outputs: dict[str, set[torch.dtype]] = {}
    for module in model.modules():
        module.register_forward_hook(
            lambda m, i, out: outputs.setdefault(type(m).__name__, set()).add(
                (out[0] if isinstance(out, tuple) else out).dtype
            )
        )
    feats, feat_lens = _padded_batch(LENGTHS)
    tokens = torch.randint(1, 12, (len(LENGTHS), 4))
    with cuda_kernel_choices(), torch.autocast("cpu", dtype=dtype), cuda_fp32_ops() as policy:
        logits, out_lens = model(feats, feat_lens)
        log_probs = ctc_log_probs(logits)
        loss = ctc_loss_on_device(
            log_probs, out_lens, tokens, torch.tensor([4, 3, 2]), step=alpha_step
        )
    assert policy.calls > 0
    assert logits.dtype == dtype and log_probs.dtype == loss.dtype == torch.float32
    assert outputs["LayerNorm"] == outputs["ConformerBlock"] == {torch.float32}
    assert outputs["Linear"] == outputs["SelfAttention"] == outputs["ConvModule"] == {dtype}
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and g.dtype == torch.float32 for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)


def test_ctc_helpers_in_fp32_without_autocast() -> None:
    logits = torch.randn(2, 10, 5, dtype=torch.bfloat16)
    log_probs = ctc_log_probs(logits)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(2, 10))
    # A target longer than the output is impossible: zero_infinity turns inf into 0.
    loss = ctc_loss(
        log_probs, torch.tensor([10, 2]), torch.ones(2, 6, dtype=torch.long), torch.tensor([3, 6])
    )
    assert torch.isfinite(loss)


def test_conformer_torch_compile_dynamic_matches_eager() -> None:
    """Full-graph capture with dynamic shapes (eager backend: checks tracing, stays fast)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _small_conformer(d_model=32, num_layers=1, ffn_dim=64, dropout=0.0)
    compiled = torch.compile(model, dynamic=True, fullgraph=True, backend="eager")
    for lengths in ((61, 47), (38, 38, 20)):
        feats, feat_lens = _padded_batch(lengths)
        logits, out_lens = compiled(feats, feat_lens)
        expected, expected_lens = model(feats, feat_lens)
        torch.testing.assert_close(logits, expected)
        assert out_lens.tolist() == expected_lens.tolist()
        logits.float().sum().backward()


def _compile_forward_backward(model_name: str, device: str, dtype: torch.dtype) -> None:
    """Inductor, dynamic shapes, training mode, three batch shapes, forward and backward."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    small = model_name == "conformer"
    model = (_small_conformer() if small else XVector(channels=64)).to(device)
    compiled = torch.compile(model, **compile_options("default", "inductor"))  # the loop's
    for lengths in ((61, 47, 80), (38, 30), (120, 100, 90, 20)):
        feats, feat_lens = (t.to(device) for t in _padded_batch(lengths))
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            output = compiled(feats, feat_lens)
        logits = output[0] if isinstance(output, tuple) else output
        logits.float().sum().backward()
        assert torch.isfinite(logits).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["conformer", "xvector"])
def test_torch_compile_inductor_cpu(model_name: str) -> None:
    """The real inductor backend on CPU (about 45 s on 2 cores for the Conformer: one compile)."""
    _compile_forward_backward(model_name, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model_name", ["conformer", "xvector"])
def test_torch_compile_inductor_cuda_autocast(model_name: str, dtype: torch.dtype) -> None:
    _compile_forward_backward(model_name, "cuda", dtype)


def test_conformer_overfits_two_utterances() -> None:
    torch.manual_seed(0)
    model = _small_conformer(dropout=0.0)
    feats, feat_lens = _padded_batch((60, 45))
    tokens = torch.tensor([[3, 5, 5, 7, 2], [9, 4, 1, 0, 0]])
    token_lens = torch.tensor([5, 3])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = None
    for _ in range(150):
        logits, out_lens = model(feats, feat_lens)
        loss = ctc_loss(ctc_log_probs(logits), out_lens, tokens, token_lens)
        start = loss.item() if start is None else start
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        hypotheses = _greedy_decode(logits.detach(), out_lens)
        if loss.item() < 0.3 * start and hypotheses == [[3, 5, 5, 7, 2], [9, 4, 1]]:
            break
    assert loss.item() < 0.3 * start, (start, loss.item())
    assert hypotheses == [[3, 5, 5, 7, 2], [9, 4, 1]]


def test_xvector_shapes() -> None:
    model = XVector(num_speakers=6, embedding_dim=128).eval()
    feats, feat_lens = _padded_batch(LENGTHS)
    assert model(feats, feat_lens).shape == (3, 6)
    assert model.embed(feats, feat_lens).shape == (3, 128)


def test_xvector_padded_batch_matches_single_utterances() -> None:
    torch.manual_seed(0)
    model = XVector(channels=64, embedding_dim=32)
    # Give BatchNorm non-trivial running statistics before switching to eval mode.
    with torch.no_grad():
        model(*_padded_batch(LENGTHS))
    model.eval()
    feats, feat_lens = _padded_batch(LENGTHS, pad_value=1e3)
    with torch.no_grad():
        logits = model(feats, feat_lens)
        embeddings = model.embed(feats, feat_lens)
        for index, length in enumerate(LENGTHS):
            single_feats = feats[index : index + 1, :length]
            single_lens = feat_lens[index : index + 1]
            torch.testing.assert_close(logits[index], model(single_feats, single_lens)[0])
            torch.testing.assert_close(embeddings[index], model.embed(single_feats, single_lens)[0])


def test_masked_mean_std_fp32_under_autocast() -> None:
    x = torch.randn(2, 3, 10)
    mask = torch.tensor([[True] * 10, [True] * 4 + [False] * 6])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mean, std = masked_mean_std(x.bfloat16(), mask)
    assert mean.dtype == std.dtype == torch.float32
    reference = x.bfloat16().float()[1, :, :4]
    torch.testing.assert_close(mean[1], reference.mean(-1))
    torch.testing.assert_close(std[1], reference.std(-1, unbiased=False))
    # Constant input: the variance clamp keeps std (and its gradient) finite.
    constant = torch.ones(1, 2, 5, requires_grad=True)
    _, std = masked_mean_std(constant, torch.ones(1, 5, dtype=torch.bool))
    std.sum().backward()
    assert torch.isfinite(constant.grad).all()


def test_xvector_autocast_bf16_forward_backward() -> None:
    model = XVector(channels=64, embedding_dim=32)
    feats, feat_lens = _padded_batch(LENGTHS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(feats, feat_lens)
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 2]))
    assert logits.dtype == torch.bfloat16
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_xvector_torch_compile_dynamic() -> None:
    """Compiles with dynamic shapes in one graph: ``masked_mean_std``'s
    ``fwd_default_precision`` no longer breaks it."""
    torch._dynamo.reset()
    model = XVector(channels=32, embedding_dim=16).eval()
    compiled = torch.compile(model, dynamic=True, backend="eager", fullgraph=True)
    for lengths in ((61, 47), (38, 30, 20)):
        feats, feat_lens = _padded_batch(lengths)
        torch.testing.assert_close(compiled(feats, feat_lens), model(feats, feat_lens))


def test_xvector_separates_two_random_classes() -> None:
    torch.manual_seed(0)
    model = XVector(channels=64, embedding_dim=32, num_speakers=2, dropout=0.0)
    generator = torch.Generator().manual_seed(1)
    # Two "speakers": different mean spectra plus noise, varying lengths.
    centers = torch.randn(2, 1, N_MELS, generator=generator)
    labels = torch.tensor([0, 1] * 4)
    feats = centers[labels] + 0.5 * torch.randn(8, 50, N_MELS, generator=generator)
    feat_lens = torch.tensor([50, 44, 39, 50, 31, 47, 28, 36])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(50):
        loss = torch.nn.functional.cross_entropy(model(feats, feat_lens), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        test_feats = centers[labels] + 0.5 * torch.randn(8, 50, N_MELS, generator=generator)
        predictions = model(test_feats, feat_lens).argmax(-1)
    assert (predictions == labels).all(), predictions


def test_xvector_trains_on_a_single_utterance_batch() -> None:
    """Duration batching can yield a batch of one; training must not fail on it."""
    model = XVector(n_mels=40, num_speakers=3).train()
    logits = model(torch.randn(1, 50, 40), torch.tensor([50]))
    torch.nn.functional.cross_entropy(logits, torch.tensor([1])).backward()
