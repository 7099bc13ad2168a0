"""FSDD discovery, checksum, (fake) download and splits. Nothing touches the network."""

from __future__ import annotations

import shutil
import tarfile
import urllib.error
from pathlib import Path

import pytest
import torch

from data import fsdd
from data.errors import DataError, DatasetNotFoundError
from data.manifest import Utterance, read_manifest
from data.text import DIGIT_WORDS


def test_shared_copy_matches_checksum(fsdd_recordings: Path) -> None:
    assert fsdd.recordings_sha256(fsdd_recordings) == fsdd.FSDD_RECORDINGS_SHA256


def test_find_accepts_root_or_recordings_dir(fsdd_root: Path, fsdd_recordings: Path) -> None:
    assert fsdd.find_fsdd_recordings(fsdd_recordings) == fsdd_recordings
    assert fsdd.find_fsdd_recordings(fsdd_recordings.parent) == fsdd_recordings
    assert fsdd.ensure_fsdd(fsdd_root, download=False) == fsdd_recordings


def _linked_copy(fsdd_recordings: Path, folder: Path, skip: int = 0) -> Path:
    """``folder`` holding links to every FSDD recording but the first ``skip``."""
    folder.mkdir(parents=True)
    for name in fsdd.FSDD_RECORDING_NAMES[skip:]:
        (folder / name).symlink_to(fsdd_recordings / name)
    return folder


def test_extra_files_beside_a_complete_copy_are_ignored(
    fsdd_recordings: Path, tmp_path: Path
) -> None:
    """A user's own take or macOS ``._*.wav`` beside the 3000 recordings must not make a
    complete copy "not found" (or downloaded again), nor join the data."""
    recordings = _linked_copy(fsdd_recordings, tmp_path / "fsdd" / "recordings")
    shutil.copy(fsdd_recordings / "0_george_0.wav", recordings / "my_own_take.wav")
    shutil.copy(fsdd_recordings / "0_george_0.wav", recordings / "0_george_50.wav")
    (recordings / "._0_george_0.wav").write_bytes(b"\x00\x05\x16\x07")  # AppleDouble

    assert fsdd.find_fsdd_recordings(tmp_path / "fsdd") == recordings
    assert fsdd.ensure_fsdd(tmp_path / "fsdd", download=False) == recordings
    assert fsdd.recordings_sha256(recordings) == fsdd.FSDD_RECORDINGS_SHA256
    utts = fsdd.fsdd_utterances(recordings)
    assert [Path(u.path).name for u in utts] == list(fsdd.FSDD_RECORDING_NAMES)


def test_an_incomplete_copy_says_how_many_recordings_it_holds(
    fsdd_recordings: Path, tmp_path: Path
) -> None:
    recordings = _linked_copy(fsdd_recordings, tmp_path / "fsdd" / "recordings", skip=2)
    shutil.copy(fsdd_recordings / "0_george_0.wav", recordings / "my_own_take.wav")
    assert fsdd.find_fsdd_recordings(tmp_path / "fsdd") is None
    with pytest.raises(DatasetNotFoundError) as info:
        fsdd.ensure_fsdd(tmp_path / "fsdd", download=False)
    message = str(info.value)
    assert f"found 2998 of the 3000 expected recordings (in {recordings})" in message


def test_parse_name() -> None:
    assert fsdd.parse_fsdd_name("/x/7_jackson_32.wav") == (7, "jackson", 32)
    with pytest.raises(DataError, match="not_fsdd.wav.*digit"):
        fsdd.parse_fsdd_name("not_fsdd.wav")


def test_utterances_and_split(fsdd_utts: list[Utterance]) -> None:
    assert len(fsdd_utts) == fsdd.FSDD_NUM_RECORDINGS
    first = fsdd_utts[0]
    assert first.id == "0_george_0" and first.transcript == "zero" and first.speaker == "george"
    assert 0.1 < first.duration < 3.0
    assert {u.speaker for u in fsdd_utts} == set(fsdd.FSDD_SPEAKERS)
    assert list(fsdd.FSDD_SPEAKERS) == sorted(fsdd.FSDD_SPEAKERS)
    assert {u.transcript for u in fsdd_utts} == set(DIGIT_WORDS)

    splits = fsdd.split_fsdd(fsdd_utts)
    assert {k: len(v) for k, v in splits.items()} == {"train": 2400, "valid": 300, "test": 300}
    index_sets = {k: {fsdd.parse_fsdd_name(u.path)[2] for u in v} for k, v in splits.items()}
    assert index_sets == {
        "test": set(range(0, 5)),
        "valid": set(range(5, 10)),
        "train": set(range(10, 50)),
    }
    ids = [{u.id for u in v} for v in splits.values()]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    for utts in splits.values():  # every speaker and digit appears in every split
        assert {u.speaker for u in utts} == set(fsdd.FSDD_SPEAKERS)
        assert {u.transcript for u in utts} == set(DIGIT_WORDS)


