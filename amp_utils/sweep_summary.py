"""Summarize a Hydra multirun (e.g. ``precision=fp32,fp16,bf16``) in one table.

Each run writes ``results.json`` into its job folder. :func:`summarize_sweep` collects them
into ``summary.md`` and ``summary.csv`` in the sweep directory, with the speed-up of each
run over the fp32 run that differs from it only in precision. Job folders (found through
Hydra's ``.hydra/overrides.yaml``) without ``results.json`` are listed as failed, so a
crashed run is visible instead of silently missing; for a run whose test found a collapsed
model (one output for everything: ``recipes/error_analysis.py``) the ``collapsed to`` column
says what it said, since its metrics compare nothing. The sweep folder also gets TensorBoard's
HParams experiment (swept keys first, the test metrics), so ``tensorboard --logdir`` on it
compares the runs. :class:`SweepSummaryCallback` runs it
at the end of every multirun.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from amp_utils.atomic import atomic_path, atomic_write_text
from amp_utils.distributed import launch_rank
from amp_utils.interruption import run_phase
from amp_utils.run_results import (
    EARLIER_RECORDS_DIR,
    PERCENT_METRICS,
    RESULTS_FILE,
    RunResults,
    metric_label,
)
from amp_utils.sweep_keys import MULTIRUN_FILE, item_key, precision_first, swept_keys
from amp_utils.tensorboard import TENSORBOARD_DIR, write_sweep_experiment

log = logging.getLogger(__name__)

JOB_STATUS_FILE = "job_status.json"  # in a job folder: how the job's last attempt went
MULTIRUN_ID_FILE = ".multirun_id"  # in the sweep folder: the multirun that launched the jobs
#: The multirun's id in the environment of its process, which its jobs inherit (local,
#: submitit and SLURM launchers); several ``-m`` processes into one sweep folder (torchrun
#: ranks, sweeps run side by side) each keep their own.
MULTIRUN_ID_ENV = "AMP_UTILS_MULTIRUN_ID"
MISSING = "—"
#: What each multirun writes anew in its sweep folder: the table (``summarize_sweep``) and
#: Hydra's master config. A sweep run again into the folder keeps the earlier ones under
#: their date (``keep_earlier_records``).
SWEEP_RECORDS = ("summary.md", "summary.csv", MULTIRUN_FILE)
SPEEDUP_COLUMN = "speed-up vs fp32"
_LEADING_COLUMNS = ("run", "status", "precision", "device", "processes", "model", "data")
_PRECISION_ORDER = ("fp32", "fp16", "bf16")
#: Override keys that choose the precision (the group, or its ``name`` field).
PRECISION_KEYS = ("precision", "precision.name")
#: What a collapsed model said to everything (``recipes/error_analysis.py``), or "no".
COLLAPSED_COLUMN = "collapsed to"
_TRAILING_COLUMNS = (
    "utt/s",
    "audio-s/s",
    SPEEDUP_COLUMN,
    "peak memory MB",
    "wall time s",
    COLLAPSED_COLUMN,
)


def _format_number(value: Any) -> str:
    """Two decimals for numbers, :data:`MISSING` for ``None``, ``str`` otherwise."""
    if value is None:
        return MISSING
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:.2f}"
    return str(value)


def _read_overrides(job_dir: Path) -> list[str]:
    """Hydra overrides of a job folder (empty if it has none or they cannot be read)."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        return []
    try:
        overrides = OmegaConf.to_container(OmegaConf.load(overrides_file))
    except Exception as err:  # a broken file must not hide the other runs
        log.warning("Cannot read %s: %s", overrides_file, err)
        return []
    return [str(item) for item in overrides] if isinstance(overrides, list) else []


def _earlier_record(path: Path, sweep_dir: Path) -> bool:
    """Whether ``path`` is in a job's copy of its record of fewer epochs (a finished job
    trained further keeps it in ``earlier/``): not a job, nor the job's results."""
    return EARLIER_RECORDS_DIR in path.relative_to(sweep_dir).parts


