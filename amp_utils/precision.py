"""Device resolution and the precision/device support check, done once at construction.

Unsupported combinations raise here, with the device and the alternatives in the message,
instead of failing (or silently falling back) in the middle of a run.
"""

from __future__ import annotations

import torch

from amp_utils.autocast import AMPConfig

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


class PrecisionNotSupportedError(RuntimeError):
    """The requested precision cannot run on the requested device."""


class DeviceNotAvailableError(RuntimeError):
    """The requested device (e.g. a CUDA GPU) is not present on this machine."""


def resolve_device(name: str | torch.device) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N`` into a device, failing clearly if absent.

    ``auto`` picks the first CUDA GPU when there is one, else the CPU.
    """
    if isinstance(name, torch.device):
        name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"Unknown device {name!r}; valid choices are: {', '.join(DEVICE_CHOICES)}."
        ) from err
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"Unsupported device {name!r}; valid choices are: {', '.join(DEVICE_CHOICES)}."
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceNotAvailableError(
                f"device={name} was requested but no CUDA GPU is available "
                "(torch.cuda.is_available() is False). Use device=cpu or device=auto."
            )
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise DeviceNotAvailableError(
                f"device={name} was requested but only {torch.cuda.device_count()} GPU(s) "
                "are visible. Use device=cuda or device=cuda:0."
            )
    return device


def check_precision_supported(amp: AMPConfig, device: torch.device) -> None:
    """Raise PrecisionNotSupportedError if ``amp`` cannot run on ``device``.

    fp32 runs everywhere. bf16 needs a GPU with bf16 support (Ampere or newer) or the CPU.
    fp16 runs on CUDA and, through CPU autocast with ``GradScaler("cpu")``, on the CPU
    (correct but usually slower than fp32 there).
    """
    if amp.dtype == torch.float32:
        return
    if device.type == "cuda" and amp.dtype == torch.bfloat16:
        if not torch.cuda.is_bf16_supported(including_emulation=False):
            name = torch.cuda.get_device_name(device)
            raise PrecisionNotSupportedError(
                f"precision=bf16 is not supported on {device} ({name}): bf16 needs an "
                "Ampere-or-newer GPU. Use precision=fp16 (with loss scaling) or precision=fp32."
            )
        return
    if device.type in ("cpu", "cuda"):
        return
    raise PrecisionNotSupportedError(
        f"precision={amp.name} is not supported on device {device}; use precision=fp32 there, "
        "or device=cuda / device=cpu for mixed precision."
    )


def make_grad_scaler(amp: AMPConfig, device: torch.device) -> torch.amp.GradScaler:
    """A GradScaler that is enabled for fp16 only (bf16 and fp32 need no loss scaling)."""
    return torch.amp.GradScaler(device.type, enabled=amp.dtype == torch.float16)


def configure_tf32(device: torch.device, allow_tf32: bool) -> None:
    """Keep fp32 true fp32 on GPUs unless TF32 is explicitly allowed."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32
