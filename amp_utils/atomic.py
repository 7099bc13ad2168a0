"""Atomic file writes: a reader sees the old file or the new one, never a partial one.

Run artefacts (manifests, connected-digit plans, ``env.txt``, results, sweep summaries) are
read by other processes and by people while a run may crash or be killed; writing to a
temporary file in the same folder, syncing it and then ``os.replace``-ing it over the
target makes each write all-or-nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Permissions of a newly created file (what ``open`` gives with the usual umask 022);
#: ``mkstemp`` would otherwise leave it at 0600, hiding it from other users.
_NEW_FILE_MODE = 0o644


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; move it onto ``path`` if the block succeeds.

    The parent folder is created if needed; an existing file's permissions are kept. On an
    exception the temporary file is removed and ``path`` is left untouched. The temporary
    name keeps the suffix, so tools that pick a format from it (soundfile) still work.

    Raises:
        OSError: naming ``path`` when the final replace fails.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except FileNotFoundError:
        mode = _NEW_FILE_MODE
    tmp: Path | None = None
    try:  # from the temporary file's creation: a signal's exception leaves none behind
        fd, tmp_name = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=f".tmp{path.suffix}", dir=path.parent
        )
        tmp = Path(tmp_name)
        os.close(fd)
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        try:
            os.replace(tmp, path)
        except OSError as err:
            raise OSError(f"Atomic write to {path} failed: {err}") from err
        fsync_directory(path.parent)
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically, creating parent folders as needed.

    Raises:
        OSError: naming ``path`` when the text cannot be encoded or written; the old
            file, if any, is left as it was.
    """
    with atomic_path(path) as tmp:
        try:
            tmp.write_text(text, encoding=encoding)
        except (OSError, UnicodeError) as err:
            raise OSError(f"Atomic write to {path} failed: {err}") from err


def atomic_write_json(path: str | os.PathLike[str], obj: Any, indent: int = 2) -> None:
    """Serialize ``obj`` as JSON and write it to ``path`` atomically.

    Serializing before opening anything means an unserializable object leaves no trace.

    Raises:
        TypeError: naming ``path`` when ``obj`` is not JSON-serializable.
    """
    try:
        text = json.dumps(obj, indent=indent) + "\n"
    except (TypeError, ValueError) as err:
        raise TypeError(f"Cannot write JSON to {path}: {err}") from err
    atomic_write_text(path, text)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Best-effort fsync of a folder so that a rename inside it survives a crash."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
