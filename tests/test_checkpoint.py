"""Checkpointer: atomic saves, verification, fallback, retention, clear errors."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from amp_utils import Checkpointer, CheckpointError, EpochCounter


def linear(value: float) -> torch.nn.Linear:
    layer = torch.nn.Linear(2, 2)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(value)
    return layer


def saved_pair(tmp_path):
    model = linear(1.0)
    ckpt = Checkpointer(tmp_path, {"model": model})
    first = ckpt.save_checkpoint(meta={"epoch": 1})
    with torch.no_grad():
        model.weight.fill_(2.0)
    second = ckpt.save_checkpoint(meta={"epoch": 2})
    return first, second


@pytest.mark.parametrize("damage", ["bitflip", "zero_bytes", "truncate", "no_meta"])
def test_corrupt_latest_checkpoint_falls_back_to_previous(tmp_path, damage, caplog):
    first, second = saved_pair(tmp_path)
    state = second.path / "state.pt"
    data = bytearray(state.read_bytes())
    if damage == "bitflip":
        data[len(data) // 2] ^= 0x01
        state.write_bytes(bytes(data))
    elif damage == "zero_bytes":
        state.write_bytes(b"")
    elif damage == "truncate":
        state.write_bytes(bytes(data[: len(data) // 2]))
    else:
        (second.path / "meta.json").unlink()
    target = linear(0.0)
    found = Checkpointer(tmp_path, {"model": target}).recover_if_possible()
    assert found.path == first.path
    assert torch.all(target.weight == 1.0)
    assert second.path.name in caplog.text


def test_leftover_temporary_folder_is_ignored(tmp_path):
    first, _ = saved_pair(tmp_path)
    (tmp_path / ".tmp-CKPT+half-written").mkdir()
    ckpts = Checkpointer(tmp_path).list_checkpoints()
    assert len(ckpts) == 2 and ckpts[0].path == first.path


def test_disk_full_during_save_keeps_previous_checkpoints(tmp_path, monkeypatch):
    first, second = saved_pair(tmp_path)
    ckpt = Checkpointer(tmp_path, {"model": linear(3.0)})

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="No space left.*intact"):
        ckpt.save_checkpoint()
    assert [c.path for c in ckpt.list_checkpoints()] == [first.path, second.path]
    assert not list(tmp_path.glob(".tmp-*"))


def test_refuses_to_save_nonfinite_weights(tmp_path):
    model = linear(float("nan"))
    with pytest.raises(CheckpointError, match="non-finite"):
        Checkpointer(tmp_path, {"model": model}).save_checkpoint()
    assert not list(tmp_path.glob("CKPT+*"))


def test_checkpoint_from_another_model_fails_clearly(tmp_path):
    Checkpointer(tmp_path, {"model": torch.nn.Linear(2, 2)}).save_checkpoint()
    other = Checkpointer(tmp_path, {"model": torch.nn.Linear(3, 5)})
    with pytest.raises(CheckpointError, match="does not fit 'model'.*different model"):
        other.recover_if_possible()
    missing = Checkpointer(tmp_path, {"model": torch.nn.Linear(2, 2), "extra": linear(1.0)})
    with pytest.raises(CheckpointError, match="no state for \\['extra'\\]"):
        missing.recover_if_possible()


def test_unwritable_folder_fails_clearly(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError, match="Cannot create checkpoint folder"):
        Checkpointer(blocker / "ckpts", {"m": linear(1.0)}).save_checkpoint()


def test_keep_recent_and_best(tmp_path):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    for acc in [50.0, 90.0, 70.0, 60.0]:
        ckpt.save_and_keep_only(meta={"acc": acc}, num_to_keep=2, max_keys=["acc"])
    assert sorted(c.meta["acc"] for c in ckpt.list_checkpoints()) == [60.0, 70.0, 90.0]
    assert ckpt.find_checkpoint(max_key="acc").meta["acc"] == 90.0
    assert ckpt.find_checkpoint().meta["acc"] == 60.0


def test_epoch_counter_round_trip():
    counter = EpochCounter(5)
    assert list(counter)[:2] == [1, 2] and counter.current == 5
    other = EpochCounter(7)
    other.load_state_dict({"current": 3})
    assert list(other) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="trainer.epochs"):
        EpochCounter(0)


class _RunsACommand:
    """Unpickling this calls ``os.system(command)``: what a malicious checkpoint would do."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def plant_code_running_checkpoint(checkpoints_dir: Path, marker: Path) -> Path:
    """Replace the newest checkpoint's state with a pickle that would create ``marker``.

    Its metadata (size, SHA-256) is rewritten to match, as an attacker would.
    """
    newest = Checkpointer(checkpoints_dir).find_checkpoint()
    state = newest.path / "state.pt"
    payload = torch.load(state, weights_only=True)
    payload["state"]["evil"] = _RunsACommand(f"touch {marker}")
    torch.save(payload, state)
    meta = json.loads((newest.path / "meta.json").read_text())
    meta["state_bytes"] = state.stat().st_size
    meta["state_sha256"] = hashlib.sha256(state.read_bytes()).hexdigest()
    (newest.path / "meta.json").write_text(json.dumps(meta))
    return newest.path


