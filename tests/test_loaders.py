"""Resuming inside an epoch: the remaining batches and the progress bar's total."""

from __future__ import annotations

import signal
import sys
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from amp_utils.brain import Brain, Stage
from amp_utils.loaders import start_epoch
from data.sampler import DurationBatchSampler


def numbered(n: int = 48) -> TensorDataset:
    return TensorDataset(torch.arange(n))


@pytest.mark.parametrize("sampler_skips", [True, False], ids=["skipping_sampler", "loop"])
def test_mid_epoch_resume_yields_the_rest_and_counts_the_whole_epoch(sampler_skips):
    if sampler_skips:
        sampler = DurationBatchSampler([1.0] * 48, max_batch_seconds=4, seed=1, num_buckets=1)
        loader = DataLoader(numbered(), batch_sampler=sampler)
    else:
        loader = DataLoader(numbered(), batch_size=4)
    full = [batch[0].tolist() for batch in start_epoch(loader, epoch=2).batches]
    batches, total = start_epoch(loader, epoch=2, skip=5)
    rest = [batch[0].tolist() for batch in batches]
    assert len(full) == 12 and rest == full[5:]  # the same epoch, its first 5 batches left out
    # A bar with initial=5 must end at 12 of 12: the skipped batches are counted once.
    assert total == 12
    assert 5 + len(rest) == total


def test_timed_batches_reports_how_long_each_batch_took_to_arrive():
    import time

    from amp_utils.loaders import timed_batches

    def slow():
        for i in range(3):
            time.sleep(0.02 * i)
            yield i

    waits: list[float] = []
    assert list(timed_batches(slow(), waits.append)) == [0, 1, 2]
    assert len(waits) == 3 and waits[1] >= 0.02 and waits[2] >= 0.04
    assert waits[0] < waits[2] - 0.02  # the instant first batch: no sleep counted in it


_SEEN_BY_INIT: list[int] = []


def _user_init(worker_id: int) -> None:
    _SEEN_BY_INIT.append(100 + worker_id)


