"""amp_utils.stall_watchdog: a run with no finished batch for a while says where it is stuck."""

from __future__ import annotations

import logging
import threading
import time

import torch
from torch.utils.data import DataLoader

from amp_utils import Stage
from amp_utils.stall_watchdog import StallWatchdog
from tests.test_brain import RegressionBrain, make_data, make_model, run_opts, sgd

#: 0.1 s, in minutes: the tests' stall threshold.
TENTH_OF_A_SECOND = 0.1 / 60


def _watchdog_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "stall-watchdog"]


def stuck_in_an_op(seconds: float) -> None:
    """Stands for a kernel that does not return (sleep, like a torch op, frees the GIL)."""
    time.sleep(seconds)


def test_a_stall_is_logged_with_the_main_threads_stack_then_its_end(caplog):
    where = lambda: "epoch 1/3, TRAIN batch 7 started"  # noqa: E731
    with (
        caplog.at_level(logging.WARNING, logger="amp_utils.stall_watchdog"),
        StallWatchdog(TENTH_OF_A_SECOND, where=where) as dog,
    ):
        started = time.monotonic()
        stuck_in_an_op(0.5)
        dog.beat()
        stalled = time.monotonic() - started  # 0.5 s, more on a loaded host
    messages = [r.getMessage() for r in caplog.records]
    stalls = [m for m in messages if m.startswith("No batch has finished")]
    # 0.5 s of stall with a 0.1 s threshold: one warning per further 0.1 s, not one per poll
    assert 2 <= len(stalls) <= stalled / 0.1 + 1e-6, (stalled, messages)
    assert "(at epoch 1/3, TRAIN batch 7 started)" in stalls[0]
    assert "in stuck_in_an_op" in stalls[0] and "time.sleep(seconds)" in stalls[0]
    assert "kill -9" in stalls[0] and "trainer.stall_warning_minutes" in stalls[0]
    assert messages[-1] == "The stall is over: a batch finished."
    assert not _watchdog_threads()


def test_a_batch_that_finishes_while_a_warning_is_written_ends_the_stall_after_it(caplog):
    """The race CI met: the watchdog decided to warn, the batch finished while it wrote the
    warning. The stall's end must be logged after the warning, and the stall count reset."""
    writing = threading.Event()

    def where() -> str:
        if not writing.is_set():
            writing.set()
            time.sleep(0.2)  # the main thread's beat() lands while the warning is written
        return "epoch 1, TRAIN batch 3 started"

    with (
        caplog.at_level(logging.WARNING, logger="amp_utils.stall_watchdog"),
        StallWatchdog(3 * TENTH_OF_A_SECOND, where=where) as dog,
    ):
        assert writing.wait(10.0)
        dog.beat()
        assert dog.warnings == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("No batch has finished"), messages
    assert messages[1] == "The stall is over: a batch finished."


def test_regular_batches_never_warn(caplog):
    with (
        caplog.at_level(logging.WARNING, logger="amp_utils.stall_watchdog"),
        StallWatchdog(3 * TENTH_OF_A_SECOND) as dog,  # 0.3 s: margin for a loaded CI host
    ):
        for _ in range(20):  # 0.4 s in all: without the beats it would warn
            time.sleep(0.02)
            dog.beat()
    assert not caplog.records


def test_zero_minutes_starts_no_thread_and_nested_use_keeps_one():
    with StallWatchdog(0.0) as dog:
        assert not dog.enabled and not _watchdog_threads()
    dog = StallWatchdog(1.0)
    with dog:
        with dog:  # evaluate() inside fit()
            assert len(_watchdog_threads()) == 1
        assert len(_watchdog_threads()) == 1
    assert not _watchdog_threads()


def test_the_brain_names_stage_batch_and_the_stuck_forward(caplog):
    class StuckOnce(RegressionBrain):
        """The first training batch of epoch 2 takes 0.4 s (a stuck op)."""

        def compute_forward(self, batch, stage):
            if stage == Stage.TRAIN and self.step == 1 and self._stage_epoch == 2:
                stuck_in_an_op(0.4)
            return super().compute_forward(batch, stage)

    brain = StuckOnce(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(stall_warning_minutes=TENTH_OF_A_SECOND),
    )
    data = DataLoader(make_data(), batch_size=8)
    with caplog.at_level(logging.WARNING, logger="amp_utils.stall_watchdog"):
        brain.fit(range(1, 3), data, valid_set=data)
        brain.evaluate(data)
    stalls = [r.getMessage() for r in caplog.records if "No batch has finished" in r.getMessage()]
    # the stuck batch's warning; a loaded host may add one elsewhere (a 0.1 s pause anywhere)
    stuck = [m for m in stalls if "(at epoch 2, TRAIN batch 1 started)" in m]
    assert stuck, [r.getMessage() for r in caplog.records]
    assert "in compute_forward" in stuck[0] and "stuck_in_an_op" in stuck[0]
    assert not _watchdog_threads()
    assert torch.isfinite(torch.tensor(brain.avg_train_loss))


def test_a_long_validation_of_quick_batches_is_no_stall(caplog):
    """Validation and test batches count as progress: sixteen 0.05 s batches (0.8 s in all)
    under a 0.5 s threshold never warn (10x a batch: margin for a loaded CI host)."""

    class SlowEval(RegressionBrain):
        def compute_forward(self, batch, stage):
            if stage != Stage.TRAIN:
                time.sleep(0.05)
            return super().compute_forward(batch, stage)

    brain = SlowEval(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(stall_warning_minutes=5 * TENTH_OF_A_SECOND),
    )
    data = DataLoader(make_data(), batch_size=2)  # 16 batches
    with caplog.at_level(logging.WARNING, logger="amp_utils.stall_watchdog"):
        brain.fit(range(1, 2), data, valid_set=data)
        brain.evaluate(data)
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_brain_default_watchdog_waits_ten_minutes():
    brain = RegressionBrain({"model": make_model()}, run_opts=run_opts())
    assert brain.stall_watchdog.seconds == 600.0