def test_checkpoint_whose_pickle_runs_code_is_refused_and_runs_nothing(tmp_path):
    saved_pair(tmp_path / "ckpts")
    marker = tmp_path / "pwned"
    planted = plant_code_running_checkpoint(tmp_path / "ckpts", marker)
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path / "ckpts", {"model": linear(0.0)}).recover_if_possible()
    message = str(err.value)
    assert "\n" not in message and str(planted) in message
    assert "Refused" in message and "system" in message and "weights_only" in message
    assert not marker.exists()  # the command never ran


def _epochs_with_cer(tmp_path, cers, num_best):
    """Save one end-of-epoch checkpoint per CER, weights filled with the epoch number."""
    model = linear(0.0)
    model.register_buffer("count", torch.tensor(0))
    ckpt = Checkpointer(tmp_path, {"model": model})
    for epoch, cer in enumerate(cers, start=1):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(epoch))
            model.count.fill_(epoch)
        ckpt.save_and_keep_only(
            meta={"CER": cer, "epoch": epoch}, num_to_keep=1, min_keys=["CER"], num_best=num_best
        )
    return ckpt, model


def test_retention_keeps_the_n_best_and_the_newest(tmp_path):
    ckpt, _ = _epochs_with_cer(tmp_path, [9.0, 3.0, 5.0, 2.0, 7.0, 8.0], num_best=3)
    kept = sorted(c.meta["epoch"] for c in ckpt.list_checkpoints())
    assert kept == [2, 3, 4, 6]  # best three (CER 2, 3, 5) + the newest


def test_a_corrupt_checkpoint_holds_no_place_a_good_one_needs(tmp_path):
    """Epoch 3's file is damaged (same size); the run resumes from epoch 2 and trains
    epochs 3 and 4 again. Rotation counted the damaged one among the last three epochs and
    deleted epoch 2, which the average needs; now the damaged one goes instead."""
    ckpt = Checkpointer(tmp_path, {"model": linear(0.0)})

    def save(epoch):
        ckpt.save_and_keep_only(meta={"epoch": epoch}, num_to_keep=1, num_last_epochs=3)

    for epoch in (1, 2, 3):
        save(epoch)
    damaged = ckpt.list_checkpoints()[-1].path / "state.pt"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    for epoch in (3, 4):  # trained again after the resume from epoch 2
        save(epoch)
    assert [c.meta["epoch"] for c in ckpt.find_last_checkpoints(3)] == [4, 3, 2]
    assert not damaged.exists()  # as retention treats corrupt checkpoints (a test below)


def test_retention_keeps_the_final_epochs_for_averaging_them(tmp_path):
    """``num_last_epochs``: the N most recent end-of-epoch checkpoints stay, a mid-epoch one
    (no metrics) neither counts nor is returned, and the best is still kept."""
    ckpt = Checkpointer(tmp_path, {"model": linear(0.0)})
    for epoch, cer in enumerate([2.0, 9.0, 8.0, 7.0], start=1):
        ckpt.save_and_keep_only(
            meta={"CER": cer, "epoch": epoch}, num_to_keep=1, min_keys=["CER"], num_last_epochs=3
        )
    ckpt.save_and_keep_only(  # as the Brain saves mid-epoch: only mid-epoch ones compete
        meta={"epoch": 5}, end_of_epoch=False, num_to_keep=1, predicate=lambda c: not c.end_of_epoch
    )
    kept = sorted(c.meta["epoch"] for c in ckpt.list_checkpoints())
    assert kept == [1, 2, 3, 4, 5]  # the best (1), the last three epochs (2-4), the newest (5)
    assert [c.meta["epoch"] for c in ckpt.find_last_checkpoints(3)] == [4, 3, 2]  # not 5
    ckpt.save_and_keep_only(
        meta={"CER": 6.0, "epoch": 6}, num_to_keep=1, min_keys=["CER"], num_last_epochs=3
    )
    kept = sorted(c.meta["epoch"] for c in ckpt.list_checkpoints())
    assert kept == [1, 3, 4, 6]  # epoch 2 and the mid-epoch one are gone
    assert [c.meta["epoch"] for c in ckpt.find_last_checkpoints(3)] == [6, 4, 3]
    assert [c.meta["epoch"] for c in ckpt.find_last_checkpoints(9)] == [6, 4, 3, 1]


