"""Data loaders for the loop: seeded generators, DDP sharding, resuming inside an epoch,
and workers that end with the training process."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from amp_utils.distributed import DistributedInfo


def seeded_generator(seed: int) -> torch.Generator:
    """A data loader's own generator, seeded with ``seed``.

    Loaders without one draw their start-up seed from the global RNG, so a resumed run
    would see a different random stream than an uninterrupted one.
    """
    return torch.Generator().manual_seed(seed)


class ReproducibleRandomSampler(RandomSampler):
    """A random order drawn afresh from ``seed + epoch`` (SpeechBrain's sampler of this name).

    torch's ``RandomSampler`` draws each epoch's order from a generator that moves on from
    epoch to epoch, which a checkpoint does not hold: a resumed process would shuffle
    differently, and a mid-epoch resume would train some examples twice and others not at
    all. The loop calls ``set_epoch`` at every epoch start (:func:`start_epoch`).

    As SpeechBrain's, it seeds with the sum: seed ``s + 1`` shuffles each epoch as seed ``s``
    shuffled the next one, so runs that differ only in their seed share shifted orders.
    The recipes' ``data.sampler.DurationBatchSampler`` seeds with both apart.
    """

    def __init__(self, data_source: Any, seed: int = 563375142, epoch: int = 0, **kwargs: Any):
        if "generator" in kwargs:
            raise ValueError(
                "ReproducibleRandomSampler draws from its own generator (seed + epoch); "
                "pass seed=..., not generator=..."
            )
        super().__init__(data_source, **kwargs)
        self.seed, self.epoch = int(seed), epoch
        self.generator = torch.Generator()

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for ``epoch`` next."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator.manual_seed(self.seed + self.epoch)
        return super().__iter__()


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _end_with_parent(parent_pid: int, then: Callable[[int], None] | None, worker_id: int) -> None:
    """What :func:`tied_worker_init` returns runs this in each worker, then ``then``."""
    if sys.platform.startswith("linux") and os.getppid() == parent_pid:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent_pid:  # the training process died before the prctl
                os._exit(0)
            # Tied to the training process, the worker leaves SIGTERM/SIGINT to it: a
            # signal to the whole process group then lets the loop finish its batches up
            # to the checkpoint (under DDP, up to the ranks' joint decision).
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
    if then is not None:
        then(worker_id)


def tied_worker_init(then: Callable[[int], None] | None = None) -> Callable[[int], None]:
    """A DataLoader ``worker_init_fn`` that has each worker killed when this process dies.

    PyTorch's workers watch for their parent's death, but a worker orphaned by ``kill -9``
    (the OOM killer, a scheduler's hard kill) then hung for ever in its exit: its result
    queue's feeder thread blocks on the pipe the other orphans hold open (seen here: every
    killed run left its workers behind, ~390 MB each). On Linux each worker asks the kernel
    for SIGKILL when the process that started it dies (``PR_SET_PDEATHSIG``); elsewhere, or
    under a fork server (the worker's parent is not this process), nothing changes.

    A worker so tied ignores SIGTERM and SIGINT. SLURM's preemption, ``timeout`` and
    Ctrl-C signal the whole process group, and torchrun forwards SIGTERM to each rank's
    process group; workers that died of it left the loop without the batches it still had
    to train before its checkpoint (under DDP the ranks stop together a step or two later,
    and their gradient all-reduce cannot wait for a rank whose loader broke). The training
    process handles the signal; its workers end when it shuts them down or dies.
    ``then(worker_id)`` runs afterwards (a caller's own ``worker_init_fn``).
    """
    _kill_workers_left_at_exit()
    return functools.partial(_end_with_parent, os.getpid(), then)


@functools.cache
def _kill_workers_left_at_exit() -> None:
    """At exit, SIGKILL the daemonic children (loader workers) still running, once.

    ``multiprocessing`` ends them at exit with SIGTERM, then joins them: a worker that
    ignores SIGTERM would hang the exit for ever (persistent workers are still running
    then). Registered after ``multiprocessing``'s own exit handler, this one runs first.
    """
    import atexit
    import multiprocessing

    def kill_daemonic_children() -> None:
        children = [c for c in multiprocessing.active_children() if c.daemon]
        if children and threading.current_thread() is threading.main_thread():
            # The DataLoader's SIGCHLD handler would report each end as a worker failure.
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for child in children:
            child.kill()

    atexit.register(kill_daemonic_children)


def make_loader(
    dataset: Any, seed: int, distributed: DistributedInfo, shard: bool, **loader_kwargs: Any
) -> DataLoader:
    """A DataLoader with its own seeded generator; with ``shard`` under DDP, a rank's shard.

    A sharded loader without its own sampler gets a ``DistributedSampler`` (each rank a
    disjoint, equally long shard, reshuffled per epoch when ``shuffle=True``); an unsharded
    one with ``shuffle=True`` a :class:`ReproducibleRandomSampler` (as in SpeechBrain), so
    that a resumed run sees every epoch in the same order.
    """
    loader_kwargs.setdefault("generator", seeded_generator(seed))
    loader_kwargs["worker_init_fn"] = tied_worker_init(loader_kwargs.get("worker_init_fn"))
    has_sampler = {"sampler", "batch_sampler"} & set(loader_kwargs)
    if shard and distributed.world_size > 1 and not has_sampler:
        loader_kwargs["sampler"] = DistributedSampler(
            dataset,
            num_replicas=distributed.world_size,
            rank=distributed.rank,
            shuffle=bool(loader_kwargs.pop("shuffle", False)),
            seed=seed,
            drop_last=True,
        )
    elif loader_kwargs.get("shuffle") and not has_sampler:
        del loader_kwargs["shuffle"]
        loader_kwargs["sampler"] = ReproducibleRandomSampler(dataset, seed=seed)
    return DataLoader(dataset, **loader_kwargs)


def shut_down_workers(loader: DataLoader) -> None:
    """Stop ``loader``'s persistent worker processes now; its next epoch starts new ones.

    A loader with ``persistent_workers`` keeps its workers until the loader is freed. A
    finished run's loaders are often freed by the garbage collector (a
    closure or a Brain holding them makes a reference cycle), which closes the workers'
    queues before the iterator's own shutdown runs: each worker then waits out its 5 s
    join timeout, 60 s for a run's 3 loaders of 4 workers, at whatever point of the next
    sweep job or of the interpreter's exit the collection happens (an H200 sweep stalled
    there). Lightning stops them the same way (``_shutdown_workers_and_reset_iterator``).
    """
    iterator = getattr(loader, "_iterator", None)
    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()
    if hasattr(loader, "_iterator"):
        loader._iterator = None
    _STREAMS.pop(loader, None)  # its iterator, and the next epoch's batches it holds


def replays_its_order(loader: DataLoader) -> bool:
    """False for a loader that shuffles with torch's ``RandomSampler`` (whose order a
    resumed run cannot draw again, see :class:`ReproducibleRandomSampler`)."""
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    return not any(
        type(candidate) is RandomSampler  # noqa: E721 (subclasses may replay theirs)
        for candidate in (sampler, getattr(sampler, "sampler", None))
    )


class EpochBatches(NamedTuple):
    """An epoch's remaining batches and the length of the whole epoch (for the bar)."""

    batches: Iterator[Any]
    total: int | None  # batches in the whole epoch, finished ones included; None: unknown