class _WorkerFacts(torch.utils.data.Dataset):
    """Items tell what the worker that made them knows: its death signal, the init's mark."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> tuple[int, int, bool]:
        import ctypes

        death_signal = ctypes.c_int(0)
        ctypes.CDLL(None).prctl(2, ctypes.byref(death_signal), 0, 0, 0)  # PR_GET_PDEATHSIG
        ignores = all(
            signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGTERM, signal.SIGINT)
        )
        return death_signal.value, (_SEEN_BY_INIT[-1] if _SEEN_BY_INIT else -1), ignores


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_loader_workers_are_killed_with_the_training_process_and_run_the_callers_init():
    """Workers of make_loader ask for SIGKILL when the training process dies (an orphan of
    kill -9 otherwise hung in its exit), leave SIGTERM/SIGINT to it (a signal to the process
    group must not break the loader before the checkpoint), then run the caller's own
    worker_init_fn."""
    from amp_utils.distributed import DistributedInfo
    from amp_utils.loaders import make_loader

    loader = make_loader(
        _WorkerFacts(),
        seed=0,
        distributed=DistributedInfo(),
        shard=True,
        num_workers=1,
        batch_size=None,
        worker_init_fn=_user_init,
    )
    assert [tuple(item) for item in loader] == [(signal.SIGKILL, 100, True)] * 2
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN  # only the workers
    assert _SEEN_BY_INIT == []  # it ran in the worker, not here


def _worker_processes() -> list:
    import multiprocessing

    return [p for p in multiprocessing.active_children() if p.is_alive()]


def test_shut_down_workers_ends_a_persistent_loaders_workers_and_keeps_it_usable():
    """A persistent loader's workers outlive a partial epoch; shut_down_workers ends them
    now (left to the garbage collector, each waited 5 s), and the next epoch starts anew."""
    from amp_utils.loaders import shut_down_workers

    loader = DataLoader(numbered(8), batch_size=2, num_workers=2, persistent_workers=True)
    before = set(_worker_processes())
    batches = iter(loader)  # still held, as a paused epoch's iterator may be
    assert next(batches)[0].tolist() == [0, 1]  # a partial epoch: workers stay
    assert len(set(_worker_processes()) - before) == 2
    shut_down_workers(loader)
    assert set(_worker_processes()) - before == set()
    assert [b[0].tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    shut_down_workers(loader)
    shut_down_workers(DataLoader(numbered(4)))  # no workers: nothing to do
    assert set(_worker_processes()) - before == set()


def test_brain_fit_and_evaluate_end_the_workers_of_the_loaders_they_made():
    """Brain makes loaders from datasets (SpeechBrain's API); their persistent workers end
    with fit/evaluate, not at a later garbage collection (a sweep's next job stalled 60 s)."""
    import gc

    from amp_utils.brain import Brain

    class Regression(Brain):
        made: list = []  # a subclass that keeps the loaders it is given

        def make_dataloader(self, *args, **kwargs):
            loader = super().make_dataloader(*args, **kwargs)
            self.made.append(loader)
            return loader

        def compute_forward(self, batch, stage):
            return self.modules.model(batch[0].float().unsqueeze(1))

        def compute_objectives(self, predictions, batch, stage):
            return predictions.pow(2).mean()

    model = torch.nn.Linear(1, 1)
    brain = Regression(
        modules={"model": model},
        opt_class=lambda params: torch.optim.SGD(params, lr=0.01),
        run_opts={"device": "cpu", "noprogressbar": True},
    )
    kwargs = {"batch_size": 4, "num_workers": 2, "persistent_workers": True}
    before = set(_worker_processes())
    gc.disable()  # no collection in between (the sweep stalled when one came later)
    try:
        brain.fit(
            range(1, 3),
            numbered(16),
            numbered(8),
            train_loader_kwargs=kwargs,
            valid_loader_kwargs=kwargs,
        )
        assert set(_worker_processes()) - before == set()
        brain.evaluate(numbered(8), test_loader_kwargs=kwargs)
        assert set(_worker_processes()) - before == set()
        assert len(Regression.made) == 3  # still held, and usable
    finally:
        gc.enable()


class _LoadLog(TensorDataset):
    """``numbered(n)`` that appends each item's index and load time to a file (workers are
    other processes; CLOCK_MONOTONIC is the same for all of them)."""

    def __init__(self, n: int, log_path) -> None:
        super().__init__(torch.arange(n))
        self.log_path = str(log_path)

    def __getitem__(self, index):
        import time

        with open(self.log_path, "a") as log:
            log.write(f"{index} {time.monotonic()}\n")
        return super().__getitem__(index)


class _EpochHalves(torch.utils.data.Sampler):
    """Epoch e reads items 8(e-1) .. 8e-1: each item's index names its epoch."""

    def __init__(self) -> None:
        self.epoch = 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(8 * (self.epoch - 1), 8 * self.epoch))

    def __len__(self) -> int:
        return 8


@pytest.mark.parametrize("prefetch", [True, False])
def test_the_next_epochs_batches_load_while_the_last_one_validates(tmp_path, prefetch):
    """The loader workers load the next epoch's first batches during validation, not after
    it (on an H200 each epoch's first batch waited ~17-20 ms, 12 % of the default recipe's
    graphed epoch); trainer.prefetch_next_epoch=false starts each epoch at its start."""
    import time

    from amp_utils import EpochCounter
    from amp_utils.brain import Brain, Stage

    validation_ends: dict[int, float] = {}

    class Validating(Brain):
        def compute_forward(self, batch, stage):
            if stage == Stage.VALID:
                time.sleep(0.3)  # long enough for the workers to start the next epoch
            return self.modules.model(batch[0].float().unsqueeze(1))

        def compute_objectives(self, predictions, batch, stage):
            return predictions.pow(2).mean()

        def on_stage_end(self, stage, stage_loss, epoch=None):
            if stage == Stage.VALID:
                validation_ends[epoch] = time.monotonic()

    log = tmp_path / "loads.txt"
    train = DataLoader(
        _LoadLog(16, log),
        batch_size=4,
        sampler=_EpochHalves(),
        num_workers=2,
        persistent_workers=True,
    )
    brain = Validating(
        {"model": torch.nn.Linear(1, 1)},
        lambda params: torch.optim.SGD(params, lr=0.01),
        run_opts={"device": "cpu", "noprogressbar": True, "prefetch_next_epoch": prefetch},
    )
    brain.fit(EpochCounter(2), train, DataLoader(numbered(4), batch_size=2))
    loads = [line.split() for line in log.read_text().splitlines()]
    second_epoch = [float(t) for index, t in loads if int(index) >= 8]
    assert len(second_epoch) == 8  # and each item once: the same batches
    early = [t for t in second_epoch if t < validation_ends[1]]
    assert bool(early) == prefetch


class _CountingBatchSampler:
    """Two batches; counts the iterators drawn from it."""

    def __init__(self) -> None:
        self.iterations = 0

    def __iter__(self):
        self.iterations += 1
        return iter([[0, 1], [2, 3]])

    def __len__(self) -> int:
        return 2


def iterations_per_start() -> int:
    """How many iterators a DataLoader with workers draws from its batch sampler when it
    starts, measured now: 2 in torch (its ``__init__``, then ``_reset``); 1 once SpeechBrain
    is imported into the process, which patches ``_reset`` to keep the first one (the peer
    and parity tests import it). The whole-suite runs that read 1 where 2 was written had
    run such a test file first in the same process."""
    sampler = _CountingBatchSampler()
    loader = DataLoader(numbered(4), batch_sampler=sampler, num_workers=1)
    iterator = iter(loader)
    try:
        return sampler.iterations
    finally:
        iterator._shutdown_workers()


def test_the_start_count_is_what_the_dataloader_draws_with_speechbrain_imported_or_not():
    starts = iterations_per_start()
    assert starts in (1, 2)
    patched = "speechbrain" in torch.utils.data.dataloader._BaseDataLoaderIter._reset.__module__
    assert starts == (1 if patched else 2)


def _streaming_loader(log_path=None, n: int = 48, workers: int = 2) -> DataLoader:
    """A persistent-worker loader of ``n`` items of unequal durations, in 4-second
    batches shuffled per epoch (``DurationBatchSampler``: it can stream epochs)."""
    durations = [0.5 + (i * 7 % 11) / 10 for i in range(n)]
    sampler = DurationBatchSampler(durations, max_batch_seconds=4, seed=3, num_buckets=3)
    dataset = _LoadLog(n, log_path) if log_path is not None else numbered(n)
    return DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0
    )


