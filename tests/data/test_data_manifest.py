"""Manifest round trips and validation errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data.errors import ManifestError
from data.manifest import Utterance, read_manifest, write_manifest

HEADER = "id,path,duration,transcript,speaker\n"


def _utterances(folder: Path, count: int = 3) -> list[Utterance]:
    folder.mkdir(parents=True, exist_ok=True)
    utts = []
    for i in range(count):
        path = folder / f"utt{i}.wav"
        path.write_bytes(b"RIFF")  # read_manifest only checks that the file exists
        utts.append(Utterance(f"utt{i}", str(path), 0.5 + i, "one, two" if i else "", "theo"))
    return utts


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_round_trip_relative_and_absolute_paths(tmp_path: Path, suffix: str) -> None:
    inside = _utterances(tmp_path / "data" / "wavs")
    outside = _utterances(tmp_path / "elsewhere", count=1)
    outside = [Utterance("far", outside[0].path, 1.25, "far", "lucas")]
    manifest = tmp_path / "data" / f"train{suffix}"
    write_manifest(manifest, [*inside, *outside])

    assert read_manifest(manifest) == [*inside, *outside]
    text = manifest.read_text()
    assert "wavs/utt0.wav" in text and str(tmp_path / "data") not in text
    assert outside[0].path in text
    assert not list(manifest.parent.glob(".*tmp*")), "temporary file left behind"


def test_jsonl_is_one_object_per_line(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    write_manifest(manifest, _utterances(tmp_path / "w"))
    lines = manifest.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[1])["id"] == "utt1"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not found.*Fix"):
        read_manifest(tmp_path / "nope.csv")


@pytest.mark.parametrize("text", ["", HEADER])
def test_empty_manifest(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path / "m.csv", text)
    with pytest.raises(ManifestError, match="empty|no utterances") as info:
        read_manifest(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "header", ["id,path,duration,speaker\n", "id,path,duration,transcript,speaker,gender\n"]
)
def test_wrong_columns_name_required_ones(tmp_path: Path, header: str) -> None:
    path = _write(tmp_path / "m.csv", header)
    with pytest.raises(ManifestError, match="id,path,duration,transcript,speaker") as info:
        read_manifest(path)
    assert str(path) in str(info.value)


def test_jsonl_wrong_keys(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", json.dumps({"id": "a", "path": "x.wav"}) + "\n")
    with pytest.raises(ManifestError, match="line 1.*missing duration, transcript, speaker"):
        read_manifest(path)


def test_duplicate_ids_are_named(tmp_path: Path) -> None:
    utts = _utterances(tmp_path / "w")
    utts.append(Utterance("utt1", utts[0].path, 1.0, "", "theo"))
    path = tmp_path / "m.csv"
    write_manifest(path, utts)
    with pytest.raises(ManifestError, match="duplicate id.*utt1"):
        read_manifest(path)


@pytest.mark.parametrize("duration", ["abc", "-1", "0", "nan"])
def test_bad_duration_names_line(tmp_path: Path, duration: str) -> None:
    path = _write(tmp_path / "m.csv", HEADER + f"a,a.wav,{duration},one,theo\n")
    with pytest.raises(ManifestError, match="line 2: bad duration"):
        read_manifest(path)


def test_missing_audio_named_and_counted(tmp_path: Path) -> None:
    rows = "".join(f"u{i},missing{i}.wav,1.0,one,theo\n" for i in range(8))
    path = _write(tmp_path / "m.csv", HEADER + rows)
    with pytest.raises(ManifestError, match="8 of 8 audio file") as info:
        read_manifest(path)
    message = str(info.value)
    assert str(tmp_path / "missing0.wav") in message and "3 more" in message


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_a_manifest_not_in_utf8_names_the_file_the_offset_and_the_fix(
    tmp_path: Path, suffix: str
) -> None:
    utts = _utterances(tmp_path / "w", count=1)
    path = tmp_path / f"latin1{suffix}"
    write_manifest(path, [Utterance("u1", utts[0].path, 0.5, "café", "josé")])
    latin1 = path.read_text(encoding="utf-8").encode("latin-1")
    path.write_bytes(latin1)
    with pytest.raises(ManifestError, match="not valid UTF-8") as info:
        read_manifest(path)
    message = str(info.value)
    assert str(path) in message and "save it as UTF-8" in message
    offset = latin1.index("é".encode("latin-1"))
    assert f"byte 0xe9 at byte offset {offset}" in message


def test_a_csv_with_a_utf8_byte_order_mark_is_read(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts with a BOM, which must not become part of "id"."""
    utts = _utterances(tmp_path / "w")
    path = tmp_path / "excel.csv"
    write_manifest(path, utts)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert read_manifest(path) == utts


@pytest.mark.parametrize("field", ["transcript", "speaker", "id", "path"])
@pytest.mark.parametrize("value", [None, 1.5, ["one"]])
def test_a_jsonl_value_that_is_not_text_names_file_line_and_field(
    tmp_path: Path, field: str, value: object
) -> None:
    """A null transcript must not become the word "None" and be trained on."""
    utts = _utterances(tmp_path / "w", count=2)
    path = tmp_path / "m.jsonl"
    write_manifest(path, utts)
    lines = path.read_text().splitlines()
    row = json.loads(lines[1])
    row[field] = value
    path.write_text("\n".join([lines[0], json.dumps(row)]) + "\n")
    with pytest.raises(ManifestError, match=f"line 2: {field} must be a string") as info:
        read_manifest(path)
    assert str(path) in str(info.value)


def test_jsonl_integer_ids_and_speakers_are_read_as_text(tmp_path: Path) -> None:
    (tmp_path / "a.wav").write_bytes(b"RIFF")
    row = {"id": 7, "path": "a.wav", "duration": 1.0, "transcript": "", "speaker": 103}
    path = _write(tmp_path / "m.jsonl", json.dumps(row) + "\n")
    [utt] = read_manifest(path)
    assert (utt.id, utt.speaker) == ("7", "103")
