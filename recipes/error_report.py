"""Print what a trained run got wrong in its test: its ``test_errors.md``.

    python recipes/error_report.py outputs/fsdd_digits/conformer_ctc/default

The report itself (the wrong utterances, the confusions per speaker, a collapsed model) is
made by ``recipes/error_analysis.py`` when the run tests its model; ``evaluate.py RUN
--errors FILE`` makes one for a re-test.
"""

from __future__ import annotations

import argparse
import sys

from recipes.error_analysis import TEST_ERRORS_FILE
from recipes.inference import RunNotFoundError, find_run_dir


def main(argv: list[str] | None = None) -> int:
    """Print the ``test_errors.md`` of each run folder given; returns the exit code.

    Running this file did nothing (no entry point) and exited 0, though the README lists it
    with the entry points. A run without the report (stopped before its test, or from
    before the report) gets the command that computes it.
    """
    parser = argparse.ArgumentParser(
        description="Print what a trained run got wrong in its test (its test_errors.md)."
    )
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders of recipes/train.py")
    args = parser.parse_args(argv)
    reports = []
    try:
        for run in args.runs:
            run_dir = find_run_dir(run)
            report = run_dir / TEST_ERRORS_FILE
            if not report.is_file():
                raise RunNotFoundError(
                    f"{run_dir} has no {TEST_ERRORS_FILE}: the run has not tested its model "
                    "(it stopped before the end of its training, or it is older than the "
                    f"report). Fix: python recipes/evaluate.py {run} --errors errors.md "
                    "(tests its best checkpoint and writes the report to errors.md)."
                )
            reports.append(report.read_text())
    except RunNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(reports), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
