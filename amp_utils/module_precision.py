"""Per-module precision from the config: ``precision.fp32_modules=[...]``.

``apply_fp32_modules`` makes the named modules run outside autocast with fp32 inputs, the
same effect as decorating their ``forward`` with ``fwd_default_precision``, without editing
the model's code. It replaces the forward of each module *instance* (an attribute, not a
parameter or buffer), so state dicts are unchanged: a checkpoint trained with the option
loads into a model without it and the other way round.

Module names are those of ``named_modules()``, prefixed by the module's key when several
modules are given as a mapping (``model.blocks.0.attention``). Patterns are shell-style
(``fnmatch``): ``*`` matches any characters, dots included, so ``model.blocks.*.attention``
names the attention of every block.

``apply_low_precision_norms`` goes the other way for LayerNorms: under autocast they take a
bf16/fp16 copy of their input (the kernel still accumulates its statistics in fp32), where
CUDA's autocast would run them in fp32 and keep an fp32 input for the backward pass.

``apply_norm_saves_16bit`` changes only what such a LayerNorm keeps: its forward pass stays
autocast's, bit for bit (fp32 math, fp32 output), but backward gets a bf16/fp16 copy of the
*normalized* input (and the fp32 inverse standard deviation) instead of the fp32 input.
Half the bytes, and the rounding touches the gradient only, relative to unit-variance values.
Compiled, it goes through one opaque operation (``layer_norm_keeping_16bit``): inductor would
otherwise fold its casts down and up into one fp32 cast and keep as much as autocast does.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from amp_utils.autocast import fwd_default_precision

#: Attribute set on a module whose forward runs in fp32 (applying twice wraps once).
FP32_MARK = "_runs_in_fp32"
#: Attribute set on a LayerNorm that runs in the autocast dtype (applying twice wraps once).
LOW_PRECISION_NORM_MARK = "_norm_in_autocast_dtype"
#: Attribute set on a LayerNorm that keeps a 16-bit normalized input (applying twice wraps once).
NORM_SAVES_16BIT_MARK = "_norm_saves_16bit"
#: Module names listed in the error for a pattern that matches nothing.
NAMES_SHOWN_IN_ERROR = 12


class UnknownModulePatternError(ValueError):
    """A ``precision.fp32_modules`` pattern matches no module of the model."""


def named_modules_of(
    modules: Mapping[str, nn.Module] | nn.Module,
) -> dict[str, nn.Module]:
    """Every module by its dotted name (``<key>.<path>`` for a mapping of modules)."""
    if isinstance(modules, nn.Module) and not isinstance(modules, nn.ModuleDict):
        return {name: module for name, module in modules.named_modules() if name}
    named = {}
    for key, root in modules.items():
        for name, module in root.named_modules():
            named[f"{key}.{name}" if name else key] = module
    return named


def names_near(names: list[str], pattern: str) -> list[str]:
    """The names most like ``pattern``: same first part and depth, else same first part."""
    first, depth = pattern.split(".")[0], pattern.count(".")
    same_root = [n for n in names if fnmatch.fnmatch(n.split(".")[0], first)] or names
    same_depth = [n for n in same_root if n.count(".") == depth]
    return same_depth or same_root


def match_module_patterns(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Names matching any of ``patterns`` (in ``names`` order).

    Raises:
        UnknownModulePatternError: for the first pattern that matches no name; the message
            lists some of the names.
    """
    names = list(names)
    matched: set[str] = set()
    for pattern in patterns:
        hits = fnmatch.filter(names, pattern)
        if not hits:
            nearby = names_near(names, pattern)
            shown = ", ".join(nearby[:NAMES_SHOWN_IN_ERROR])
            more = (
                f", ... ({len(nearby)} of {len(names)})"
                if len(nearby) > NAMES_SHOWN_IN_ERROR
                else ""
            )
            raise UnknownModulePatternError(
                f"precision.fp32_modules: pattern {pattern!r} matches no module; module "
                f"names are dotted paths such as: {shown}{more}."
            )
        matched.update(hits)
    return [name for name in names if name in matched]


def run_in_fp32(module: nn.Module) -> None:
    """Make ``module``'s forward run with autocast off and floating inputs cast to fp32.

    Outside autocast nothing changes. The wrapper is an instance attribute: it is not
    part of ``state_dict`` and applying it twice wraps once.
    """
    if getattr(module, FP32_MARK, False):
        return
    module.forward = fwd_default_precision(module.forward, cast_inputs=torch.float32)
    setattr(module, FP32_MARK, True)


