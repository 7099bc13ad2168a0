"""Test a finished run again, with its own settings or changed ones; the run is not touched.

python recipes/evaluate.py RUN_DIR                          # the run's test, recomputed
python recipes/evaluate.py RUN_DIR model.decoder=lexicon    # re-score with the lexicon decoder
python recipes/evaluate.py RUN_DIR precision.eval_precision=bf16 --split valid
python recipes/evaluate.py RUN_DIR model.decoder=greedy --json greedy.json
python recipes/evaluate.py multirun/DATE model.decoder=lexicon  # each job of a sweep; the mean
python recipes/evaluate.py RUN_DIR --errors errors.md      # + what it got wrong, and how

It loads the run's resolved config (``config_resolved.yaml``), applies the ``key=value``
overrides, rebuilds the data and the Brain and tests the checkpoint the run tested (the
best by the validation metric, or the same average). Nothing in the run folder is written:
the metrics are printed, ``--json FILE`` saves them to a new file, and ``--errors FILE``
writes a new markdown file with each run's wrong utterances, its errors per speaker and its
most frequent confusions (``recipes/error_analysis.py``). A speaker-ID run whose training
data now names other speakers than its ``labels.json`` is refused (its classes would be
read as other speakers); an ASR run decodes with the words its ``labels.json`` records.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from amp_utils import resolve_device
from amp_utils.atomic import atomic_write_json, atomic_write_text
from amp_utils.interruption import run_phase, signals_held
from data.errors import DataError
from recipes.audio_brain import LEGACY_AVERAGE_FROM, format_metrics
from recipes.data_setup import DataBundle, build_data
from recipes.error_analysis import error_report
from recipes.experiment import build_brain
from recipes.inference import (
    RunNotFoundError,
    find_run_dir,
    is_run_dir,
    sweep_jobs,
    unfinished_run_note,
)
from recipes.preflight import USER_ERRORS, preflight, run_options
from recipes.resolvers import register_resolvers
from recipes.run_folder import LABELS_FILE
from recipes.task import LEGACY_BEAM_SIZE, LEGACY_DECODER
from recipes.tasks import task_for

logger = logging.getLogger(__name__)
SPLITS = ("test", "valid")
#: How to go on after a signal stopped an evaluation (it writes nothing before its end).
EVALUATE_AGAIN = "Run the same command again to evaluate."
#: ... or stopped it while it wrote its files, which it finished first.
WRITTEN_WHOLE = "Its files were written whole before it stopped: the evaluation is complete."
_ABSENT = object()  # OmegaConf.select's default for a key the config does not have


def run_config(run_dir: Path, overrides: list[str]) -> DictConfig:
    """The run's resolved config with ``key=value`` overrides of keys it already has."""
    resolved = run_dir / "config_resolved.yaml"
    if not resolved.is_file():
        raise RunNotFoundError(
            f"{run_dir} has no config_resolved.yaml: it is not a run folder of recipes/train.py."
        )
    cfg = OmegaConf.load(resolved)
    if task_for(cfg.model).needs_tokenizer:  # runs from before the lexicon decoder
        cfg.model.setdefault("decoder", LEGACY_DECODER)  # were tested with best-path decoding
        cfg.model.setdefault("beam_size", LEGACY_BEAM_SIZE)
        cfg.model.setdefault("valid_decoder", cfg.model.decoder)  # validated with it too
    cfg.trainer.setdefault("average_from", LEGACY_AVERAGE_FROM)  # runs from before the option
    cfg.trainer.setdefault("checkpoint_writes", "auto")  # no bearing on a re-test
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not a key=value override (e.g. model.decoder=lexicon).")
        current = OmegaConf.select(cfg, key, default=_ABSENT)
        if current is _ABSENT:
            raise ValueError(f"{key} is not a key of this run's config (see {resolved}).")
        if OmegaConf.is_config(current) and key == "device" and "name" in current:
            key, item = "device.name", f"device.name={value}"  # device=cpu, as train.py's
        elif OmegaConf.is_config(current):
            hint = " (evaluation runs in precision.eval_precision)" if key == "precision" else ""
            raise ValueError(
                f"{key} is a group of settings in this run's config, not one value: set one "
                f"of its keys instead{hint}: {', '.join(f'{key}.{k}' for k in current)}."
            )
        OmegaConf.update(cfg, key, OmegaConf.select(OmegaConf.from_dotlist([item]), key))
    return cfg


