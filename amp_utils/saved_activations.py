"""Activation memory: what autograd keeps for the backward pass, by dtype and by module.

Mixed precision saves memory only where the tensors autograd keeps for the backward pass
(inputs of matmuls, softmax outputs, dropout masks, ...) are in bf16/fp16. Ops that
autocast runs in fp32, modules a model keeps in fp32 on purpose and autocast's copies of
the weights keep bf16 from halving the activation memory; how much depends on the device
(autocast's op lists and the model's kernels differ between CPU and CUDA). ``SavedActivations``
counts every tensor autograd saves during a forward pass (``saved_tensors_hooks``), once
per storage, by dtype and by the innermost module running when it was saved;
``activation_memory`` measures one batch under fp32 and under the run's precision and
says which modules hold the fp32 bytes that remain.

Parameters are not counted (they are memory either way); autocast's low-precision copies
of them are, as they live until the backward pass.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from amp_utils.autocast import TorchAutocast
from amp_utils.rng_state import capture_rng_state, restore_rng_state

MB = 2**20
Measured = TypeVar("Measured")
OUTSIDE = "(outside modules: the loss)"
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """fp32/bf16/fp16 for the float types, else torch's name (``int64``, ``bool``)."""
    return _NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass
class SavedBytes:
    """Bytes saved for the backward pass: by dtype, and by module then dtype."""

    by_dtype: dict[str, int] = field(default_factory=dict)
    by_module: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """All bytes saved for the backward pass."""
        return sum(self.by_dtype.values())

    def add(self, module: str, dtype: str, nbytes: int) -> None:
        """Count ``nbytes`` of ``dtype`` saved while ``module`` ran."""
        self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + nbytes
        per_module = self.by_module.setdefault(module, {})
        per_module[dtype] = per_module.get(dtype, 0) + nbytes