class _EpochStream:
    """A loader's one iteration across epochs (see :func:`start_epoch`), and where it is."""

    def __init__(
        self, iterator: Iterator[Any], sampler: Any, epoch: int, until: int | None
    ) -> None:
        self.iterator = iterator
        self.sampler = sampler
        self.iterations = sampler.iterations  # the sampler's iterations when it began
        self.next_epoch: int | None = epoch  # the epoch whose first batch comes next
        self.until = until  # the last epoch it loads (None: without end)

    def continues(self, loader: DataLoader, epoch: int) -> bool:
        """Whether the stream's next batch is ``epoch``'s first, from the loader's live
        workers (no epoch left early, no other iteration of the loader since, not past the
        last epoch it loads)."""
        return (
            self.next_epoch == epoch
            and (self.until is None or epoch <= self.until)
            and getattr(loader, "_iterator", None) is self.iterator
            and self.sampler.iterations == self.iterations
        )

    def take(self, epoch: int, count: int) -> Iterator[Any]:
        """``epoch``'s next ``count`` batches. Its last one moves the stream to the next
        epoch's start; an epoch left before it leaves the stream's position unknown."""
        self.next_epoch = None
        for taken in range(1, count + 1):
            try:
                batch = next(self.iterator)
            except StopIteration:  # an epoch without batches ended the sampler's stream
                return
            if taken == count:
                self.next_epoch = epoch + 1
            yield batch


_STREAMS: weakref.WeakKeyDictionary[DataLoader, _EpochStream] = weakref.WeakKeyDictionary()


def streams_epochs(loader: DataLoader) -> bool:
    """Whether :func:`start_epoch` runs ``loader``'s epochs as one iteration: persistent
    workers and a batch sampler that can go on into the next epoch (``spans_epochs``) and
    skips a resumed epoch's batches itself (``skip_batches``), e.g.
    ``data.sampler.DurationBatchSampler``; its batches in order (``in_order``: out of order,
    an epoch's last batches could come after the next epoch's first)."""
    return (
        loader.num_workers > 0
        and loader.persistent_workers
        and getattr(loader, "in_order", True)
        and hasattr(loader.batch_sampler, "spans_epochs")
        and hasattr(loader.batch_sampler, "skip_batches")
    )


