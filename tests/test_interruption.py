"""Mid-epoch checkpoint policy and signal catching, without a training loop."""

from __future__ import annotations

import os
import signal

import pytest

from amp_utils.interruption import (
    MidEpochCheckpointPolicy,
    MidEpochDecision,
    StopSignals,
    TrainingInterrupted,
    interrupted_error,
)


def test_policy_saves_every_n_steps_and_only_with_a_checkpointer():
    policy = MidEpochCheckpointPolicy(interval_steps=3)
    saves = [policy.decide(s, s, False, can_save=True).save for s in range(1, 8)]
    assert saves == [False, False, True, False, False, True, False]
    assert policy.decide(3, 3, False, can_save=False) == MidEpochDecision(False, False)


def test_policy_saves_by_time_and_the_clock_restarts_after_a_save():
    policy = MidEpochCheckpointPolicy(interval_minutes=1.0)
    assert not policy.decide(1, 1, False, can_save=True).save
    policy.last_save_time -= 61
    assert policy.decide(2, 2, False, can_save=True).save
    policy.saved()
    assert not policy.decide(3, 3, False, can_save=True).save


def test_a_signal_means_save_and_stop_even_without_a_checkpointer():
    policy = MidEpochCheckpointPolicy()
    assert policy.decide(1, 0, True, can_save=False) == MidEpochDecision(True, True)


def test_a_stop_all_ranks_agreed_on_needs_no_joint_decision_point():
    """Between joint decisions (every 4 updates here) the ranks still stop at once when
    they all know of a signal (read from the loss all-reduce); no collective is made."""
    policy = MidEpochCheckpointPolicy(world_size=2, decide_every=4)
    assert policy.decide(3, 3, False, can_save=True) == MidEpochDecision(False, False)
    agreed = policy.decide(3, 3, False, can_save=True, agreed_stop=True)
    assert agreed == MidEpochDecision(True, True)


def test_stop_signals_remember_the_first_and_restore_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with StopSignals() as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        assert caught.received == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_repeated_at_once_is_the_same_request(monkeypatch):
    """Under SLURM a torchrun rank gets the job's SIGTERM and torchrun's forwarded copy
    milliseconds apart: that must not stop it before its checkpoint. A later SIGTERM, or
    a second Ctrl-C, still stops at once."""
    clock = {"now": 100.0}
    monkeypatch.setattr("amp_utils.interruption.time.monotonic", lambda: clock["now"])
    with StopSignals() as caught:
        os.kill(os.getpid(), signal.SIGTERM)
        clock["now"] += 0.01
        os.kill(os.getpid(), signal.SIGTERM)  # the forwarded copy: nothing raised
        assert caught.received == signal.SIGTERM
        clock["now"] += StopSignals.REPEAT_WINDOW_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
    with StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: stop now, however fast
            os.kill(os.getpid(), signal.SIGINT)
    with StopSignals():
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)


def test_after_a_signal_the_workers_ends_raise_nothing_until_the_context_ends():
    """A process-group signal ends the DataLoader workers too: PyTorch's SIGCHLD handler
    would raise mid-batch, so after the first signal SIGCHLD is left to its default."""

    def torch_like(signum, frame):  # stands in for the DataLoader's SIGCHLD handler
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")

    before = signal.signal(signal.SIGCHLD, torch_like)
    try:
        with StopSignals():
            assert signal.getsignal(signal.SIGCHLD) is torch_like  # until a signal comes
            os.kill(os.getpid(), signal.SIGINT)
            assert signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL
            os.kill(os.getpid(), signal.SIGCHLD)  # a worker's end: nothing raised
        assert signal.getsignal(signal.SIGCHLD) is torch_like
    finally:
        signal.signal(signal.SIGCHLD, before)


def test_interrupted_error_names_the_signal_and_how_to_resume():
    error = interrupted_error(signal.SIGINT, 2, 5)
    assert isinstance(error, TrainingInterrupted)
    assert "SIGINT" in str(error) and "epoch 2, batch 5" in str(error)
    assert "Run the same command again" in str(error)
