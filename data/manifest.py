"""Manifests: the list of utterances of one split, as CSV or JSON Lines.

A manifest has the fields ``id,path,duration,transcript,speaker``. ``path`` is absolute
or relative to the manifest's folder, so a prepared data folder can be moved as a whole.
``read_manifest`` validates everything up front (columns, ids, durations, that the audio
exists) so a bad manifest fails before training with the file and row in the message.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from amp_utils.atomic import atomic_write_text
from data.errors import ManifestError

#: How many offending items an error message lists before summarising with a count.
_MAX_LISTED = 5


@dataclass(frozen=True)
class Utterance:
    """One utterance: an audio file and its labels.

    Attributes:
        id: unique name of the utterance within its manifest.
        path: path of the audio file (absolute once read from a manifest).
        duration: length in seconds.
        transcript: what is said (may be empty for tasks without text).
        speaker: speaker name.
    """

    id: str
    path: str
    duration: float
    transcript: str
    speaker: str


#: Column order of a manifest: ``id,path,duration,transcript,speaker``.
MANIFEST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(Utterance))


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json")


def _is_manifest_suffix(path: Path) -> bool:
    """Whether ``path`` is named like a manifest (not, say, an audio file given by mistake)."""
    return path.suffix.lower() in (".csv", ".jsonl", ".json")


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return f"{shown} (and {more} more)" if more > 0 else shown


def _stored_path(audio_path: str, manifest_dir: Path) -> str:
    """Path as written to a manifest: relative when inside the manifest's folder."""
    audio = Path(audio_path).absolute()
    if audio.is_relative_to(manifest_dir):
        return audio.relative_to(manifest_dir).as_posix()
    return str(audio)


def write_manifest(path: str | Path, utterances: Iterable[Utterance]) -> None:
    """Write utterances to a ``.csv`` or ``.jsonl`` manifest, atomically.

    Audio paths inside the manifest's folder are stored relative to it (the folder can be
    moved), others absolute.

    Args:
        path: destination; the format follows the suffix (``.jsonl`` or else CSV).
        utterances: the rows, written in the given order.
    """
    path = Path(path).absolute()
    rows = [{**asdict(utt), "path": _stored_path(utt.path, path.parent)} for utt in utterances]
    if _is_jsonl(path):
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=MANIFEST_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        text = buffer.getvalue()
    atomic_write_text(path, text)


def _read_csv_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    reader = csv.DictReader(io.StringIO(text))
    header = tuple(reader.fieldnames or ())
    _check_columns(path, header, "header")
    rows = []
    for row in reader:
        # Line 1 is the header; data rows are numbered as they appear in the file.
        if None in row or any(value is None for value in row.values()):
            raise ManifestError(
                f"Manifest {path}, line {reader.line_num}: expected {len(MANIFEST_FIELDS)} "
                f"comma-separated values ({','.join(MANIFEST_FIELDS)}), got a different "
                "number. Fix: quote values that contain commas (the csv module does this)."
            )
        rows.append((reader.line_num, row))
    return rows


def _read_jsonl_rows(path: Path, text: str) -> list[tuple[int, dict]]:
    rows = []
    for line_num, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ManifestError(
                f"Manifest {path}, line {line_num}: not valid JSON ({err.msg}). "
                "Fix: write one JSON object per line."
            ) from None
        if not isinstance(row, dict):
            raise ManifestError(
                f"Manifest {path}, line {line_num}: expected a JSON object, got "
                f"{type(row).__name__}. Fix: write one JSON object per line."
            )
        _check_columns(path, tuple(row), f"line {line_num}")
        rows.append((line_num, row))
    return rows


def _check_columns(path: Path, columns: tuple[str, ...], where: str) -> None:
    missing = [name for name in MANIFEST_FIELDS if name not in columns]
    extra = [name for name in columns if name not in MANIFEST_FIELDS]
    if missing or extra:
        problems = []
        if missing:
            problems.append(f"missing {', '.join(missing)}")
        if extra:
            problems.append(f"unexpected {', '.join(map(str, extra))}")
        raise ManifestError(
            f"Manifest {path}, {where}: wrong columns ({'; '.join(problems)}). "
            f"Fix: use exactly the columns {','.join(MANIFEST_FIELDS)}."
        )