class ModuleStack:
    """Which module's forward is running, innermost first, while the context is active.

    ``labels_and_modules`` gives each watched module its label (its name, its type...);
    :attr:`current` is the label of the innermost one running, or None outside them all.
    """

    def __init__(self, labels_and_modules: Iterable[tuple[str, nn.Module]]) -> None:
        self._modules = list(labels_and_modules)
        self._stack: list[str] = []
        self._handles: list[Any] = []

    @property
    def current(self) -> str | None:
        """The label of the innermost watched module running now."""
        return self._stack[-1] if self._stack else None

    def __enter__(self) -> ModuleStack:
        for label, module in self._modules:
            self._handles.append(module.register_forward_pre_hook(self._enter(label)))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def _enter(self, label: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._stack.append(label)

        return hook

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:
            self._stack.pop()


class SavedActivations:
    """Context counting the tensors autograd saves for backward while it is active.

    Each storage counts once (a tensor saved by several ops, or views of one tensor, is
    one allocation), under the innermost module of ``model`` whose forward was running
    (``""``: outside every submodule, e.g. the loss). Parameters are skipped.

    ``by_module=False`` counts by dtype only (everything under ``""``) and adds no module
    hooks: for ``torch.compile``d blocks, whose compiled graph keeps what the partitioner
    chose and runs as one autograd node. TorchDynamo traces the hooks and guards on each
    module's label, so with them every block of a regionally compiled model recompiled,
    and past ``recompile_limit`` ran eagerly: the count was no longer the compiled one.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> with SavedActivations(model) as saved:
        ...     loss = model(torch.randn(3, 4)).sum()
        >>> saved.result.by_dtype["fp32"] > 0
        True
    """

    def __init__(self, model: nn.Module, by_module: bool = True) -> None:
        self.model = model
        self.result = SavedBytes()
        watched = model.named_modules() if by_module else ()
        self._running = ModuleStack((name, m) for name, m in watched if name)
        self._seen: set[int] = set()
        self._params: set[int] = set()
        self._hooks: Any = None

    def __enter__(self) -> SavedActivations:
        self._params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        self._running.__enter__()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._running.__exit__(*exc)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout != torch.strided:  # sparse/nested: no plain storage to count
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params or key in self._seen or storage.nbytes() == 0:
            return tensor
        self._seen.add(key)
        module = self._running.current or ""
        self.result.add(module, dtype_name(tensor.dtype), storage.nbytes())
        return tensor


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def measure_saved(
    model: nn.Module,
    forward: Callable[[], Any],
    device_type: str,
    dtype: torch.dtype | None,
    by_module: bool = True,
) -> SavedBytes:
    """Run ``forward`` (with gradients, under autocast to ``dtype``; None: fp32) and count
    what it saves for the backward pass (per module unless ``by_module=False``, see
    :class:`SavedActivations`). The graph is dropped without a backward pass."""
    with SavedActivations(model, by_module) as saved, torch.enable_grad():
        # None is fp32 here; TorchAutocast(dtype=None) is autocast's default 16-bit dtype
        with TorchAutocast(device_type=device_type, dtype=dtype or torch.float32):
            output = forward()
        del output
    return saved.result


@dataclass
class ActivationMemory:
    """Saved-for-backward bytes of one batch under fp32 and under a run's precision."""

    precision: str
    fp32: SavedBytes
    low: SavedBytes
    #: what training holds in fp32 in every precision: parameters, gradients, optimizer state
    state_bytes: int = 0
    #: counted per module (eager); False: by dtype only (compiled regions, see SavedActivations)
    by_module: bool = True

    @property
    def ratio(self) -> float:
        """The run's precision's saved bytes over fp32's."""
        return self.low.total / self.fp32.total if self.fp32.total else float("nan")

    @property
    def peak_ratio(self) -> float:
        """Saved bytes plus ``state_bytes``, the run's precision over fp32: what peak
        memory compares, before the allocator's cache and the step's temporaries."""
        fp32 = self.fp32.total + self.state_bytes
        return (self.low.total + self.state_bytes) / fp32 if fp32 else float("nan")

    def fp32_holders(self, top: int = 8) -> list[tuple[str, int, int]]:
        """The modules keeping the most fp32 bytes under the run's precision, each at
        least 0.5 % of its total: (module, fp32 bytes, all its bytes under fp32), most first."""
        rows = [
            (name, counts.get("fp32", 0), self.fp32.by_module.get(name, {}).get("fp32", 0))
            for name, counts in self.low.by_module.items()
        ]
        rows = [row for row in rows if row[1] >= 0.005 * self.low.total]  # not the noise
        return sorted(rows, key=lambda row: -row[1])[:top]

    def by_module_type(self, model: nn.Module) -> dict[str, dict[str, int]]:
        """fp32 and run-precision bytes summed over modules of the same class."""
        classes = {name: type(module).__name__ for name, module in model.named_modules()}
        classes[""] = OUTSIDE
        summed: dict[str, dict[str, int]] = defaultdict(lambda: {"fp32": 0, "low": 0})
        for key, result in (("fp32", self.fp32), ("low", self.low)):
            for name, counts in result.by_module.items():
                summed[classes.get(name, OUTSIDE)][key] += sum(counts.values())
        return dict(summed)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready data: totals, the ratio, per dtype and per module."""
        return {
            "precision": self.precision,
            "ratio": self.ratio,
            "state_bytes": self.state_bytes,
            "peak_ratio": self.peak_ratio,
            "by_module": self.by_module,
            "fp32": {"by_dtype": self.fp32.by_dtype, "by_module": self.fp32.by_module},
            self.precision: {"by_dtype": self.low.by_dtype, "by_module": self.low.by_module},
        }

    def markdown(self, model: nn.Module) -> str:
        """The report: totals and ratio, bytes per dtype, per module type, fp32 holders."""
        name = self.precision
        by_size = sorted(self.low.by_dtype.items(), key=lambda kv: -kv[1])
        dtypes = ", ".join(f"{dtype} {nbytes / MB:.1f} MB" for dtype, nbytes in by_size)
        lines = [
            f"# Activation memory: {name} against fp32",
            "",
            "Bytes autograd keeps for the backward pass of one training batch (parameters "
            "excluded; autocast's copies of them included). Peak memory adds parameters, "
            "gradients, optimizer state and the allocator's cache to this.",
            "",
            f"- fp32: **{self.fp32.total / MB:.1f} MB**; {name}: **{self.low.total / MB:.1f}"
            f" MB**, **{self.ratio:.2f}×** fp32.",
            f"- {name} by dtype: {dtypes}",
            f"- With parameters, gradients and optimizer state ({self.state_bytes / MB:.1f} MB "
            f"in both): {name} **{self.peak_ratio:.2f}×** fp32, the ratio peak memory shows "
            "before the allocator's cache and the step's temporaries.",
            "",
        ]
        if not self.by_module:
            lines.append(
                "Counted by dtype only: a compiled region keeps what torch.compile's "
                "partitioner chose and runs as one autograd node, so no module is named."
            )
            return "\n".join(lines) + "\n"
        lines += [
            f"| module type | fp32 (MB) | {name} (MB) | ratio |",
            "|---|---|---|---|",
        ]
        types = sorted(self.by_module_type(model).items(), key=lambda kv: -kv[1]["fp32"])
        for module_type, sizes in types:
            ratio = sizes["low"] / sizes["fp32"] if sizes["fp32"] else float("nan")
            lines.append(
                f"| {module_type} | {sizes['fp32'] / MB:.2f} | {sizes['low'] / MB:.2f} "
                f"| {ratio:.2f} |"
            )
        holders = self.fp32_holders()
        if holders:
            lines += [
                "",
                f"Modules that still keep fp32 tensors under {name} (the innermost module "
                "running when autograd saved them): ops that autocast runs in fp32, or "
                "that the model keeps in fp32 on purpose.",
                "",
                f"| module | fp32 kept under {name} (MB) | all saved under fp32 (MB) |",
                "|---|---|---|",
            ]
            lines += [
                f"| `{module or OUTSIDE}` | {kept / MB:.2f} | {full / MB:.2f} |"
                for module, kept, full in holders
            ]
        return "\n".join(lines) + "\n"


def activation_memory(
    model: nn.Module,
    forward: Callable[[], Any],
    device_type: str,
    precision: str,
    dtype: torch.dtype | None,
    by_module: bool = True,
) -> ActivationMemory:
    """Saved-for-backward bytes of ``forward`` under fp32 and under ``dtype`` (same batch).

    ``forward`` should run the model and its loss as training does (train mode, so that
    dropout saves its masks). The generators are reset between the two passes, so both
    draw the same dropout masks. ``by_module=False`` for compiled models (see
    :class:`SavedActivations`).
    """
    fp32, low = fp32_and_precision(
        lambda autocast_dtype: measure_saved(
            model, forward, device_type, autocast_dtype, by_module
        ),
        dtype,
    )
    return ActivationMemory(precision, fp32, low, by_module=by_module)


def fp32_and_precision(
    measure: Callable[[torch.dtype | None], Measured], dtype: torch.dtype | None
) -> tuple[Measured, Measured]:
    """``measure(None)`` (fp32), then ``measure(dtype)``, with the generators reset between
    the two so that both passes draw the same dropout masks and random branches."""
    generators = capture_rng_state()
    fp32 = measure(None)
    restore_rng_state(generators)
    return fp32, measure(dtype)


def training_forward(brain: Any, batch: Any) -> Callable[[], torch.Tensor]:
    """A function that runs a Brain's training forward pass and loss on ``batch`` (moved
    to the Brain's device) and returns the loss: what the measurements here run."""
    from amp_utils.brain import Stage

    on_device = batch.to(brain.device) if hasattr(batch, "to") else batch

    def forward() -> torch.Tensor:
        predictions = brain.compute_forward(on_device, Stage.TRAIN)
        return brain.compute_objectives(predictions, on_device, Stage.TRAIN)

    return forward


def training_activation_memory(brain: Any, batch: Any, by_module: bool = True) -> ActivationMemory:
    """``activation_memory`` of a Brain's training forward and loss on ``batch``
    (``by_module=False`` once its modules are compiled)."""
    brain.modules.train()
    memory = activation_memory(
        brain.modules,
        training_forward(brain, batch),
        brain.device_type,
        brain.amp.name,
        brain.amp.dtype,
        by_module,
    )
    memory.state_bytes = training_state_bytes(brain.modules, brain.optimizers_dict.values())
    return memory


def training_state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of the trainable parameters, their gradients (one per parameter, as a step
    has them) and the optimizers' state tensors (AdamW: two moments per parameter)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    total = 2 * sum(p.nbytes for p in trainable)
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))
    return total
