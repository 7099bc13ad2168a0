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

The depthwise ``Conv1d`` of a Conformer is the exception on a CPU in every precision. On
torch's default ``[B, C, T]`` layout oneDNN runs its forward as a GEMM over unfolded
windows; channels-last (``[B, T, C]`` in memory, what the Conformer's ``x.transpose(1, 2)``
already is) it picks its direct depthwise kernels, and the bf16 one of those hangs like the
fp16 one (``[1, 32, 58]``, kernel 15, AMX Xeon, torch 2.11). So on a CPU a depthwise
``Conv1d`` computes in fp32, channels-last, as a ``conv2d`` over ``[B, C, 1, T]``
(``depthwise_conv1d``), and returns the autocast dtype. Forward + backward of
``[32, 144, 50]``, kernel 15, 2 cores (ms, best of 3 means of 30, before -> after): fp32
5.9 -> 3.0, bf16 5.6 -> 2.9, fp16 (fp32 before too) 5.4 -> 3.0
(``benchmarks/results/2026-11-25-cpu-channels-last.md``); fp32 channels-last ran 2,400
shapes (batch 1-64, 8-512 channels, 1-400 frames, kernels 3-31) without a hang.

Dropout on a CPU costs more than its matmuls suggest: ``F.dropout`` draws one 32-bit number
from the CPU generator (mt19937, serial) per element with ``bernoulli_``, 21-24 % of the
Conformer's CPU training step (25 calls, ~55 ms of ~250 ms per step, in fp32 and bf16
alike; ``recipes/benchmark.py benchmark.profile_steps=10``). ``dropout`` and ``Dropout``
here draw 16 random bits per element instead (one 64-bit draw serves four elements):
``[25, 58, 576]`` in 1.6 ms instead of 4.8 ms, and the Conformer's CPU step 1.16x faster
in fp32, 1.20x in bf16 (``benchmarks/results/2026-11-25-cpu-dropout.md``). Each element is
still dropped independently; ``p`` is rounded to a multiple of 1/65536 and the kept values
are scaled by the inverse of the rounded keep probability, so the expectation stays exact.
On CUDA (fast Philox masks), under ``torch.compile`` (inductor draws its own) and in eval
mode it is ``F.dropout``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: Dropout's mask draws this many random bits per element on a CPU: ``p`` is rounded to 1/2**16.
_MASK_BITS = 16
#: The smallest int64: ``random_(_INT64_MIN, None)`` fills all 64 bits uniformly.
_INT64_MIN = -(2**63)

#: Reduced-precision dtypes whose CPU attention kernels are slower than fp32's.
_SLOW_ON_CPU = (torch.bfloat16, torch.float16)
#: Input dtypes of a CPU depthwise ``Conv1d`` computed by ``depthwise_conv1d`` (in fp32).
_CHANNELS_LAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


CUDA_DEPTHWISE = ("torch", "cudnn", "unfold")  # how a CUDA depthwise Conv1d computes


class Conv1d(_FP32ConvOnCPUFp16, nn.Conv1d):
    """``nn.Conv1d`` that computes in fp32 on a CPU under fp16, and depthwise in fp32
    channels-last on a CPU in every precision (see the module docstring).

    ``cuda_depthwise`` (:func:`use_cuda_depthwise` sets it) picks how a depthwise one
    computes on CUDA: ``torch`` (``nn.Conv1d``'s way), ``cudnn``
    (:func:`depthwise_conv1d_channels_last`) or ``unfold`` (:func:`depthwise_conv1d_unfold`).
    """

    cuda_depthwise: str = "torch"

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Conv1d's argument name)
        """The convolution; a CPU depthwise one through ``depthwise_conv1d``."""
        stride, padding, dilation = self.stride[0], self.padding[0], self.dilation[0]  # type: ignore[index]
        if _depthwise_on_cpu(self, input):
            return depthwise_conv1d(input, self.weight, self.bias, stride, padding, dilation)
        if self.cuda_depthwise != "torch" and input.is_cuda and _depthwise_conv(self, input):
            conv = (
                depthwise_conv1d_channels_last
                if self.cuda_depthwise == "cudnn"
                else depthwise_conv1d_unfold
            )
            return conv(input, self.weight, self.bias, stride, padding, dilation)
        return super().forward(input)


