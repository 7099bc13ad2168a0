"""Multi-process training (DDP): start the process group, rank-0-only work, collectives.

One recipe runs unchanged on one process, under ``torchrun`` (one or several nodes) and as
a multi-task SLURM job sent by Hydra's submitit launcher:

* ``torchrun`` exports ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_*``; a submitit job
  with several tasks gets them exported from its SLURM (or local) job environment;
* ``init_distributed`` starts the process group once (nccl on CUDA, gloo on CPU unless
  told otherwise) and pins each process to its own GPU;
* every helper here is a no-op in a single process, so recipes call them unconditionally;
* the Brain wraps its modules with ``wrap_ddp`` (after ``convert_sync_batchnorm``) and runs
  gradient-accumulation batches under ``no_sync``.

The API follows SpeechBrain's ``speechbrain.utils.distributed`` (``run_on_main``,
``if_main_process``, ``ddp_barrier``), with one addition: ``run_on_main`` hands the main
process's result (or its exception) to every rank, so a failed data preparation stops
all ranks with the same message instead of leaving them waiting.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "nccl", "gloo")
T = TypeVar("T")
_control_group: Any = None  # a gloo group for host-side decisions when the backend is nccl


class DistributedConfigError(ValueError):
    """A distributed setting that cannot work (e.g. nccl without a GPU)."""


@dataclass(frozen=True)
class DistributedInfo:
    """Where this process stands in the job: world size, ranks and the backend."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    backend: str | None = None  # None: not distributed

    @property
    def enabled(self) -> bool:
        """Whether a process group is running (also with a single process under torchrun)."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0, the process that logs and writes the run's outputs."""
        return self.rank == 0


def _export_submitit_environment() -> None:
    """Inside a multi-task submitit job (SLURM or local), export torchrun-style variables."""
    if "RANK" in os.environ or "SUBMITIT_EXECUTOR" not in os.environ:
        return
    try:
        import submitit
    except ImportError:  # submitit variables without submitit: nothing to export
        return
    if submitit.JobEnvironment().num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def launched_distributed() -> bool:
    """Whether this process was started by torchrun or as one task of a multi-task job."""
    _export_submitit_environment()
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch_rank() -> int:
    """This process's rank as its launcher set it (``RANK``; 0 when not launched
    distributed), before any process group exists: who records and summarises a sweep."""
    launched_distributed()  # a multi-task submitit job's tasks learn their RANK here
    return int(os.environ.get("RANK", "0"))


def resolve_backend(backend: str, device_type: str) -> str:
    """``auto`` -> nccl on CUDA, gloo on CPU; checks the choice fits the device."""
    if backend not in BACKENDS:
        raise DistributedConfigError(
            f"distributed_backend={backend!r} is unknown; choose one of: {', '.join(BACKENDS)}."
        )
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise DistributedConfigError(
            f"distributed_backend=nccl needs device=cuda, but the run is on {device_type}. "
            "Fix: use trainer.distributed_backend=gloo (or auto) on CPU."
        )
    return backend


def init_distributed(backend: str = "auto", device_type: str = "cpu") -> DistributedInfo:
    """Start the process group if this process was launched for it; else a 1-process info.

    On CUDA each process is pinned to GPU ``LOCAL_RANK``. Safe to call more than once.
    """
    already = dist.is_available() and dist.is_initialized()
    if not already and not launched_distributed():
        return DistributedInfo()
    if device_type == "cuda":
        torch.cuda.set_device(_local_gpu(int(os.environ.get("LOCAL_RANK", 0))))
    if already:  # started by the caller's own code
        return distributed_info()
    end_with_launcher()
    dist.init_process_group(backend=resolve_backend(backend, device_type))
    atexit.register(destroy_distributed)
    info = distributed_info()
    if info.is_main:
        logger.info("Distributed: %d processes, backend %s", info.world_size, info.backend)
    return info


#: Linux ``prctl`` option: the signal this process gets when its parent ends.
_PR_SET_PDEATHSIG = 1


