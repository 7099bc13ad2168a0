"""Device resolution and the precision/device support check, done once at construction.

Unsupported combinations raise here, with the device and the alternatives in the message,
instead of failing (or silently falling back) in the middle of a run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from amp_utils.autocast import AMPConfig

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")
#: ``precision=auto`` picks the fastest precision the device computes natively.
AUTO = "auto"
#: Slowdown of emulated bf16/fp16 against fp32 on a CPU without native support, by the
#: widest vector instructions torch uses there, as measured:
#: - AVX2 only (AMD EPYC; default ASR recipe end to end): fp32 160 utt/s, bf16 16, fp16 14;
#: - AVX512 without AVX512-BF16/FP16 (Intel Xeon family 6 model 85; ``recipes/benchmark.py``
#:   training steps): bf16 0.50-0.54x fp32 (Conformer) and 0.46x (x-vector); fp16 0.05x
#:   (Conformer: its matmuls have no fast fp16 kernel there) and 0.63-0.87x (x-vector, whose
#:   convolutions run in fp32) (benchmarks/results/2026-11-26-cpu-avx512-no-bf16.md).
EMULATED_CPU_SLOWDOWN = {
    ("bf16", "AVX512"): "about 2x slower than fp32 (measured on an Intel Xeon with AVX512 "
    "but no AVX512-BF16)",
    ("fp16", "AVX512"): "up to 20x slower than fp32 (measured on an Intel Xeon with AVX512 "
    "but no AVX512-FP16: 0.05x fp32 for the Conformer)",
}
#: Where the table has no measurement for the instruction set (AVX2, or other CPUs).
EMULATED_CPU_SLOWDOWN_DEFAULT = "about 10x slower than fp32 (measured on an AVX2-only AMD EPYC)"
#: fp16 on a CPU with AVX512-FP16 but no AMX-FP16, as measured on an Intel Xeon (family 6
#: model 167) with the recipes' convolutions in fp32 (``amp_utils.fast_kernels``): training
#: steps at 1.01-1.04x fp32 (Conformer) and 1.13-1.14x (x-vector), 0.92-0.94x end to end,
#: where bf16 ran at 1.12-1.76x (benchmarks/results/2026-11-25-cpu-fp16-conv.md).
AVX512_FP16_SPEED = "about as fast as fp32 (measured 0.92-0.94x fp32 end to end)"

logger = logging.getLogger(__name__)
_warned: set[tuple[str, str, str]] = set()


def reset_emulation_warnings() -> None:
    """Let :func:`warn_if_emulated` warn again: at the start of each run, so that every
    job of a sweep run in one process has the warning in its own ``train.log``."""
    _warned.clear()


class PrecisionNotSupportedError(RuntimeError):
    """The requested precision cannot run on the requested device."""


class DeviceNotAvailableError(RuntimeError):
    """The requested device (e.g. a CUDA GPU) is not present on this machine."""


def parse_device_name(name: str) -> str:
    """Check a device string's form (``auto``, ``cpu``, ``cuda`` or ``cuda:N``) without
    touching the hardware; returns it. The one parser of device names: the config check
    calls it before any work, ``resolve_device`` when the run starts.

    Raises:
        ValueError: the name is none of those forms; the message lists the valid ones.
    """
    name = str(name)
    if name in ("auto", "cpu", "cuda") or (name.startswith("cuda:") and name[5:].isdigit()):
        return name
    raise ValueError(f"Unknown device {name!r}; valid choices are: {', '.join(DEVICE_CHOICES)}.")


def resolve_device(name: str | torch.device) -> torch.device:
    """Turn ``auto``/``cpu``/``cuda``/``cuda:N`` into a device, failing clearly if absent.

    ``auto`` picks the first CUDA GPU when there is one, else the CPU.
    """
    name = parse_device_name(str(name))
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
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


def cuda_bf16_native(device: torch.device) -> bool:
    """Whether the GPU ``device`` computes bf16 natively: compute capability 8.0 (Ampere)
    or newer, or ROCm, as ``torch.cuda.is_bf16_supported(including_emulation=False)`` says
    for the *current* GPU. A single process on ``cuda:1`` never makes it current, so on a
    machine with mixed GPUs that answered for ``cuda:0``."""
    if torch.version.hip:
        return True
    return torch.version.cuda is not None and torch.cuda.get_device_properties(device).major >= 8


def check_precision_supported(amp: AMPConfig, device: torch.device) -> None:
    """Raise PrecisionNotSupportedError if ``amp`` cannot run on ``device``.

    fp32 runs everywhere. bf16 needs a GPU with bf16 support (Ampere or newer) or the CPU.
    fp16 runs on CUDA and, through CPU autocast with ``GradScaler("cpu")``, on the CPU
    (correct but usually slower than fp32 there).
    """
    if amp.dtype == torch.float32:
        return
    if device.type == "cuda" and amp.dtype == torch.bfloat16:
        if not cuda_bf16_native(device):
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


#: The variable oneDNN reads, once per process, for the size of its kernel cache.
ONEDNN_CACHE_VARIABLE = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def configure_onednn_cache(capacity: int | None) -> None:
    """Let oneDNN keep ``capacity`` CPU kernels (primitives) instead of its default 1024.

    On a CPU, bf16/fp16 matmuls and convolutions (and fp32 convolutions) are oneDNN kernels
    generated for each op and input shape, and kept in an LRU cache. Batches of varying
    length meet more shapes than 1024 kernels cover: the ASR recipe needs ~30 kernels per
    batch shape and meets ~120 shapes in 30 epochs, so with the default cache bf16 kept
    regenerating evicted kernels (235-430 per epoch, 0.5-0.9 s of a ~9 s epoch). With 4096
    its 30-epoch bf16 runs trained 1.10-1.14x faster (three seeds) and peaked ~0.56 GB
    higher in host memory; fp32 (MKL matmuls) was unchanged
    (``benchmarks/results/2026-11-25-cpu-onednn-cache.md``).

    oneDNN reads the size from the environment when it creates its first kernel, so this
    must run before the process's first CPU matmul or convolution; later calls change
    nothing. torch exports no function to set it. ``None`` leaves the environment alone.
    """
    if capacity is not None:
        os.environ[ONEDNN_CACHE_VARIABLE] = str(int(capacity))


def cpu_native_precisions() -> frozenset[str]:
    """Reduced precisions this CPU computes natively (others are emulated, and slow).

    bf16 needs AVX512-BF16 or AMX; fp16 needs AMX-FP16. Tests patch this function.
    """
    native = set()
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        native.add("bf16")
    if torch.cpu._is_amx_fp16_supported():
        native.add("fp16")
    return frozenset(native)


def cpu_has_avx512_fp16() -> bool:
    """Whether this CPU has AVX512-FP16 (``/proc/cpuinfo``; torch has no probe for it).

    oneDNN then runs fp16 natively enough to reach fp32's speed, not beyond it (no AMX-FP16).
    False where ``/proc/cpuinfo`` cannot be read. Tests patch this function.
    """
    try:
        return "avx512_fp16" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False


def cpu_vector_isa() -> str:
    """The widest vector instructions torch's CPU kernels use here: ``"AVX512"``,
    ``"AVX2"``, ``"DEFAULT"`` (or another platform's name). Tests patch this function."""
    return torch.backends.cpu.get_cpu_capability()


def emulated_cpu_slowdown(name: str) -> str:
    """How much slower than fp32 ``name`` (bf16/fp16) runs emulated on this CPU, as measured
    on a CPU with the same vector instructions."""
    return EMULATED_CPU_SLOWDOWN.get((name, cpu_vector_isa()), EMULATED_CPU_SLOWDOWN_DEFAULT)


def resolve_precision(name: str, device: torch.device) -> tuple[str, str]:
    """The precision to use for ``name`` on ``device``, and why.

    ``auto`` picks bf16 where it is native (CUDA GPUs with bf16; CPUs with AVX512-BF16 or
    AMX), else fp16 on CUDA (with loss scaling), else fp32. Other names stay as they are.
    """
    if name != AUTO:
        return name, "requested"
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        if cuda_bf16_native(device):
            return "bf16", f"{gpu} computes bf16 natively"
        return "fp16", f"{gpu} has no native bf16; fp16 with dynamic loss scaling"
    if device.type == "cpu" and "bf16" in cpu_native_precisions():
        return "bf16", "this CPU computes bf16 natively (AVX512-BF16 or AMX)"
    return "fp32", (
        "no native bf16 on this CPU (needs AVX512-BF16 or AMX); emulated bf16 would be "
        f"{emulated_cpu_slowdown('bf16')}"
    )


def warn_if_emulated(amp: AMPConfig, device: torch.device, key: str = "precision") -> bool:
    """Warn (once per precision and key) when ``amp`` is not native on this CPU; True if so.

    ``key`` is the setting the message names (``precision.eval_precision`` for evaluation).

    Emulated bf16/fp16 is 2-20x slower than fp32, by precision and vector instructions
    (``emulated_cpu_slowdown``); fp16 on a CPU with AVX512-FP16 but no AMX-FP16 is about as
    fast as fp32 (with ``fast_kernels``' fp32 convolutions), a gain of nothing: each gets
    its own message, with what to use instead.
    """
    if device.type != "cpu" or amp.dtype == torch.float32:
        return False
    if amp.name in cpu_native_precisions():
        return False
    if (key, amp.name, device.type) in _warned:
        return True
    _warned.add((key, amp.name, device.type))
    if amp.name == "fp16" and cpu_has_avx512_fp16():
        logger.warning(
            "%s=fp16 on a CPU with AVX512-FP16 but without AMX-FP16: fp16 runs %s here, "
            "so it gains nothing and adds loss scaling. Use %s=auto (bf16 where this "
            "CPU has it natively) or %s=fp32.",
            key,
            AVX512_FP16_SPEED,
            key,
            key,
        )
    else:
        needs = "AVX512-BF16 or AMX" if amp.name == "bf16" else "AMX-FP16"
        logger.warning(
            "%s=%s on a CPU without %s: PyTorch emulates %s here, %s. Use "
            "%s=fp32, or %s=auto to pick the fastest precision this machine supports.",
            key,
            amp.name,
            needs,
            amp.name,
            emulated_cpu_slowdown(amp.name),
            key,
            key,
        )
    return True
