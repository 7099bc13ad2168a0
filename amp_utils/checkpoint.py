"""Atomic, verified checkpoints of everything a run needs to continue exactly.

A checkpoint is a folder ``CKPT+<time>+<seq>/`` holding ``state.pt`` (the state dicts of
all registered recoverables) and ``meta.json`` (user metadata such as ``{"CER": 3.1}``, plus
the size and SHA-256 of ``state.pt``). The folder is written under a temporary name and
renamed into place, so a kill at any moment leaves either the old set of checkpoints or the
new one, never a half-written checkpoint. On load the checksum is verified; a corrupt or
truncated checkpoint is skipped with a warning naming it, and the previous good one is used.

``state.pt`` is loaded with ``torch.load(weights_only=True)``: tensors, numbers, strings and
plain containers only (what the state dicts of modules, optimizers, schedulers, scalers and
the loop hold, Python's RNG state included). A pickle that would import or call anything
else (e.g. ``os.system``) is refused before it runs: run folders are passed around, and
loading one must not execute code from it.

Under DDP only rank 0 writes and deletes checkpoints; every rank waits until they are on
disk, and every rank can load them (the run folder must be on a shared filesystem when
the ranks span several nodes).

With ``background_writes`` (a single process), a save copies the state to host memory and
returns; a writer thread serialises, hashes, writes, syncs and rotates it while training
goes on, as Lightning's ``AsyncCheckpointIO`` does. The next save, ``keep_only`` and
``list_checkpoints`` (through which the Checkpointer finds what it loads and averages)
first wait for that write, and re-raise its error; a kill during it leaves the previous
checkpoints, as a kill during a foreground save does. The copy does not keep tensors that
shared storage shared (tied weights are written twice; they load the same).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from amp_utils.atomic import fsync_directory
from amp_utils.distributed import ddp_barrier, distributed_info, is_main_process

logger = logging.getLogger(__name__)

CKPT_PREFIX = "CKPT+"
TMP_PREFIX = ".tmp-"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
FORMAT_VERSION = 1


class Recoverable(Protocol):
    """Anything with ``state_dict``/``load_state_dict`` (modules, optimizers, scalers...)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or does not fit what is being restored."""


@dataclass(frozen=True)
class Checkpoint:
    """A verified checkpoint on disk."""

    path: Path
    meta: dict[str, Any]

    @property
    def end_of_epoch(self) -> bool:
        """Whether the checkpoint was saved at the end of an epoch (not mid-epoch)."""
        return bool(self.meta.get("end_of_epoch", True))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingWriter:
    """A binary file that hashes (SHA-256) what is written through it.

    ``torch.save`` streams a checkpoint through it, so the checksum comes from the bytes as
    they are written instead of from reading the file back (one 28 MB read and hash less per
    save of the default recipe, ~34 ms on a 2-core CPU).
    """

    def __init__(self, file: Any) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def _delete(path: Path) -> None:
    """Delete a checkpoint atomically: rename it out of sight first, then remove it.

    A kill during ``rmtree`` would otherwise leave a half-deleted ``CKPT+*`` folder.
    """
    hidden = path.with_name(f"{TMP_PREFIX}deleted-{path.name}")
    try:
        os.replace(path, hidden)
    except OSError:
        return
    shutil.rmtree(hidden, ignore_errors=True)


def read_state(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """The payload of a ``state.pt``, loaded as weights only (no code runs).

    Raises:
        CheckpointError: one line, if the file holds anything but tensors and plain data
            (a pickle that would import or call a Python object), or cannot be read.
    """
    if Path(path).is_file() and not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"Cannot read checkpoint {path}: it is not a PyTorch checkpoint (torch.save "
            "writes a zip archive; this file is not one: truncated, or another file). "
            "Delete this checkpoint folder to resume from an older one."
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))  # wording differs across versions
        what = f"the Python object {found.group(1)}" if found else "Python objects"
        raise CheckpointError(
            f"Refused to load {path}: it would import {what}, and checkpoints may hold "
            "only tensors and plain data (loaded with weights_only=True, nothing was run). "
            "Only use run folders you trust, or delete this checkpoint."
        ) from None
    except Exception as err:  # noqa: BLE001 - any other error means unreadable
        detail = " ".join(str(err).split())[:300]
        raise CheckpointError(f"Cannot read checkpoint {path}: {detail}") from err


def _all_finite(state: Any) -> bool:
    """Whether every floating-point tensor inside ``state`` (nested dicts/lists) is finite."""
    if isinstance(state, torch.Tensor):
        return not state.is_floating_point() or bool(torch.isfinite(state).all())
    if isinstance(state, Mapping):
        return all(_all_finite(v) for v in state.values())
    if isinstance(state, list | tuple):
        return all(_all_finite(v) for v in state)
    return True


def _host_snapshot(value: Any) -> Any:
    """A copy of a state dict that training cannot change any more: every tensor copied to
    host memory, containers rebuilt, anything else deep-copied (a module state dict's
    ``_metadata``, which loading reads, included)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        items = [(k, _host_snapshot(v)) for k, v in value.items()]
        out: dict[Any, Any] = OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
        if hasattr(value, "_metadata"):
            out._metadata = copy.deepcopy(value._metadata)  # type: ignore[attr-defined]
        return out
    if isinstance(value, list | tuple):
        return type(value)(_host_snapshot(v) for v in value)
    return copy.deepcopy(value)