def _epochs_planned(sampler: DurationBatchSampler) -> list[int | None]:
    """The epochs whose batches ``sampler`` is asked for from now on, in order (None: the
    current one), recorded in the main process, where a DataLoader runs its sampler."""
    asked: list[int | None] = []
    plan_of = sampler._rank_batches

    def recorded(epoch: int | None = None) -> list[list[int]]:
        asked.append(epoch)
        return plan_of(epoch)

    sampler._rank_batches = recorded
    return asked


def _plan(loader: DataLoader, epoch: int, skip: int = 0) -> list[list[int]]:
    """What a fresh sampler of the same options yields for ``epoch``: the reference."""
    old = loader.batch_sampler
    sampler = DurationBatchSampler(old.durations, max_batch_seconds=4, seed=3, num_buckets=3)
    sampler.set_epoch(epoch)
    return list(sampler)[skip:]


def test_a_streaming_loader_runs_its_epochs_as_one_iteration_with_each_epochs_batches():
    """Epochs of a persistent-worker loader are one iteration of it: no restart at an
    epoch's start (it waited 14-22 ms per epoch for the workers and a first batch), and
    every epoch holds the batches a restarted loader gives, with its own length."""
    from amp_utils.loaders import shut_down_workers, streams_epochs

    loader = _streaming_loader()
    assert streams_epochs(loader)
    out_of_order = _streaming_loader()
    out_of_order.in_order = False  # an epoch's last batches could follow the next's first
    assert not streams_epochs(out_of_order)
    sampler = loader.batch_sampler
    try:
        for epoch in range(4):
            batches, total = start_epoch(loader, epoch)
            got = [batch[0].tolist() for batch in batches]
            assert got == _plan(loader, epoch) and total == len(got), epoch
            # set_epoch ran for the consumer: len() and the fingerprint are this epoch's
            assert sampler.epoch == epoch and len(loader) == total
        assert sampler.iterations == iterations_per_start()  # the DataLoader's start, once
        assert len({len(_plan(loader, epoch)) for epoch in range(8)}) > 1  # lengths vary
    finally:
        shut_down_workers(loader)


