"""Batches by total padded duration, with length bucketing, for single- and multi-process runs.

A fixed batch size wastes memory on short utterances and runs out of it on long ones;
bounding ``len(batch) * longest`` (what the padded batch tensor costs) keeps the memory
per step nearly constant. Sorting into duration buckets keeps padding small, and
shuffling inside buckets and the batch order keeps epochs random but reproducible from
``(seed, epoch)``, which is what resuming a run needs.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Iterator, Sequence

import torch

from data.errors import DataError


class DurationBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yield lists of dataset indices whose padded duration fits ``max_batch_seconds``.

    A batch's padded duration is ``len(batch) * max(duration in batch)``; an item longer
    than the budget forms a batch of its own. Indices are sorted by duration and cut into
    ``num_buckets`` buckets of equal count; batches are packed inside each bucket and the
    batch order is shuffled. With ``shuffle=True`` each epoch packs and orders differently,
    deterministically for a given ``(seed, epoch)``.

    With ``pad_to_buckets=True`` every batch of a bucket holds the same number of items,
    ``max_batch_seconds // longest item of the bucket`` (the last batch of a bucket may hold
    fewer), so that padding each batch to its bucket's longest item (``PadToBuckets``)
    leaves at most two batch shapes per bucket: a bounded set for ``torch.compile`` and
    CUDA graphs. Bucket boundaries depend only on the durations, never on the epoch.

    With ``num_replicas > 1`` every rank builds the same batch list and takes every
    ``num_replicas``-th batch starting at ``rank``. For training (``drop_uneven=True``) the
    list is first truncated to a multiple of ``num_replicas`` so all ranks run the same
    number of steps (DDP needs that; the dropped batches change every epoch). For
    evaluation (``drop_uneven=False``) every batch goes to exactly one rank, so metrics
    summed over the ranks cover the whole split.

    Args:
        durations: duration in seconds of every dataset item.
        max_batch_seconds: budget for ``len(batch) * longest item``.
        shuffle: shuffle within buckets and the batch order (False: sorted, fixed order).
        seed: base seed; each epoch's shuffle is seeded with ``"{seed}-{epoch}"``.
        num_buckets: number of duration buckets.
        drop_last: drop each bucket's last batch when it is incomplete (it would still
            have room for one more item as long as its longest one), unless it is the
            bucket's only batch.
        num_replicas: number of distributed processes.
        rank: this process's rank in ``[0, num_replicas)``.
        drop_uneven: with several replicas, drop the last batches that would give the
            ranks unequal batch counts.
        pad_to_buckets: fixed batch sizes per bucket (see above).
        pad_quantum: with ``pad_to_buckets``, bucket edges are rounded up to a multiple of
            this many seconds (e.g. 64 samples), so a length that resampling rounds by a
            sample still fits its bucket; batch sizes are computed for the rounded edges.
        ascending_epochs: epochs 1 to this one (the loop counts from 1, as SpeechBrain) present
            their buckets shortest first, each bucket's batches still shuffled: SortaGrad
            (Amodei et al., 2016, Deep Speech 2), which lets a CTC model align short
            utterances before long ones. 0: every epoch in random batch order.
    """

    def __init__(
        self,
        durations: Sequence[float],
        max_batch_seconds: float,
        shuffle: bool = True,
        seed: int = 0,
        num_buckets: int = 10,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
        drop_uneven: bool = True,
        pad_to_buckets: bool = False,
        pad_quantum: float = 0.0,
        ascending_epochs: int = 0,
    ) -> None:
        if not max_batch_seconds > 0:
            raise DataError(
                f"max_batch_seconds must be positive, got {max_batch_seconds}. "
                "Fix: set a budget in seconds of padded audio per batch, e.g. "
                "data.max_batch_seconds=40."
            )
        self.durations = [float(d) for d in durations]
        bad = [d for d in self.durations if not (math.isfinite(d) and d >= 0)]
        if not self.durations or bad:
            raise DataError(
                f"DurationBatchSampler needs one finite, non-negative duration per item; "
                f"got {len(self.durations)} durations, {len(bad)} bad (e.g. {bad[:3]}). "
                "Fix: check the manifest's duration column and that the split is not empty."
            )
        if num_buckets < 1:
            raise DataError(
                f"num_buckets must be at least 1, got {num_buckets}. Fix: e.g. num_buckets=10."
            )
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise DataError(
                f"Need num_replicas >= 1 and 0 <= rank < num_replicas, got "
                f"num_replicas={num_replicas}, rank={rank}. Fix: pass the world size and "
                "this process's rank from torch.distributed."
            )
        self.max_batch_seconds = float(max_batch_seconds)
        self.shuffle = shuffle
        self.seed = seed
        self.num_buckets = num_buckets
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_uneven = drop_uneven
        self.pad_to_buckets = pad_to_buckets
        self.pad_quantum = float(pad_quantum)
        if ascending_epochs < 0:
            raise DataError(
                f"ascending_epochs must be >= 0, got {ascending_epochs}. Fix: 0 (off) or the "
                "number of first epochs whose batches go shortest first, e.g. 1."
            )
        self.ascending_epochs = ascending_epochs
        self.epoch = 0
        self._skip = 0
        #: Plans of the last two epochs asked: the current one, and the next one that a
        #: stream across epochs (below) computes while the current one still trains.
        self._cache: dict[int, list[list[int]]] = {}
        #: While true, an iteration runs on from the current epoch (past ``skip_batches``)
        #: into the next ones without end: ``amp_utils.loaders.start_epoch`` sets it around
        #: the ``iter()`` of a DataLoader whose workers then load across epoch ends.
        self.spans_epochs = False
        #: The last epoch such an iteration runs into (a run's last epoch: its workers
        #: then load nothing past it); None: without end.
        self.spans_until: int | None = None
        #: Iterations started so far: a stream across epochs is only continued if nobody
        #: iterated the sampler since it began (that would have reset its DataLoader).
        self.iterations = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose batches iterations yield (seeds the shuffle).

        Also clears any resume position set by ``skip_batches``: it belonged to the
        previous epoch.
        """
        self.epoch = epoch
        self._skip = 0

    def skip_batches(self, num_batches: int) -> None:
        """Start the current epoch at batch ``num_batches`` (for resuming mid-epoch).

        The position belongs to the epoch, not to one iteration: every iteration until the
        next ``set_epoch`` starts there and ``len()`` counts the remaining batches. A
        multiprocessing DataLoader may call ``__iter__`` more than once when it starts (it
        discards the first iterator), so a one-shot skip would be lost.
        """
        if num_batches < 0:
            raise DataError(
                f"skip_batches needs a count >= 0, got {num_batches}. Fix: pass the number "
                "of batches of this epoch already trained."
            )
        self._skip = num_batches

    def _buckets(self) -> list[list[int]]:
        """Item indices per bucket, sorted by duration: equal counts, shortest first."""
        order = sorted(range(len(self.durations)), key=lambda i: (self.durations[i], i))
        num_buckets = min(self.num_buckets, len(order))
        bounds = [round(b * len(order) / num_buckets) for b in range(num_buckets + 1)]
        return [order[start:end] for start, end in zip(bounds[:-1], bounds[1:], strict=True)]

    def _edge(self, bucket: list[int]) -> float:
        """A bucket's padded length: its longest duration, rounded up to ``pad_quantum``."""
        longest = max(self.durations[i] for i in bucket)
        if self.pad_quantum <= 0:
            return longest
        return self.pad_quantum * math.ceil(longest / self.pad_quantum - 1e-9)

    def bucket_edges(self) -> list[float]:
        """Each bucket's padded length in seconds (shortest first): what batches pad to."""
        return [self._edge(bucket) for bucket in self._buckets() if bucket]

    def _pack_fixed(self, bucket: list[int]) -> list[list[int]]:
        """Cut a bucket into batches of the count whose padded audio fits the budget."""
        edge = self._edge(bucket)
        size = max(1, int(self.max_batch_seconds // edge)) if edge > 0 else len(bucket)
        batches = [bucket[start : start + size] for start in range(0, len(bucket), size)]
        if self.drop_last and len(batches) > 1 and len(batches[-1]) < size:
            batches.pop()
        return batches

    def _pack(self, bucket: list[int]) -> list[list[int]]:
        """Cut a bucket into batches within the budget (greedily, in the bucket's order)."""
        if self.pad_to_buckets:
            return self._pack_fixed(bucket)
        batches: list[list[int]] = []
        batch: list[int] = []
        longest = 0.0
        for index in bucket:
            duration = self.durations[index]
            new_longest = max(longest, duration)
            if batch and (len(batch) + 1) * new_longest > self.max_batch_seconds:
                batches.append(batch)
                batch, new_longest = [], duration
            batch.append(index)
            longest = new_longest
        if batch:
            incomplete = (len(batch) + 1) * longest <= self.max_batch_seconds
            # a bucket's only batch is kept, as in _pack_fixed: dropping it could leave a
            # small split (every bucket one incomplete batch) with an empty epoch
            if not (self.drop_last and incomplete and batches):
                batches.append(batch)
        return batches

    def _all_batches(self, epoch: int | None = None) -> list[list[int]]:
        """Batches of ``epoch`` (default: the current one) for all ranks together, cached
        for the last two epochs asked. A function of the epoch alone: computing another epoch's
        never changes the current one."""
        epoch = self.epoch if epoch is None else epoch
        if epoch in self._cache:
            return self._cache[epoch]
        # seeded with both, not their sum: seed + epoch gave seed 2's epoch 1 the order of
        # seed 1's epoch 2, so the runs of a sweep over seeds shared their data orders
        rng = random.Random(f"{self.seed}-{epoch}")
        batches: list[list[int]] = []
        for bucket in self._buckets():
            if self.shuffle:
                rng.shuffle(bucket)  # so a bucket's batches come in a random order too
            batches.extend(self._pack(bucket))
        # SortaGrad (epochs 1 to ascending_epochs): the buckets in turn, shortest first
        if self.shuffle and not 0 < epoch <= self.ascending_epochs:
            rng.shuffle(batches)
        self._cache[epoch] = batches
        if len(self._cache) > 2:
            del self._cache[next(iter(self._cache))]  # the oldest
        return batches

    def _kept_batches(self, epoch: int | None = None) -> list[list[int]]:
        """An epoch's batches of all ranks, less the uneven rest (``drop_uneven``)."""
        batches = self._all_batches(epoch)
        if self.drop_uneven:
            batches = batches[: len(batches) - len(batches) % self.num_replicas]
        return batches

    def _rank_batches(self, epoch: int | None = None) -> list[list[int]]:
        return self._kept_batches(epoch)[self.rank :: self.num_replicas]

    def _epochs_from(self, epoch: int, skip: int, until: int | None) -> Iterator[list[int]]:
        """This rank's batches of ``epoch`` past ``skip``, then of every later epoch up to
        ``until`` (None: without end); ends at an epoch without batches (rather than
        looking for one forever)."""
        while until is None or epoch <= until:
            batches = self._rank_batches(epoch)[skip:]
            if not batches and skip == 0:
                return
            yield from batches
            epoch, skip = epoch + 1, 0

    def epoch_fingerprint(self) -> str:
        """A digest of the current epoch's batch plan (all ranks, before any skip).

        A checkpoint saved inside an epoch keeps it: a run resumed there skips the batches
        it trained, which is exact only if the epoch's plan is still the same one (the same
        data, durations, seed and batching options).
        """
        plan = json.dumps(self._all_batches(), separators=(",", ":"))
        return hashlib.sha256(plan.encode("ascii")).hexdigest()[:16]

    def epoch_utterances(self) -> int:
        """Utterances in the current epoch's batches, all ranks together: fewer than
        ``len(durations)`` when batches are dropped (``drop_last``, ``drop_uneven``)."""
        return sum(len(batch) for batch in self._kept_batches())

    def __iter__(self) -> Iterator[list[int]]:
        self.iterations += 1
        if self.spans_epochs:
            return self._epochs_from(self.epoch, self._skip, self.spans_until)
        return iter(self._rank_batches()[self._skip :])

    def __len__(self) -> int:
        """Number of batches this rank yields in the current epoch (after the resume skip)."""
        return max(0, len(self._rank_batches()) - self._skip)
