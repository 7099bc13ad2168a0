"""Label audio files with a trained run: transcripts (ASR) or speaker names (speaker ID).

python recipes/transcribe.py outputs/fsdd_digits/conformer_ctc/default a.wav b.wav
python recipes/transcribe.py RUN_DIR a.wav --precision bf16 --device cuda

Without ``--precision`` it labels in the precision the run's test ran in (``results.json``).
A file that cannot be read (missing, a folder, not audio) is named on stderr and the others
are labelled; the exit status is then 2. A file far longer than the run's training audio is
labelled with a warning that names its duration and the training range.
"""

from __future__ import annotations

import argparse
import re
import sys

from amp_utils import CheckpointError, DeviceNotAvailableError, PrecisionNotSupportedError
from data.errors import AudioError, DataError
from recipes.inference import RunNotFoundError, load_trained


def as_transcribe_advice(err: Exception) -> str:
    """``err``'s message with training-style advice (``device=cpu``) in this tool's flags
    (``--device cpu``), and a bad audio file's fix (written for a dataset's files: data
    preparation, ``data.skip_bad_files``) replaced by one for a file given here."""
    if isinstance(err, AudioError) and err.problem:
        return f"{err.problem}. Fix: pass a readable audio file (wav, flac, ...)."
    return re.sub(r"\b(device|precision)=([\w:]+)", r"--\1 \2", str(err))


def main(argv: list[str] | None = None) -> int:
    """Print ``<file>\\t<label>`` per readable audio file, then one ``error:`` line
    per file that cannot be read; returns the exit code (0, or 2 if a file could not be
    labelled)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", help="run folder (or a checkpoint inside it)")
    parser.add_argument("audio", nargs="+", help="audio files (any rate; resampled)")
    parser.add_argument(
        "--precision",
        default=None,
        help="fp32 | fp16 | bf16 | auto (the fastest this device computes natively; "
        "default: the precision the run was tested in)",
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    args = parser.parse_args(argv)
    try:
        trained = load_trained(args.run, device=args.device, precision=args.precision)
        labels = trained.label_each(args.audio)
    except (
        RunNotFoundError,
        DataError,
        CheckpointError,
        PrecisionNotSupportedError,
        DeviceNotAvailableError,
        ValueError,
    ) as err:
        print(f"error: {as_transcribe_advice(err)}", file=sys.stderr)
        return 2
    bad = [label for label in labels if isinstance(label, AudioError)]
    for path, label in zip(args.audio, labels, strict=True):
        if not isinstance(label, AudioError):
            print(f"{path}\t{label}")
    sys.stdout.flush()  # the labels, then what could not be labelled
    for err in bad:
        print(f"error: {as_transcribe_advice(err)}", file=sys.stderr)
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
