"""Drop-in replacements for ops whose fast precision depends on the device.

Autocast picks one dtype for a whole region, but PyTorch's kernels are not equally fast in
every dtype on every device. On a CPU, ``scaled_dot_product_attention``'s bf16 backward
(the flash kernel for CPUs) is several times slower than its fp32 one on short sequences,
and that alone cancelled the matmul gain of bf16 autocast for the ASR recipe on a CPU with
AMX (``benchmarks/results/2026-11-25-cpu-amx.md``, per ``recipes/benchmark.py`` with
``benchmark.profile_steps``). Measured there (2 cores, 4 heads, head size 36, boolean
key mask, forward + backward, ms, mean of 30):

======================  ============  ============  ===============
batch x frames          fp32 flash    bf16 flash    bf16 via fp32
======================  ============  ============  ===============
32 x 50 (one digit)     1.9           9.9           2.6
8 x 400 (8 s)           13.8          16.2          14.3
4 x 800 (16 s)          24.2          22.3          25.1
======================  ============  ============  ===============

So on a CPU the attention core runs in fp32 (its inputs cast up, its output cast back to
the autocast dtype, so the layers around it keep their precision): 3.8x faster on one-digit
batches, on par at 8 s, 13 % slower at 16 s, where bf16 flash starts to pay. On CUDA
nothing changes.

Convolutions under fp16 on a CPU are worse: on an Intel Xeon with AVX512-FP16 but no
AMX-FP16 (Sapphire Rapids class, torch 2.11), oneDNN's fp16 depthwise convolution never
returns for some batch shapes (its JIT kernel generator, ``jit_brdgmm_kernel_base_t``,
loops forever: a Conformer's ``[1, 32, 58]`` input, kernel 15, hangs; ``[32, 32, 50]`` takes
0.4 ms), and an fp16 ``Conv2d`` backward takes 3 s where fp32 takes 30 ms. The x-vector
model trained at 0.01x fp32's speed in fp16 there, and the Conformer's fp16 training hung
in its first step (``benchmarks/results/2026-11-25-cpu-fp16-conv.md``). ``Conv1d`` and
``Conv2d`` here are ``nn.Conv1d``/``nn.Conv2d`` (same parameters and state-dict keys) that
compute in fp32 on a CPU under fp16 autocast, so fp16 trains at about fp32's speed there;
bf16 convolutions are fast on CPUs and keep their dtype, and on CUDA nothing changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Reduced-precision dtypes whose CPU attention kernels are slower than fp32's.
_SLOW_ON_CPU = (torch.bfloat16, torch.float16)


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None
) -> Tensor:
    """``F.scaled_dot_product_attention`` in the precision that is fast on this device.

    On a CPU with bf16/fp16 inputs (autocast), computes in fp32 with autocast off and
    returns the inputs' dtype; elsewhere calls ``F.scaled_dot_product_attention``
    unchanged. The branch depends only on the device and dtype, so ``torch.compile``
    traces it without a guard on values.
    """
    if query.device.type == "cpu" and query.dtype in _SLOW_ON_CPU:
        # Autocast off: under CPU autocast, SDPA would cast fp32 inputs straight back down.
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(
                query.float(), key.float(), value.float(), attn_mask=attn_mask
            )
        return out.to(query.dtype)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)


def fp16_on_cpu(x: Tensor) -> bool:
    """True when an op on ``x`` would compute in fp16 on a CPU: an fp16 tensor, or any
    floating tensor under CPU autocast to fp16.

    Depends only on the device, the dtype and the autocast state, so ``torch.compile``
    guards on those, never on values.
    """
    if x.device.type != "cpu":
        return False
    if x.dtype == torch.float16:
        return True
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16


class _FP32ConvOnCPUFp16:
    """Mixin for ``nn.ConvNd``: fp32 on a CPU where the op would compute in fp16."""

    weight: Tensor
    bias: Tensor | None

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.ConvNd's argument name)
        """The convolution; on a CPU in fp16, computed in fp32 and returned as fp16."""
        if not fp16_on_cpu(input):
            return super().forward(input)  # type: ignore[misc]
        bias = None if self.bias is None else self.bias.float()
        # Autocast off: under CPU autocast the conv would cast fp32 inputs back to fp16.
        with torch.autocast("cpu", enabled=False):
            out = self._conv_forward(input.float(), self.weight.float(), bias)  # type: ignore[attr-defined]
        return out.to(torch.float16)


class Conv1d(_FP32ConvOnCPUFp16, nn.Conv1d):
    """``nn.Conv1d`` that computes in fp32 on a CPU under fp16 (see the module docstring)."""


class Conv2d(_FP32ConvOnCPUFp16, nn.Conv2d):
    """``nn.Conv2d`` that computes in fp32 on a CPU under fp16 (see the module docstring)."""
