"""Free Spoken Digit Dataset (FSDD) v1.0.10: find or download it, and make digit manifests.

FSDD holds 3000 recordings ``{digit}_{speaker}_{index}.wav`` (8 kHz mono, 6 speakers, index
0-49). The official split uses index 0-4 for test; this module carves index 5-9 out of the
training indices for validation, so the test set stays the official one.

``ensure_fsdd`` never trusts a partial download: it unpacks into a temporary folder,
checks the file count and a content checksum, and only then moves the recordings into
place. A local copy is found by the 3000 expected file names; other files beside them (a
user's own takes, macOS ``._*.wav`` metadata) are ignored, never read as FSDD.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import http.client
import logging
import os
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

from data.audio import audio_info
from data.errors import DataError, DatasetNotFoundError
from data.manifest import Utterance, write_manifest
from data.synthetic_voices import synthetic_digit_utterances
from data.text import DIGIT_WORDS

try:
    import fcntl
except ImportError:  # Windows: downloads are not serialised
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

FSDD_VERSION = "1.0.10"
FSDD_URL = (
    "https://github.com/Jakobovski/free-spoken-digit-dataset/archive/refs/tags/v1.0.10.tar.gz"
)
FSDD_SPEAKERS: tuple[str, ...] = ("george", "jackson", "lucas", "nicolas", "theo", "yweweler")
#: Digits and recording indices of every speaker: ``{digit}_{speaker}_{index}.wav``.
FSDD_DIGITS = range(10)
FSDD_INDICES = range(50)
#: The release's recording file names, sorted; a copy is complete when all are present.
FSDD_RECORDING_NAMES: tuple[str, ...] = tuple(
    sorted(
        f"{digit}_{speaker}_{index}.wav"
        for digit in FSDD_DIGITS
        for speaker in FSDD_SPEAKERS
        for index in FSDD_INDICES
    )
)
FSDD_NUM_RECORDINGS = len(FSDD_RECORDING_NAMES)  # 3000
#: sha256 over, for each expected recording (``FSDD_RECORDING_NAMES``) in sorted name
#: order, its name (UTF-8) then its bytes.
FSDD_RECORDINGS_SHA256 = "45a9b976ba3397a2fd5c70a9f2e43c34f442a3a6be47392ecfc41174b678f37e"

#: Seconds a download waits for the server: to connect, and for each read. Without it a
#: stalled server (a dead proxy, a firewall swallowing the reply) hung the run for good.
FSDD_DOWNLOAD_TIMEOUT_S = 60.0
#: Space a download needs (MB): the archive plus its unpacked recordings (~27 MB).
FSDD_SPACE_MB = 50
#: Errors of the target disk (full, read-only, no permission), not of the network.
_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
_LOCK_NAME = ".fsdd-download.lock"

#: Folder name at the top of the release archive.
FSDD_ARCHIVE_DIR = f"free-spoken-digit-dataset-{FSDD_VERSION}"
FSDD_ARCHIVE_NAME = f"{FSDD_ARCHIVE_DIR}.tar.gz"

#: Official test indices (0-4) and the validation indices carved from training (5-9).
TEST_INDICES = range(0, 5)
VALID_INDICES = range(5, 10)


def _candidates(root: Path) -> list[Path]:
    return [root, root / "recordings", root / FSDD_ARCHIVE_DIR / "recordings"]


def _expected_present(folder: Path) -> list[Path]:
    """The expected recordings (``FSDD_RECORDING_NAMES``) in ``folder``, in name order."""
    if not folder.is_dir():
        return []
    present = set(os.listdir(folder))  # one listing, not 3000 stat calls (network drives)
    return [folder / name for name in FSDD_RECORDING_NAMES if name in present]


def recordings_sha256(recordings_dir: str | Path) -> str:
    """Content checksum of a recordings folder (see ``FSDD_RECORDINGS_SHA256``).

    Only the expected recordings count: extra files beside them do not change it, and a
    missing or altered recording does.
    """
    digest = hashlib.sha256()
    for wav in _expected_present(Path(recordings_dir)):
        digest.update(wav.name.encode("utf-8"))
        digest.update(wav.read_bytes())
    return digest.hexdigest()


def find_fsdd_recordings(root: str | Path) -> Path | None:
    """Locate FSDD's ``recordings`` folder under ``root``.

    ``root`` may be the recordings folder itself, a folder holding ``recordings/`` (like
    the shared copy), or one holding the unpacked archive
    (``free-spoken-digit-dataset-1.0.10/recordings``).

    Returns:
        The first candidate folder holding every expected recording
        (``FSDD_RECORDING_NAMES``; other files beside them are ignored), or ``None`` if
        there is none.
    """
    for folder in _candidates(Path(root)):
        if len(_expected_present(folder)) == len(FSDD_RECORDING_NAMES):
            return folder
    return None


def _not_found(root: Path, problem: str, fix: str | None = None) -> DatasetNotFoundError:
    candidates = _candidates(root)
    looked = ", ".join(str(folder) for folder in candidates)
    found, folder = max((len(_expected_present(folder)), folder) for folder in candidates)
    where = f" (in {folder})" if found else ""
    fix = fix or f"or set data.download=true to download {FSDD_URL}"
    return DatasetNotFoundError(
        f"FSDD v{FSDD_VERSION} recordings not found: {problem}; found {found} of the "
        f"{len(FSDD_RECORDING_NAMES)} expected recordings{where}. Looked for "
        f"{{digit}}_{{speaker}}_{{index}}.wav files in {looked}. Fix: set data.root=PATH (or "
        f"the environment variable FSDD_ROOT=PATH) to a folder holding FSDD's complete "
        f"recordings/, {fix}."
    )


def _disk_error(err: BaseException) -> bool:
    """Whether ``err`` is the target disk's (full, read-only, no permission), not the
    network's or the archive's: its fix is another folder or free space, not a download."""
    return isinstance(err, OSError) and err.errno in _DISK_ERRNOS


def _unwritable(root: Path, err: OSError, needed_mb: float) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"FSDD v{FSDD_VERSION} cannot be written into data.root={root} ({err}). Fix: free "
        f"about {max(needed_mb, 1):.0f} MB there (or make it writable) and re-run, or set "
        "data.root=PATH (or FSDD_ROOT=PATH) to a writable folder with space, or to a "
        "folder holding FSDD's complete recordings/."
    )


def _is_recording(member: tarfile.TarInfo) -> bool:
    """A regular ``*/recordings/*.wav`` file that unpacks inside the staging folder."""
    path = Path(member.name)
    return (
        member.isfile()
        and len(path.parts) >= 3
        and path.parts[-2] == "recordings"
        and path.parts[-1].endswith(".wav")
        and not path.is_absolute()
        and ".." not in path.parts
    )


#: ``extractall``'s safe "data" filter where this Python has it (3.10.12+, 3.11.4+, 3.12):
#: on 3.10.0-3.10.11 and 3.11.0-3.11.3 ``filter=`` was a TypeError traceback. Without it
#: ``_is_recording`` alone keeps the members to regular files inside the staging folder.
_EXTRACT_FILTER: dict[str, str] = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def _moved_aside(folder: Path) -> Path:
    """Rename ``folder`` to the first free ``<name>.incomplete[-N]`` beside it; returns that."""
    for n in range(1, 1000):
        aside = folder.with_name(f"{folder.name}.incomplete" + (f"-{n}" if n > 1 else ""))
        if not aside.exists() and not aside.is_symlink():
            folder.rename(aside)
            return aside
    raise FileExistsError(f"no free name to move {folder} aside")


def _unpack_recordings(archive: Path, root: Path) -> Path:
    """Unpack ``*/recordings/*.wav`` from ``archive``, verify, and move into ``root``.

    Call it holding ``_download_lock(root)``: the staging folder's name is fixed, so that
    a run killed while unpacking leaves nothing the next one does not remove.
    """
    staging = root / ".fsdd-unpack.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    members: list[tarfile.TarInfo] = []
    try:
        try:
            with tarfile.open(archive, "r:*") as tar:
                members = [m for m in tar.getmembers() if _is_recording(m)]
                tar.extractall(staging, members=members, **_EXTRACT_FILTER)
        except (tarfile.TarError, OSError, EOFError) as err:
            if _disk_error(err):  # the archive is fine: keep it, it is not downloaded again
                needed = sum(m.size for m in members) / 1e6 or FSDD_SPACE_MB
                raise _unwritable(root, err, needed) from None
            archive.unlink(missing_ok=True)
            raise DatasetNotFoundError(
                f"FSDD archive {archive} cannot be unpacked ({err}); it was deleted. "
                f"Fix: re-run to download {FSDD_URL} again, or set data.root=PATH to an "
                "unpacked copy."
            ) from None
        folders = sorted({staging / Path(m.name).parent for m in members})
        count = len(members)
        checksum = recordings_sha256(folders[0]) if len(folders) == 1 else ""
        expected = len(FSDD_RECORDING_NAMES)
        if len(folders) != 1 or count != expected or checksum != FSDD_RECORDINGS_SHA256:
            archive.unlink(missing_ok=True)
            raise DatasetNotFoundError(
                f"FSDD archive {archive} does not hold the expected recordings: found "
                f"{count} .wav files in {len(folders)} recordings folder(s) with checksum "
                f"{checksum or '-'}, expected {expected} in one folder with "
                f"checksum {FSDD_RECORDINGS_SHA256}. The archive and the partial unpack "
                f"were deleted. Fix: re-run to download {FSDD_URL} again, or set "
                "data.root=PATH to a verified copy."
            )
        # Move the verified tree into place: <root>/free-spoken-digit-dataset-1.0.10/...
        top = staging / Path(members[0].name).parts[0]
        target = root / FSDD_ARCHIVE_DIR
        if target.exists() or target.is_symlink():  # incomplete (else it had been found)
            aside = _moved_aside(target)  # never deleted: it may hold a user's own files
            logger.warning(
                "%s held an incomplete FSDD copy; moved it to %s (nothing deleted) to put "
                "the verified download in its place.",
                target,
                aside,
            )
        top.replace(target)
        return target / folders[0].relative_to(top)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _download_lock(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``root``'s download: runs started together (sweep jobs
    side by side, several commands on one data.root) download and unpack once, in turn.

    The lock is ``flock`` on ``root/.fsdd-download.lock``: the kernel releases it when its
    holder dies (kill -9 leaves no stale lock). The holder deletes the file when done, so
    a waiter checks, once it holds the lock, that it locked the file still at that path.
    Where ``fcntl`` is missing (Windows) or the filesystem has no locks (``ENOLCK`` on
    some NFS mounts) runs are not serialised. The file is opened read-only, so a lock
    file another user's run left behind does not stop this one.
    """
    if fcntl is None:
        yield
        return
    path = root / _LOCK_NAME
    while True:
        # A run that failed removes the data.root it made, under a waiter's feet: make it.
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    logger.info("Waiting for another run downloading FSDD into %s.", root)
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as err:  # no locks here: it was an OSError traceback
                logger.warning(
                    "Cannot lock %s (%s): runs started together on this data.root may "
                    "download FSDD at the same time.",
                    path,
                    err,
                )
                try:
                    yield
                finally:
                    path.unlink(missing_ok=True)
                return
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                try:
                    yield
                finally:
                    path.unlink(missing_ok=True)  # before the unlock: see above
                return
        finally:
            os.close(fd)


def _download(url: str, archive: Path, timeout: float) -> None:
    """Download ``url`` to ``archive`` through ``<archive>.part``, renamed when complete.

    ``timeout`` bounds the wait to connect and for each read, so a stalled server ends
    the download; a transfer shorter than its Content-Length is refused. The ``.part``
    file is removed on any error (a kill -9 leaves it to the next run, which overwrites
    it).

    Raises:
        OSError: the download failed (``urllib.error.URLError``, ``HTTPError``, timeouts,
            a short transfer, disk errors).
    """
    part = archive.with_name(archive.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            length = response.headers.get("Content-Length", "")
            total = int(length) if length.isdigit() else None
            received = 0
            with (
                open(part, "wb") as out,
                tqdm(
                    total=total, unit="B", unit_scale=True, desc=archive.name, leave=False
                ) as progress,
            ):
                while chunk := response.read(1 << 16):
                    out.write(chunk)
                    received += len(chunk)
                    progress.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())
            if total is not None and received != total:
                raise OSError(f"the transfer was cut short after {received} of {total} bytes")
        part.replace(archive)
    except http.client.HTTPException as err:  # IncompleteRead, BadStatusLine: not OSError
        raise OSError(f"{type(err).__name__}: {err}") from err
    except TimeoutError as err:
        raise OSError(f"no answer from the server for {timeout:g} s: timed out") from err
    except urllib.error.URLError as err:
        if isinstance(err.reason, TimeoutError):
            raise OSError(f"no answer from the server for {timeout:g} s: timed out") from err
        raise
    finally:
        part.unlink(missing_ok=True)


def _download_and_unpack(root: Path) -> Path:
    """Under ``_download_lock(root)``: the recordings folder, downloaded if still missing."""
    found = find_fsdd_recordings(root)  # another run may have put it there while we waited
    if found is not None:
        return found
    for stale in root.glob(f"{glob.escape(FSDD_ARCHIVE_NAME)}.*.partial"):
        stale.unlink(missing_ok=True)  # torch.hub's temporary files of a killed download
    archive = root / FSDD_ARCHIVE_NAME
    if not archive.is_file():
        logger.info("Downloading FSDD v%s from %s into %s.", FSDD_VERSION, FSDD_URL, root)
        try:
            _download(FSDD_URL, archive, FSDD_DOWNLOAD_TIMEOUT_S)
        except OSError as err:
            if _disk_error(err):
                raise _unwritable(root, err, FSDD_SPACE_MB) from None
            host = urllib.parse.urlsplit(FSDD_URL).netloc
            raise _not_found(
                root,
                f"the download failed ({err})",
                f"or re-run once {host} can be reached to download {FSDD_URL} (behind a "
                "proxy: set https_proxy), or unpack that archive under data.root yourself",
            ) from None
    recordings = _unpack_recordings(archive, root)
    archive.unlink(missing_ok=True)
    logger.info("FSDD v%s downloaded and verified: %s.", FSDD_VERSION, recordings)
    return recordings


def ensure_fsdd(root: str | Path, download: bool = True) -> Path:
    """Return FSDD's recordings folder under ``root``, downloading it if needed.

    Runs started together on one ``root`` download once: the others wait for it
    (``_download_lock``). A download that stalls for ``FSDD_DOWNLOAD_TIMEOUT_S`` fails.
    A failed download leaves no folder it made behind; one killed mid-way leaves nothing
    the next run trusts.

    Args:
        root: where to look (see ``find_fsdd_recordings``) and where to download to.
        download: if False, never touch the network.

    Returns:
        The recordings folder.

    Raises:
        DatasetNotFoundError: if the data is absent and download is disabled or fails, or
            the downloaded archive does not hold the expected recordings, or ``root``
            cannot be written to; one line naming the problem and the fix.
    """
    root = Path(root).absolute()
    if root.exists() and not root.is_dir():  # it was a FileExistsError traceback
        raise DatasetNotFoundError(
            f"data.root={root} is a file, not a folder. Fix: set data.root=PATH (or the "
            "environment variable FSDD_ROOT=PATH) to the folder holding FSDD's recordings/, "
            "or to a folder to download them into."
        )
    found = find_fsdd_recordings(root)
    if found is not None:
        return found
    if not download:
        raise _not_found(root, "download is disabled")
    created = [folder for folder in (root, *root.parents) if not folder.exists()]
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a read-only parent: it was a traceback
        if _disk_error(err):
            raise _unwritable(root, err, FSDD_SPACE_MB) from None
        raise _not_found(
            root,
            f"the folder to download it into cannot be made ({err})",
            "or to a folder that can be made to download it into",
        ) from None
    try:
        with _download_lock(root):
            return _download_and_unpack(root)
    except OSError as err:  # the lock file, moving folders: a full or read-only root
        if not _disk_error(err):
            raise
        raise _unwritable(root, err, FSDD_SPACE_MB) from None
    finally:
        for folder in created:  # a misspelled data.root leaves no folders behind
            with contextlib.suppress(OSError):  # not empty: the data, or someone else's
                folder.rmdir()


def parse_fsdd_name(path: str | Path) -> tuple[int, str, int]:
    """Digit, speaker and index of an FSDD file named ``{digit}_{speaker}_{index}.wav``.

    Raises:
        DataError: if the name does not follow that pattern.
    """
    parts = Path(path).stem.split("_")
    if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit() and parts[1]:
        digit, speaker, index = int(parts[0]), parts[1], int(parts[2])
        if 0 <= digit <= 9:
            return digit, speaker, index
    raise DataError(
        f"Not an FSDD recording name: {path}. Fix: FSDD files are named "
        "{digit}_{speaker}_{index}.wav (e.g. 7_jackson_32.wav); keep only those in recordings/."
    )


def fsdd_utterances(recordings_dir: str | Path) -> list[Utterance]:
    """One utterance per FSDD recording, sorted by file name.

    The transcript is the digit's word (``"seven"``), the id the file stem; durations
    come from the file headers. Only the expected recordings (``FSDD_RECORDING_NAMES``)
    are read: other files in the folder (a user's own takes) are not FSDD.
    """
    utterances = []
    for wav in _expected_present(Path(recordings_dir).absolute()):
        digit, speaker, _ = parse_fsdd_name(wav)
        frames, sample_rate = audio_info(wav)
        utterances.append(
            Utterance(
                id=wav.stem,
                path=str(wav),
                duration=frames / sample_rate,
                transcript=DIGIT_WORDS[digit],
                speaker=speaker,
            )
        )
    return utterances


def split_fsdd(
    utterances: Sequence[Utterance], test_speakers: Sequence[str] = ()
) -> dict[str, list[Utterance]]:
    """Split FSDD utterances by recording index, or hold whole speakers out for testing.

    Without ``test_speakers``: test = index 0-4 (the official test set), valid = 5-9,
    train = 10-49; every speaker and digit appears in every split.

    With ``test_speakers``: test = every recording of those speakers (voices the model has
    never heard: what a user's own voice is to it), valid = index 0-9 of the others,
    train = index 10-49 of the others.

    Returns:
        ``{"train": [...], "valid": [...], "test": [...]}`` in input order.

    Raises:
        DataError: a held-out speaker is not in the data, or no speaker is left to train on.
    """
    speakers = sorted({utt.speaker for utt in utterances})
    held_out = set(test_speakers)
    unknown = sorted(held_out - set(speakers))
    if unknown:
        raise DataError(
            f"data.test_speakers names {unknown}, not FSDD speakers; choose from: "
            f"{', '.join(speakers)}."
        )
    if held_out and held_out >= set(speakers):
        raise DataError(
            "data.test_speakers holds out every speaker; leave at least one to train on."
        )
    splits: dict[str, list[Utterance]] = {"train": [], "valid": [], "test": []}
    for utt in utterances:
        _, _, index = parse_fsdd_name(utt.path)
        if held_out:
            split = (
                "test"
                if utt.speaker in held_out
                else "valid"
                if index in TEST_INDICES or index in VALID_INDICES
                else "train"
            )
        elif index in TEST_INDICES:
            split = "test"
        elif index in VALID_INDICES:
            split = "valid"
        else:
            split = "train"
        splits[split].append(utt)
    return splits


def prepare_fsdd_digits(
    root: str | Path,
    out_dir: str | Path,
    download: bool = True,
    test_speakers: Sequence[str] = (),
    synthetic_voices: int = 0,
    sample_rate: int = 8000,
) -> dict[str, Path]:
    """Write ``train/valid/test.csv`` manifests of single FSDD digits into ``out_dir``.

    Safe to re-run: manifests are rewritten atomically (3000 header reads, about a second).
    A split with held-out speakers goes to its own subfolder (``test_speakers=jackson``), so
    the runs of a leave-one-speaker-out sweep never share manifests.

    Args:
        root: where FSDD is or should be downloaded to (see ``ensure_fsdd``).
        out_dir: folder for the manifests.
        download: allow downloading FSDD if it is not under ``root``.
        test_speakers: speakers held out for testing (see ``split_fsdd``); empty: the
            official split.
        synthetic_voices: text-to-speech voices whose ten digits join the training split
            (``data/synthetic_voices.py``; their audio is cached in ``out_dir``); 0: none.
        sample_rate: sample rate of the synthesized audio.

    Returns:
        Manifest path per split.
    """
    recordings = ensure_fsdd(root, download=download)
    out_dir = Path(out_dir)
    splits = split_fsdd(fsdd_utterances(recordings), test_speakers)
    if synthetic_voices:
        splits["train"] += synthetic_digit_utterances(
            synthetic_voices, out_dir / "synthetic_voices", sample_rate
        )
    if test_speakers:
        out_dir = out_dir / f"test_speakers={','.join(sorted(test_speakers))}"
    if synthetic_voices:
        out_dir = out_dir / f"synthetic_voices={synthetic_voices}"
    paths = {}
    for split, utterances in splits.items():
        paths[split] = out_dir / f"{split}.csv"
        write_manifest(paths[split], utterances)
    return paths