def apply_fp32_modules(
    modules: Mapping[str, nn.Module] | nn.Module, patterns: Iterable[str] | str | None
) -> list[str]:
    """Run the modules whose names match ``patterns`` in fp32, even under autocast.

    Args:
        modules: one module (names as in its ``named_modules()``) or a mapping of them
            (names prefixed by the key: ``model.encoder``), e.g. a Brain's modules.
        patterns: ``fnmatch`` patterns of module names (``model.blocks.*.attention``);
            one string is one pattern; ``None`` or empty: nothing changes.

    Returns:
        The names of the modules now pinned to fp32 (every match; a module inside a
        matched one runs in fp32 too, as it is called under autocast's disabled context).

    Raises:
        UnknownModulePatternError: a pattern matches no module (the message lists names).
    """
    patterns = [patterns] if isinstance(patterns, str) else list(patterns or ())
    if not patterns:
        return []
    named = named_modules_of(modules)
    matched = match_module_patterns(named, patterns)
    for name in matched:
        run_in_fp32(named[name])
    return matched


def autocast_dtype_for(tensor: torch.Tensor) -> torch.dtype | None:
    """The low-precision dtype autocast computes in on ``tensor``'s device; None when
    autocast is off there (or set to fp32)."""
    device_type = tensor.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    return None if dtype == torch.float32 else dtype


def run_norm_in_autocast_dtype(norm: nn.LayerNorm) -> None:
    """Make ``norm`` normalize a copy of its input in autocast's dtype (bf16/fp16) with its
    weight and bias in that dtype, autocast off inside. The output is in that dtype, and
    what the backward pass keeps is half the size of fp32's. Outside autocast nothing
    changes; the state dict neither (an instance attribute, applied once)."""
    if getattr(norm, LOW_PRECISION_NORM_MARK, False):
        return
    full_precision = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype_for(x)
        if dtype is None or not x.is_floating_point():
            return full_precision(x)
        weight = None if norm.weight is None else norm.weight.to(dtype)
        bias = None if norm.bias is None else norm.bias.to(dtype)
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x.to(dtype), norm.normalized_shape, weight, bias, norm.eps)

    norm.forward = forward
    setattr(norm, LOW_PRECISION_NORM_MARK, True)


def autocast_runs_norms_in_fp32(device_type: str) -> bool:
    """Whether autocast on ``device_type`` computes ``layer_norm`` in fp32 whatever its
    input's dtype: CUDA's does (its fp32 op list); the CPU's computes in the input's dtype.
    ``benchmarks/cuda_policy.py`` replaces it to count CUDA's choices on a CPU."""
    return device_type == "cuda"