def start_epoch(
    loader: DataLoader,
    epoch: int,
    skip: int = 0,
    stream: bool = True,
    last_epoch: int | None = None,
) -> EpochBatches:
    """Start ``epoch`` of ``loader`` past its first ``skip`` batches (a mid-epoch resume).

    An epoch-aware sampler is told the epoch; one with ``skip_batches`` leaves the
    finished batches out itself (its ``len()`` then excludes them, and no batch is
    loaded twice); otherwise they are loaded and dropped here. Either way ``total``
    counts the whole epoch, so a progress bar starting at ``skip`` ends at ``total``.

    With ``stream`` and a loader that :func:`streams_epochs`, epochs are one iteration of
    the loader: its sampler runs on into the next epoch, so the workers load the next
    epoch's first batches while the last ones of this epoch train. Restarting a
    persistent loader's iteration instead (``iter()`` at each epoch) waits for every
    worker to acknowledge, for the epoch's plan and for a first batch: 27-31 ms per epoch
    on a 2-core CPU (1.4-1.8 ms streamed), ~20 ms on an H200's host, 12 % of the default
    recipe's graphed epoch.
    The next epoch's batches are the ones a restart would draw (the sampler's plan is a
    function of its seed and the epoch); an epoch left early (debug runs, a stop) or a
    resume inside an epoch restarts the iteration there. The sampler draws an epoch's
    batches up to ``prefetch_factor * num_workers`` batches before the epoch starts, so
    its options must not change while a loader streams. ``last_epoch`` (a run's last
    epoch, e.g. an ``EpochCounter``'s limit) ends the stream there: without it, after the
    last epoch the workers would load that many batches of an epoch never trained (CPU
    time taken from the final validation and test) and hold them until
    :func:`shut_down_workers`. An epoch past ``last_epoch`` (a run extended in the same
    process) starts a new stream.
    """
    if last_epoch is not None and epoch > last_epoch:
        raise ValueError(
            f"start_epoch: epoch {epoch} is past last_epoch {last_epoch}. Fix: pass the run's "
            "last epoch (at least this one), or None."
        )
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    skipped_by_sampler = False
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        if hasattr(candidate, "set_epoch"):
            candidate.set_epoch(epoch)
            if skip and hasattr(candidate, "skip_batches"):
                candidate.skip_batches(skip)
                skipped_by_sampler = True
                break
    total = len(loader) if hasattr(loader, "__len__") else None
    if total is not None and skipped_by_sampler:
        total += skip
    if stream and streams_epochs(loader):  # its sampler skipped (it has skip_batches)
        return EpochBatches(_streamed(loader, sampler, epoch, skip, last_epoch), total)
    batches = iter(loader)
    if skip and not skipped_by_sampler:
        for _ in range(skip):
            next(batches)
    return EpochBatches(batches, total)


def _streamed(
    loader: DataLoader, sampler: Any, epoch: int, skip: int, until: int | None
) -> Iterator[Any]:
    """``epoch``'s batches past ``skip`` from the loader's stream (:func:`start_epoch`,
    once the sampler is set to the epoch and its skip), continued or started here; a
    stream started here loads no epoch past ``until``."""
    current = _STREAMS.get(loader)
    if skip or current is None or not current.continues(loader, epoch):
        # a DataLoader draws iter(sampler) twice when it starts (once where SpeechBrain,
        # imported, has patched its _reset); the stream counts from after the start
        sampler.spans_epochs, sampler.spans_until = True, until
        try:
            iterator = iter(loader)
        finally:
            sampler.spans_epochs, sampler.spans_until = False, None
        current = _STREAMS[loader] = _EpochStream(iterator, sampler, epoch, until)
    return current.take(epoch, len(loader))  # len(): the epoch's batches after skip


def epoch_fingerprint(loader: DataLoader) -> str | None:
    """The digest of the loader's current epoch plan, from a sampler that offers one
    (``epoch_fingerprint()``, e.g. ``data.sampler.DurationBatchSampler``); else None."""
    sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        fingerprint = getattr(candidate, "epoch_fingerprint", None)
        if callable(fingerprint):
            return str(fingerprint())
    return None


def timed_batches(batches: Iterable[Any], on_wait: Callable[[float], None]) -> Iterator[Any]:
    """``batches``, reporting to ``on_wait`` the seconds each one took to arrive.

    The time the loop spends blocked on the loader (worker start-up included): when it is a
    large share of an epoch, the data pipeline, not the model, sets the training speed.
    """
    iterator = iter(batches)
    while True:
        start = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        on_wait(time.perf_counter() - start)
        yield batch
