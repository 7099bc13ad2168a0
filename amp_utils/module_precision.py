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
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from amp_utils.autocast import fwd_default_precision

#: Attribute set on a module whose forward runs in fp32 (applying twice wraps once).
FP32_MARK = "_runs_in_fp32"
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