def end_with_launcher() -> bool:
    """Under ``torchrun``, have this rank sent SIGTERM when its launcher process ends.

    torchrun starts each rank in a session of its own (``start_new_session``), so a
    signal to torchrun's process group does not reach the ranks, and torchrun forwards
    only the signals it can catch. Killed with ``kill -9`` (its PID or its process group,
    an out-of-memory kill), it left its ranks training on, orphaned: they held the run
    folder, so the same command was refused ("in use by another training process"), and
    they went on writing into it with nobody to see their output. With the parent-death
    signal the ranks get SIGTERM instead, which the training loop turns into a joint stop
    and a checkpoint, as for a SIGTERM forwarded by torchrun.

    Linux only; a no-op (False) elsewhere, outside torchrun (``TORCHELASTIC_RUN_ID``) and
    where ``prctl`` is unavailable. If the launcher is already gone, SIGTERM is sent at
    once.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        parent = os.getppid()
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no libc prctl: the ranks outlive a killed torchrun
        return False
    if os.getppid() != parent:  # the launcher ended before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def _local_gpu(local_rank: int) -> int:
    """This process's GPU: number LOCAL_RANK, or the only one it sees (SLURM GPU binding)."""
    visible = torch.cuda.device_count()
    if local_rank < visible:
        return local_rank
    if visible == 1:  # e.g. --gpus-per-task=1: each process sees just its own GPU
        return 0
    raise DistributedConfigError(
        f"LOCAL_RANK={local_rank} but this process sees {visible} GPU(s). Fix: start at most "
        "one process per GPU (torchrun --nproc_per_node=<number of GPUs>, or SLURM "
        "tasks_per_node = gpus_per_node)."
    )


def distributed_info() -> DistributedInfo:
    """This process's rank, world size and backend (a 1-process info when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistributedInfo()
    return DistributedInfo(
        world_size=dist.get_world_size(),
        rank=dist.get_rank(),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        backend=str(dist.get_backend()),
    )


def destroy_distributed() -> None:
    """End the process group (a no-op when there is none); ``init_distributed`` runs it at exit.

    Garbage is collected first. A DDP module left in a reference cycle (the Brain, once
    ``train()`` has returned) holds the process group through its reducer, so the group
    would outlive this call and be torn down during interpreter finalization, where gloo's
    worker threads can abort the process: a rank of a finished run then exited with SIGABRT
    ("terminate called without an active exception") after the results were written.
    """
    global _control_group
    if dist.is_available() and dist.is_initialized():
        _control_group = None
        gc.collect()  # free DDP reducers in reference cycles while the interpreter is whole
        dist.destroy_process_group()


def is_main_process() -> bool:
    """True on rank 0 and in a single process."""
    return distributed_info().is_main


def if_main_process() -> bool:
    """SpeechBrain's name for ``is_main_process``."""
    return is_main_process()


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def ddp_barrier() -> None:
    """Wait until every rank gets here (a no-op in a single process)."""
    if _multi_process():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s (picklable) object on every rank."""
    if not _multi_process():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


class _Failed:
    """Stands in for the main process's result when it raised."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def run_on_main(
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    post_func: Callable[..., Any] | None = None,
    post_args: Sequence[Any] | None = None,
    post_kwargs: Mapping[str, Any] | None = None,
    run_post_on_main: bool = False,
) -> T:
    """Run ``func`` on rank 0 only (e.g. download, data preparation), then sync all ranks.

    Every rank gets rank 0's return value; if it raised, every rank raises the same
    error. ``post_func`` then runs on the other ranks (and on rank 0 too with
    ``run_post_on_main``), as in SpeechBrain.
    """
    result: Any = None
    if is_main_process():
        try:
            result = func(*(args or ()), **(kwargs or {}))
        except Exception as err:  # handed to every rank, re-raised below
            result = _Failed(err)
    result = broadcast_object(result)
    if isinstance(result, _Failed):
        raise result.error
    if post_func is not None and (run_post_on_main or not is_main_process()):
        post_func(*(post_args or ()), **(post_kwargs or {}))
    ddp_barrier()
    return result


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(tensor: torch.Tensor, op: Any) -> torch.Tensor:
    """``op`` over all ranks, as a new tensor on the input's device."""
    if not _multi_process():
        return tensor
    comm = tensor.detach().to(_comm_device(), copy=True)
    dist.all_reduce(comm, op=op)
    # To the host a copy must block: a non-blocking one lands in pinned memory later, and
    # callers read the sum at once (.tolist(): metric counts, validation rounds).
    return comm.to(tensor.device, non_blocking=tensor.device.type != "cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over all ranks (a new tensor on the input's device).

    On the GPU with nccl this is queued on the stream and does not wait for the device.
    """
    return _all_reduce(tensor, dist.ReduceOp.SUM)


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over all ranks."""
    return _all_reduce(tensor, dist.ReduceOp.MAX)


def all_reduce_counts(counts: Mapping[str, float]) -> dict[str, float]:
    """Sum named counts (edits, totals, correct...) over all ranks, in one collective."""
    if not _multi_process() or not counts:
        return dict(counts)
    values = torch.tensor([float(v) for v in counts.values()], dtype=torch.float64)
    summed = all_reduce_sum(values).tolist()
    return dict(zip(counts, summed, strict=True))


def all_gather_lists(items: list[Any]) -> list[Any]:
    """Every rank's (picklable) ``items`` joined in rank order (``items`` in one process)."""
    if not _multi_process():
        return list(items)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(items))
    return [item for rank_items in gathered for item in rank_items]