def test_best_checkpoints_are_ranked_and_averaged(tmp_path):
    ckpt, model = _epochs_with_cer(tmp_path, [9.0, 3.0, 5.0, 2.0], num_best=3)
    best = ckpt.find_best_checkpoints(3, min_key="CER")
    assert [c.meta["epoch"] for c in best] == [4, 2, 3]
    assert [c.meta["epoch"] for c in ckpt.find_best_checkpoints(2)] == [4, 3]  # newest first
    ckpt.load_averaged(best, ["model"])
    assert torch.allclose(model.weight, torch.full((2, 2), 3.0))  # mean of epochs 4, 2, 3
    assert torch.allclose(model.bias, torch.full((2,), 3.0))
    assert int(model.count) == 4  # integer buffers: from the best checkpoint
    ckpt.load_averaged(best[:1], ["model"])
    assert torch.equal(model.weight, torch.full((2, 2), 4.0))  # one: that checkpoint
    with pytest.raises(CheckpointError, match="No checkpoint to average"):
        ckpt.load_averaged([], ["model"])
    with pytest.raises(CheckpointError, match="Cannot average 'optimizer'"):
        ckpt.load_averaged(best, ["optimizer"])


# --- What the tests above left open (found by mutation testing, docs/mutation_testing.md) ---

import logging  # noqa: E402
import pickle  # noqa: E402
import re  # noqa: E402
import time  # noqa: E402

import amp_utils.checkpoint as checkpoint_module  # noqa: E402
from amp_utils.checkpoint import average_state_dicts, read_state  # noqa: E402

LOGGER = "amp_utils.checkpoint"


class Recorder:
    """A recoverable that keeps what it was given (any value, any device)."""

    def __init__(self, state=None) -> None:
        self.state = state if state is not None else {"w": torch.ones(2)}
        self.loaded = None

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.loaded = state