def _is_depthwise(conv: nn.Conv1d) -> bool:
    """True when ``conv`` has one group per input channel (more than one)."""
    return conv.groups == conv.in_channels > 1


def _depthwise_conv(conv: nn.Conv1d, input: Tensor) -> bool:  # noqa: A002
    """True when ``conv`` is depthwise with zero padding given as a number, on a batch."""
    return (
        input.dim() == 3
        and _is_depthwise(conv)
        and conv.padding_mode == "zeros"
        and not isinstance(conv.padding, str)
    )


def use_cuda_depthwise(modules: Mapping[str, nn.Module] | nn.Module, how: str) -> list[str]:
    """Compute every depthwise :class:`Conv1d` of ``modules`` on CUDA the way ``how`` says
    (``device.cuda_depthwise``: one of :data:`CUDA_DEPTHWISE`). Returns their names.

    PyTorch sends a depthwise convolution to cuDNN only for fp16 inputs that pass a
    workload heuristic, or for channels-last inputs; fp32 and bf16 ``[B, C, T]`` inputs run
    its own ``conv_depthwise2d`` kernels. On the 2026-11-27 H200 those took ~6 ms of every
    Conformer-M step (31 taps, 16 blocks; the weight gradient ~4.7 ms), in every precision:
    25 % of bf16's GPU time. Nothing changes on a CPU.
    """
    if how not in CUDA_DEPTHWISE:
        raise ValueError(f"cuda_depthwise={how!r}: choose one of {', '.join(CUDA_DEPTHWISE)}.")
    roots = {"": modules} if isinstance(modules, nn.Module) else dict(modules)
    changed = []
    for root_name, root in roots.items():
        for name, module in root.named_modules():
            if isinstance(module, Conv1d) and _is_depthwise(module):
                module.cuda_depthwise = how
                changed.append(".".join(part for part in (root_name, name) if part))
    return changed


def depthwise_conv1d_channels_last(
    input: Tensor,  # noqa: A002 (F.conv1d's argument name)
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
) -> Tensor:
    """``F.conv1d(..., groups=channels)`` of ``[B, C, T]`` as a channels-last ``conv2d`` over
    ``[B, C, 1, T]``, in the dtype ``F.conv1d`` would use (autocast's, if on): the layout for
    which PyTorch picks cuDNN's depthwise kernels on CUDA.

    A time-major input (``x.transpose(1, 2)`` of ``[B, T, C]``, as in the Conformer) is
    channels-last already and is not copied; the output has time-major strides too.
    """
    x = input.unsqueeze(2).contiguous(memory_format=torch.channels_last)
    out = F.conv2d(
        x,
        weight.unsqueeze(2),
        bias,
        stride=(1, stride),
        padding=(0, padding),
        dilation=(1, dilation),
        groups=input.shape[1],
    )
    return out.squeeze(2)


def depthwise_conv1d_unfold(
    input: Tensor,  # noqa: A002 (F.conv1d's argument name)
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
) -> Tensor:
    """``F.conv1d(..., groups=channels)`` of ``[B, C, T]`` as a sum over sliding windows:
    time-major (``[B, T, C]``) windows times each channel's ``M`` filters of ``K`` taps
    (``weight`` is ``[C * M, 1, K]``; ``M`` is 1 for the Conformer's), summed over the taps.

    Elementwise products and a reduction, so ``torch.compile`` fuses them into its own
    kernels (forward and both gradients) instead of calling a convolution. Computes in the
    dtype ``F.conv1d`` would (autocast's, if on; reductions accumulate in fp32) and returns a
    ``[B, C, T']`` tensor with time-major strides. Eager, it writes ``B x T' x C x K``
    products: for compiled code.
    """
    device = input.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else input.dtype
    channels, taps = input.shape[1], weight.shape[-1]
    x = input.transpose(1, 2).to(dtype)  # [B, T, C]
    x = F.pad(x, (0, 0, padding, padding))
    windows = x.unfold(1, dilation * (taps - 1) + 1, stride)[..., ::dilation]  # [B, T', C, K]
    filters = weight.to(dtype).view(channels, -1, taps)  # [C, M, K]: F.conv1d's channel order
    # CUDA's autocast runs sum in fp32 (its fp32 list): accumulate there, return the dtype.
    out = (windows.unsqueeze(3) * filters).sum(-1).to(dtype).flatten(2)  # [B, T', C * M]
    if bias is not None:
        out = out + bias.to(dtype)
    return out.transpose(1, 2)


