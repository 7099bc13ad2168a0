"""Find where code reads tensor values on the host -- on any device, the CPU included.

A training step captured as a CUDA graph (``trainer.graph_step``) must not read device
values on the host: ``.item()``, ``bool(tensor)``, ``.tolist()``, a boolean mask, an op
whose output size depends on values (``nonzero``, ``unique``) or PyTorch's CUDA CTC loss
(which copies the lengths to the host) each wait for the GPU, and a capture that meets one
fails with a CUDA error that does not say where. On a GPU,
``torch.cuda.set_sync_debug_mode`` finds them; :class:`HostReads` finds them on the CPU
too, by watching the ATen ops a piece of code dispatches, so that a CPU test can show a
step is capturable before any GPU is at hand, and name the line that is not.

Example::

    with HostReads() as reads:
        loss = model(batch).sum()
        print(loss.item())
    reads.found  # [HostRead(what='aten._local_scalar_dense ...', where='x.py:3 in <module>')]
"""

from __future__ import annotations

import os
import threading
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten

#: Ops that wait for their inputs' values on the host, with what they mean to a user.
HOST_READ_OPS: dict[Any, str] = {
    _aten._local_scalar_dense.default: (
        "reads a tensor's value on the host (.item(), float(), int(), bool(), `if tensor`)"
    ),
    _aten.equal.default: "compares tensors into a Python bool (torch.equal)",
    _aten.nonzero.default: "output size depends on the values (nonzero)",
    _aten.masked_select.default: "output size depends on the values (masked_select)",
    _aten._unique2.default: "output size depends on the values (unique)",
    _aten.unique_dim.default: "output size depends on the values (unique)",
    _aten.unique_consecutive.default: "output size depends on the values (unique_consecutive)",
    _aten.bincount.default: "output size depends on the values (bincount)",
    _aten._ctc_loss.default: "PyTorch's CTC loss reads the lengths on the host on CUDA",
    _aten._ctc_loss.Tensor: "PyTorch's CTC loss reads the lengths on the host on CUDA",
    _aten._cudnn_ctc_loss.default: "cuDNN's CTC loss reads the lengths on the host",
}

#: Ops that read values on the host only for some arguments: (op, test, meaning).
_BOOL_INDEX = "a boolean-mask index (its size depends on the values)"
_CONDITIONAL_OPS: list[tuple[Any, Callable[[tuple, dict], bool], str]] = [
    (
        _aten.repeat_interleave.Tensor,
        lambda args, kwargs: kwargs.get("output_size") is None,
        "repeat_interleave without output_size (its size depends on the values)",
    ),
]
for _op in (_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default):
    _CONDITIONAL_OPS.append(
        (
            _op,
            lambda args, kwargs: any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in (args[1] if len(args) > 1 else kwargs.get("indices", ()))
            ),
            _BOOL_INDEX,
        )
    )

_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)


class HostRead(NamedTuple):
    """One host read: what it was, and the innermost line of user code that made it."""

    what: str
    where: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def _user_frame() -> str:
    """The innermost stack frame outside torch and this module, as 'file:line in func'."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _THIS_FILE or path.startswith(_TORCH_DIR):
            continue
        return f"{os.path.relpath(path)}:{frame.lineno} in {frame.name}"
    return "<unknown>"


class HostReads(TorchDispatchMode):
    """Context manager that records every host read of tensor values inside it.

    ``found`` lists them (:class:`HostRead`), in order. Besides the ATen ops of
    :data:`HOST_READ_OPS` (and boolean-mask indexing, ``repeat_interleave`` without an
    output size), it sees ``Tensor.tolist()`` and ``Tensor.numpy()``, which read memory
    without dispatching an op -- in the thread that entered it only (a DataLoader's
    pin-memory thread is not the code under watch; nor, on CUDA, is a custom autograd
    Function's backward calling them from the autograd engine's thread). It does not see
    host-to-device copies of host data (``torch.tensor(..., device="cuda")``): on the CPU
    there is no device to copy to.

    ``torch.compile``d code runs eagerly inside it (``torch.compiler.set_stance
    ("force_eager")``), so the reads it sees are those of the eager code. Without the
    stance, TorchDynamo meets a frame under a dispatch mode, skips it, and never compiles
    that code again, in or out of the mode: one checked step left regionally compiled
    Conformer blocks eager for the rest of the run (the 2026-11-26 H200 captured 6,282
    eager kernels per Conformer-M step instead of the compiled ones).
    """

    _PATCHED = ("tolist", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[HostRead] = []
        self._saved: dict[str, Any] = {}
        self._thread = threading.get_ident()
        self._stance: Any = None

    def record(self, what: str) -> None:
        self.found.append(HostRead(what, _user_frame()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        what = HOST_READ_OPS.get(func)
        if what is None:
            for op, applies, meaning in _CONDITIONAL_OPS:
                if func is op and applies(args, kwargs):
                    what = meaning
                    break
        if what is not None:
            self.record(f"aten.{func.__name__}: {what}")
        return func(*args, **kwargs)

    def __enter__(self) -> HostReads:
        self._thread = threading.get_ident()
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        super().__enter__()
        for name in self._PATCHED:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            setattr(torch.Tensor, name, self._recording(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._restore()
            stance, self._stance = self._stance, None
            if stance is not None:
                stance.__exit__(*exc)

    def _restore(self) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _recording(self, name: str, original: Callable) -> Callable:
        def method(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.record(f"Tensor.{name}(): copies the values to the host")
            return original(tensor, *args, **kwargs)

        return method

    def report(self) -> str:
        """The reads, one per line with its place (the first of each place), or ''."""
        seen: dict[str, HostRead] = {}
        for read in self.found:
            seen.setdefault(f"{read.where}|{read.what}", read)
        return "\n".join(str(read) for read in seen.values())