def test_checkpoint_name_meta_and_payload_are_what_was_saved(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    fixed_ns = 1_700_000_001_123_456_789  # the name keeps the last 9 digits: 123456789
    monkeypatch.setattr(time, "time_ns", lambda: fixed_ns)
    ckpt = Checkpointer(tmp_path / "a" / "b", {"model": linear(1.0)})  # parents are created

    saved = ckpt.save_checkpoint(meta={"CER": 3.5, "where": Path("x/y")})

    stamp = time.strftime("%Y-%m-%d+%H-%M-%S", time.localtime(fixed_ns // 10**9))
    assert saved.path == tmp_path / "a" / "b" / f"CKPT+{stamp}+123456789"
    assert saved.end_of_epoch  # the default
    on_disk = json.loads((saved.path / "meta.json").read_text())
    assert saved.meta.keys() == on_disk.keys() and saved.meta["CER"] == 3.5
    assert on_disk["CER"] == 3.5 and on_disk["where"] == "x/y"  # non-JSON values as str
    assert on_disk["end_of_epoch"] is True and on_disk["recoverables"] == ["model"]
    assert on_disk["state_bytes"] == (saved.path / "state.pt").stat().st_size
    assert isinstance(on_disk["unixtime"], float)
    payload = read_state(saved.path / "state.pt")  # default map_location: the CPU
    assert payload["format"] == 1 and set(payload["state"]) == {"model"}
    assert f"Saved checkpoint {saved.path}" in caplog.messages


def test_a_save_hashes_its_bytes_as_written_and_never_reads_them_back(tmp_path, monkeypatch):
    """Each epoch's save read its 28 MB state file back twice (for the checksum, then for
    rotation's check): now the checksum is the bytes' as torch.save writes them, and the
    file a process wrote is not re-hashed by its rotation. Loading still verifies."""
    from amp_utils import checkpoint

    reads = []
    real_sha256 = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: reads.append(path) or real_sha256(path))
    model = linear(1.0)
    ckpt = Checkpointer(tmp_path, {"model": model})
    for epoch in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(epoch))
        saved = ckpt.save_and_keep_only(meta={"epoch": epoch}, num_to_keep=2)
        state = saved.path / "state.pt"
        assert saved.meta["state_sha256"] == hashlib.sha256(state.read_bytes()).hexdigest()
    assert reads == []
    assert [c.meta["epoch"] for c in ckpt.list_checkpoints(verify=False)] == [2, 3]
    # Another process (a resume) verifies what it did not write, once per file version.
    resumed = Checkpointer(tmp_path, {"model": linear(0.0)})
    resumed.keep_only(num_to_keep=2)
    resumed.keep_only(num_to_keep=2)
    assert len(reads) == 2
    assert resumed.recover_if_possible() is not None and len(reads) > 2  # loading hashes


def test_mid_epoch_checkpoints_are_marked_and_left_out_of_the_best(tmp_path):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    ckpt.save_and_keep_only(meta={"CER": 5.0}, num_to_keep=5)
    ckpt.save_and_keep_only(meta={"CER": 1.0}, end_of_epoch=False, num_to_keep=5)
    listed = ckpt.list_checkpoints()
    assert [c.end_of_epoch for c in listed] == [True, False]
    assert [c.meta["CER"] for c in ckpt.find_best_checkpoints(5, min_key="CER")] == [5.0]


def test_checkpoints_are_listed_in_save_order_even_when_names_are_not(tmp_path, monkeypatch):
    """A clock set back (DST, NTP) gives a later checkpoint an earlier name."""
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    for name_ns, unix in [(2_000_000_000 * 10**9, 100.0), (1_000_000_000 * 10**9, 200.0)]:
        monkeypatch.setattr(time, "time_ns", lambda ns=name_ns: ns)
        monkeypatch.setattr(time, "time", lambda t=unix: t)
        ckpt.save_checkpoint(meta={"unix": unix})
    assert [c.meta["unix"] for c in ckpt.list_checkpoints()] == [100.0, 200.0]
    assert ckpt.find_checkpoint().meta["unix"] == 200.0
    # A checkpoint without a recorded time (hand-made) sorts first.
    old = ckpt.list_checkpoints()[1].path / "meta.json"
    meta = json.loads(old.read_text())
    del meta["unixtime"]
    old.write_text(json.dumps(meta))
    assert [c.meta["unix"] for c in ckpt.list_checkpoints()] == [200.0, 100.0]


@pytest.mark.parametrize(
    ("damage", "reason"),
    [("bitflip", "checksum mismatch"), ("truncate", r"size \d+ != recorded \d+")],
)
def test_skipped_checkpoint_warning_names_it_and_the_reason(tmp_path, damage, reason, caplog):
    _, second = saved_pair(tmp_path)
    state = second.path / "state.pt"
    data = bytearray(state.read_bytes())
    if damage == "bitflip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    state.write_bytes(bytes(data))
    Checkpointer(tmp_path).list_checkpoints()
    pattern = f"^Skipping unreadable checkpoint {re.escape(str(second.path))} \\({reason}\\)$"
    assert any(re.match(pattern, m) for m in caplog.messages), caplog.messages


def test_find_checkpoint_by_min_and_max_key_else_the_latest(tmp_path):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    for cer in [4.0, 1.0, 3.0, 2.0]:
        ckpt.save_checkpoint(meta={"CER": cer})
    assert ckpt.find_checkpoint(min_key="CER").meta["CER"] == 1.0
    assert ckpt.find_checkpoint(max_key="CER").meta["CER"] == 4.0
    assert ckpt.find_checkpoint(min_key="WER").meta["CER"] == 2.0  # not recorded: latest
    assert ckpt.find_checkpoint(max_key="WER").meta["CER"] == 2.0
    best = ckpt.find_best_checkpoints(3, max_key="CER")
    assert [c.meta["CER"] for c in best] == [4.0, 3.0, 2.0]
    assert ckpt.find_best_checkpoints(2, max_key="WER") == ckpt.list_checkpoints()[::-1][:2]


@pytest.mark.parametrize(("key", "expected"), [("min_key", 1.0), ("max_key", 4.0)])
def test_recover_if_possible_loads_the_best_by_key(tmp_path, key, expected):
    model = linear(0.0)
    ckpt = Checkpointer(tmp_path, {"model": model})
    for cer in [4.0, 1.0, 3.0]:
        with torch.no_grad():
            model.weight.fill_(cer)
        ckpt.save_checkpoint(meta={"CER": cer})
    target = linear(0.0)
    found = Checkpointer(tmp_path, {"model": target}).recover_if_possible(**{key: "CER"})
    assert found.meta["CER"] == expected
    assert torch.all(target.weight == expected)


def test_map_location_reaches_torch_load(tmp_path, caplog):
    """Tensors are loaded where asked (``meta`` here: no real device needed)."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    Checkpointer(tmp_path, {"model": Recorder()}).save_checkpoint()
    recorder = Recorder()
    ckpt = Checkpointer(tmp_path, {"model": recorder})
    assert read_state(ckpt.find_checkpoint().path / "state.pt", "meta")["state"]["model"][
        "w"
    ].is_meta
    found = ckpt.recover_if_possible(map_location="meta")
    assert recorder.loaded["w"].is_meta
    assert f"Loaded checkpoint {found.path}" in caplog.messages
    ckpt.load_checkpoint(found)  # default: the CPU
    assert recorder.loaded["w"].device == torch.device("cpu")
    ckpt.load_averaged([found], ["model"], map_location="meta")
    assert recorder.loaded["w"].is_meta


def test_partial_and_optional_recoverables(tmp_path):
    Checkpointer(tmp_path, {"model": linear(1.0)}).save_checkpoint()
    extra, model = Recorder(), linear(0.0)
    partial = Checkpointer(tmp_path, {"extra": extra, "model": model}, allow_partial_load=True)
    partial.recover_if_possible()
    assert torch.all(model.weight == 1.0) and extra.loaded is None  # the missing one is skipped
    ckpt = Checkpointer(tmp_path, {"model": linear(0.0)})
    ckpt.add_recoverable("accounting", Recorder(), optional=True)
    ckpt.recover_if_possible()  # an optional recoverable may be missing
    ckpt.add_recoverable("accounting", Recorder())  # registered again, now required
    with pytest.raises(CheckpointError, match=r"no state for \['accounting'\]"):
        ckpt.recover_if_possible()


def test_recoverable_needs_both_state_methods():
    class SaveOnly:
        def state_dict(self):
            return {}

    with pytest.raises(TypeError, match="Recoverable 'x' has no state_dict/load_state_dict"):
        Checkpointer(".", {"x": SaveOnly()})


def test_nonfinite_values_in_nested_lists_are_refused_plain_values_are_fine(tmp_path):
    plain = Recorder({"step": 3, "name": "run", "history": [1.0, torch.tensor(2.0), (4, "a")]})
    assert Checkpointer(tmp_path, {"loop": plain}).save_checkpoint() is not None
    bad = Recorder({"history": [torch.tensor(1.0), (torch.tensor(float("inf")),)]})
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, {"loop": bad}).save_checkpoint()
    assert str(err.value) == (
        "Refusing to save a checkpoint: 'loop' holds non-finite values (NaN/Inf). The previous "
        "checkpoints are kept; lower the learning rate or use bf16 instead of fp16."
    )


def test_only_rank_zero_writes_and_deletes(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    ckpt.save_checkpoint()
    ckpt.save_checkpoint()
    monkeypatch.setattr(checkpoint_module, "is_main_process", lambda: False)
    assert ckpt.save_checkpoint() is None
    ckpt.keep_only(num_to_keep=1)
    assert len(ckpt.list_checkpoints()) == 2  # rank 0 saves and deletes; others only wait
    assert ckpt.save_and_keep_only(num_to_keep=1) is None  # nor rotates after a save
    assert len(ckpt.list_checkpoints()) == 2


def test_retention_defaults_predicate_and_num_to_keep_zero(tmp_path):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    for cer in [1.0, 3.0, 2.0]:
        ckpt.save_and_keep_only(meta={"CER": cer}, num_to_keep=5)
    ckpt.keep_only(min_keys=["CER"])  # defaults: the newest and the one best
    assert [c.meta["CER"] for c in ckpt.list_checkpoints()] == [1.0, 2.0]
    ckpt.save_and_keep_only(meta={"CER": 3.0}, min_keys=["CER"])  # num_best=1: not 2.0
    assert [c.meta["CER"] for c in ckpt.list_checkpoints()] == [1.0, 3.0]
    ckpt.save_and_keep_only(meta={"CER": 0.5})  # defaults: the newest only
    assert [c.meta["CER"] for c in ckpt.list_checkpoints()] == [0.5]

    for cer in [3.0, 4.0]:
        ckpt.save_checkpoint(meta={"CER": cer}, end_of_epoch=False)
    ckpt.save_and_keep_only(
        meta={"CER": 5.0}, end_of_epoch=False, num_to_keep=1, predicate=lambda c: not c.end_of_epoch
    )  # only mid-epoch checkpoints may go: the end-of-epoch ones stay
    assert [c.meta["CER"] for c in ckpt.list_checkpoints()] == [0.5, 5.0]
    ckpt.keep_only(num_to_keep=0, min_keys=["CER"])  # none by age, the best by CER
    assert [c.meta["CER"] for c in ckpt.list_checkpoints()] == [0.5]


def test_mid_epoch_checkpoint_is_superseded_by_the_end_of_its_epoch(tmp_path):
    """The end-of-epoch save deletes the mid-epoch checkpoints before it: one never takes
    a ``num_to_keep`` place from an end-of-epoch checkpoint (it used to, and with
    ``keep_checkpoints=2`` the run kept epoch N and a stale mid-epoch one, not N-1)."""
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    for epoch in (1, 2):
        ckpt.save_checkpoint(meta={"epoch": epoch, "mid": True}, end_of_epoch=False)
        ckpt.save_and_keep_only(meta={"epoch": epoch, "mid": False}, num_to_keep=2)
    kept = [(c.meta["epoch"], c.meta["mid"]) for c in ckpt.list_checkpoints()]
    assert kept == [(1, False), (2, False)]
    ckpt.save_checkpoint(meta={"epoch": 3, "mid": True}, end_of_epoch=False)
    ckpt.keep_only(num_to_keep=2)  # the newer mid-epoch one is what resume needs: it stays
    kept = [(c.meta["epoch"], c.meta["mid"]) for c in ckpt.list_checkpoints()]
    assert kept == [(2, False), (3, True)]


def test_retention_deletes_corrupt_and_half_written_leftovers(tmp_path):
    first, _ = saved_pair(tmp_path)
    state = first.path / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01  # corrupt but of the recorded size: found by hashing only
    state.write_bytes(bytes(data))
    (tmp_path / ".tmp-CKPT+half-written").mkdir()
    (tmp_path / ".tmp-deleted-CKPT+old").mkdir()
    ckpt = Checkpointer(tmp_path)
    ckpt.keep_only(num_to_keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [ckpt.list_checkpoints()[0].path.name]
    assert not first.path.exists()


def test_failing_temporary_folder_gives_a_checkpoint_error(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    ckpt.save_checkpoint()
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.startswith(".tmp-"):
            raise OSError(errno.EACCES, "Permission denied")
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    with pytest.raises(CheckpointError) as err:
        ckpt.save_checkpoint()
    assert "Permission denied" in str(err.value)
    assert str(err.value).endswith(
        "Earlier checkpoints are intact; free disk space or choose another output folder."
    )
    assert len(ckpt.list_checkpoints()) == 1


def test_unwritable_folder_message_says_what_to_do(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(CheckpointError) as err:
        Checkpointer(blocker / "ckpts", {"m": linear(1.0)}).save_checkpoint()
    assert str(err.value).endswith("Point the run at a writable folder (hydra.run.dir=PATH).")


def test_load_errors_say_what_is_wrong_on_one_line(tmp_path):
    Checkpointer(tmp_path, {"model": torch.nn.Linear(2, 2)}).save_checkpoint()
    saved = torch.load(next(tmp_path.glob("CKPT+*")) / "state.pt", weights_only=True)
    other = torch.nn.Linear(3, 5)
    with pytest.raises(RuntimeError) as torch_err:
        other.load_state_dict(saved["state"]["model"])
    detail = " ".join(str(torch_err.value).split())[:300]
    assert len(str(torch_err.value)) > 300  # the detail is cut
    with pytest.raises(CheckpointError) as err:
        Checkpointer(tmp_path, {"model": other}).recover_if_possible()
    assert str(err.value).endswith(
        "different model or configuration; use a fresh run folder or the matching config. "
        f"({detail})"
    )
    missing = Checkpointer(tmp_path, {"model": torch.nn.Linear(2, 2), "extra": linear(1.0)})
    with pytest.raises(CheckpointError) as err:
        missing.recover_if_possible()
    assert str(err.value).endswith(
        "it was written by a different recipe. Start a fresh run folder or point at the right "
        "checkpoint."
    )


def test_unreadable_state_error_is_one_line_with_a_bounded_detail(tmp_path, monkeypatch):
    saved = Checkpointer(tmp_path, {"model": linear(1.0)}).save_checkpoint()
    path = tmp_path / "state.pt"
    path.write_bytes((saved.path / "state.pt").read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError) as err:
        read_state(path)
    assert str(err.value) == (
        f"Cannot read checkpoint {path}: it is not a PyTorch checkpoint (torch.save writes a "
        "zip archive; this file is not one: truncated, or another file). Delete this "
        "checkpoint folder to resume from an older one."
    )

    def long_error(*args, **kwargs):
        raise RuntimeError("word\n" * 100)

    monkeypatch.setattr(torch, "load", long_error)
    with pytest.raises(CheckpointError) as err:
        read_state(saved.path / "state.pt")  # a zip archive that torch cannot load
    detail = ("word " * 60)[:300]
    assert str(err.value) == f"Cannot read checkpoint {saved.path / 'state.pt'}: {detail}"


def test_refused_pickle_message_without_a_named_global(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError("Weights only load failed for some other reason")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError) as err:
        read_state(tmp_path / "state.pt")
    assert str(err.value) == (
        f"Refused to load {tmp_path / 'state.pt'}: it would import Python objects, and "
        "checkpoints may hold only tensors and plain data (loaded with weights_only=True, "
        "nothing was run). Only use run folders you trust, or delete this checkpoint."
    )


def test_averaging_errors_and_log(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0), "other": Recorder()})
    first = ckpt.save_checkpoint()
    ckpt.recoverables.pop("other")
    with pytest.raises(CheckpointError) as err:  # in the checkpoint, not registered
        ckpt.load_averaged([first], ["model", "other"])
    assert str(err.value) == "Cannot average 'other': missing from the recoverables."
    second = ckpt.save_checkpoint()  # without "other"
    ckpt.add_recoverable("other", Recorder())
    with pytest.raises(CheckpointError) as err:  # registered, not in every checkpoint
        ckpt.load_averaged([first, second], ["other"])
    assert str(err.value) == f"Cannot average 'other': missing from ['{second.path.name}']."
    with pytest.raises(CheckpointError) as err:
        ckpt.load_averaged([], ["model"])
    assert str(err.value) == "No checkpoint to average: train at least one epoch first."
    ckpt.load_averaged([first, second], ["model"])
    assert (
        f"Loaded the average of 2 checkpoints: {first.path.name}, {second.path.name}"
        in caplog.messages
    )


def test_average_is_taken_in_float64_and_keeps_the_dtype():
    big = torch.full((3,), 60000.0, dtype=torch.float16)  # fp16 sums would overflow
    states = [{"w": big, "n": torch.tensor(1)}, {"w": big, "n": torch.tensor(2)}] * 2
    averaged = average_state_dicts(states)
    assert averaged["w"].dtype == torch.float16
    assert torch.equal(averaged["w"], big)
    assert averaged["n"] is states[0]["n"]


class _HeldWrites:
    """Holds the background writer before it writes, until ``release()``."""

    def __init__(self, monkeypatch) -> None:
        import threading

        from amp_utils import checkpoint

        self.go = threading.Event()
        self.started = threading.Event()
        write = checkpoint.Checkpointer._write

        def held(ckpt, *args, **kwargs):
            self.started.set()
            assert self.go.wait(10), "the test never released the writer"
            return write(ckpt, *args, **kwargs)

        monkeypatch.setattr(checkpoint.Checkpointer, "_write", held)

    def release(self) -> None:
        self.go.set()


def test_a_background_write_holds_the_state_of_the_moment_of_the_save(tmp_path, monkeypatch):
    """The loop goes on changing its tensors in place while the writer thread writes: the
    checkpoint must hold them as they were when ``save`` returned, and a BatchNorm's state
    dict keeps the version metadata that loading reads."""
    held = _HeldWrites(monkeypatch)
    model = torch.nn.Sequential(linear(1.0), torch.nn.BatchNorm1d(2))
    ckpt = Checkpointer(tmp_path, {"model": model}, background_writes=True)
    assert ckpt.save_and_keep_only(meta={"epoch": 1}) is None  # returns before it is written
    assert held.started.wait(10)
    with torch.no_grad():
        model[0].weight.fill_(5.0)  # the next steps, while the writer is held
    assert not list(tmp_path.glob("CKPT+*"))
    held.release()
    ckpt.wait()
    (saved,) = Checkpointer(tmp_path).list_checkpoints()
    state = read_state(saved.path / "state.pt")["state"]["model"]
    assert torch.equal(state["0.weight"], torch.ones(2, 2))
    assert state._metadata[""]["version"] == model.state_dict()._metadata[""]["version"]
    assert state._metadata["1"] == model.state_dict()._metadata["1"]
    assert saved.meta["epoch"] == 1


def test_reading_the_checkpoints_waits_for_the_background_write(tmp_path, monkeypatch):
    """Listing, finding and loading see a save that ``save`` already returned from."""
    import threading

    held = _HeldWrites(monkeypatch)
    model = linear(1.0)
    ckpt = Checkpointer(tmp_path, {"model": model}, background_writes=True)
    for epoch in (1, 2, 3):
        ckpt.save_and_keep_only(
            meta={"epoch": epoch, "CER": float(epoch)}, num_to_keep=1, min_keys=["CER"]
        )
        if epoch == 1:
            assert held.started.wait(10)
            threading.Timer(0.2, held.release).start()
    # rotation ran after each write: the newest and the best (epoch 1) are left
    assert [c.meta["epoch"] for c in ckpt.list_checkpoints()] == [1, 3]
    assert ckpt.find_checkpoint(min_key="CER").meta["epoch"] == 1
    ckpt.save_checkpoint(meta={"epoch": 4})
    assert ckpt.recover_if_possible().meta["epoch"] == 4


def test_a_failed_background_write_is_raised_by_the_next_call(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)}, background_writes=True)
    ckpt.save_checkpoint(meta={"epoch": 1})
    ckpt.wait()

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    assert ckpt.save_and_keep_only(meta={"epoch": 2}) is None
    with pytest.raises(CheckpointError, match="No space left.*Earlier checkpoints are intact"):
        ckpt.list_checkpoints()
    ckpt.wait()  # raised once
    assert [c.meta["epoch"] for c in ckpt.list_checkpoints()] == [1]
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_background_save_of_nonfinite_weights_is_refused_by_the_writer(tmp_path):
    """The finiteness check runs in the writer thread: the refusal comes from the next
    call, and nothing is written."""
    model = linear(1.0)
    ckpt = Checkpointer(tmp_path, {"model": model}, background_writes=True)
    ckpt.save_checkpoint(meta={"epoch": 1})
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert ckpt.save_and_keep_only(meta={"epoch": 2}) is None
    with torch.no_grad():
        model.weight[0, 0] = 1.0  # the snapshot was taken at the save
    with pytest.raises(CheckpointError, match="'model' holds non-finite values"):
        ckpt.wait()
    assert [c.meta["epoch"] for c in ckpt.list_checkpoints()] == [1]


def test_a_save_syncs_its_files_before_the_rename_and_the_folder_after_it(tmp_path, monkeypatch):
    """A power loss or kernel crash after a save must leave the checkpoint whole or absent:
    ``state.pt`` and ``meta.json`` reach the disk before the folder is renamed into place,
    and the rename itself is made durable by syncing the checkpoints folder. Without the
    file syncs the renamed folder could hold empty or partial files after a crash (the old
    checkpoints already rotated away); nothing else in the suite would notice."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", f"{src} -> {dst}"))
        return real_replace(src, dst, *args, **kwargs)

    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name the synced files")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    saved = Checkpointer(tmp_path, {"model": linear(1.0)}).save_checkpoint()

    renames = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(renames) == 1 and events[renames[0]][1].endswith(f" -> {saved.path}")
    before = {Path(path).name for kind, path in events[: renames[0]] if kind == "fsync"}
    after = [Path(path) for kind, path in events[renames[0] :] if kind == "fsync"]
    assert {"state.pt", "meta.json"} <= before, events
    assert tmp_path.resolve() in [p.resolve() for p in after], events