def _depthwise_on_cpu(conv: nn.Conv1d, input: Tensor) -> bool:  # noqa: A002
    """True when ``conv`` is depthwise, ``input`` a batched CPU float tensor, and nothing
    (string padding, non-zero padding modes, ``torch.compile``) asks for ``nn.Conv1d``'s path."""
    return (
        input.device.type == "cpu"
        and input.dtype in _CHANNELS_LAST_DTYPES
        and _depthwise_conv(conv, input)
        and not torch.compiler.is_compiling()
    )


def depthwise_conv1d(
    input: Tensor,  # noqa: A002 (F.conv1d's argument name)
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int = 1,
    padding: int = 0,
    dilation: int = 1,
) -> Tensor:
    """``F.conv1d(..., groups=channels)`` of ``[B, C, T]`` as oneDNN runs it fast on a CPU:
    in fp32, as a channels-last ``conv2d`` (see the module docstring).

    Returns the dtype ``F.conv1d`` would (autocast's where CPU autocast is on, else the
    input's) and a ``[B, C, T']`` tensor with time-major strides, so ``.transpose(1, 2)``
    of it is contiguous. A time-major input (``x.transpose(1, 2)`` of ``[B, T, C]``) needs
    no copy in fp32.
    """
    autocast = torch.is_autocast_enabled("cpu")
    out_dtype = torch.get_autocast_dtype("cpu") if autocast else input.dtype
    # Autocast off: under CPU autocast, the conv would cast the fp32 inputs straight back down.
    with torch.autocast("cpu", enabled=False):
        out = depthwise_conv1d_channels_last(
            input.float(),
            weight.float(),
            None if bias is None else bias.float(),
            stride,
            padding,
            dilation,
        )
    return out.to(out_dtype)


class Conv2d(_FP32ConvOnCPUFp16, nn.Conv2d):
    """``nn.Conv2d`` that computes in fp32 on a CPU under fp16 (see the module docstring)."""


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:  # noqa: A002 (F.dropout's argument name)
    """``F.dropout`` whose CPU mask is three times cheaper to draw (see the module docstring).

    On a CPU in training mode, every element is kept when its own 16 random bits (four
    elements per 64-bit draw of the default CPU generator, so seeding and
    ``torch.get_rng_state`` cover it as they cover ``F.dropout``) fall at or above
    ``round(p * 2**16)``, and kept values are scaled by ``2**16 / (2**16 - round(p * 2**16))``,
    the inverse of the keep probability actually used. Everywhere else (CUDA, eval,
    ``torch.compile``, ``p`` of 0, 1 or out of range, non-float input) it is ``F.dropout``.
    """
    levels = 1 << _MASK_BITS
    dropped_levels = round(p * levels) if 0.0 < p < 1.0 else 0
    if (
        not training
        or not 0 < dropped_levels < levels
        or input.device.type != "cpu"
        or not input.is_floating_point()
        or torch.compiler.is_compiling()
    ):
        return F.dropout(input, p, training, inplace)
    count = input.numel()
    words = torch.empty((count + 3) // 4, dtype=torch.int64).random_(_INT64_MIN, None)
    bits = words.view(torch.int16)[:count].view(input.shape)  # uniform over [-2**15, 2**15)
    keep = bits >= dropped_levels - levels // 2
    mask = keep.to(input.dtype).mul_(levels / (levels - dropped_levels))
    return input.mul_(mask) if inplace else input * mask


class Dropout(nn.Dropout):
    """``nn.Dropout`` with the cheaper CPU mask of ``dropout`` (no parameters, no state)."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 (nn.Dropout's argument name)
        """Dropout of ``input`` in training mode; ``input`` itself in eval mode."""
        return dropout(input, self.p, self.training, self.inplace)
