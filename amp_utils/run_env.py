"""Record the software and hardware environment of a run in ``env.txt``.

Mixed-precision results depend on the GPU (bf16 support, tensor cores), on CUDA/cuDNN and
on library versions; writing them next to each run's results makes speed and accuracy
numbers comparable and reproducible. Every probe tolerates failure: a missing GPU, git or
pip must never stop a training run.
"""

from __future__ import annotations

import importlib
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch

from amp_utils.atomic import atomic_write_text
from amp_utils.precision import cpu_native_precisions, cpu_vector_isa, cuda_bf16_native

_REPO_DIR = Path(__file__).resolve().parent


def _version(module_name: str) -> str:
    """``__version__`` of a module, or why it is unknown."""
    try:
        return str(importlib.import_module(module_name).__version__)
    except Exception as err:  # any import problem is only reported
        return f"unavailable ({type(err).__name__}: {err})"


def _run(command: list[str], timeout: float = 60.0) -> str | None:
    """stdout of ``command`` run in the repository, or ``None`` if it fails."""
    try:
        result = subprocess.run(
            command, cwd=_REPO_DIR, capture_output=True, text=True, timeout=timeout, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout


def git_revision() -> str:
    """``<commit hash>`` plus ``(dirty)`` when the work tree has changes; ``unknown`` on failure."""
    head = _run(["git", "rev-parse", "HEAD"], timeout=10.0)
    if not head:
        return "unknown"
    status = _run(["git", "status", "--porcelain"], timeout=10.0)
    if status is None:
        return f"{head.strip()} (dirty state unknown)"
    return f"{head.strip()} (dirty)" if status.strip() else head.strip()


def _cpu_precision_line() -> str:
    """The CPU's vector instructions and native reduced precisions: what decides
    ``precision=auto`` on a CPU and how fast bf16/fp16 run there (emulated: 2-10x slower)."""
    try:
        native = ", ".join(sorted(cpu_native_precisions())) or "none (bf16/fp16 emulated)"
        return f"cpu vector isa: {cpu_vector_isa()}; native reduced precisions: {native}"
    except Exception as err:  # a probe never stops a run
        return f"cpu precisions: unknown ({type(err).__name__}: {err})"


def _cuda_lines() -> list[str]:
    """CUDA availability, versions, device names and bf16 support."""
    available = torch.cuda.is_available()
    lines = [
        f"cuda available: {available}",
        f"cuda version (torch build): {torch.version.cuda}",
        f"cudnn version: {torch.backends.cudnn.version() if available else None}",
    ]
    if available:
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            native = cuda_bf16_native(torch.device("cuda", index))
            lines.append(
                f"gpu {index}: {torch.cuda.get_device_name(index)} (compute capability "
                f"{major}.{minor}, native bf16: {'yes' if native else 'no'})"
            )
    return lines


def _installed_packages() -> str:
    """``pip freeze`` output; falls back to installed distributions when pip is missing."""
    frozen = _run([sys.executable, "-m", "pip", "freeze"], timeout=120.0)
    if frozen is not None:
        return frozen.rstrip("\n")
    from importlib import metadata

    names = sorted(
        f"{dist.metadata['Name']}=={dist.version}"
        for dist in metadata.distributions()
        if dist.metadata["Name"]
    )
    return "# pip freeze failed; installed distributions instead\n" + "\n".join(names)


def environment_report() -> str:
    """The text that :func:`write_env_file` writes."""
    lines = [
        f"date: {datetime.now(timezone.utc).isoformat(timespec='seconds')}",
        f"python: {sys.version.split()[0]} ({sys.executable})",
        f"platform: {platform.platform()}",
        f"processor: {platform.machine()}",
        f"torch: {torch.__version__}",
        f"torchaudio: {_version('torchaudio')}",
        f"hydra: {_version('hydra')}",
        f"omegaconf: {_version('omegaconf')}",
        f"torch cpu threads: {torch.get_num_threads()}",
        _cpu_precision_line(),
        *_cuda_lines(),
        f"git revision: {git_revision()}",
        "",
        "pip freeze:",
        _installed_packages(),
    ]
    return "\n".join(lines) + "\n"


def write_env_file(path: Path) -> None:
    """Write the environment report (see module docstring) to ``path`` atomically.

    Args:
        path: destination, usually ``<run dir>/env.txt``.
    """
    atomic_write_text(path, environment_report())