def test_held_out_speakers_are_tested_on_and_never_trained_on(
    fsdd_utts: list[Utterance],
) -> None:
    splits = fsdd.split_fsdd(fsdd_utts, test_speakers=["jackson", "lucas"])
    assert {k: len(v) for k, v in splits.items()} == {"train": 1600, "valid": 400, "test": 1000}
    assert {u.speaker for u in splits["test"]} == {"jackson", "lucas"}
    others = set(fsdd.FSDD_SPEAKERS) - {"jackson", "lucas"}
    for split in ("train", "valid"):
        assert {u.speaker for u in splits[split]} == others
        assert {u.transcript for u in splits[split]} == set(DIGIT_WORDS)
    valid_indices = {fsdd.parse_fsdd_name(u.path)[2] for u in splits["valid"]}
    assert valid_indices == set(range(10))
    with pytest.raises(DataError, match="'bob'.*choose from: george, jackson"):
        fsdd.split_fsdd(fsdd_utts, test_speakers=["bob"])
    with pytest.raises(DataError, match="every speaker"):
        fsdd.split_fsdd(fsdd_utts, test_speakers=list(fsdd.FSDD_SPEAKERS))


def test_held_out_manifests_go_to_their_own_folder(fsdd_root: Path, tmp_path: Path) -> None:
    official = fsdd.prepare_fsdd_digits(fsdd_root, tmp_path, download=False)
    held = fsdd.prepare_fsdd_digits(fsdd_root, tmp_path, download=False, test_speakers=["theo"])
    assert held["test"].parent == tmp_path / "test_speakers=theo"
    assert len(read_manifest(official["test"])) == 300  # not overwritten
    assert len(read_manifest(held["test"])) == 500


def test_prepare_fsdd_digits(fsdd_root: Path, tmp_path: Path) -> None:
    paths = fsdd.prepare_fsdd_digits(fsdd_root, tmp_path / "digits", download=False)
    assert sorted(paths) == ["test", "train", "valid"]
    assert len(read_manifest(paths["test"])) == 300
    # Safe to re-run.
    assert fsdd.prepare_fsdd_digits(fsdd_root, tmp_path / "digits", download=False) == paths


def test_missing_without_download_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(DatasetNotFoundError) as info:
        fsdd.ensure_fsdd(tmp_path, download=False)
    message = str(info.value)
    assert fsdd.FSDD_URL in message and "data.root=" in message and "FSDD_ROOT" in message
    assert str(tmp_path) in message


def test_network_failure_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(url: str, dst: str, hash_prefix: str | None = None, progress: bool = True):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(DatasetNotFoundError, match="download failed.*data.root=") as info:
        fsdd.ensure_fsdd(tmp_path / "fsdd")
    assert fsdd.FSDD_URL in str(info.value)


@pytest.fixture
def local_archive(fsdd_recordings: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A release-like tarball with 30 FSDD recordings plus a README, and a copy of the 30."""
    source = tmp_path / "source"
    source.mkdir()
    for name in sorted(p.name for p in fsdd_recordings.glob("*_theo_*.wav"))[:30]:
        shutil.copy(fsdd_recordings / name, source / name)
    (tmp_path / "README.md").write_text("readme")
    archive = tmp_path / "release.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "README.md", arcname=f"{fsdd.FSDD_ARCHIVE_DIR}/README.md")
        for wav in sorted(source.iterdir()):
            tar.add(wav, arcname=f"{fsdd.FSDD_ARCHIVE_DIR}/recordings/{wav.name}")
    return archive, source


@pytest.fixture
def fake_download(local_archive, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make torch.hub.download_url_to_file copy the local archive; returns the URLs asked."""
    urls: list[str] = []

    def copy(url: str, dst: str, hash_prefix: str | None = None, progress: bool = True):
        urls.append(url)
        shutil.copy(local_archive[0], dst)

    monkeypatch.setattr(torch.hub, "download_url_to_file", copy)
    return urls


def test_download_with_wrong_content_is_rejected(tmp_path: Path, fake_download) -> None:
    root = tmp_path / "fsdd"
    with pytest.raises(DatasetNotFoundError, match="does not hold the expected recordings"):
        fsdd.ensure_fsdd(root)
    assert fake_download == [fsdd.FSDD_URL]
    assert list(root.iterdir()) == [], "archive or partial unpack left behind"


def test_download_and_unpack(
    tmp_path: Path, local_archive, fake_download, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, source = local_archive
    monkeypatch.setattr(fsdd, "FSDD_NUM_RECORDINGS", 30)
    monkeypatch.setattr(
        fsdd, "FSDD_RECORDING_NAMES", tuple(sorted(p.name for p in source.iterdir()))
    )
    monkeypatch.setattr(fsdd, "FSDD_RECORDINGS_SHA256", fsdd.recordings_sha256(source))
    root = tmp_path / "fsdd"

    recordings = fsdd.ensure_fsdd(root)
    assert recordings == root / fsdd.FSDD_ARCHIVE_DIR / "recordings"
    assert sorted(p.name for p in recordings.iterdir()) == sorted(p.name for p in source.iterdir())
    assert sorted(p.name for p in root.iterdir()) == [fsdd.FSDD_ARCHIVE_DIR]  # no archive
    assert not (root / fsdd.FSDD_ARCHIVE_DIR / "README.md").exists()

    # Found on the next call without downloading again.
    assert fsdd.ensure_fsdd(root) == recordings
    assert fsdd.find_fsdd_recordings(root / fsdd.FSDD_ARCHIVE_DIR) == recordings
    assert len(fake_download) == 1


def test_corrupt_archive_is_deleted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def garbage(url: str, dst: str, hash_prefix: str | None = None, progress: bool = True):
        Path(dst).write_bytes(b"not a tarball")

    monkeypatch.setattr(torch.hub, "download_url_to_file", garbage)
    root = tmp_path / "fsdd"
    with pytest.raises(DatasetNotFoundError, match="cannot be unpacked"):
        fsdd.ensure_fsdd(root)
    assert list(root.iterdir()) == []
