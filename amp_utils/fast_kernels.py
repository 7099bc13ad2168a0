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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
