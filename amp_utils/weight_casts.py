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
        self.cast_uses: Counter[int] = Counter()  # parameter index -> uses of its casts
        # id of a cast's output -> parameter index; the outputs are kept alive for the pass
        self._cast_of: dict[int, int] = {}
        self._outputs: list[torch.Tensor] = []

    def __enter__(self) -> ParameterUses:
        # torch.compile'd code runs eagerly while observed: TorchDynamo skips a frame it
        # meets under a dispatch mode and never compiles that code again, so one observed
        # step left the compiled CTC update and compiled blocks eager for the whole run
        # (2026-11-27 H200: 0 compiled calls in a captured bf16 step, 245 without this mode).
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:  # noqa: ANN002
        try:
            super().__exit__(*exc)
        finally:
            self._stance.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        cast_of = self.record(func, args, kwargs)
        out = func(*args, **kwargs)
        if cast_of is not None:
            self._cast_of[id(out)] = cast_of
            self._outputs.append(out)
        return out

    def record(self, func, args, kwargs) -> int | None:  # noqa: ANN001
        """Note what ``func`` does to each watched parameter among ``args``, and each use of
        a parameter's cast (autocast's weight cache hands one cast to every use). Returns
        the parameter's index when ``func`` is a cast of one to ``dtype``."""
        cast_of = None
        for arg in args:
            if not isinstance(arg, torch.Tensor):
                continue
            if id(arg) in self._cast_of:
                self.cast_uses[self._cast_of[id(arg)]] += 1
            index = self._index.get(id(arg))
            if index is None:
                continue
            if self.is_cast_to_dtype(func, args, kwargs):
                self.casts[index] += 1
                cast_of = index
            else:
                self.other_uses[index] += 1
        return cast_of

    def is_cast_to_dtype(self, func, args, kwargs) -> bool:  # noqa: ANN001
        """A plain cast of one tensor to ``dtype`` (nothing else changed), as autocast's."""
        if func is not torch.ops.aten._to_copy.default or len(args) != 1:
            return False
        changed = {key for key, value in kwargs.items() if value is not None}
        return kwargs.get("dtype") == self.dtype and changed <= {"dtype", "non_blocking"}

    def qualifying(self) -> list[nn.Parameter]:
        """The parameters cast exactly once, whose cast has one use, and used for nothing
        else (contiguous ones).

        A weight used twice shows two casts without autocast's weight cache, and one cast
        used twice with it: either way it is left to autocast, so the same parameters
        qualify with the cache on or off, and casting them together gives autocast's values
        in both modes (the eager step and the graph-safe step).
        """
        return [
            p
            for i, p in enumerate(self.params)
            if self.casts[i] == 1
            and self.cast_uses[i] <= 1
            and self.other_uses[i] == 0
            and p.is_contiguous()
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
        # For the backward pass of the last forward that cast together: which views it
        # reached, and which parameters had a gradient before it (see settle_gradients).
        self._reached: set[int] | None = None
        self._had_grad: list[bool] = []

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
        every parameter (and of their casts) are recorded. A weight used twice is left to
        autocast, so the grouped casts match autocast's with and without its weight cache.
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
        self._track_reached(views)
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

    def _track_reached(self, views: list[torch.Tensor]) -> None:
        """Note which views the coming backward pass reaches (a hook on each)."""
        self._reached = None
        if not views or not views[0].requires_grad:
            return  # no backward pass follows (evaluation, no_grad)
        reached: set[int] = set()
        self._reached = reached
        self._had_grad = [p.grad is not None for p in self._cast or []]
        for i, view in enumerate(views):
            view.register_hook(lambda grad, i=i: reached.add(i))

    def settle_gradients(self) -> None:
        """After the backward pass: a qualifying parameter that this forward pass did not
        use gets back the gradient it had (None when it had none), not the zeros its slice
        of the flat cast's gradient holds.

        Under autocast's own casts an unused weight (an optional head, a dropped layer) has
        no gradient, so the optimizer leaves it and its moments alone; so it must be here.
        """
        reached, self._reached = self._reached, None
        if reached is None:
            return
        for i, (param, had) in enumerate(zip(self._cast or [], self._had_grad, strict=True)):
            if i not in reached and not had:
                param.grad = None

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
