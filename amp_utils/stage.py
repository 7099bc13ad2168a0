"""``Stage``: which part of an experiment runs (SpeechBrain's ``sb.Stage``)."""

from __future__ import annotations

from enum import Enum, auto


class Stage(Enum):
    """Simple enum to track stage of experiments."""

    TRAIN = auto()
    VALID = auto()
    TEST = auto()
