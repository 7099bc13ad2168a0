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
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from amp_utils.autocast import fwd_default_precision

#: Attribute set on a module whose forward runs in fp32 (applying twice wraps once).
FP32_MARK = "_runs_in_fp32"
#: Attribute set on a LayerNorm that runs in the autocast dtype (applying twice wraps once).
LOW_PRECISION_NORM_MARK = "_norm_in_autocast_dtype"
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


def apply_low_precision_norms(modules: Mapping[str, nn.Module] | nn.Module) -> list[str]:
    """Run every ``nn.LayerNorm`` of ``modules`` in the autocast dtype (see
    :func:`run_norm_in_autocast_dtype`), except those pinned to fp32 by
    ``precision.fp32_modules`` (apply that first). Returns their names."""
    named = named_modules_of(modules)
    changed = []
    for name, module in named.items():
        pinned = any(
            getattr(named[prefix], FP32_MARK, False)
            for prefix in _prefixes(name)
            if prefix in named
        )
        if isinstance(module, nn.LayerNorm) and not pinned:
            run_norm_in_autocast_dtype(module)
            changed.append(name)
    return changed


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``[a, a.b, a.b.c]``: the module and the modules that contain it."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]
