"""Exceptions raised by the data package.

Every error carries one message that names the problem, the file (and row) involved and
the fix, so a failed run can be repaired without reading the code. All derive from
``ValueError`` through ``DataError`` so callers can catch one type.
"""


class DataError(ValueError):
    """Base class for bad data or bad data settings."""


class AudioError(DataError):
    """An audio file is missing, empty, truncated or cannot be decoded.

    ``problem`` is the message without its fix (``"Bad audio file a.wav: ..."``), so a tool
    that was given the file itself (``transcribe.py``) can give its own fix instead of the
    dataset's (re-run data preparation, ``data.skip_bad_files``).
    """

    def __init__(self, message: str, *, problem: str | None = None) -> None:
        super().__init__(message)
        self.problem = problem


class ManifestError(DataError):
    """A manifest file is missing, empty or malformed, or points at missing audio."""


class DatasetNotFoundError(DataError):
    """A dataset is not on disk and could not (or may not) be downloaded."""