def test_an_epoch_left_early_a_resume_or_another_iteration_restart_the_stream_in_place():
    from amp_utils.loaders import shut_down_workers

    loader = _streaming_loader()
    try:
        batches, _ = start_epoch(loader, 0)
        next(batches)  # a debug run's or a stopped run's epoch, left after one batch
        got = [b[0].tolist() for b in start_epoch(loader, 1).batches]
        assert got == _plan(loader, 1)
        batches, total = start_epoch(loader, 2, skip=3)  # a resume inside epoch 2
        assert [b[0].tolist() for b in batches] == _plan(loader, 2, skip=3)
        assert total == len(_plan(loader, 2))
        assert [b[0].tolist() for b in start_epoch(loader, 3).batches] == _plan(loader, 3)
        loader.batch_sampler.set_epoch(7)
        assert [b[0].tolist() for b in loader] == _plan(loader, 7)  # a plain iteration ...
        got = [b[0].tolist() for b in start_epoch(loader, 4).batches]
        assert got == _plan(loader, 4)  # ... is not taken for epoch 4's start
        shut_down_workers(loader)  # the workers end (a finished run) ...
        got = [b[0].tolist() for b in start_epoch(loader, 5).batches]
        assert got == _plan(loader, 5)  # ... and the next epoch starts new ones
        # stream=False (trainer.prefetch_next_epoch=false): each epoch restarts
        before = loader.batch_sampler.iterations
        got = [b[0].tolist() for b in start_epoch(loader, 6, stream=False).batches]
        assert got == _plan(loader, 6) and loader.batch_sampler.iterations > before
    finally:
        shut_down_workers(loader)


@pytest.mark.parametrize("stream", [True, False])
def test_the_next_epochs_first_batches_load_during_the_last_steps(tmp_path, stream):
    """Streamed, the workers load the next epoch's first batches while the last ones of
    an epoch are still training (a run without validation, or the benchmark's loader
    rows, had nothing to hide the restart under); restarted, nothing loads past the end."""
    import time

    from amp_utils.loaders import shut_down_workers

    log = tmp_path / "loads.txt"
    loader = _streaming_loader(log)
    try:
        batches, total = start_epoch(loader, 0, stream=stream)
        for _ in range(total - 1):
            next(batches)
        # the last step: the workers are idle unless they have more to load
        deadline = time.monotonic() + (10.0 if stream else 0.5)
        while time.monotonic() < deadline:
            loaded = len(log.read_text().splitlines())
            if loaded > 48:  # epoch 0 loads each of the 48 items once
                break
            time.sleep(0.02)
        assert (loaded > 48) == stream, loaded
        assert len(list(batches)) == 1
    finally:
        shut_down_workers(loader)


