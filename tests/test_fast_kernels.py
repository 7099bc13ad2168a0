"""amp_utils.fast_kernels: ops computed in the precision that is fast on the device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from amp_utils import fast_kernels
from amp_utils.fast_kernels import scaled_dot_product_attention
from recipes.asr.model import SelfAttention


def _qkv(dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    shape = (2, 4, 7, 8)
    return tuple(torch.randn(shape, generator=generator).to(device, dtype) for _ in range(3))


def _recording_sdpa(monkeypatch) -> list[torch.dtype]:
    """Patch the SDPA that fast_kernels calls so that the test sees its input dtypes."""
    seen: list[torch.dtype] = []
    real = F.scaled_dot_product_attention

    def recording(query, key, value, **kwargs):
        seen.append(query.dtype)
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(fast_kernels.F, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_attention_in_reduced_precision_runs_in_fp32_and_returns_its_dtype(monkeypatch, dtype):
    seen = _recording_sdpa(monkeypatch)
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
    seen = _recording_sdpa(monkeypatch)
    query, key, value = _qkv(torch.float32)
    out = scaled_dot_product_attention(query, key, value)
    assert seen == [torch.float32]
    assert torch.equal(out, F.scaled_dot_product_attention(query, key, value))


def test_conformer_attention_under_cpu_bf16_autocast_uses_fp32_attention(monkeypatch):
    """The ASR model's attention block gets the fp32 core; its projections stay bf16."""
    seen = _recording_sdpa(monkeypatch)
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
    seen = _recording_sdpa(monkeypatch)
    query, key, value = _qkv(torch.bfloat16, device=str(cuda_device))
    assert scaled_dot_product_attention(query, key, value).dtype == torch.bfloat16
    assert seen == [torch.bfloat16]