def _layer_norm_and_16bit_copy(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_shape: list[int],
    eps: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``native_layer_norm`` of fp32 ``x`` (output, fp32) with the normalized input in
    ``dtype`` and the inverse standard deviation: what :class:`_LayerNormSaving16Bit` keeps.
    Registered below as one operation that ``torch.compile`` cannot see into.

    Under ``torch.compile`` the plain autograd function kept nothing less: inductor's joint
    graph folds the cast to 16 bits and the backward pass's cast back into one fp32 cast
    (``pointless_convert``), and its partitioner then kept fp32 values, the same bytes as
    autocast's LayerNorm (``benchmarks/activation_memory_cuda_policy.py --compiled``). The
    outputs of an opaque operation are kept as they are. The forward computes what eager
    computes, with the same kernel."""
    out, _, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
    # The normalized input by the same kernel without weight and bias: one operation and
    # one fp32 temporary, where (x - mean) * rstd took two of each.
    x_hat = torch.native_layer_norm(x, normalized_shape, None, None, eps)[0]
    return out, x_hat.to(dtype), rstd


#: :func:`_layer_norm_and_16bit_copy` as one operation:
#: ``torch.ops.amp_utils.layer_norm_keeping_16bit``.
layer_norm_keeping_16bit = torch.library.custom_op(
    "amp_utils::layer_norm_keeping_16bit", mutates_args=()
)(_layer_norm_and_16bit_copy)


@layer_norm_keeping_16bit.register_fake
def _layer_norm_keeping_16bit_shapes(x, weight, bias, normalized_shape, eps, dtype) -> tuple:
    """The outputs' shapes and dtypes (what ``torch.compile`` traces with)."""
    kept = x.dim() - len(normalized_shape)  # statistics: one per leading index, dims kept
    stats = x.new_empty((*x.shape[:kept], *([1] * len(normalized_shape))))
    # native_layer_norm's outputs are contiguous whatever x's strides (a transposed input)
    return x.new_empty(x.shape), x.new_empty(x.shape, dtype=dtype), stats


class _LayerNormSaving16Bit(torch.autograd.Function):
    """``F.layer_norm`` in fp32 that keeps ``(x - mean) * rstd`` in 16 bits for backward.

    The backward pass is aten's LayerNorm backward on the normalized input with mean 0 and
    inverse standard deviation 1, scaled by the kept ``rstd``: the same formula as from the
    fp32 input (``dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))``, ``g = dy * weight``),
    with ``x_hat`` rounded to ``dtype``.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        normalized_shape: tuple[int, ...],
        eps: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        # compiled: one opaque operation (see its docstring); eager: the same kernels
        # without the custom operation's dispatch
        compute = (
            torch.ops.amp_utils.layer_norm_keeping_16bit
            if torch.compiler.is_compiling()
            else _layer_norm_and_16bit_copy
        )
        out, x_hat, rstd = compute(x.float(), weight, bias, list(normalized_shape), eps, dtype)
        ctx.save_for_backward(x_hat, rstd, weight, bias)
        ctx.normalized_shape, ctx.input_dtype = normalized_shape, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, rstd, weight, bias = ctx.saved_tensors
        needs = ctx.needs_input_grad
        mask = [needs[0], weight is not None and needs[1], bias is not None and needs[2]]
        dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
            grad_out.float(),
            x_hat.float(),
            list(ctx.normalized_shape),
            torch.zeros_like(rstd),
            torch.ones_like(rstd),
            weight,
            bias,
            mask,
        )
        if dx is not None:
            dx = dx.mul_(rstd).to(ctx.input_dtype)  # dx is this function's own: in place
        return dx, dweight, dbias, None, None, None


def run_norm_saving_16bit(norm: nn.LayerNorm) -> None:
    """Make ``norm`` keep a 16-bit copy of its normalized input for backward where autocast
    runs it in fp32 (CUDA, or an fp32 input on a CPU): the output is autocast's, bit for bit,
    and the backward pass keeps half the bytes. No autocast, no gradients, or a LayerNorm
    autocast already runs in 16 bits: the usual forward. Compiled (``torch.compile``), an
    fp32 input goes through the opaque ``layer_norm_keeping_16bit`` and a 16-bit one runs as
    autocast runs it, whose input the partitioner keeps. The state dict is unchanged (an
    instance attribute, applied once)."""
    if getattr(norm, NORM_SAVES_16BIT_MARK, False):
        return
    usual = norm.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype_for(x)
        if dtype is None or not x.is_floating_point() or not torch.is_grad_enabled():
            return usual(x)
        if x.dtype != torch.float32 and not autocast_runs_norms_in_fp32(x.device.type):
            return usual(x)  # autocast computes it in x's 16 bits and keeps x: nothing to gain
        if x.dtype != torch.float32 and torch.compiler.is_compiling():
            # Autocast's fp32 LayerNorm as it is: compiled, the partitioner keeps the 16-bit
            # input and recomputes the rest from it, where the opaque operation below would
            # keep its fp32 output too (the SiLU input of the Conformer's conv module).
            with torch.autocast(x.device.type, enabled=False):
                return F.layer_norm(
                    x.float(), norm.normalized_shape, norm.weight, norm.bias, norm.eps
                )
        with torch.autocast(x.device.type, enabled=False):
            return _LayerNormSaving16Bit.apply(
                x, norm.weight, norm.bias, tuple(norm.normalized_shape), norm.eps, dtype
            )

    norm.forward = forward
    setattr(norm, NORM_SAVES_16BIT_MARK, True)


def _unpinned_layer_norms(modules: Mapping[str, nn.Module] | nn.Module) -> dict[str, nn.LayerNorm]:
    """The ``nn.LayerNorm``s of ``modules`` by name, except those inside a module pinned to
    fp32 by ``precision.fp32_modules`` (apply that first)."""
    named = named_modules_of(modules)
    return {
        name: module
        for name, module in named.items()
        if isinstance(module, nn.LayerNorm)
        and not any(
            getattr(named[prefix], FP32_MARK, False)
            for prefix in _prefixes(name)
            if prefix in named
        )
    }


def apply_low_precision_norms(modules: Mapping[str, nn.Module] | nn.Module) -> list[str]:
    """Run every ``nn.LayerNorm`` of ``modules`` in the autocast dtype (see
    :func:`run_norm_in_autocast_dtype`), except those pinned to fp32 by
    ``precision.fp32_modules`` (apply that first). Returns their names."""
    norms = _unpinned_layer_norms(modules)
    for norm in norms.values():
        run_norm_in_autocast_dtype(norm)
    return list(norms)


def apply_norm_saves_16bit(modules: Mapping[str, nn.Module] | nn.Module) -> list[str]:
    """Have every ``nn.LayerNorm`` of ``modules`` keep a 16-bit normalized input for
    backward (see :func:`run_norm_saving_16bit`), except those pinned to fp32 by
    ``precision.fp32_modules`` (apply that first). Returns their names."""
    norms = _unpinned_layer_norms(modules)
    for norm in norms.values():
        run_norm_saving_16bit(norm)
    return list(norms)


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``: the module and the modules that contain it."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