def _parse_duration(path: Path, line_num: int, value: object) -> float:
    try:
        duration = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        duration = math.nan
    if not math.isfinite(duration) or duration <= 0:
        raise ManifestError(
            f"Manifest {path}, line {line_num}: bad duration {value!r}. "
            "Fix: duration must be a positive number of seconds; re-run data preparation."
        )
    return duration


def _read_text(path: Path) -> str:
    """The manifest's text, decoded as UTF-8; a leading byte order mark is dropped.

    Excel's "CSV UTF-8" starts the file with a BOM, which would otherwise become part of
    the first column's name. Any other encoding fails naming the file and the first bad
    byte, instead of a bare ``UnicodeDecodeError``.
    """
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
        offset = err.start + bom
        hint = "" if _is_manifest_suffix(path) else " (or give the manifest, not this file)"
        raise ManifestError(
            f"Manifest {path} is not valid UTF-8: byte {data[offset]:#04x} at byte offset "
            f"{offset} cannot be decoded ({err.reason}). Fix: save it as UTF-8 (Excel: "
            f'"CSV UTF-8"; or iconv -f latin1 -t utf-8){hint}.'
        ) from None


def _text_field(path: Path, line_num: int, row: dict, name: str) -> str:
    """``row[name]`` as text; JSON null, floats, lists etc. are refused.

    ``str(None)`` would otherwise make a missing transcript the word "None" and train on it.
    CSV values are always strings; a JSONL integer id or speaker is taken as its text.
    """
    value = row[name]
    if isinstance(value, str):
        return value
    if name in ("id", "speaker") and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # numeric ids (LibriSpeech speakers: 103) name things as well
    empty = ' (an empty transcript is "")' if name == "transcript" else ""
    raise ManifestError(
        f"Manifest {path}, line {line_num}: {name} must be a string, got "
        f"{json.dumps(value)} ({type(value).__name__}). Fix: write the {name} as a JSON "
        f"string{empty}."
    )


def read_manifest(path: str | Path) -> list[Utterance]:
    """Read and validate a ``.csv`` or ``.jsonl`` manifest.

    Relative audio paths are resolved against the manifest's folder, so the returned
    utterances always hold absolute paths.

    Args:
        path: the manifest file.

    Returns:
        The utterances in file order.

    Raises:
        ManifestError: if the manifest is missing, empty or not UTF-8, has missing or
            extra columns, duplicate ids, a bad duration or a non-text id, path,
            transcript or speaker (JSON null), or names audio files that do not exist.
    """
    path = Path(path).absolute()
    if not path.is_file():
        raise ManifestError(
            f"Manifest not found: {path}. Fix: give the path of an existing manifest "
            "(with data=manifest: data.train=PATH, data.valid=PATH, data.test=PATH; relative "
            "paths are read from the folder the command runs in)."
        )
    text = _read_text(path)
    if not text.strip():
        raise ManifestError(
            f"Manifest {path} is empty. Fix: re-run data preparation to regenerate it."
        )
    rows = _read_jsonl_rows(path, text) if _is_jsonl(path) else _read_csv_rows(path, text)
    if not rows:
        raise ManifestError(
            f"Manifest {path} has no utterances (only a header). "
            "Fix: re-run data preparation to regenerate it."
        )

    utterances = []
    for line_num, row in rows:
        audio = Path(_text_field(path, line_num, row, "path"))
        if not audio.is_absolute():
            audio = path.parent / audio
        utterances.append(
            Utterance(
                id=_text_field(path, line_num, row, "id"),
                path=str(audio),
                duration=_parse_duration(path, line_num, row["duration"]),
                transcript=_text_field(path, line_num, row, "transcript"),
                speaker=_text_field(path, line_num, row, "speaker"),
            )
        )

    duplicates = [uid for uid, count in Counter(u.id for u in utterances).items() if count > 1]
    if duplicates:
        raise ManifestError(
            f"Manifest {path}: {len(duplicates)} duplicate id(s): {_listed(duplicates)}. "
            "Fix: every utterance id must be unique; re-run data preparation."
        )

    missing = [u.path for u in utterances if not Path(u.path).is_file()]
    if missing:
        raise ManifestError(
            f"Manifest {path}: {len(missing)} of {len(utterances)} audio file(s) do not "
            f"exist: {_listed(missing)}. Fix: re-run data preparation, or check data.root "
            "if the data was moved."
        )
    return utterances
