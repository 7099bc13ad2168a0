"""Autocast's weight casts, made once per step in a few kernels: :class:`WeightCasts`.

Under autocast every ``nn.Linear``/``nn.Conv`` weight and bias is cast to bf16/fp16 where it
is used: one small cast kernel per weight in the forward pass, and one more in the backward
pass that casts its gradient back to fp32. The default Conformer has 77 such parameters, so
a bf16 step runs 154 cast kernels that fp32 does not (of 704 operations in all). On a GPU a
small model's step time follows its kernel count, even inside a CUDA graph.

``WeightCasts`` makes the same casts in one go: it concatenates the parameters, casts the
flat copy once, and lets the modules use views of it for the forward pass. Autograd then
sums nothing and casts nothing per weight: the backward pass concatenates the gradients of
the views and casts them back to fp32 in one kernel, and each parameter's fp32 gradient is
a slice of that. The values are bit for bit those of autocast's own casts (a cast is a cast:
round to nearest even, element by element).

Which parameters qualify is *observed*, not guessed: the first forward pass runs under a
dispatch mode that records every operation a parameter enters. A parameter qualifies when
the only thing the forward pass does with it is one cast to the autocast dtype -- exactly
what autocast does to the weight of a linear layer or a convolution. LayerNorm weights (run
in fp32 by CUDA's autocast), BatchNorm parameters, modules pinned to fp32, weights used
twice or reshaped before use keep autocast's own handling.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)


class ParameterUses(TorchDispatchMode):
    """Records, for each watched parameter, the operations a forward pass applies to it.

    :meth:`qualifying` then names the parameters whose only use was one cast to ``dtype``:
    those :class:`WeightCasts` casts together.
    """

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self.casts: Counter[int] = Counter()  # parameter index -> casts to ``dtype``
        self.other_uses: Counter[int] = Counter()  # parameter index -> any other operation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        self.record(func, args, kwargs)
        return func(*args, **kwargs)

    def record(self, func, args, kwargs) -> None:  # noqa: ANN001
        """Note what ``func`` does to each watched parameter among ``args``."""
        for arg in args:
            index = self._index.get(id(arg)) if isinstance(arg, torch.Tensor) else None
            if index is None:
                continue
            if self.is_cast_to_dtype(func, args, kwargs):
                self.casts[index] += 1
            else:
                self.other_uses[index] += 1

    def is_cast_to_dtype(self, func, args, kwargs) -> bool:  # noqa: ANN001
        """A plain cast of one tensor to ``dtype`` (nothing else changed), as autocast's."""
        if func is not torch.ops.aten._to_copy.default or len(args) != 1:
            return False
        changed = {key for key, value in kwargs.items() if value is not None}
        return kwargs.get("dtype") == self.dtype and changed <= {"dtype", "non_blocking"}

    def qualifying(self) -> list[nn.Parameter]:
        """The parameters cast exactly once and used for nothing else (contiguous ones)."""
        return [
            p
            for i, p in enumerate(self.params)
            if self.casts[i] == 1 and self.other_uses[i] == 0 and p.is_contiguous()
        ]


class WeightCasts:
    """Cast the weights that autocast casts, once per step and in one kernel each way.

    Use :meth:`during_forward` around the forward pass (and the loss), inside autocast. The
    first call observes which parameters qualify (see the module docstring); later calls
    swap a low-precision view in for each of them while the forward pass runs. Backward
    runs after the ``with`` block, as usual.

    Args:
        modules: the modules whose parameters may be cast (a mapping, e.g. ``Brain.modules``).
        dtype: the autocast dtype (``torch.bfloat16`` or ``torch.float16``).
    """

    def __init__(self, modules: Mapping[str, nn.Module] | nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        roots = [modules] if isinstance(modules, nn.Module) else list(modules.values())
        # Every (module, name) slot of each parameter: a tied weight is swapped everywhere.
        self._slots: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
        self._candidates: list[nn.Parameter] = []
        for root in roots:
            for module in root.modules():
                for name, param in module._parameters.items():
                    if param is None or not param.requires_grad:
                        continue
                    if id(param) not in self._slots:
                        self._candidates.append(param)
                    self._slots[id(param)].append((module, name))
        self._cast: list[nn.Parameter] | None = None  # None until observed

    @property
    def observed(self) -> bool:
        """Whether the parameters that qualify are known (after the first forward pass)."""
        return self._cast is not None

    @property
    def parameters(self) -> list[nn.Parameter]:
        """The parameters cast together (empty before the first forward pass)."""
        return list(self._cast or [])

    @contextmanager
    def during_forward(self) -> Iterator[None]:
        """Run the forward pass with the qualifying weights cast together.

        The first time, the forward pass runs as usual under autocast while the uses of
        every parameter are recorded. Call it with autocast's weight cache off on that
        first pass (``torch.autocast(..., cache_enabled=False)``): a weight used twice then
        shows two casts and is left to autocast, so the grouped casts match autocast's
        with and without its cache.
        """
        if self._cast is None:
            with ParameterUses(self._candidates, self.dtype) as uses:
                yield
            self._cast = uses.qualifying()
            logger.info(
                "Autocast weight casts: %d of %d parameters are cast to %s together, once "
                "per step (the others are not only cast by the forward pass).",
                len(self._cast),
                len(self._candidates),
                self.dtype,
            )
            return
        if not self._cast:
            yield
            return
        views = self.cast_together()
        saved = []
        try:
            for param, view in zip(self._cast, views, strict=True):
                for module, name in self._slots[id(param)]:
                    saved.append((module, name, module._parameters[name]))
                    module._parameters[name] = view  # type: ignore[assignment]
            yield
        finally:
            for module, name, param in saved:
                module._parameters[name] = param

    def cast_together(self) -> list[torch.Tensor]:
        """Low-precision copies of the qualifying parameters, views of one flat tensor.

        Forward: one concatenation and one cast. Backward: one concatenation of the views'
        gradients and one cast back to fp32, whose slices become the parameters' gradients.
        """
        params = self._cast or []
        if not params:
            return []
        flat = torch.cat([p.reshape(-1) for p in params]).to(self.dtype)
        pieces = flat.split([p.numel() for p in params])
        return [piece.view(p.shape) for piece, p in zip(pieces, params, strict=True)]
