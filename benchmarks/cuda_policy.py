"""What a training step does on CUDA, emulated on a CPU: counts and dtype checks without a GPU.

Two parts, used by the CPU counts of ``benchmarks/activation_memory_cuda_policy.py`` and
``benchmarks/kernel_count_cuda_policy.py`` and by tests:

- ``cuda_kernel_choices()`` / ``use_cuda_kernel_choices()``: ``amp_utils.fast_kernels``
  computes as it does on CUDA (its CPU-only choices off: attention and depthwise
  convolutions in the autocast dtype, convolutions in fp16, CUDA's dropout with its
  one-byte bool mask), and ``amp_utils.module_precision`` takes autocast to compute
  LayerNorms in fp32 as CUDA's does (``precision.norm_saves_16bit``);
- ``cuda_fp32_ops()``: CUDA autocast's fp32 op lists under CPU autocast.

CPU and CUDA autocast keep different op lists. CUDA's runs reductions, softmaxes, norms,
``exp``/``log``/``pow`` and the losses in fp32 (its ``fp32`` and ``fp32_set_opt_dtype``
policies); CPU's runs most of them in the input's dtype. Code that relies on CPU's choice
(``x.sum(-1)`` of bf16 products returning bf16) passes every CPU test and breaks on the GPU:
the unfold depthwise convolution returned fp32 under CUDA's bf16 autocast, found only when a
lease ran the GPU test (fixed in d02f673).

``cuda_fp32_ops()`` is a ``TorchFunctionMode`` that, while CPU autocast runs in bf16/fp16,
computes the ops of CUDA's fp32 lists as CUDA does: floating inputs cast to fp32, autocast off
inside, fp32 out. Other ops and everything outside autocast are left alone. The lists are
those of PyTorch's ``aten/src/ATen/autocast_mode.cpp`` (CUDA, torch 2.11) for the functions
this project calls; an op missing here runs as CPU autocast runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

import amp_utils.fast_kernels as fast_kernels
import amp_utils.module_precision as module_precision

#: The module attributes that hold the CPU-only choices (``fast_kernels``') and the rule for
#: LayerNorms under autocast (``module_precision``'s), which the emulation replaces.
_CPU_CHOICES = (
    (fast_kernels, "_SLOW_ON_CPU"),
    (fast_kernels, "_depthwise_on_cpu"),
    (fast_kernels, "fp16_on_cpu"),
    (fast_kernels, "dropout"),
    (module_precision, "autocast_runs_norms_in_fp32"),
)


def cuda_dropout(
    input: torch.Tensor,  # noqa: A002 (F.dropout's argument name)
    p: float = 0.5,
    training: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """``F.dropout`` as it runs on CUDA: the fused ``native_dropout``, which keeps a
    one-byte bool mask for backward in every precision. On a CPU ``F.dropout`` multiplies by
    a mask in the input's dtype and keeps that (4 bytes an element in fp32, 2 in bf16): the
    counts of 2026-11-26 used it and so overstated what fp32 keeps, and bf16's saving."""
    if not training or p == 0.0:
        return input
    return torch.native_dropout(input, p, True)[0]


def use_cuda_kernel_choices() -> None:
    """Turn off ``fast_kernels``' CPU-only choices for the rest of the process (fp32
    attention and depthwise convolutions, fp32 convolutions under fp16, 16-bit dropout
    masks): the model then computes and saves what it does on CUDA."""
    fast_kernels._SLOW_ON_CPU = ()
    fast_kernels._depthwise_on_cpu = lambda conv, x: False
    fast_kernels.fp16_on_cpu = lambda x: False
    fast_kernels.dropout = cuda_dropout
    module_precision.autocast_runs_norms_in_fp32 = lambda device_type: True


@contextmanager
def cuda_kernel_choices() -> Iterator[None]:
    """:func:`use_cuda_kernel_choices` inside the block only (for tests)."""
    saved = [(module, name, getattr(module, name)) for module, name in _CPU_CHOICES]
    use_cuda_kernel_choices()
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


#: CUDA autocast's ``fp32`` and ``fp32_set_opt_dtype`` ops, by the Python functions that
#: reach them (a ``Tensor`` method and its ``torch.*`` twin are both listed).
CUDA_FP32_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.sum,
        torch.Tensor.sum,
        torch.prod,
        torch.Tensor.prod,
        torch.cumsum,
        torch.Tensor.cumsum,
        torch.cumprod,
        torch.Tensor.cumprod,
        torch.softmax,
        torch.Tensor.softmax,
        F.softmax,
        torch.log_softmax,
        torch.Tensor.log_softmax,
        F.log_softmax,
        torch.exp,
        torch.Tensor.exp,
        torch.expm1,
        torch.log,
        torch.Tensor.log,
        torch.log1p,
        torch.Tensor.log1p,
        torch.pow,
        torch.Tensor.pow,
        torch.rsqrt,
        torch.Tensor.rsqrt,
        torch.reciprocal,
        torch.Tensor.reciprocal,
        torch.logsumexp,
        torch.Tensor.logsumexp,
        torch.norm,
        torch.Tensor.norm,
        torch.linalg.vector_norm,
        torch.layer_norm,
        F.layer_norm,
        torch.group_norm,
        F.group_norm,
        F.softplus,
        F.mse_loss,
        F.l1_loss,
        F.smooth_l1_loss,
        F.nll_loss,
        F.kl_div,
        F.cosine_similarity,
        F.binary_cross_entropy_with_logits,
    }
)


def _low_precision_cpu_autocast() -> bool:
    """CPU autocast is on with a 16-bit dtype (fp32 autocast changes nothing)."""
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in (
        torch.bfloat16,
        torch.float16,
    )


def _to_fp32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


class cuda_fp32_ops(TorchFunctionMode):  # noqa: N801 (used as a context manager, like a function)
    """While active, CPU autocast computes CUDA autocast's fp32 ops in fp32 (see module doc).

    ``calls`` counts the calls it changed, so a test can check the emulation was reached;
    not those traced by ``torch.compile``: TorchDynamo guarded on the counter's value and
    recompiled at every call.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func not in CUDA_FP32_FUNCTIONS or not _low_precision_cpu_autocast():
            return func(*args, **kwargs)
        if kwargs.get("dtype") is not None:  # fp32_set_opt_dtype: an explicit dtype wins
            return func(*args, **kwargs)
        if not torch.compiler.is_compiling():  # compiled: a counter would be guarded on
            self.calls += 1
        with torch.autocast("cpu", enabled=False):
            return func(*tree_map(_to_fp32, args), **tree_map(_to_fp32, kwargs))