def any_rank(*flags: bool) -> tuple[bool, ...]:
    """For each flag, whether it is set on any rank.

    A tiny CPU collective (gloo, also next to nccl): it synchronises the processes, not
    the GPU queue. Used for decisions all ranks must take together (stop, checkpoint).
    """
    global _control_group
    if not _multi_process():
        return tuple(bool(f) for f in flags)
    if dist.get_backend() != "gloo" and _control_group is None:
        _control_group = dist.new_group(backend="gloo")  # collective: every rank gets here
    values = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=_control_group)
    return tuple(bool(v) for v in values.tolist())


#: What gloo's TCP transport says when the process at the other end of a connection has
#: ended (killed, crashed, or stopped by its launcher).
_PEER_GONE_MARKERS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
)


def lost_a_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective that failed because another rank of the job ended.

    Under DDP a rank killed (``kill -9``, the OOM killer) or crashed breaks the others'
    next collective (the gradient all-reduce, a metric sum) with a gloo error such as
    "[.../gloo/transport/tcp/pair.cc:538] Read error ...: Connection reset by peer". That
    was shown as a traceback through autograd, which named neither the cause (another
    process) nor what to do (resume). False outside a multi-process group.
    """
    if not isinstance(err, RuntimeError) or not _multi_process():
        return False
    text = str(err)
    return any(marker in text for marker in _PEER_GONE_MARKERS)


def lost_a_peer_message(err: BaseException) -> str:
    """The one-line explanation for :func:`lost_a_peer` errors: what happened, what to do."""
    detail = " ".join(str(err).split())
    detail = detail.rsplit("] ", 1)[-1][:200]  # gloo's source location is noise here
    return (
        f"Another process of this DDP run ended (this rank {distributed_info().rank} lost "
        f"its connection: {detail}), so this one stops too. The launcher's output names the "
        "process that ended and why; checkpoints already saved are intact. Run the same "
        "command again to resume from the latest one."
    )


def convert_sync_batchnorm(
    modules: dict[str, torch.nn.Module], world_size: int, device: torch.device
) -> dict[str, torch.nn.Module]:
    """The modules with their BatchNorm layers as SyncBatchNorm (statistics over all ranks).

    A no-op in a single process.

    Raises:
        DistributedConfigError: several processes on a device other than CUDA.
    """
    if world_size <= 1:
        return modules
    if device.type != "cuda":
        raise DistributedConfigError(
            "trainer.sync_batchnorm=true needs CUDA: PyTorch's SyncBatchNorm runs on GPUs "
            "only. Fix: set trainer.sync_batchnorm=false for CPU (gloo) runs."
        )
    return {
        name: torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        for name, module in modules.items()
    }


def wrap_ddp(
    modules: torch.nn.ModuleDict, device: torch.device, find_unused_parameters: bool = False
) -> list[DistributedDataParallel]:
    """Wrap, in place, every module with trainable parameters in DistributedDataParallel.

    Modules without trainable parameters (e.g. feature extraction) stay as they are:
    there is nothing to synchronise. Callers keep the unwrapped modules for checkpoints,
    so checkpoints have the same keys with and without DDP.

    Returns:
        The DDP wrappers, for :func:`no_sync`.
    """
    wrapped: list[DistributedDataParallel] = []
    for name, module in modules.items():
        if not any(p.requires_grad for p in module.parameters()):
            continue
        ddp = DistributedDataParallel(
            module,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=find_unused_parameters,
        )
        modules[name] = ddp
        wrapped.append(ddp)
    return wrapped


@contextmanager
def no_sync(ddp_modules: Sequence[DistributedDataParallel], use: bool = True) -> Iterator[None]:
    """Skip DDP's gradient all-reduce inside the block when ``use`` (accumulation batches)."""
    with ExitStack() as stack:
        if use:
            for module in ddp_modules:
                stack.enter_context(module.no_sync())
        yield