def _job_dir_of(results_file: Path, job_dirs: set[Path]) -> Path:
    """The job folder a ``results.json`` belongs to: nearest ancestor with ``.hydra``."""
    for parent in results_file.parents:
        if parent in job_dirs:
            return parent
    return results_file.parent


def _override_value(overrides: list[str], key: str) -> str | None:
    """Value of ``key=value`` (also ``+key=``/``++key=``) in a list of overrides."""
    for override in overrides:
        name, sep, value = override.partition("=")
        if sep and name.lstrip("+") == key:
            return value
    return None


def _non_precision_overrides(overrides: list[str]) -> tuple[str, ...]:
    """The overrides other than ``precision=...``, sorted."""
    return tuple(
        sorted(o for o in overrides if o.partition("=")[0].lstrip("+") not in PRECISION_KEYS)
    )


def _precision_override(overrides: list[str]) -> str | None:
    """The precision an override list asks for (``precision=`` or ``precision.name=``)."""
    for key in PRECISION_KEYS:
        value = _override_value(overrides, key)
        if value is not None:
            return value
    return None


def _comparison_key(run: dict[str, Any]) -> tuple:
    """What must match for two runs to be compared: all but precision."""
    results: RunResults = run["results"]
    return (
        results.device,
        results.world_size,
        results.model,
        results.data,
        _non_precision_overrides(run["overrides"]),
    )


def _rated_without_warmup(results: RunResults) -> bool:
    """Whether the run's speed leaves out its sessions' first epochs (results.json files
    from before ``throughput.warmup_time_s`` rate all epochs): only speeds rated alike
    make a speed-up (a re-launched sweep lists its finished older runs too)."""
    return results.throughput.warmup_time_s is not None


def _precision_rank(precision: str | None) -> int:
    """Where a precision's rows go: fp32, fp16, bf16, then anything else."""
    return _PRECISION_ORDER.index(precision) if precision in _PRECISION_ORDER else 99


def _sort_key(run: dict[str, Any]) -> tuple:
    """Sort by overrides, keeping runs that differ only in precision together (fp32 first)."""
    precision = _precision_override(run["overrides"])
    if precision is None and run["results"] is not None:
        precision = run["results"].precision
    rank = _precision_rank(precision)
    return (_non_precision_overrides(run["overrides"]), rank, str(precision), run["name"])