def use_trained_labels(run_dir: Path, cfg: DictConfig, data: DataBundle) -> None:
    """Re-test with the labels the run was trained with (its ``labels.json``), not those of
    its training data as it reads now.

    A speaker-ID model's classes are the speakers of its training split, in the order its
    ``labels.json`` records; the re-test rebuilds the data and numbers the speakers of the
    training split as it reads now. A manifest edited since (a speaker added, removed or
    renamed) numbered them otherwise: the checkpoint then failed to load as "written by a
    different model", or, with as many speakers as before, its classes were read as other
    speakers and the accuracy was silently wrong. That is refused.

    ASR's lexicon decoder says only the training transcripts' words: rebuilt from a manifest
    that gained a word since, the re-test decoded with another lexicon than the run's test
    (and ``transcribe.py``, which reads ``labels.json``). The run's words are used, with a
    warning naming the difference.

    Raises:
        DataError: the speakers differ, naming both lists and the fix.
    """
    try:
        recorded = json.loads((run_dir / LABELS_FILE).read_text())
        trained, words = recorded["speakers"], recorded.get("words")
    except (OSError, ValueError, KeyError, TypeError):  # a run from before labels.json
        return
    if task_for(cfg.model).closed_set_speakers and list(trained) != list(data.speakers):
        raise DataError(
            f"{run_dir} identifies the speakers it was trained on, {list(trained)} (its "
            f"{LABELS_FILE}), but its training data now has {list(data.speakers)}: the "
            "model's classes would be read as other speakers. Fix: re-test it with the "
            "training manifest it was trained on (data.train=PATH), or train a new run on the "
            "new data."
        )
    if words is not None and tuple(words) != tuple(data.words):
        now = set(data.words)
        added, gone = sorted(now - set(words)), sorted(set(words) - now)
        change = "; ".join(
            f"{what}: {', '.join(found)}"
            for what, found in (("new words", added), ("words gone", gone))
            if found
        )
        logger.warning(
            "%s's training transcripts now have other words than its lexicon (%s, the words "
            "it was trained and tested with) (%s): the re-test decodes with the run's words.",
            run_dir,
            LABELS_FILE,
            change,
        )
        data.words = tuple(words)


def evaluate_run(run: str | Path, overrides: list[str] | None = None, split: str = "test") -> dict:
    """Test a finished run's tested checkpoint on ``split`` under ``overrides``.

    Returns:
        ``{"run", "split", "overrides", "precision", "metrics", "tested_checkpoint",
        "errors"}``; ``precision`` is the one the metrics were computed in (the run's
        ``precision.eval_precision``, ``auto`` resolved); ``errors`` is the markdown error
        report (``recipes/error_analysis.py``).
    """
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not valid; choose one of: {', '.join(SPLITS)}.")
    run_dir = find_run_dir(run)
    note = unfinished_run_note(run_dir)
    if note is not None:
        logger.warning(note)
    overrides = list(overrides or [])
    cfg = run_config(run_dir, overrides)
    preflight(cfg)  # the checks train.py runs: values, decoder back end, device, precision
    cfg.trainer.noprogressbar = True
    device = resolve_device(run_options(cfg).device)
    with run_phase(f"evaluating {run_dir}"), build_data(cfg, device) as data:
        # each run's loader workers end with its evaluation, a signal's too
        use_trained_labels(run_dir, cfg, data)
        brain = build_brain(cfg, data, run_dir, tensorboard=None)
        metrics = brain.evaluate_best(getattr(data, split))
    return {
        "run": str(run_dir),
        "split": split,
        "overrides": overrides,
        "precision": brain.eval_amp.name,
        "metrics": metrics,
        "tested_checkpoint": brain.tested_checkpoint(),
        "errors": error_report(
            brain.outcomes,
            words=task_for(cfg.model).needs_tokenizer,
            title=f"{split.capitalize()} errors of {run_dir}"
            + (f" ({' '.join(overrides)})" if overrides else ""),
        ),
    }


