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
