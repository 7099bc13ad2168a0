"""Autocast helpers with the API and behaviour of SpeechBrain's ``speechbrain.utils.autocast``.

``AMPConfig`` maps a precision name to a dtype, ``TorchAutocast`` is ``torch.autocast`` that
is a true no-op for fp32, and ``fwd_default_precision`` pins a module's forward to a safe
precision (fp32 by default) even when the caller runs under autocast; as SpeechBrain's (1.1),
the decorator uses ``torch.amp.custom_fwd`` with the device type of the first tensor input,
so it works for CPU autocast as well as CUDA autocast.

Where these differ from SpeechBrain's, on purpose (``tests/test_speechbrain_parity.py``
compares the rest):

* ``fwd_default_precision``: a call with keyword arguments only, or with a number or list
  first, works (SpeechBrain's fails inside ``custom_fwd``, even outside autocast), and on a
  device without autocast (``meta``) the function runs untouched (SpeechBrain's raises);
  the wrapper carries ``cast_inputs`` for tools that ask what it does.
* ``AMPConfig.from_name``'s error quotes the name (``('fp8')``); ``AMPConfig.name`` is extra.
* ``TorchAutocast``'s error on entering autocast also says the original error; its
  ``enabled`` attribute is extra.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

#: The one table from precision name to dtype.
PRECISIONS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@dataclass
class AMPConfig:
    """Mixed-precision setting of a run: the dtype that autocast computes in."""

    dtype: torch.dtype

    @classmethod
    def from_name(cls, name: str | None) -> AMPConfig:
        """Build from ``"fp32"``, ``"fp16"``, ``"bf16"`` (``None`` means fp32).

        Raises:
            ValueError: for any other name; the message lists the valid ones.
        """
        if name is None:
            return cls(torch.float32)
        if isinstance(name, str) and name in PRECISIONS:
            return cls(PRECISIONS[name])
        raise ValueError(
            f"Specified autocast mode ({name!r}) incorrect, expected one of `fp32`, `fp16`, `bf16`."
        )

    @property
    def name(self) -> str:
        """The short name (``fp32``/``fp16``/``bf16``) of this config's dtype."""
        for key, dtype in PRECISIONS.items():
            if dtype == self.dtype:
                return key
        raise ValueError(f"No precision name for dtype {self.dtype}")


class TorchAutocast:
    """``torch.autocast`` that does nothing at all for float32.

    All arguments are forwarded to ``torch.autocast``. Without a ``dtype`` keyword it is
    the float32 no-op; ``dtype=None`` is ``torch.autocast``'s own meaning, the device's
    default autocast dtype (bf16 on a CPU, fp16 on CUDA), as in SpeechBrain. Errors raised
    when entering autocast (e.g. a dtype the device does not support) are re-raised with
    the dtype and the device in the message, chained to the original error.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.enabled = kwargs.get("dtype", torch.float32) != torch.float32
        self.context = torch.autocast(*args, **kwargs) if self.enabled else nullcontext()

    def __enter__(self) -> Any:
        try:
            return self.context.__enter__()
        except RuntimeError as err:
            device = getattr(self.context, "device", "?")
            dtype = getattr(self.context, "fast_dtype", "?")
            raise RuntimeError(
                f"Error during autocasting with dtype={dtype} on device={device}: {err}"
            ) from err

    def __exit__(self, *exc: Any) -> Any:
        return self.context.__exit__(*exc)


#: Device types whose autocast is built into every torch: no need to ask torch at run time.
_BUILTIN_AUTOCAST = frozenset({"cpu", "cuda"})


def _autocast_available(device_type: str) -> bool:
    """Whether autocast exists for ``device_type``. CPU and CUDA are answered here, without
    ``torch.amp.is_autocast_available``: TorchDynamo cannot trace that function (torch
    2.11), and a decorated forward inside a compiled region broke its graph there."""
    return device_type in _BUILTIN_AUTOCAST or torch.amp.is_autocast_available(device_type)


def _first_tensor_device_type(args: tuple, kwargs: dict) -> str:
    """Device type (``"cuda"``, ``"cpu"``, ...) of the first tensor argument."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type
    return "cpu"


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    """``value`` with its floating-point tensors (in tuples, lists, dicts) cast to ``dtype``,
    as ``torch.amp.custom_fwd`` casts its inputs."""
    return torch.amp.autocast_mode._cast(value, device_type, dtype)


def fwd_default_precision(
    fwd: Callable | None = None,
    cast_inputs: torch.dtype | None = torch.float32,
) -> Callable:
    """Decorator for forward methods that must not run in reduced precision.

    Under autocast, the wrapped forward runs with autocast disabled and its floating-point
    tensor inputs cast to ``cast_inputs`` (e.g. feature extraction, CTC loss, softmax over
    a large vocabulary). Outside autocast nothing changes. The wrapped function gains a
    ``force_allow_autocast`` keyword: ``True`` calls the original function untouched, so a
    user can opt back into autocast.

    Usable bare (``@fwd_default_precision``) or with arguments
    (``@fwd_default_precision(cast_inputs=torch.float64)``).

    Args:
        fwd: the function to wrap; omitted when the decorator is called with arguments.
        cast_inputs: dtype that floating-point tensor inputs are cast to under autocast.
    """
    if fwd is None:
        return functools.partial(fwd_default_precision, cast_inputs=cast_inputs)

    # Built once here, not on first call, so that torch.compile traces straight through.
    wrapped_by_device = {
        device_type: torch.amp.custom_fwd(fwd, device_type=device_type, cast_inputs=cast_inputs)
        for device_type in ("cuda", "cpu")
    }

    @functools.wraps(fwd)
    def wrapper(*args: Any, force_allow_autocast: bool = False, **kwargs: Any) -> Any:
        if force_allow_autocast:
            return fwd(*args, **kwargs)
        device_type = _first_tensor_device_type(args, kwargs)
        if not _autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
            return fwd(*args, **kwargs)  # no autocast there (e.g. "meta") or now: nothing to undo
        if not args or not hasattr(args[0], "__dict__"):
            # custom_fwd marks its first argument for custom_bwd: keyword arguments only, or
            # a number or list first, would fail there, so cast and disable here instead.
            if cast_inputs is None:
                return fwd(*args, **kwargs)
            with torch.autocast(device_type, enabled=False):
                return fwd(
                    *_cast(args, device_type, cast_inputs),
                    **_cast(kwargs, device_type, cast_inputs),
                )
        wrapped = wrapped_by_device.get(device_type)
        if wrapped is None:  # other backends: their own custom_fwd, made when first seen
            wrapped = wrapped_by_device[device_type] = torch.amp.custom_fwd(
                fwd, device_type=device_type, cast_inputs=cast_inputs
            )
        return wrapped(*args, **kwargs)

    # What tools ask of a decorated forward (``amp_utils.numerics.runs_in_fp32``): the dtype
    # its inputs are cast to under autocast, autocast off (None: autocast left as it is).
    wrapper.cast_inputs = cast_inputs  # type: ignore[attr-defined]
    return wrapper