def test_a_stream_loads_nothing_past_the_last_epoch_and_an_epoch_after_it_starts_anew():
    """With ``last_epoch`` (a run's last epoch, which Brain.fit passes) the workers load
    no batch of the epoch after it: without it they loaded up to ``prefetch_factor *
    num_workers`` batches never trained, during the final validation and test. A later
    epoch (a run extended in the same process) restarts the loader with all its batches."""
    from amp_utils.loaders import shut_down_workers

    loader = _streaming_loader()
    sampler = loader.batch_sampler
    asked = _epochs_planned(sampler)
    try:
        for epoch in (1, 2):
            got = [b[0].tolist() for b in start_epoch(loader, epoch, last_epoch=2).batches]
            assert got == _plan(loader, epoch)
        assert 3 not in asked, asked  # the last batch was taken: the sampler was done
        got = [b[0].tolist() for b in start_epoch(loader, 3, last_epoch=4).batches]
        assert got == _plan(loader, 3)
        assert 4 in asked  # a stream again, up to its new last epoch
        with pytest.raises(ValueError, match="past last_epoch 4"):  # not an empty epoch
            start_epoch(loader, 5, last_epoch=4)
    finally:
        shut_down_workers(loader)


def test_an_epoch_without_batches_ends_the_stream():
    sampler = DurationBatchSampler(
        [1.0] * 3, max_batch_seconds=4, num_buckets=1, num_replicas=2, rank=1
    )
    assert len(sampler) == 0  # one batch for 2 ranks: dropped as uneven
    sampler.spans_epochs = True
    result: list = []
    # not a search for a non-empty epoch that never ends (a thread: that would hang)
    listing = threading.Thread(target=lambda: result.append(list(sampler)), daemon=True)
    listing.start()
    listing.join(timeout=10.0)
    assert result == [[]]


def test_a_fit_over_streamed_epochs_trains_as_one_over_restarted_epochs():
    """Brain.fit streams a DurationBatchSampler loader's epochs (trainer.prefetch_next_epoch,
    the default): the same batches in the same order, so the same weights, as restarting
    the loader at every epoch (prefetch_next_epoch=false); and no restart in between."""
    from amp_utils import EpochCounter
    from amp_utils.brain import Brain
    from amp_utils.loaders import shut_down_workers

    class Regression(Brain):
        def compute_forward(self, batch, stage):
            return self.modules.model(batch[0].float().unsqueeze(1) / 48)

        def compute_objectives(self, predictions, batch, stage):
            return (predictions - 1.0).pow(2).mean()

    weights = {}
    for prefetch in (True, False):
        torch.manual_seed(0)
        loader = _streaming_loader()
        brain = Regression(
            {"model": torch.nn.Linear(1, 1)},
            lambda params: torch.optim.SGD(params, lr=0.1),
            run_opts={"device": "cpu", "noprogressbar": True, "prefetch_next_epoch": prefetch},
        )
        asked = _epochs_planned(loader.batch_sampler)
        try:
            brain.fit(EpochCounter(4), loader)
            weights[prefetch] = [p.detach().clone() for p in brain.modules.parameters()]
            iterations = loader.batch_sampler.iterations
            start = iterations_per_start()
            assert iterations == (start if prefetch else start + 3), iterations  # + 3 restarts
            assert 5 not in asked, asked  # the stream ends with the run's last epoch
        finally:
            shut_down_workers(loader)
    assert all(torch.equal(a, b) for a, b in zip(weights[True], weights[False], strict=True))


class _Regression(Brain):
    """Fits y = 1 on the items' numbers; records each stage's batches and losses."""

    def compute_forward(self, batch, stage):
        self.seen.setdefault((stage, self._stage_epoch), []).append(batch[0].tolist())
        return self.modules.model(batch[0].float().unsqueeze(1) / 48)

    def compute_objectives(self, predictions, batch, stage):
        return (predictions - 1.0).pow(2).mean()

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == Stage.VALID:
            self.valid_losses.append(stage_loss)