def _job_status(job_dir: Path) -> dict[str, Any]:
    """A job folder's ``job_status.json`` (``recipes/sweep_jobs.py``), ``{}`` if none."""
    try:
        status = json.loads((job_dir / JOB_STATUS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def _collect_runs(sweep_dir: Path, multirun: str | None = None) -> list[dict[str, Any]]:
    """One entry per job folder: its name, overrides and results (``None`` if failed).

    With ``multirun`` (the id a multirun wrote into the sweep folder), only the jobs that
    multirun launched, as its jobs recorded in ``job_status.json``: a job whose attempt
    failed, or was killed (still ``running``), counts as failed even where an earlier
    attempt's ``results.json`` is in its folder.
    """
    job_dirs = {
        overrides_file.parent.parent
        for overrides_file in sweep_dir.rglob("overrides.yaml")
        if overrides_file.parent.name == ".hydra" and not _earlier_record(overrides_file, sweep_dir)
    }
    statuses = {job_dir: _job_status(job_dir) for job_dir in job_dirs}
    if multirun is not None:
        job_dirs = {d for d in job_dirs if statuses[d].get("multirun") == multirun}
    results_by_job: dict[Path, RunResults | None] = dict.fromkeys(job_dirs)
    for results_file in sweep_dir.rglob(RESULTS_FILE):
        if _earlier_record(results_file, sweep_dir):
            continue
        job_dir = _job_dir_of(results_file, job_dirs)
        if job_dir not in results_by_job:  # a job of another multirun
            continue
        if multirun is not None and statuses[job_dir].get("status") != "finished":
            continue  # this attempt failed or was killed: not its results
        try:
            results = RunResults.read(results_file)
        except (OSError, ValueError) as err:
            log.warning("Cannot read %s, counting the run as failed: %s", results_file, err)
            results = None
        results_by_job[job_dir] = results

    runs = []
    for job_dir, results in results_by_job.items():
        overrides = _read_overrides(job_dir)
        if results is not None and results.overrides is not None:
            overrides = [str(item) for item in results.overrides]
        runs.append(
            {
                "name": job_dir.relative_to(sweep_dir).as_posix() or ".",
                "overrides": overrides,
                "results": results,
            }
        )
    runs.sort(key=_sort_key)
    return runs


def _collapsed_cell(collapsed: dict[str, Any] | None) -> str:
    """'"five" (97 %)' for a model that said "five" to everything, 'no' for one that listens.

    Such a model learned the labels' prior, not the audio: its metrics compare nothing
    (the run's ``test_errors.md`` explains). Results from before this field: "no".
    """
    if not collapsed:
        return "no"
    return f"{collapsed['said']} ({100 * float(collapsed['share']):.0f} %)"


def _build_rows(runs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Table rows (all values formatted as strings) in the order of ``runs``."""
    metric_names: list[str] = []
    valid_names: list[str] = []  # in percent only: the figure a search picks its trial by
    for run in runs:
        if run["results"] is not None:
            for name in run["results"].test_metrics or {}:
                if name not in metric_names:
                    metric_names.append(name)
            for name in run["results"].valid_metrics or {}:
                if name in PERCENT_METRICS and name not in valid_names:
                    valid_names.append(name)

    fp32_speed: dict[tuple, float] = {}
    for run in runs:
        results = run["results"]
        if results is not None and results.precision == "fp32":
            speed = results.throughput.train_utterances_per_s
            if isinstance(speed, (int, float)) and speed > 0:
                key = (_comparison_key(run), _rated_without_warmup(results))
                fp32_speed.setdefault(key, float(speed))

    valid_columns = {name: metric_label(name, "valid ") for name in valid_names}
    metric_columns = {name: metric_label(name) for name in metric_names}  # "test CER %"
    columns = (*_LEADING_COLUMNS, *valid_columns.values(), *metric_columns.values())
    rows = []
    for run in runs:
        results = run["results"]
        row = dict.fromkeys((*columns, *_TRAILING_COLUMNS), MISSING)
        row["run"] = run["name"]
        if results is None:
            row["status"] = "failed"
            row["precision"] = _precision_override(run["overrides"]) or MISSING
            rows.append(row)
            continue
        row["status"] = "ok"
        row["precision"] = precision_label(results)
        row["device"] = _format_number(results.device)
        row["model"] = _format_number(results.model)
        row["data"] = _format_number(results.data)
        row["processes"] = str(results.world_size)  # DDP ranks
        for name, column in valid_columns.items():  # the tested weights' validation
            row[column] = _format_number((results.valid_metrics or {}).get(name))
        metrics = results.test_metrics or {}
        for name, column in metric_columns.items():
            row[column] = _format_number(metrics.get(name))
        speed = results.throughput.train_utterances_per_s
        row["utt/s"] = _format_number(speed)
        row["audio-s/s"] = _format_number(results.throughput.train_audio_seconds_per_s)
        reference = fp32_speed.get((_comparison_key(run), _rated_without_warmup(results)))
        if reference is not None and isinstance(speed, (int, float)):
            row[SPEEDUP_COLUMN] = f"{speed / reference:.2f}x"
        row["peak memory MB"] = _format_number(results.peak_memory_mb)
        row["wall time s"] = _format_number(results.wall_time_s)
        row[COLLAPSED_COLUMN] = _collapsed_cell(results.collapsed)
        rows.append(row)
    return rows


def format_markdown(rows: list[dict[str, str]]) -> str:
    """A GitHub-flavoured markdown table of ``rows`` (columns from the first row)."""
    if not rows:
        return "_No runs found._\n"
    columns = list(rows[0])

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    lines = [line(columns), "|" + "|".join("---" for _ in columns) + "|"]
    lines += [line([row[column] for column in columns]) for row in rows]
    return "\n".join(lines) + "\n"


def held_out_speakers_markdown(runs: list[dict[str, Any]]) -> str:
    """Per held-out speaker test metrics and their mean, for runs with ``test_speakers``.

    A leave-one-speaker-out sweep (``-m 'data.test_speakers=[george],[jackson],...'``)
    gives one run per held-out voice; the mean over them is the number that says whether
    a model works on a voice it has never heard. Runs are grouped by precision, model and
    their other overrides (a sweep over seeds too: one table per seed), so that a mean
    never mixes settings; empty string when no run held speakers out.
    """
    groups: dict[tuple[str, str, tuple[str, ...]], list[tuple[str, dict[str, float]]]] = {}
    for run in runs:
        results = run["results"]
        speakers = (results.dataset or {}).get("test_speakers") if results else None
        if not speakers:
            continue
        others = tuple(
            o
            for o in _non_precision_overrides(run["overrides"])
            if o.partition("=")[0].lstrip("+") != "data.test_speakers"
        )
        key = (precision_label(results), str(results.model), others)
        groups.setdefault(key, []).append((",".join(speakers), results.test_metrics or {}))
    if not groups:
        return ""
    out = ["", "## Held-out speakers (test set = every recording of a voice never trained on)", ""]
    for (precision, model, others), entries in sorted(groups.items()):
        names = [n for n in entries[0][1] if n != "loss"]
        rows = [
            {
                "held-out speaker": speaker,
                **{metric_label(n): _format_number(m.get(n)) for n in names},
            }
            for speaker, m in sorted(entries, key=lambda entry: entry[0])
        ]
        mean = {"held-out speaker": f"mean of {len(entries)}"}
        for name in names:
            values = [m[name] for _, m in entries if isinstance(m.get(name), (int, float))]
            mean[metric_label(name)] = _format_number(sum(values) / len(values) if values else None)
        setting = ", ".join([model, precision, *others])
        out += [f"{setting}:", "", format_markdown([*rows, mean])]
    return "\n".join(out)


def _signed(value: float) -> str:
    """``+0.33`` / ``-0.17``; a value that rounds to zero is ``+0.00``, never ``-0.00``."""
    return f"{round(value, 2) or 0.0:+.2f}"


def precision_label(results: RunResults) -> str:
    """The precision a run trained in, ``"bf16 (auto)"`` when ``precision=auto`` chose it,
    and ``", eval fp32"`` when its validation and test ran in another one (its test
    figures are that precision's)."""
    label = _format_number(results.precision)
    if results.precision_requested == "auto":
        label += " (auto)"
    if results.eval_precision and results.eval_precision != results.precision:
        label += f", eval {results.eval_precision}"
    return label


def seeds_markdown(runs: list[dict[str, Any]]) -> str:
    """Mean and spread over seeds, and each precision's difference from fp32, for a sweep
    that varies ``seed`` (``-m precision=fp32,bf16 seed=1,2,3``).

    One seed's test set (300 utterances: one error is 0.33 points) cannot tell a precision
    that costs accuracy from run-to-run noise; several seeds can. Runs are grouped by all
    their overrides but ``seed``; each precision's group is compared with the fp32 group of
    the same other overrides, seed by seed (the same seed draws the same initial weights and
    data order, so a paired difference is the precision's effect plus noise). Runs of
    ``precision=auto`` form groups of their own (``"fp32 (auto)"``), apart from the runs
    that asked for the precision it chose; they are the fp32 reference only where no run
    asked for fp32. Empty string when no group has two seeds.
    """
    groups: dict[tuple, dict[str, RunResults]] = {}
    for run in runs:
        results: RunResults | None = run["results"]
        seed = _override_value(run["overrides"], "seed")
        if results is None or seed is None:
            continue
        others = tuple(
            o for o in _non_precision_overrides(run["overrides"]) if item_key(o) != "seed"
        )
        key = (str(results.model), str(results.data), str(results.device), others)
        groups.setdefault((*key, precision_label(results)), {})[seed] = results
    all_groups = groups  # fp32 references: a single surviving fp32 seed still pairs
    groups = {key: by_seed for key, by_seed in groups.items() if len(by_seed) > 1}
    if not groups:
        return ""

    def order(key: tuple) -> tuple:  # by the precision trained in ("fp16, eval fp32": fp16)
        trained = next(iter(groups[key].values())).precision
        return (key[:4], _precision_rank(trained), key[4])

    rows = []
    for key in sorted(groups, key=order):
        by_seed = groups[key]
        reference = all_groups.get((*key[:4], "fp32")) or all_groups.get(
            (*key[:4], "fp32 (auto)"), {}
        )
        names = [n for n in next(iter(by_seed.values())).test_metrics or {} if n != "loss"]
        row = {
            "model": key[0],
            "data": key[1],
            "overrides": " ".join(key[3]) or MISSING,
            "precision": key[4],
            "seeds": ",".join(sorted(by_seed)),
        }
        for name in names:
            values = {s: r.test_metrics[name] for s, r in by_seed.items() if r.test_metrics}
            mean = sum(values.values()) / len(values)
            label = metric_label(name)
            row[f"{label} mean (min-max)"] = (
                f"{mean:.2f} ({min(values.values()):.2f}-{max(values.values()):.2f})"
            )
            paired = {
                s: v - reference[s].test_metrics[name]
                for s, v in sorted(values.items())
                if s in reference and name in (reference[s].test_metrics or {})
            }
            row[f"{label} vs fp32, per seed"] = (
                f"{_signed(sum(paired.values()) / len(paired))} "
                f"[{', '.join(_signed(d) for d in paired.values())}]"
                if paired and reference is not by_seed
                else MISSING
            )
        speed = {s: r.throughput.train_utterances_per_s for s, r in by_seed.items()}
        speed = {s: v for s, v in speed.items() if isinstance(v, (int, float))}
        ref_speed = {s: r.throughput.train_utterances_per_s for s, r in reference.items()}
        # seed by seed, as the metrics: only the seeds both precisions ran
        shared = [
            s
            for s in speed
            if isinstance(ref_speed.get(s), (int, float))
            and ref_speed[s] > 0
            and _rated_without_warmup(by_seed[s]) == _rated_without_warmup(reference[s])
        ]
        row["utt/s mean"] = _format_number(sum(speed.values()) / len(speed) if speed else None)
        row[SPEEDUP_COLUMN] = (
            f"{sum(speed[s] for s in shared) / sum(ref_speed[s] for s in shared):.2f}x"
            if shared
            else MISSING
        )
        rows.append(row)
    out = ["", "## Over seeds (mean, spread, and each precision against fp32 seed by seed)", ""]
    columns = list(dict.fromkeys(c for row in rows for c in row))
    table = [{c: row.get(c, MISSING) for c in columns} for row in rows]
    return "\n".join([*out, format_markdown(table)])


def format_csv(rows: list[dict[str, str]]) -> str:
    """CSV text of ``rows`` with a header line (empty string for no rows)."""
    if not rows:
        return ""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def summarize_sweep(sweep_dir: Path, multirun: str | None = None) -> list[dict[str, str]]:
    """Collect a sweep's runs and write ``summary.md`` and ``summary.csv`` into it.

    Args:
        sweep_dir: the multirun directory (``hydra.sweep.dir``).
        multirun: only the jobs of this multirun (the id ``SweepSummaryCallback`` wrote
            into ``sweep_dir``), each as its ``job_status.json`` says it went; None: every
            job folder in ``sweep_dir``, by its ``results.json``.

    Returns:
        The table rows, sorted by overrides (runs that differ only in precision next to
        each other, in the order fp32, fp16, bf16): dicts from column name to the formatted
        cell (``run``, ``status``, ``precision``, ``device``, ``processes``, ``model``,
        ``data``, each test metric with its unit (``test CER %``, ``test loss``), ``utt/s``,
        ``audio-s/s``, ``speed-up vs fp32``, ``peak memory MB``, ``wall time s``,
        ``collapsed to``); missing values are ``"—"``.
    """
    sweep_dir = Path(sweep_dir)
    runs = _collect_runs(sweep_dir, multirun)
    rows = _build_rows(runs)
    atomic_write_text(
        sweep_dir / "summary.md",
        format_markdown(rows) + held_out_speakers_markdown(runs) + seeds_markdown(runs),
    )
    atomic_write_text(sweep_dir / "summary.csv", format_csv(rows))
    write_hparams_experiment(sweep_dir, runs)
    return rows


def write_hparams_experiment(sweep_dir: Path, runs: list[dict[str, Any]]) -> list[str]:
    """TensorBoard's HParams experiment of the sweep: swept keys first, test metrics only.

    Returns the hparam names in column order (empty if no run logged hparams).
    """
    tags: list[str] = []
    for run in runs:
        if run["results"] is not None:
            tags += [t for t in run["results"].final_metrics() if t not in tags]
    run_dirs = [sweep_dir / run["name"] / TENSORBOARD_DIR for run in runs]
    first = [*precision_first(swept_keys(sweep_dir)), "precision"]  # what differs first
    try:
        return write_sweep_experiment(sweep_dir, [d for d in run_dirs if d.is_dir()], first, tags)
    except Exception as err:  # the table is written; TensorBoard falls back to its own view
        log.warning("Cannot write the sweep's TensorBoard hparams experiment: %s", err)
        return []


def sweep_dir_given(hydra_cfg: DictConfig) -> bool:
    """Whether the command fixed the sweep's folder (``hydra.sweep.dir=PATH``): the same
    command then finds it again. The default folder is named by the clock
    (``multirun/${now:...}``): the same command alone starts a new sweep elsewhere."""
    for override in OmegaConf.select(hydra_cfg, "overrides.hydra", default=None) or []:
        key, _, value = str(override).partition("=")
        if key.lstrip("+") == "hydra.sweep.dir" and "${" not in value:
            return True
    return False


def summary_resume_hint(hydra_cfg: DictConfig) -> str:
    """How to write a sweep's summary that a signal stopped: the same command, in the same
    sweep folder (its finished jobs only say so and are summarised)."""
    again = "Run the same command again"
    if not sweep_dir_given(hydra_cfg):
        again += f" with hydra.sweep.dir={Path(str(hydra_cfg.sweep.dir)).absolute()}"
    return f"{again} to write it: the sweep's finished jobs are not trained again."


def keep_earlier_records(sweep_dir: Path) -> dict[Path, Path]:
    """Copy each of ``SWEEP_RECORDS`` in ``sweep_dir`` to a name dated by its modification
    time (``summary.2026-11-28_21-44-04.md``) before a multirun writes it anew.

    A sweep run again into its folder (more or fewer precisions, other seeds) summarises
    only the jobs it launched, and Hydra saves its own ``multirun.yaml``: without a copy the
    earlier sweep's table and config were gone. ``drop_unchanged_copies`` removes the
    copies of the records the multirun wrote the same again. Returns ``{record: copy}``.
    """
    kept = {}
    for name in SWEEP_RECORDS:
        path = sweep_dir / name
        try:
            data = path.read_bytes()
            stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(path.stat().st_mtime))
        except OSError:  # none yet
            continue
        copy = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
        number = 1
        while copy.exists():
            copy = path.with_name(f"{path.stem}.{stamp}_{number}{path.suffix}")
            number += 1
        with atomic_path(copy) as tmp:
            tmp.write_bytes(data)
        kept[path] = copy
    return kept


def drop_unchanged_copies(kept: dict[Path, Path]) -> list[Path]:
    """Delete the copies (``keep_earlier_records``) of the records that are the same as
    before; returns the copies kept."""
    left = []
    for path, copy in kept.items():
        try:
            if path.read_bytes() == copy.read_bytes():
                copy.unlink()
                continue
        except OSError:  # the record is gone: its copy is all there is
            pass
        left.append(copy)
    return left


class SweepSummaryCallback(Callback):
    """Hydra callback that summarizes the sweep when a multirun ends.

    Enable it in the Hydra config::

        hydra:
          callbacks:
            sweep_summary:
              _target_: amp_utils.sweep_summary.SweepSummaryCallback
    """

    def __init__(self) -> None:
        self.multirun: str | None = None
        self._earlier: dict[Path, Path] = {}  # records of an earlier multirun: their copies

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Write a new id into the sweep folder: each job records it in its
        ``job_status.json``, and the summary lists the jobs that carry it (a sweep run again
        into the same folder: this multirun's jobs, as they went this time)."""
        sweep_dir = Path(config.hydra.sweep.dir)
        self.multirun = uuid.uuid4().hex
        os.environ[MULTIRUN_ID_ENV] = self.multirun
        if launch_rank() != 0:  # under torchrun every rank runs the sweep: rank 0 records it
            return
        try:
            sweep_dir.mkdir(parents=True, exist_ok=True)
            self._earlier = keep_earlier_records(sweep_dir)  # before Hydra saves its config
            atomic_write_text(sweep_dir / MULTIRUN_ID_FILE, self.multirun + "\n")
        except OSError as err:  # the summary then lists every job folder, as before
            log.warning("Cannot write %s: %s", sweep_dir / MULTIRUN_ID_FILE, err)
            self.multirun = None

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Write ``summary.md``/``summary.csv`` into ``hydra.sweep.dir`` and print the table.

        Raises:
            SystemExit: (status 1, after the table) when a job failed, naming those jobs;
                also when the summary cannot be written (Hydra turns a callback's error
                into a warning, and the sweep would end as if all were well).
        """
        if launch_rank() != 0:  # its jobs recorded nothing: rank 0 summarises the sweep
            return
        # SIGTERM/SIGINT here stop the sweep with one line (each summary file is written
        # whole or not at all) saying how to write it (recipes' RunSignals).
        hint = lambda: summary_resume_hint(config.hydra)  # noqa: E731 (asked at a signal)
        with run_phase("writing the sweep summary", hint=hint, install=True):
            self._summarize(config)

    def _summarize(self, config: DictConfig) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            log.warning("Sweep directory %s does not exist; no summary written", sweep_dir)
            return
        try:
            rows = summarize_sweep(sweep_dir, self.multirun)
        except Exception as err:  # Hydra would only warn: the sweep must not look fine
            raise SystemExit(
                f"error: the sweep summary could not be written ({type(err).__name__}: {err}); "
                f"each job's results.json is in its folder in {sweep_dir}."
            ) from err
        print(f"Sweep summary ({sweep_dir / 'summary.md'}):\n{format_markdown(rows)}")
        kept = drop_unchanged_copies(self._earlier)
        if kept:
            print(
                "The earlier sweep's files in this folder are kept as "
                + ", ".join(copy.name for copy in kept)
            )
        failed = [row["run"] for row in rows if row.get("status") == "failed"]
        if failed:
            raise SystemExit(
                f"error: {len(failed)} of {len(rows)} sweep jobs failed ({', '.join(failed)}): "
                f"each one's train.log in {sweep_dir} says why; the others' results are in "
                "summary.md."
            )
