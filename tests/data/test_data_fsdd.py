"""FSDD discovery, checksum, (fake) download and splits. Nothing touches the network."""

from __future__ import annotations

import contextlib
import errno
import http.server
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    def offline(url: str, archive: Path, timeout: float) -> None:
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(fsdd, "_download", offline)
    with pytest.raises(DatasetNotFoundError, match="download failed.*data.root=") as info:
        fsdd.ensure_fsdd(tmp_path / "fsdd")
    assert fsdd.FSDD_URL in str(info.value) and "can be reached" in str(info.value)


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


# --- Downloads from a local stand-in for GitHub (http.server in a thread) -----------------


class _ReleaseServer:
    """Serves one archive over HTTP on 127.0.0.1, as GitHub serves FSDD_URL.

    ``mode``: ``ok``, ``404``, ``500`` or ``truncated`` (the Content-Length of the whole
    archive, half of it sent); ``delay``: seconds before each answer; ``chunk_pause``:
    seconds between 4 KiB chunks (a slow link). ``requests`` lists the paths asked for.
    """

    def __init__(self, body: bytes) -> None:
        self.body, self.mode, self.delay, self.chunk_pause = body, "ok", 0.0, 0.0
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                server.requests.append(self.path)
                time.sleep(server.delay)
                if server.mode in ("404", "500"):
                    self.send_error(int(server.mode))
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                body = server.body
                if server.mode == "truncated":
                    body = body[: len(body) // 2]
                with contextlib.suppress(OSError):  # the client was killed
                    for start in range(0, len(body), 4096):
                        self.wfile.write(body[start : start + 4096])
                        time.sleep(server.chunk_pause)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v{fsdd.FSDD_VERSION}.tar.gz"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def thirty_recordings(local_archive, monkeypatch: pytest.MonkeyPatch) -> tuple[str, ...]:
    """Make the local archive's 30 recordings the complete, verified FSDD."""
    _, source = local_archive
    names = tuple(sorted(p.name for p in source.iterdir()))
    monkeypatch.setattr(fsdd, "FSDD_NUM_RECORDINGS", len(names))
    monkeypatch.setattr(fsdd, "FSDD_RECORDING_NAMES", names)
    monkeypatch.setattr(fsdd, "FSDD_RECORDINGS_SHA256", fsdd.recordings_sha256(source))
    return names


def _ensure_in_threads(root: Path, count: int) -> list[BaseException | Path]:
    """``ensure_fsdd(root)`` in ``count`` threads started together (runs or sweep jobs
    side by side): each one's recordings folder or error, in the order they ended."""
    results: list[BaseException | Path] = []

    def run() -> None:
        try:
            results.append(fsdd.ensure_fsdd(root))
        except BaseException as err:  # noqa: BLE001 (handed to the test's thread)
            results.append(err)

    workers = [threading.Thread(target=run) for _ in range(count)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    return results


@pytest.fixture
def release_server(local_archive, monkeypatch: pytest.MonkeyPatch) -> Iterator[_ReleaseServer]:
    """The local archive served over HTTP, with ``fsdd.FSDD_URL`` pointing at it."""
    server = _ReleaseServer(local_archive[0].read_bytes())
    monkeypatch.setattr(fsdd, "FSDD_URL", server.url)
    yield server
    server.close()


def test_download_with_wrong_content_is_rejected(
    tmp_path: Path, release_server: _ReleaseServer
) -> None:
    root = tmp_path / "fsdd"
    with pytest.raises(DatasetNotFoundError, match="does not hold the expected recordings"):
        fsdd.ensure_fsdd(root)
    assert len(release_server.requests) == 1
    assert not root.exists(), "archive or partial unpack left behind"


def test_download_and_unpack(
    tmp_path: Path, local_archive, release_server: _ReleaseServer, thirty_recordings
) -> None:
    _, source = local_archive
    root = tmp_path / "fsdd"

    recordings = fsdd.ensure_fsdd(root)
    assert recordings == root / fsdd.FSDD_ARCHIVE_DIR / "recordings"
    assert sorted(p.name for p in recordings.iterdir()) == sorted(p.name for p in source.iterdir())
    assert sorted(p.name for p in root.iterdir()) == [fsdd.FSDD_ARCHIVE_DIR]  # no archive
    assert not (root / fsdd.FSDD_ARCHIVE_DIR / "README.md").exists()

    # Found on the next call without downloading again.
    assert fsdd.ensure_fsdd(root) == recordings
    assert fsdd.find_fsdd_recordings(root / fsdd.FSDD_ARCHIVE_DIR) == recordings
    assert len(release_server.requests) == 1


def test_corrupt_archive_is_deleted(tmp_path: Path, release_server: _ReleaseServer) -> None:
    release_server.body = b"not a tarball"
    root = tmp_path / "fsdd"
    with pytest.raises(DatasetNotFoundError, match="cannot be unpacked"):
        fsdd.ensure_fsdd(root)
    assert not root.exists()


def test_a_stalled_server_times_out_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that accepts the connection and never answers (a dead proxy, a firewall
    that swallows the reply) hung the run for good: torch.hub's urlopen has no timeout."""
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(4)  # the kernel completes the handshake; nobody ever answers
    monkeypatch.setattr(fsdd, "FSDD_URL", f"http://127.0.0.1:{stalled.getsockname()[1]}/a")
    monkeypatch.setattr(fsdd, "FSDD_DOWNLOAD_TIMEOUT_S", 0.5, raising=False)
    root = tmp_path / "fsdd"
    outcome: list[BaseException | Path] = []

    def download() -> None:
        try:
            outcome.append(fsdd.ensure_fsdd(root))
        except BaseException as err:  # noqa: BLE001 (handed to the test's thread)
            outcome.append(err)

    worker = threading.Thread(target=download, daemon=True)
    worker.start()
    worker.join(timeout=20)
    hung = worker.is_alive()
    stalled.close()  # ends a hung download (connection reset) before the assertions
    worker.join(timeout=20)
    assert not hung, "the download waited for the stalled server without a timeout"
    (error,) = outcome
    assert isinstance(error, DatasetNotFoundError), error
    assert "timed out" in str(error) and "\n" not in str(error)
    assert not root.exists(), "a failed download left its folder behind"


@pytest.mark.parametrize("mode", ["404", "500", "truncated", "refused"])
def test_a_failed_download_says_so_in_one_line_and_leaves_nothing(
    mode: str, tmp_path: Path, release_server: _ReleaseServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer cut short was taken as a complete archive (urllib does not check the
    Content-Length), then blamed on the archive, leaving the download folder behind."""
    if mode == "refused":
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setattr(fsdd, "FSDD_URL", f"http://127.0.0.1:{closed.getsockname()[1]}/a")
        closed.close()
    release_server.mode = mode
    root = tmp_path / "data" / "fsdd"
    with pytest.raises(DatasetNotFoundError) as info:
        fsdd.ensure_fsdd(root)
    message = str(info.value)
    expected = {"404": "HTTP Error 404", "500": "HTTP Error 500", "refused": "Connection refused"}
    assert expected.get(mode, "cut short") in message
    assert "the download failed" in message and fsdd.FSDD_URL in message
    assert "Fix: " in message and "\n" not in message
    assert not (tmp_path / "data").exists(), "a failed download left its folders behind"


def test_runs_started_together_download_once(
    tmp_path: Path, release_server: _ReleaseServer, thirty_recordings
) -> None:
    """Two runs (sweep jobs side by side) on an empty data.root both downloaded, then
    unpacked into the same staging folder, deleting each other's files: tracebacks
    (FileNotFoundError) or a wrong checksum, and at times no run at all got its data."""
    release_server.delay = 0.5  # both ask before either has the archive
    root = tmp_path / "fsdd"
    results = _ensure_in_threads(root, 3)
    assert results == [root / fsdd.FSDD_ARCHIVE_DIR / "recordings"] * 3
    assert len(release_server.requests) == 1, "each run downloaded the archive"
    assert fsdd.recordings_sha256(results[0]) == fsdd.FSDD_RECORDINGS_SHA256
    assert sorted(p.name for p in root.iterdir()) == [fsdd.FSDD_ARCHIVE_DIR]


_KILLED_DOWNLOAD = """
import sys
from data import fsdd
fsdd.FSDD_URL = sys.argv[2]
fsdd.ensure_fsdd(sys.argv[1])
"""


def test_a_download_killed_midway_leaves_nothing_the_next_run_keeps(
    tmp_path: Path, release_server: _ReleaseServer, thirty_recordings
) -> None:
    """kill -9 during the transfer left torch.hub's ``*.partial`` file in data.root for
    good: every killed download added one (the whole archive's size at worst)."""
    release_server.chunk_pause = 0.05
    root = tmp_path / "fsdd"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    killed = subprocess.Popen(
        [sys.executable, "-c", _KILLED_DOWNLOAD, str(root), fsdd.FSDD_URL],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size for p in root.glob(f"{fsdd.FSDD_ARCHIVE_NAME}?*")):
            assert killed.poll() is None and time.monotonic() < deadline, "no transfer seen"
            time.sleep(0.02)
    finally:
        killed.kill()  # SIGKILL: no clean-up runs
        killed.wait()
    assert not (root / fsdd.FSDD_ARCHIVE_NAME).exists(), "a partial file was taken as done"

    release_server.chunk_pause = 0.0
    recordings = fsdd.ensure_fsdd(root)
    assert fsdd.recordings_sha256(recordings) == fsdd.FSDD_RECORDINGS_SHA256
    assert sorted(p.name for p in root.iterdir()) == [fsdd.FSDD_ARCHIVE_DIR]


def test_an_incomplete_copy_in_the_download_folder_is_kept(
    tmp_path: Path, fsdd_recordings: Path, release_server: _ReleaseServer, thirty_recordings
) -> None:
    """An incomplete ``free-spoken-digit-dataset-1.0.10/`` (a manual unpack cut short, a
    user's own takes beside the recordings) was deleted whole by the download."""
    root = tmp_path / "fsdd"
    old = root / fsdd.FSDD_ARCHIVE_DIR / "recordings"
    old.mkdir(parents=True)
    shutil.copy(fsdd_recordings / thirty_recordings[0], old / thirty_recordings[0])
    (old / "my_own_take.wav").write_bytes(b"RIFF mine")

    recordings = fsdd.ensure_fsdd(root)
    assert recordings == old
    assert fsdd.recordings_sha256(recordings) == fsdd.FSDD_RECORDINGS_SHA256
    kept = list(root.glob("*/recordings/my_own_take.wav"))
    assert [p.read_bytes() for p in kept] == [b"RIFF mine"], "the user's file was deleted"


def test_a_full_disk_while_unpacking_keeps_the_archive_and_says_so(
    tmp_path: Path, release_server: _ReleaseServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No space to unpack was reported as a broken archive: the good download was deleted
    and the fix said to download it again, into the same full disk."""
    root = tmp_path / "fsdd"

    def disk_full(self, *args, **kwargs) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tarfile.TarFile, "extractall", disk_full)
    with pytest.raises(DatasetNotFoundError) as info:
        fsdd.ensure_fsdd(root)
    message = str(info.value)
    assert "No space left on device" in message and "free" in message
    assert "cannot be unpacked" not in message and "\n" not in message
    assert (root / fsdd.FSDD_ARCHIVE_NAME).read_bytes() == release_server.body, "not kept"

    monkeypatch.undo()  # space freed: the next run unpacks the kept archive
    monkeypatch.setattr(fsdd, "FSDD_URL", "http://127.0.0.1:1/unreachable")
    with pytest.raises(DatasetNotFoundError, match="does not hold the expected"):
        fsdd.ensure_fsdd(root)  # the 30-file archive is unpacked, not downloaded again
    assert len(release_server.requests) == 1


def test_a_read_only_data_root_asks_for_a_writable_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data.root under a read-only folder: the fix said to allow the download, which was
    allowed; it needs a folder that can be written to."""

    def read_only(self: Path, *args, **kwargs) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(self))

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(DatasetNotFoundError) as info:
        fsdd.ensure_fsdd(tmp_path / "fsdd")
    message = str(info.value)
    assert "Read-only file system" in message and "writable" in message
    assert "download" not in message.split("Fix:")[1], "the download was allowed"


def test_unpacks_on_a_python_without_tar_filters(
    tmp_path: Path, release_server: _ReleaseServer, thirty_recordings, monkeypatch
) -> None:
    """Python 3.10.0-3.10.11 and 3.11.0-3.11.3 (pyproject allows >=3.10) have no
    ``extractall(filter=...)``: every download ended in a TypeError traceback."""
    extractall = tarfile.TarFile.extractall

    def old_extractall(self, path=".", members=None, *, numeric_owner=False):
        return extractall(self, path, members, numeric_owner=numeric_owner, filter="data")

    monkeypatch.delattr(tarfile, "data_filter")
    monkeypatch.setattr(tarfile.TarFile, "extractall", old_extractall)
    monkeypatch.setattr(fsdd, "_EXTRACT_FILTER", {}, raising=False)  # as imported there
    recordings = fsdd.ensure_fsdd(tmp_path / "fsdd")
    assert fsdd.recordings_sha256(recordings) == fsdd.FSDD_RECORDINGS_SHA256


def test_members_outside_the_staging_folder_are_never_unpacked() -> None:
    def member(name: str) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type = tarfile.REGTYPE
        return info

    assert fsdd._is_recording(member(f"{fsdd.FSDD_ARCHIVE_DIR}/recordings/0_theo_0.wav"))
    assert not fsdd._is_recording(member("../../x/recordings/0_theo_0.wav"))
    assert not fsdd._is_recording(member("/etc/x/recordings/0_theo_0.wav"))


def test_a_filesystem_without_locks_still_downloads(
    tmp_path: Path, release_server: _ReleaseServer, thirty_recordings, monkeypatch
) -> None:
    """Some NFS mounts answer flock with ENOLCK: the download goes on, unserialised."""
    import fcntl

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    root = tmp_path / "fsdd"
    recordings = fsdd.ensure_fsdd(root)
    assert fsdd.recordings_sha256(recordings) == fsdd.FSDD_RECORDINGS_SHA256
    assert sorted(p.name for p in root.iterdir()) == [fsdd.FSDD_ARCHIVE_DIR]


def test_runs_started_together_without_network_each_say_so_in_one_line(
    tmp_path: Path, release_server: _ReleaseServer
) -> None:
    """The run that failed first removed the data.root it had made while the others
    waited on the lock inside it: they ended in a FileNotFoundError traceback."""
    release_server.mode, release_server.delay = "404", 0.3
    root = tmp_path / "data" / "fsdd"
    results = _ensure_in_threads(root, 3)
    assert [type(err) for err in results] == [DatasetNotFoundError] * 3, results
    assert len(release_server.requests) == 3  # each tried in turn, none at once