def _regression(prefetch: bool) -> _Regression:
    brain = _Regression(
        {"model": torch.nn.Linear(1, 1)},
        lambda params: torch.optim.SGD(params, lr=0.1),
        run_opts={"device": "cpu", "noprogressbar": True, "prefetch_next_epoch": prefetch},
    )
    brain.seen, brain.valid_losses = {}, []
    return brain


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_fit_streams_its_validation_loader_with_the_same_batches(monkeypatch, shuffle):
    """The validation loader's epochs stream too: its workers load the next validation's
    first batches during training instead of restarting at every epoch (~20 ms per epoch on
    an H200's host), with the batches and so the losses of a restarted loader, nothing
    loaded past the run's last validation, and a progress bar that knows its length. A
    validation sampler that shuffles is not streamed: each streamed validation would draw
    another epoch's batches."""
    import amp_utils.brain as brain_module
    from amp_utils import EpochCounter
    from amp_utils.loaders import shut_down_workers

    bars = []
    real_bar = brain_module.tqdm

    def recorded_bar(*args, **kwargs):
        bar = real_bar(*args, **kwargs)
        bars.append((kwargs.get("desc", ""), bar.total))  # total: as given, or len()
        return bar

    monkeypatch.setattr(brain_module, "tqdm", recorded_bar)
    losses = {}
    for prefetch in (True, False):
        torch.manual_seed(0)
        train, valid = _streaming_loader(workers=0), _streaming_loader()
        valid.batch_sampler.shuffle = shuffle  # the recipes' validation samplers: False
        asked = _epochs_planned(valid.batch_sampler)
        brain = _regression(prefetch)
        bars.clear()
        try:
            brain.fit(EpochCounter(3), train, valid)
            iterations = valid.batch_sampler.iterations
            streamed = prefetch and not shuffle
            start = iterations_per_start()
            assert iterations == (start if streamed else start + 2), iterations  # + 2 restarts
            assert 4 not in asked, asked
        finally:
            shut_down_workers(valid)
        validations = [(d, t) for d, t in bars if d.endswith(" valid")]
        for epoch, (_, total) in enumerate(validations, start=1):
            assert total == len(brain.seen[(Stage.VALID, epoch)]), (prefetch, validations)
        losses[prefetch] = brain.valid_losses
    assert len(losses[True]) == 3 and losses[True] == losses[False]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_loader_that_trains_and_validates_gives_each_stage_its_batches(shuffle):
    """``fit(counter, loader, loader)``: no epoch is started before the validation (the
    validation would take its batches: epochs 2 and 3 trained none); every epoch trains its
    whole plan and validates, shuffled (no validation streams) or not (the validations and
    the training epochs then share one stream)."""
    from amp_utils import EpochCounter
    from amp_utils.loaders import shut_down_workers

    loader = _streaming_loader()
    loader.batch_sampler.shuffle = shuffle
    brain = _regression(prefetch=True)
    try:
        brain.fit(EpochCounter(3), loader, loader)
    finally:
        shut_down_workers(loader)
    reference = _streaming_loader()
    reference.batch_sampler.shuffle = shuffle
    for epoch in (1, 2, 3):
        reference.batch_sampler.set_epoch(epoch)
        planned = [batch[0].tolist() for batch in reference]
        assert brain.seen[(Stage.TRAIN, epoch)] == planned, epoch
        assert len(brain.seen[(Stage.VALID, epoch)]) > 0, epoch
    assert all(loss > 0 for loss in brain.valid_losses)


def test_shutting_down_a_streaming_loader_lets_go_of_its_stream():
    """The stream's iterator holds the next epoch's loaded (pinned, on CUDA) batches: a
    finished run's shut-down loader must not keep them until the loader itself is freed."""
    from amp_utils.loaders import _STREAMS, shut_down_workers

    loader = _streaming_loader()
    list(start_epoch(loader, 0).batches)
    assert loader in _STREAMS
    shut_down_workers(loader)
    assert loader not in _STREAMS