def split_arguments(items: list[str]) -> tuple[list[str], list[str]]:
    """Run folders and ``key=value`` overrides, in the order given.

    Existing paths are runs (sweep job folders hold ``=``: ``0_data.test_speakers=[lucas]``),
    and so is an item with a ``/`` before its ``=``: a missing run, reported as such rather
    than taken for an override. Of several existing paths (a shell glob such as
    ``multirun/DATE/*``), those that are not run folders (``summary.md``, the sweep's ``tb/``,
    a job stopped before it started training) are left out. A sweep's folder stands for its
    jobs (``multirun/DATE`` as ``multirun/DATE/*``).
    """
    runs = [item for item in items if Path(item).exists() or not _is_override(item)]
    overrides = [item for item in items if item not in runs]
    runs = [job for run in runs for job in _sweep_jobs_or_run(run)]
    if len(runs) > 1:
        runs = [run for run in runs if not Path(run).exists() or is_run_dir(Path(run))]
    return runs, overrides


def _sweep_jobs_or_run(item: str) -> list[str]:
    """A sweep folder's job folders (it was refused as "not a training run folder"), or
    ``[item]``: a run folder, a missing one, or a sweep without jobs (refused by name)."""
    jobs = sweep_jobs(item) if Path(item).is_dir() and not is_run_dir(Path(item)) else None
    return [str(job) for job in jobs] if jobs else [item]


def _is_override(item: str) -> bool:
    """``key=value``, and not a path that is missing (``runs/0_data.test_speakers=[x]``)."""
    key, sep, _ = item.partition("=")
    return bool(sep) and "/" not in key


def mean_metrics(results: list[dict]) -> dict[str, float] | None:
    """The mean of each metric over several runs (e.g. a leave-one-speaker-out sweep);
    None when the runs have different metrics (runs of different tasks)."""
    keys = results[0]["metrics"].keys()
    if any(r["metrics"].keys() != keys for r in results):
        return None
    return {key: sum(r["metrics"][key] for r in results) / len(results) for key in keys}


def main(argv: list[str] | None = None) -> int:
    """Print the metrics per run (and their mean over several runs); ``--json`` saves them.

    Returns the exit code. SIGTERM/SIGINT stop it at once with one line (exit status 1,
    as a training run's): nothing was written yet, or the files asked for are whole.
    """
    with run_phase("evaluating", hint=EVALUATE_AGAIN, install=True):
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "items",
        nargs="+",
        metavar="RUN_OR_OVERRIDE",
        help="run folders (several: e.g. multirun/DATE/*, or the sweep folder multirun/DATE), "
        "then key=value changes "
        "(e.g. model.decoder=lexicon)",
    )
    parser.add_argument("--split", default="test", help="test | valid")
    parser.add_argument("--json", type=Path, help="also write the result to this new file")
    parser.add_argument(
        "--errors",
        type=Path,
        help="also write the wrong utterances and the most frequent confusions "
        "(markdown) to this new file",
    )
    args = parser.parse_args(argv)
    register_resolvers()
    runs, overrides = split_arguments(args.items)
    try:
        if not runs:
            raise RunNotFoundError("No run folder given (e.g. outputs/fsdd_digits/...).")
        for run in runs:  # every run is found before any is evaluated
            if not Path(run).exists() and re.fullmatch(r"\w+(\.\w+)+", run):
                raise ValueError(  # was "model.decoder does not exist (relative paths ...)"
                    f"{run} is neither a run folder nor a key=value override: give the key "
                    f"a value (e.g. {run}=...)."
                )
            find_run_dir(run)
        for new_file in (args.json, args.errors):
            if new_file is not None and new_file.exists():
                raise FileExistsError(f"{new_file} exists; give a new file (nothing is rewritten).")
        results = [evaluate_run(run, overrides, args.split) for run in runs]
    except (*USER_ERRORS, RunNotFoundError, ValueError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for result in results:
        print(f"{result['run']} {args.split}: {format_metrics(result['metrics'])}")
    saved: dict[str, Any] = results[0]
    if len(results) > 1:
        mean = mean_metrics(results)
        if mean is None:
            print(f"no mean of the {len(results)} runs: they have different metrics (tasks)")
        else:
            print(f"mean of {len(results)} runs, {args.split}: {format_metrics(mean)}")
        saved = {"runs": results, "mean_metrics": mean}
    errors = [result.pop("errors") for result in results]
    written = [str(f) for f in (args.json, args.errors) if f is not None]
    # Both or neither (a rerun refuses files that exist); a signal waits for both.
    phase = f"writing {' and '.join(written)}" if written else "printing the metrics"
    with run_phase(phase, hint=WRITTEN_WHOLE), signals_held():
        if args.json is not None:
            atomic_write_json(args.json, saved)
        if args.errors is not None:
            atomic_write_text(args.errors, "\n".join(errors))
            print(f"errors: {args.errors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
