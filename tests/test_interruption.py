"""Mid-epoch checkpoint policy and signal catching, without a training loop."""

from __future__ import annotations

import os
import signal

import pytest

from amp_utils.interruption import (
    RESUME_HINT,
    MidEpochCheckpointPolicy,
    MidEpochDecision,
    RunInterrupted,
    RunSignals,
    StopSignals,
    TrainingInterrupted,
    interrupted_error,
    run_phase,
    signals_held,
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


def test_outside_fit_a_signal_stops_at_once_naming_what_the_run_was_doing():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(RunInterrupted) as caught, RunSignals():
        with run_phase("preparing the data"):
            pass
        with run_phase("testing the best checkpoint"):
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: the same exit, no traceback
            pytest.fail("not stopped at once")
    assert isinstance(caught.value, TrainingInterrupted | SystemExit)
    assert str(caught.value) == (
        "Received SIGINT while testing the best checkpoint: stopped there; nothing recorded "
        f"was lost (no file is left half-written). {RESUME_HINT}"
    )
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_held_block_is_finished_before_the_signal_stops_the_run():
    """Records written together (TensorBoard's final figures, then results.json) are all
    written; a forwarded copy of the SIGTERM changes nothing, another signal stops now."""
    done = []
    with pytest.raises(RunInterrupted, match="while writing the results"), RunSignals():
        with run_phase("writing the results"), signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # torchrun's forwarded copy
            done.append("tensorboard")
            done.append("results.json")
        pytest.fail("not stopped at the end of the held block")
    assert done == ["tensorboard", "results.json"]
    with pytest.raises(KeyboardInterrupt), RunSignals(), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the SIGTERM: stop now


def test_a_held_block_that_fails_raises_its_own_error():
    with pytest.raises(ValueError, match="disk"), RunSignals(), signals_held():
        os.kill(os.getpid(), signal.SIGTERM)
        raise ValueError("disk full")


def test_run_phase_changes_no_handler_without_run_signals_unless_asked():
    """Library use (a Brain outside the recipes) keeps the signals' usual handling."""
    before = signal.getsignal(signal.SIGTERM)
    with run_phase("loading the checkpoint to resume from"):
        assert signal.getsignal(signal.SIGTERM) is before
    with run_phase("evaluating", hint="Run it again.", install=True):
        assert signal.getsignal(signal.SIGTERM) is not before
        with pytest.raises(RunInterrupted, match=r"while evaluating: .* Run it again\.$"):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_fit_caught_after_its_last_look_stops_the_run_when_fit_ends():
    """Inside fit StopSignals takes over; a signal it caught that ended nothing (after the
    loop's last look: the last checkpoint's write) stops the run when it exits, instead of
    the run going on to test as if none had come."""
    with pytest.raises(RunInterrupted, match="Received SIGTERM while training"), RunSignals():
        with run_phase("training"), StopSignals() as caught:
            os.kill(os.getpid(), signal.SIGTERM)
            assert caught.received == signal.SIGTERM  # no exception inside fit
        pytest.fail("the caught signal was dropped")
    with pytest.raises(TrainingInterrupted) as saved, RunSignals(), StopSignals():
        os.kill(os.getpid(), signal.SIGTERM)
        raise interrupted_error(signal.SIGTERM, 1, 3)  # fit's own exit stands alone
    assert "saved a checkpoint" in str(saved.value)
    with pytest.raises(TrainingInterrupted) as saved, RunSignals():
        try:
            with StopSignals():
                os.kill(os.getpid(), signal.SIGTERM)
                raise interrupted_error(signal.SIGTERM, 1, 3)
        finally:  # torchrun's forwarded copy, after fit stopped: the same request
            os.kill(os.getpid(), signal.SIGTERM)
    assert "saved a checkpoint" in str(saved.value)
    with StopSignals() as caught:  # without RunSignals (library use) nothing more happens
        os.kill(os.getpid(), signal.SIGTERM)
    assert caught.received == signal.SIGTERM
