"""Operations of one training step, fp32 against bf16/fp16: why mixed precision runs more.

A GPU runs about one kernel per aten operation, and a small model's step takes time in
proportion to its kernels, even replayed from a CUDA graph. Autocast adds operations that
fp32 does not run: casts. It casts each weight where it is used and its gradient back, and it
casts activations between the ops it runs in 16 bits and those it keeps in fp32 (on CUDA,
LayerNorm: its input up, then the next linear layer's input down, and the same for their
gradients). So a bf16 step can run half as many operations again as fp32, and be no faster.

``step_operations`` counts the aten operations (views excluded) of one forward and backward
pass under fp32 and under the run's precision, and sorts the casts:

- **weights**: casts of a parameter in the forward pass, and how many of those parameters
  qualify for ``precision.fused_weight_casts`` (their only use is that cast, see
  :mod:`amp_utils.weight_casts`);
- **activations**: other casts in the forward pass, by the type of the innermost module
  that made them (``LayerNorm`` and ``Linear`` point at CUDA's fp32 LayerNorms, which
  ``precision.low_precision_norms`` removes);
- **backward**: casts in the backward pass (mostly each forward cast's gradient).

``recipes/diagnose.py`` writes the result as ``step_operations.md``/``.json``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from amp_utils.autocast import TorchAutocast
from amp_utils.saved_activations import (
    OUTSIDE,
    ModuleStack,
    fp32_and_precision,
    training_forward,
)
from amp_utils.weight_casts import ParameterUses

#: Operations that make no kernel, besides views (``detach`` is one): a view that is not
#: marked as one.
_NO_KERNEL = frozenset({"_unsafe_view"})


def is_operation(func: torch._ops.OpOverload) -> bool:
    """Whether an aten call counts as an operation here: it makes a kernel (not a view)."""
    return not func.is_view and func.overloadpacket.__name__ not in _NO_KERNEL


@dataclass
class StepOperations:
    """Operations of one forward and backward pass under one precision."""

    total: int = 0
    weight_casts: int = 0  # forward casts of parameters
    fusable_weights: int = 0  # parameters whose only forward use is one cast
    activation_casts: dict[str, int] = field(default_factory=dict)  # module type -> casts
    backward_casts: int = 0

    @property
    def casts(self) -> int:
        """Every cast between floating dtypes, forward and backward."""
        return self.weight_casts + sum(self.activation_casts.values()) + self.backward_casts


class _OperationCount(ParameterUses):
    """Counts operations and sorts the casts while a forward (then backward) pass runs."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, dtype)
        self._all_params = {id(p) for p in model.parameters()}  # frozen ones too
        self.result = StepOperations()
        self.backward = False  # set for the backward pass
        self._running = ModuleStack((type(m).__name__, m) for m in model.modules())

    def __enter__(self) -> _OperationCount:
        self._running.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._running.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if is_operation(func):
            self.result.total += 1
            if _is_float_cast(func, args, kwargs):
                self._sort_cast(args[0])
        if not self.backward:
            self.record(func, args, kwargs)
        return func(*args, **kwargs)

    def _sort_cast(self, tensor: torch.Tensor) -> None:
        if self.backward:
            self.result.backward_casts += 1
        elif id(tensor) in self._all_params:
            self.result.weight_casts += 1
        else:
            kind = self._running.current or OUTSIDE
            casts = self.result.activation_casts
            casts[kind] = casts.get(kind, 0) + 1


def _is_float_cast(func, args, kwargs) -> bool:  # noqa: ANN001
    """A ``_to_copy`` from one floating dtype to another."""
    if func is not torch.ops.aten._to_copy.default or not args:
        return False
    source, target = args[0].dtype, kwargs.get("dtype")
    return (
        source.is_floating_point
        and target is not None
        and target.is_floating_point
        and (target != source)
    )


def count_step_operations(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    device_type: str,
    dtype: torch.dtype | None,
) -> StepOperations:
    """Operations of ``forward()`` (which returns the loss) and its backward pass.

    Autocast runs without its weight cache, as a captured step does, so a weight used
    twice shows two casts. The parameters' gradients are left as they were.
    """
    grads = {p: p.grad for p in model.parameters()}
    for p in grads:
        p.grad = None
    dtype = dtype or torch.float32  # TorchAutocast(dtype=None): autocast's default dtype
    counter = _OperationCount(model, dtype)
    try:
        with counter:
            with TorchAutocast(device_type=device_type, dtype=dtype, cache_enabled=False):
                loss = forward()
            counter.backward = True
            loss.backward()
    finally:
        for p, grad in grads.items():
            p.grad = grad
    counter.result.fusable_weights = len(counter.qualifying()) if dtype else 0
    return counter.result