class Checkpointer:
    """Saves and restores a set of named recoverables (SpeechBrain-style API).

    Args:
        checkpoints_dir: folder that holds the ``CKPT+*`` folders; created if missing.
        recoverables: name -> object with ``state_dict``/``load_state_dict``.
        allow_partial_load: tolerate recoverables missing from a checkpoint.
        background_writes: a save returns once the state is copied to host memory and a
            writer thread puts it on disk (see the module's docstring); single process
            only (under DDP saves stay in the foreground). ``wait()`` returns once it is
            on disk.
    """

    def __init__(
        self,
        checkpoints_dir: str | Path,
        recoverables: Mapping[str, Recoverable] | None = None,
        allow_partial_load: bool = False,
        background_writes: bool = False,
    ) -> None:
        self.checkpoints_dir = Path(checkpoints_dir)
        self.background_writes = background_writes
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future[Any] | None = None
        self.recoverables: dict[str, Recoverable] = {}
        self.optional: set[str] = set()  # recoverables a checkpoint may lack
        self.allow_partial_load = allow_partial_load
        # (state file, size, mtime) -> its SHA-256 matched: each file is hashed once
        self._verified: dict[tuple[str, int, int], bool] = {}
        if recoverables:
            self.add_recoverables(recoverables)

    def add_recoverable(self, name: str, obj: Recoverable, optional: bool = False) -> None:
        """Register one object to save and restore under ``name``.

        ``optional``: a checkpoint without state for it still loads (the object keeps its
        own state); for state added after checkpoints were written, e.g. run accounting.
        """
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(f"Recoverable {name!r} has no state_dict/load_state_dict.")
        self.recoverables[name] = obj
        if optional:
            self.optional.add(name)
        else:
            self.optional.discard(name)

    def add_recoverables(self, recoverables: Mapping[str, Recoverable]) -> None:
        """Register several objects at once."""
        for name, obj in recoverables.items():
            self.add_recoverable(name, obj)

    # ------------------------------------------------------------------ saving
    def wait(self) -> None:
        """Return once the checkpoint being written in the background, if any, is on disk.

        Raises:
            CheckpointError: that write failed (e.g. disk full); the checkpoints before it
                are intact.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def save_checkpoint(
        self, meta: Mapping[str, Any] | None = None, end_of_epoch: bool = True
    ) -> Checkpoint | None:
        """Write a new checkpoint atomically and return it.

        Under DDP, rank 0 writes it and the other ranks get None; all ranks return once
        it is on disk. With ``background_writes`` it returns None once the state is
        copied, and the writer thread puts it on disk.

        Raises:
            CheckpointError: if a floating-point tensor is not finite (a checkpoint never
                holds NaN/Inf weights) or the folder cannot be written (e.g. disk full);
                existing checkpoints are left untouched. A background write's error comes
                from the Checkpointer's next call (``wait``).
        """
        return self._save(meta, end_of_epoch, rotate=None)

    def _save(
        self,
        meta: Mapping[str, Any] | None,
        end_of_epoch: bool,
        rotate: Callable[[], None] | None,
    ) -> Checkpoint | None:
        """Save, then ``rotate`` (delete what is not kept: rank 0, every rank waiting for
        it), in the foreground or the background (``background_writes``, one process)."""
        self.wait()
        state = {name: obj.state_dict() for name, obj in self.recoverables.items()}
        if self.background_writes and distributed_info().world_size == 1:
            state = _host_snapshot(state)  # training goes on changing the live tensors
            meta = copy.deepcopy(dict(meta or {}))
            if self._writer is None:
                self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
            self._pending = self._writer.submit(
                self._write_and_rotate, state, meta, end_of_epoch, rotate
            )
            return None
        self._check_finite(state)
        ckpt = self._write(state, meta, end_of_epoch) if is_main_process() else None
        ddp_barrier()
        if rotate is not None:
            if is_main_process():
                rotate()
            ddp_barrier()
        return ckpt

    def _write_and_rotate(
        self,
        state: dict[str, Any],
        meta: Mapping[str, Any],
        end_of_epoch: bool,
        rotate: Callable[[], None] | None,
    ) -> Checkpoint:
        # In the writer thread, off the loop: ~24 ms for the default recipe's 506 tensors.
        self._check_finite(state)
        ckpt = self._write(state, meta, end_of_epoch)
        if rotate is not None:
            rotate()
        return ckpt

    def _check_finite(self, state: dict[str, Any]) -> None:
        for name in self.recoverables:
            if not _all_finite(state[name]):
                raise CheckpointError(
                    f"Refusing to save a checkpoint: '{name}' holds non-finite values "
                    "(NaN/Inf). The previous checkpoints are kept; lower the learning rate "
                    "or use bf16 instead of fp16."
                )

    def _write(
        self, state: dict[str, Any], meta: Mapping[str, Any] | None, end_of_epoch: bool
    ) -> Checkpoint:
        try:
            self.checkpoints_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointError(
                f"Cannot create checkpoint folder {self.checkpoints_dir}: {err}. "
                "Point the run at a writable folder (hydra.run.dir=PATH)."
            ) from err
        now = time.time_ns()  # one clock reading: names sort in save order
        stamp = time.strftime("%Y-%m-%d+%H-%M-%S", time.localtime(now // 10**9))
        name = f"{CKPT_PREFIX}{stamp}+{now % 10**9:09d}"
        tmp_dir = self.checkpoints_dir / f"{TMP_PREFIX}{name}"
        final_dir = self.checkpoints_dir / name
        try:
            tmp_dir.mkdir()
            state_path = tmp_dir / STATE_FILE
            with open(state_path, "wb") as file:
                written = _HashingWriter(file)
                torch.save({"format": FORMAT_VERSION, "state": state}, written)
                file.flush()
                os.fsync(file.fileno())
            stat = state_path.stat()
            full_meta = {
                **dict(meta or {}),
                "end_of_epoch": end_of_epoch,
                "unixtime": time.time(),
                "state_sha256": written.digest.hexdigest(),
                "state_bytes": stat.st_size,
                "recoverables": sorted(state),
            }
            with open(tmp_dir / META_FILE, "w") as file:
                json.dump(full_meta, file, indent=2, default=str)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp_dir, final_dir)
            fsync_directory(self.checkpoints_dir)
            # Rotation need not read back what was just hashed as it was written.
            self._verified[(str(final_dir / STATE_FILE), stat.st_size, stat.st_mtime_ns)] = True
        except OSError as err:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise CheckpointError(
                f"Could not write checkpoint {final_dir}: {err}. Earlier checkpoints are "
                "intact; free disk space or choose another output folder."
            ) from err
        logger.info("Saved checkpoint %s", final_dir)
        return Checkpoint(final_dir, full_meta)

    def save_and_keep_only(
        self,
        meta: Mapping[str, Any] | None = None,
        end_of_epoch: bool = True,
        num_to_keep: int = 1,
        min_keys: Iterable[str] | None = None,
        max_keys: Iterable[str] | None = None,
        predicate: Callable[[Checkpoint], bool] | None = None,
        num_best: int = 1,
        num_last_epochs: int = 0,
    ) -> Checkpoint | None:
        """Save, then delete all but the ``num_to_keep`` most recent and the best ones.

        The ``num_best`` best checkpoints for each key in ``min_keys`` (lowest values) and
        ``max_keys`` (highest values) are always kept, whatever their age, and so are the
        ``num_last_epochs`` most recent end-of-epoch ones (more than one of either for
        checkpoint averaging). With ``predicate``, only the checkpoints it accepts are
        candidates for deletion. Mid-epoch checkpoints older than an end-of-epoch one are
        deleted (see ``keep_only``).
        """
        return self._save(
            meta,
            end_of_epoch,
            rotate=functools.partial(
                self._delete_all_but,
                num_to_keep,
                min_keys,
                max_keys,
                predicate,
                num_best,
                num_last_epochs,
            ),
        )

    def keep_only(
        self,
        num_to_keep: int = 1,
        min_keys: Iterable[str] | None = None,
        max_keys: Iterable[str] | None = None,
        predicate: Callable[[Checkpoint], bool] | None = None,
        num_best: int = 1,
        num_last_epochs: int = 0,
    ) -> None:
        """Delete checkpoints that are neither among the most recent nor the best.

        A mid-epoch checkpoint saved before the newest end-of-epoch one is superseded: it
        never takes one of the ``num_to_keep`` most recent places and is deleted (resume
        starts from the newest checkpoint; best selection and averaging skip mid-epoch
        ones), as SpeechBrain's end-of-epoch save removes the intra-epoch checkpoints.
        Under DDP rank 0 deletes; all ranks return once it is done.
        """
        self.wait()
        if is_main_process():
            self._delete_all_but(
                num_to_keep, min_keys, max_keys, predicate, num_best, num_last_epochs
            )
        ddp_barrier()

    def _delete_all_but(
        self,
        num_to_keep: int,
        min_keys: Iterable[str] | None,
        max_keys: Iterable[str] | None,
        predicate: Callable[[Checkpoint], bool] | None,
        num_best: int = 1,
        num_last_epochs: int = 0,
    ) -> None:
        # The places are given among verified checkpoints: a corrupt one (of the recorded
        # size, found by hashing) must not hold one a good checkpoint needs (the averaged
        # final epochs, the best); it goes with the others not kept.
        listed = self._list_checkpoints(verify=False)
        ckpts = [c for c in listed if self._intact(c)]
        superseded = _superseded_mid_epoch(ckpts)
        if predicate is not None:
            ckpts = [c for c in ckpts if predicate(c)]
            listed = [c for c in listed if predicate(c)]
        recent = [c for c in ckpts if c.path not in superseded]
        keep = {c.path for c in recent[-num_to_keep:]} if num_to_keep > 0 else set()
        if num_last_epochs > 0:
            keep.update(c.path for c in [c for c in ckpts if c.end_of_epoch][-num_last_epochs:])
        for key in min_keys or ():
            keep.update(c.path for c in self._ranked(ckpts, key, minimize=True)[:num_best])
        for key in max_keys or ():
            keep.update(c.path for c in self._ranked(ckpts, key, minimize=False)[:num_best])
        for ckpt in listed:
            if ckpt.path not in keep:
                _delete(ckpt.path)
        # Leftovers of a process killed while saving or deleting.
        for stale in self.checkpoints_dir.glob(f"{TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)

    # ---------------------------------------------------------------- finding
    def list_checkpoints(self, verify: bool = True) -> list[Checkpoint]:
        """All readable checkpoints, oldest first; corrupt ones are skipped with a warning.

        Waits for a checkpoint being written in the background: what the Checkpointer finds,
        loads and averages comes from here."""
        self.wait()
        return self._list_checkpoints(verify)

    def _list_checkpoints(self, verify: bool) -> list[Checkpoint]:
        if not self.checkpoints_dir.is_dir():
            return []
        found = []
        for path in sorted(self.checkpoints_dir.glob(f"{CKPT_PREFIX}*")):
            meta = self._read_meta(path, verify=verify)
            if meta is not None:
                found.append(Checkpoint(path, meta))
        found.sort(key=lambda c: (c.meta.get("unixtime", 0.0), c.path.name))
        return found

    def _read_meta(self, path: Path, verify: bool) -> dict[str, Any] | None:
        try:
            meta = json.loads((path / META_FILE).read_text())
            state_path = path / STATE_FILE
            size = state_path.stat().st_size
            if size != meta["state_bytes"]:
                raise ValueError(f"size {size} != recorded {meta['state_bytes']}")
            if verify and _sha256(state_path) != meta["state_sha256"]:
                raise ValueError("checksum mismatch")
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.warning("Skipping unreadable checkpoint %s (%s)", path, err)
            return None
        return meta

    def _intact(self, ckpt: Checkpoint) -> bool:
        """Whether ``ckpt``'s state file (of its recorded size) has its recorded SHA-256.

        For rotation, which runs after every save: each version of a file (its size and
        modification time) is hashed once in this process; loading always hashes.
        """
        state_path = ckpt.path / STATE_FILE
        try:
            stat = state_path.stat()
        except OSError:
            return False
        key = (str(state_path), stat.st_size, stat.st_mtime_ns)
        if key not in self._verified:
            self._verified[key] = _sha256(state_path) == ckpt.meta["state_sha256"]
            if not self._verified[key]:
                logger.warning("Skipping unreadable checkpoint %s (checksum mismatch)", ckpt.path)
        return self._verified[key]

    @staticmethod
    def _ranked(ckpts: list[Checkpoint], key: str, minimize: bool) -> list[Checkpoint]:
        """Checkpoints that record ``key``, best first (ties: the older first)."""
        scored = [c for c in ckpts if isinstance(c.meta.get(key), int | float)]
        return sorted(scored, key=lambda c: c.meta[key] if minimize else -c.meta[key])

    @classmethod
    def _best(cls, ckpts: list[Checkpoint], key: str, minimize: bool) -> Checkpoint | None:
        ranked = cls._ranked(ckpts, key, minimize)
        return ranked[0] if ranked else None

    def find_best_checkpoints(
        self, num: int, min_key: str | None = None, max_key: str | None = None
    ) -> list[Checkpoint]:
        """The ``num`` best end-of-epoch checkpoints by ``min_key``/``max_key``, best first.

        Without a key (or when no checkpoint records it): the ``num`` most recent ones,
        newest first. Mid-epoch checkpoints are left out: they hold no validation metrics.
        """
        ckpts = [c for c in self.list_checkpoints() if c.end_of_epoch]
        key, minimize = (min_key, True) if min_key is not None else (max_key, False)
        ranked = self._ranked(ckpts, key, minimize) if key is not None else []
        return (ranked or ckpts[::-1])[:num]

    def find_last_checkpoints(self, num: int) -> list[Checkpoint]:
        """The ``num`` most recent end-of-epoch checkpoints, newest first (the final epochs,
        which icefall averages); mid-epoch ones are left out."""
        return [c for c in self.list_checkpoints() if c.end_of_epoch][::-1][:num]

    def find_checkpoint(
        self, min_key: str | None = None, max_key: str | None = None
    ) -> Checkpoint | None:
        """The best checkpoint by ``min_key``/``max_key``, else the most recent one."""
        ckpts = self.list_checkpoints()
        if not ckpts:
            return None
        if min_key is not None:
            return self._best(ckpts, min_key, minimize=True) or ckpts[-1]
        if max_key is not None:
            return self._best(ckpts, max_key, minimize=False) or ckpts[-1]
        return ckpts[-1]

    # ---------------------------------------------------------------- loading
    def load_checkpoint(self, ckpt: Checkpoint, map_location: Any = "cpu") -> None:
        """Restore every registered recoverable from ``ckpt``."""
        payload = read_state(ckpt.path / STATE_FILE, map_location=map_location)
        state = payload["state"]
        missing = sorted(set(self.recoverables) - set(state) - self.optional)
        if missing and not self.allow_partial_load:
            raise CheckpointError(
                f"Checkpoint {ckpt.path} has no state for {missing}; it was written by a "
                "different recipe. Start a fresh run folder or point at the right checkpoint."
            )
        for name, obj in self.recoverables.items():
            if name not in state:
                continue
            try:
                obj.load_state_dict(state[name])
            except CheckpointError:  # the recoverable's own message says what is wrong
                raise
            except (RuntimeError, ValueError, KeyError) as err:
                detail = " ".join(str(err).split())[:300]
                raise CheckpointError(
                    f"Checkpoint {ckpt.path} does not fit '{name}': it was written by a "
                    "different model or configuration; use a fresh run folder or the matching "
                    f"config. ({detail})"
                ) from err
        logger.info("Loaded checkpoint %s", ckpt.path)

    def load_averaged(
        self, ckpts: list[Checkpoint], names: Iterable[str], map_location: Any = "cpu"
    ) -> None:
        """Load the average of ``ckpts`` into the recoverables ``names`` (e.g. the model).

        Checkpoint averaging (as ESPnet and icefall evaluate): the floating-point tensors
        of each named state dict are averaged over the checkpoints, in float64 and cast
        back to their dtype; everything else (integer buffers such as BatchNorm's
        ``num_batches_tracked``) comes from the first checkpoint. Other recoverables are
        not touched. One checkpoint: the same as loading it.

        Raises:
            CheckpointError: no checkpoint, or a named state missing from one of them.
        """
        if not ckpts:
            raise CheckpointError("No checkpoint to average: train at least one epoch first.")
        names = list(names)
        states = [
            read_state(c.path / STATE_FILE, map_location=map_location)["state"] for c in ckpts
        ]
        for name in names:
            lacking = [c.path.name for c, s in zip(ckpts, states, strict=True) if name not in s]
            if lacking or name not in self.recoverables:
                raise CheckpointError(
                    f"Cannot average '{name}': missing from {lacking or 'the recoverables'}."
                )
            averaged = average_state_dicts([s[name] for s in states])
            self.recoverables[name].load_state_dict(averaged)
        logger.info(
            "Loaded the average of %d checkpoints: %s",
            len(ckpts),
            ", ".join(c.path.name for c in ckpts),
        )

    def recover_if_possible(
        self, min_key: str | None = None, max_key: str | None = None, map_location: Any = "cpu"
    ) -> Checkpoint | None:
        """Load the best (or latest) checkpoint if there is one; return it, else None."""
        ckpt = self.find_checkpoint(min_key=min_key, max_key=max_key)
        if ckpt is not None:
            self.load_checkpoint(ckpt, map_location=map_location)
        return ckpt


def _superseded_mid_epoch(ckpts: list[Checkpoint]) -> set[Path]:
    """Mid-epoch checkpoints (``ckpts`` oldest first) saved before an end-of-epoch one."""
    ends = [i for i, c in enumerate(ckpts) if c.end_of_epoch]
    if not ends:
        return set()
    return {c.path for c in ckpts[: ends[-1]] if not c.end_of_epoch}


def average_state_dicts(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Element-wise mean of the floating-point tensors of several state dicts.

    Non-floating entries (integer buffers, plain values) are taken from the first one.
    Every state dict must have the same keys and shapes (the same model).
    """
    first = states[0]
    averaged: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            total = torch.zeros_like(value, dtype=torch.float64)
            for state in states:
                total += state[key].to(torch.float64)
            averaged[key] = (total / len(states)).to(value.dtype)
        else:
            averaged[key] = value
    return averaged
