"""Data loaders for the loop: seeded generators, DDP sharding, resuming inside an epoch."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, DistributedSampler

from amp_utils.distributed import DistributedInfo


def seeded_generator(seed: int) -> torch.Generator:
    """A data loader's own generator, seeded with ``seed``.

    Loaders without one draw their start-up seed from the global RNG, so a resumed run
    would see a different random stream than an uninterrupted one.
    """
    return torch.Generator().manual_seed(seed)


def make_loader(
    dataset: Any, seed: int, distributed: DistributedInfo, shard: bool, **loader_kwargs: Any
) -> DataLoader:
    """A DataLoader with its own seeded generator; with ``shard`` under DDP, a rank's shard.

    A sharded loader without its own sampler gets a ``DistributedSampler`` (each rank a
    disjoint, equally long shard, reshuffled per epoch when ``shuffle=True``).
    """
    loader_kwargs.setdefault("generator", seeded_generator(seed))
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
    return DataLoader(dataset, **loader_kwargs)


class EpochBatches(NamedTuple):
    """An epoch's remaining batches and the length of the whole epoch (for the bar)."""

    batches: Iterator[Any]
    total: int | None  # batches in the whole epoch, finished ones included; None: unknown


def start_epoch(loader: DataLoader, epoch: int, skip: int = 0) -> EpochBatches:
    """Start ``epoch`` of ``loader`` past its first ``skip`` batches (a mid-epoch resume).

    An epoch-aware sampler is told the epoch; one with ``skip_batches`` leaves the
    finished batches out itself (its ``len()`` then excludes them, and no batch is
    loaded twice); otherwise they are loaded and dropped here. Either way ``total``
    counts the whole epoch, so a progress bar starting at ``skip`` ends at ``total``.
    """
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
    batches = iter(loader)
    if skip and not skipped_by_sampler:
        for _ in range(skip):
            next(batches)
    return EpochBatches(batches, total)


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