@dataclass
class StepOperationsReport:
    """One step's operations under fp32 and under the run's precision."""

    precision: str
    fp32: StepOperations
    low: StepOperations
    fused_weight_casts: bool  # whether the run casts the qualifying weights together

    @property
    def ratio(self) -> float:
        """The precision's operations over fp32's."""
        return self.low.total / max(self.fp32.total, 1)

    @property
    def fused_total(self) -> int:
        """The precision's operations with the qualifying weights cast together: two
        casts per such weight become a concatenation and a cast each way."""
        return self.low.total - 2 * self.low.fusable_weights + 4 * bool(self.low.fusable_weights)

    def to_json(self) -> dict[str, Any]:
        """The counts, as ``step_operations.json`` stores them."""

        def counts(ops: StepOperations) -> dict[str, Any]:
            return {
                "total": ops.total,
                "casts": ops.casts,
                "weight_casts": ops.weight_casts,
                "fusable_weights": ops.fusable_weights,
                "activation_casts": dict(ops.activation_casts),
                "backward_casts": ops.backward_casts,
            }

        return {
            "precision": self.precision,
            "fp32": counts(self.fp32),
            self.precision: counts(self.low),
            "ratio": round(self.ratio, 3),
            "with_fused_weight_casts": self.fused_total,
            "fused_weight_casts": self.fused_weight_casts,
        }

    def markdown(self) -> str:
        """``step_operations.md``: the table, the casts by module type, and what to do."""
        low, fp32, name = self.low, self.fp32, self.precision
        activations = sum(low.activation_casts.values())
        lines = [
            f"# Operations of one training step: fp32 and {name}",
            "",
            "One forward and backward pass of one training batch, counted as aten operations",
            "(views excluded; a GPU runs about one kernel per operation, and a small model's",
            "step takes time in proportion to its kernels, replayed from a CUDA graph or not).",
            "",
            f"| | fp32 | {name} |",
            "|---|---:|---:|",
            f"| operations | {fp32.total} | {low.total} ({self.ratio:.2f}x) |",
            f"| casts between float types | {fp32.casts} | {low.casts} |",
            f"| - of weights, forward | {fp32.weight_casts} | {low.weight_casts} |",
            f"| - of activations, forward | {sum(fp32.activation_casts.values())} "
            f"| {activations} |",
            f"| - backward | {fp32.backward_casts} | {low.backward_casts} |",
            "",
        ]
        if low.activation_casts:
            ranked = sorted(low.activation_casts.items(), key=lambda kv: -kv[1])
            lines += [
                f"Activation casts under {name}, by the module type that made them: "
                + ", ".join(f"{kind} {count}" for kind, count in ranked)
                + ".",
                "",
            ]
        if low.fusable_weights:
            state = "on in this run" if self.fused_weight_casts else "off in this run"
            lines.append(
                f"- {low.fusable_weights} parameters are only cast by the forward pass: "
                f"`precision.fused_weight_casts` ({state}) casts them together, once per step "
                f"with a concatenation and a cast each way: {self.fused_total} operations, "
                f"{self.fused_total / max(fp32.total, 1):.2f}x fp32's."
            )
        norm_casts = low.activation_casts.get("LayerNorm", 0)
        if norm_casts:
            lines.append(
                f"- {norm_casts} activation casts are made by LayerNorms that run in fp32 "
                "under this device's autocast (each also makes the next layer cast its "
                "output back): `precision.low_precision_norms=true` normalizes a "
                f"{name} copy instead (fp32 statistics inside the kernel), which removes "
                "these casts and halves what the LayerNorms keep for the backward pass."
            )
        return "\n".join(lines) + "\n"


def step_operations(
    model: nn.Module,
    forward: Callable[[], torch.Tensor],
    device_type: str,
    precision: str,
    dtype: torch.dtype | None,
    fused_weight_casts: bool = True,
) -> StepOperationsReport:
    """``count_step_operations`` under fp32 and under ``dtype`` (same dropout masks)."""
    fp32, low = fp32_and_precision(
        lambda autocast_dtype: count_step_operations(model, forward, device_type, autocast_dtype),
        dtype,
    )
    return StepOperationsReport(precision, fp32, low, fused_weight_casts)


def training_step_operations(
    brain: Any, batch: Any, fused_weight_casts: bool | None = None
) -> StepOperationsReport:
    """``step_operations`` of a Brain's training forward, loss and backward on ``batch``.

    Args:
        brain: the Brain whose training step is counted.
        batch: one training batch.
        fused_weight_casts: whether the steps described cast the qualifying weights
            together, for the report's "on/off in this run"; None: whether training with
            ``brain``'s options would (``Brain.fuses_weight_casts``).
    """
    if fused_weight_casts is None:
        fused_weight_casts = brain.fuses_weight_casts()
    brain.modules.train()
    return step_operations(
        brain.modules,
        training_forward(brain, batch),
        brain.device_type,
        brain.amp.name,
        brain.amp.dtype,
        fused_weight_casts,
    )