def test_a_kill_while_rotation_deletes_leaves_no_half_deleted_checkpoint(
    tmp_path, monkeypatch, caplog
):
    """Rotation renames a checkpoint out of sight before removing its files: a kill in the
    middle of the removal (here: after ``state.pt`` went) leaves a hidden leftover that the
    next rotation clears, never a ``CKPT+*`` folder without its state, which every later
    listing would warn about and no rotation would ever delete (it is not listed)."""
    from amp_utils import checkpoint

    model = linear(1.0)
    ckpt = Checkpointer(tmp_path, {"model": model})
    first = ckpt.save_checkpoint(meta={"epoch": 1})
    real_rmtree = checkpoint.shutil.rmtree

    def killed_half_way(path, *args, **kwargs):
        (Path(path) / "state.pt").unlink()
        raise KeyboardInterrupt  # stands for the kill

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_and_keep_only(meta={"epoch": 2}, num_to_keep=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)

    resumed = Checkpointer(tmp_path, {"model": linear(0.0)})
    with caplog.at_level(logging.WARNING):
        listed = resumed.list_checkpoints()
    assert [c.meta["epoch"] for c in listed] == [2] and "Skipping" not in caplog.text
    resumed.keep_only(num_to_keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [listed[0].path.name]
    assert not first.path.exists()


def test_a_kill_while_a_save_writes_leaves_only_complete_checkpoints(tmp_path, monkeypatch, caplog):
    """A kill inside ``torch.save`` (not an OSError: nothing cleans up after it) leaves the
    half-written state under the temporary name only: the restarted run lists the earlier
    checkpoint alone, without a warning, and its next rotation clears the leftover."""
    from amp_utils import checkpoint

    ckpt = Checkpointer(tmp_path, {"model": linear(1.0)})
    first = ckpt.save_checkpoint(meta={"epoch": 1})

    def killed_while_writing(obj, file, *args, **kwargs):
        file.write(b"PK\x03\x04 half of a zip archive")
        raise KeyboardInterrupt  # stands for the kill

    monkeypatch.setattr(checkpoint.torch, "save", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(meta={"epoch": 2})
    monkeypatch.undo()

    resumed = Checkpointer(tmp_path, {"model": linear(0.0)})
    with caplog.at_level(logging.WARNING):
        assert [c.path for c in resumed.list_checkpoints()] == [first.path]
    assert "Skipping" not in caplog.text
    resumed.keep_only(num_to_keep=1)
    assert [p.name for p in tmp_path.iterdir()] == [first.path.name]
