"""Tests of the sweep summary (summary.md / summary.csv) and its Hydra callback."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from amp_utils.sweep_summary import (
    JOB_STATUS_FILE,
    MULTIRUN_ID_ENV,
    MULTIRUN_ID_FILE,
    SweepSummaryCallback,
    _signed,
    summarize_sweep,
)

SPEEDS = {"fp32": 100.0, "fp16": 180.0, "bf16": 150.0}


def _write_job(sweep_dir: Path, name: str, overrides: list[str], results: dict | None) -> None:
    """A Hydra job folder: ``.hydra/overrides.yaml`` and, unless failed, ``results.json``."""
    job_dir = sweep_dir / name
    (job_dir / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(overrides), job_dir / ".hydra" / "overrides.yaml")
    if results is not None:
        (job_dir / "results.json").write_text(json.dumps(results))


def _results(precision: str, overrides: list[str], **metrics: float) -> dict:
    speed = SPEEDS[precision]
    return {
        "precision": precision,
        "device": "cpu",
        "device_name": "cpu (2 threads)",
        "model": "conformer_ctc",
        "task": "asr",
        "data": "fsdd_digits",
        "overrides": overrides,
        "test_metrics": metrics or {"CER": 1.234, "WER": 3.4, "loss": 0.11},
        "throughput": {"train_utterances_per_s": speed, "train_audio_seconds_per_s": speed / 2},
        "peak_memory_mb": 812.5,
        "wall_time_s": 301.2,
        "epochs": 10,
    }


def _fake_sweep(sweep_dir: Path) -> None:
    """fp32/fp16/bf16 runs of one model, one failed run, one run without an fp32 baseline."""
    for index, precision in enumerate(("fp32", "fp16", "bf16")):
        overrides = [f"precision={precision}", "trainer.epochs=10"]
        _write_job(sweep_dir, str(index), overrides, _results(precision, overrides))
    _write_job(sweep_dir, "3", ["precision=fp16", "trainer.epochs=20"], None)
    overrides = ["precision=bf16", "trainer.epochs=20"]
    _write_job(sweep_dir, "4", overrides, _results("bf16", overrides, accuracy=99.25))


def test_summarize_sweep_rows_and_speedups(tmp_path: Path) -> None:
    _fake_sweep(tmp_path)
    rows = summarize_sweep(tmp_path)

    assert [row["run"] for row in rows] == ["0", "1", "2", "3", "4"]  # by overrides, fp32 first
    assert list(rows[0]) == [
        "run",
        "status",
        "precision",
        "device",
        "processes",
        "model",
        "data",
        "test CER %",
        "test WER %",
        "test loss",
        "test accuracy %",
        "utt/s",
        "audio-s/s",
        "speed-up vs fp32",
        "peak memory MB",
        "wall time s",
        "collapsed to",
    ]
    by_run = {row["run"]: row for row in rows}
    assert by_run["0"]["speed-up vs fp32"] == "1.00x"
    assert by_run["1"]["speed-up vs fp32"] == "1.80x"
    assert by_run["2"]["speed-up vs fp32"] == "1.50x"
    assert by_run["4"]["speed-up vs fp32"] == "—"  # its fp32 counterpart does not exist
    assert by_run["1"]["test CER %"] == "1.23" and by_run["1"]["test accuracy %"] == "—"
    assert by_run["4"]["test accuracy %"] == "99.25" and by_run["4"]["test CER %"] == "—"
    assert by_run["0"]["utt/s"] == "100.00" and by_run["0"]["audio-s/s"] == "50.00"
    assert by_run["0"]["peak memory MB"] == "812.50" and by_run["0"]["wall time s"] == "301.20"
    assert by_run["0"]["status"] == "ok"
    assert by_run["3"]["status"] == "failed" and by_run["3"]["precision"] == "fp16"
    assert by_run["3"]["utt/s"] == "—"

    markdown = (tmp_path / "summary.md").read_text()
    assert markdown.startswith("| run | status | precision |")
    assert "| 1 | ok | fp16 | cpu | 1 | conformer_ctc | fsdd_digits | 1.23 |" in markdown
    assert "| 3 | failed | fp16 |" in markdown
    assert len(markdown.strip().splitlines()) == 2 + len(rows)

    with open(tmp_path / "summary.csv", newline="") as handle:
        assert list(csv.DictReader(handle)) == rows


def test_speedup_compares_only_runs_that_differ_in_precision(tmp_path: Path) -> None:
    """An fp32 run of another model or with other overrides is not a baseline."""
    _write_job(
        tmp_path, "a", ["precision=fp32", "lr=1"], _results("fp32", ["precision=fp32", "lr=1"])
    )
    other_model = _results("fp32", ["precision=fp32", "lr=2"])
    other_model["model"] = "xvector"
    _write_job(tmp_path, "b", ["precision=fp32", "lr=2"], other_model)
    _write_job(
        tmp_path, "c", ["precision=bf16", "lr=2"], _results("bf16", ["precision=bf16", "lr=2"])
    )
    by_run = {row["run"]: row for row in summarize_sweep(tmp_path)}
    assert by_run["c"]["speed-up vs fp32"] == "—"
    assert by_run["a"]["speed-up vs fp32"] == "1.00x"


def test_speeds_rated_differently_make_no_speed_up(tmp_path: Path) -> None:
    """A results.json from before throughput.warmup_time_s rates every epoch, a newer one
    leaves out each session's first: a sweep re-launched into its folder lists its finished
    older runs beside new ones, and their ratio would mix the two (on an H200 the first epoch
    made 1.19x read 2.14x). Only speeds rated alike pair, in the table and over seeds."""
    for seed in (1, 2):
        for index, precision in enumerate(("fp32", "bf16")):
            overrides = [f"precision={precision}", f"seed={seed}"]
            results = _results(precision, overrides)
            if precision == "bf16" or seed == 2:
                results["throughput"]["warmup_time_s"] = 1.5  # a newer run
            else:  # the old fp32 run: its start-up counted in, it reads slower
                results["throughput"]["train_utterances_per_s"] = 50.0
            _write_job(tmp_path, f"{seed}{index}", overrides, results)
    by_run = {row["run"]: row for row in summarize_sweep(tmp_path)}
    assert by_run["11"]["speed-up vs fp32"] == "—"  # seed 1: old fp32, new bf16
    assert by_run["21"]["speed-up vs fp32"] == "1.50x"  # seed 2: both new
    section = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    bf16 = next(line for line in section.splitlines() if "| bf16 |" in line)
    assert "| 150.00 | 1.50x |" in bf16  # seed 2 only


def test_a_run_whose_model_collapsed_is_marked_in_the_table(tmp_path: Path) -> None:
    """The H200 sweep's three runs all wrote "five" for every digit; the table said "ok"."""
    collapsed = _results("bf16", ["precision=bf16"], CER=63.9, WER=90.1)
    collapsed["collapsed"] = {
        "label": "five",
        "share": 0.97,
        "reference_share": 0.1,
        "said": '"five"',
    }
    _write_job(tmp_path, "0", ["precision=fp32"], _results("fp32", ["precision=fp32"]))
    _write_job(tmp_path, "1", ["precision=bf16"], collapsed)
    by_run = {row["run"]: row for row in summarize_sweep(tmp_path)}
    assert by_run["0"]["collapsed to"] == "no" and by_run["1"]["collapsed to"] == '"five" (97 %)'
    assert by_run["1"]["status"] == "ok" and by_run["1"]["test WER %"] == "90.10"
    assert '| "five" (97 %) |' in (tmp_path / "summary.md").read_text()
    collapsed["collapsed"] = {"label": "∅", "share": 1.0, "reference_share": 0.0, "said": "nothing"}
    _write_job(tmp_path, "2", ["precision=fp16"], collapsed)
    assert {r["run"]: r for r in summarize_sweep(tmp_path)}["2"][
        "collapsed to"
    ] == "nothing (100 %)"


def test_unreadable_results_counts_as_failed(tmp_path: Path) -> None:
    _write_job(tmp_path, "0", ["precision=bf16"], None)
    (tmp_path / "0" / "results.json").write_text("{not json")
    (row,) = summarize_sweep(tmp_path)
    assert row["status"] == "failed" and row["precision"] == "bf16"


def test_empty_sweep_writes_placeholder(tmp_path: Path) -> None:
    assert summarize_sweep(tmp_path) == []
    assert "No runs" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "summary.csv").read_text() == ""


def test_callback_writes_summary_and_prints_table(tmp_path: Path, capsys) -> None:
    _fake_sweep(tmp_path)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit, match=r"1 of 5 sweep jobs failed \(3\)"):  # run 3 failed
        SweepSummaryCallback().on_multirun_end(config=config)
    assert (tmp_path / "summary.md").is_file() and (tmp_path / "summary.csv").is_file()
    printed = capsys.readouterr().out
    assert "| 1 | ok | fp16 |" in printed and "1.80x" in printed


def test_a_summary_that_cannot_be_written_fails_the_sweep(tmp_path: Path, monkeypatch) -> None:
    """Hydra turns a callback's exception into a warning: the sweep ended with status 0."""
    import amp_utils.sweep_summary as sweep_summary

    def broken(sweep_dir: Path) -> list:
        raise TypeError("'<' not supported between instances of 'dict' and 'dict'")

    monkeypatch.setattr(sweep_summary, "summarize_sweep", broken)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}})
    with pytest.raises(SystemExit, match="the sweep summary could not be written .TypeError"):
        SweepSummaryCallback().on_multirun_end(config=config)


def test_callback_is_instantiable_from_hydra_config() -> None:
    from hydra.utils import instantiate

    callback = instantiate({"_target_": "amp_utils.sweep_summary.SweepSummaryCallback"})
    assert isinstance(callback, SweepSummaryCallback)


def test_leave_one_speaker_out_sweep_gets_per_speaker_rows_and_their_mean(tmp_path: Path) -> None:
    for index, (speaker, wer) in enumerate((("george", 40.0), ("lucas", 60.0), ("theo", 20.0))):
        overrides = [f"data.test_speakers=[{speaker}]"]
        results = _results("fp32", overrides, CER=wer / 2, WER=wer, loss=1.0)
        results["dataset"] = {"test_speakers": [speaker]}
        _write_job(tmp_path, f"{index}_data.test_speakers=[{speaker}]", overrides, results)
    _write_job(tmp_path, "3_plain", [], _results("fp32", []))  # no held-out speaker: not listed
    summarize_sweep(tmp_path)
    text = (tmp_path / "summary.md").read_text()
    held_out = text.split("## Held-out speakers", 1)[1]
    lines = [line for line in held_out.splitlines() if line.startswith("| ")]
    assert lines[0] == "| held-out speaker | test CER % | test WER % |"
    assert lines[1:] == [
        "| george | 20.00 | 40.00 |",
        "| lucas | 30.00 | 60.00 |",
        "| theo | 10.00 | 20.00 |",
        "| mean of 3 | 20.00 | 40.00 |",
    ]
    summarize_sweep_without = tmp_path / "plain"
    _write_job(summarize_sweep_without, "0_plain", [], _results("fp32", []))
    summarize_sweep(summarize_sweep_without)
    assert "Held-out" not in (summarize_sweep_without / "summary.md").read_text()


def test_the_speed_up_over_seeds_pairs_the_seeds_both_precisions_ran(tmp_path: Path) -> None:
    """bf16's seed 3 failed: its speed-up is taken against fp32's seeds 1 and 2 only (it
    was taken against all three, here 2.33x where each paired seed gives 2.00x)."""
    speeds = {("fp32", 1): 100, ("fp32", 2): 110, ("fp32", 3): 60, ("bf16", 1): 200}
    speeds[("bf16", 2)] = 220
    for index, ((precision, seed), speed) in enumerate(speeds.items()):
        overrides = [f"precision={precision}", f"seed={seed}"]
        results = _results(precision, overrides, CER=3.0)
        results["throughput"]["train_utterances_per_s"] = speed
        _write_job(tmp_path, f"{index}", overrides, results)
    _write_job(tmp_path, "5", ["precision=bf16", "seed=3"], None)
    summarize_sweep(tmp_path)
    section = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    bf16 = next(line for line in section.splitlines() if "| bf16 |" in line)
    assert "| 210.00 | 2.00x |" in bf16


@pytest.mark.parametrize("with_fp32", [True, False])
def test_auto_runs_over_seeds_are_a_group_of_their_own(tmp_path: Path, with_fp32: bool) -> None:
    """-m precision=fp32,auto seed=1,2 where auto picks fp32: the auto runs were filed
    under fp32 by seed, over the explicit fp32 runs, which vanished from the table. Without
    explicit fp32 runs, the auto ones are the fp32 reference."""
    cers = {("auto", 1): 5.0, ("auto", 2): 6.0, ("bf16", 1): 2.0, ("bf16", 2): 2.0}
    if with_fp32:
        cers |= {("fp32", 1): 1.0, ("fp32", 2): 2.0}
    for index, ((asked, seed), cer) in enumerate(cers.items()):
        overrides = [f"precision={asked}", f"seed={seed}"]
        results = _results("fp32" if asked == "auto" else asked, overrides, CER=cer)
        results["precision_requested"] = asked
        _write_job(tmp_path, f"{index}", overrides, results)
    summarize_sweep(tmp_path)
    section = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    rows = {line.split(" | ")[3]: line for line in section.splitlines() if "fsdd_digits" in line}
    assert rows["fp32 (auto)"].count("5.50 (5.00-6.00)") == 1
    if with_fp32:
        assert "| 1.50 (1.00-2.00) | — |" in rows["fp32"]
        assert "+4.00 [+4.00, +4.00]" in rows["fp32 (auto)"]
        assert "+0.50 [+1.00, +0.00]" in rows["bf16"]
    else:
        assert "fp32" not in rows and "| 5.50 (5.00-6.00) | — |" in rows["fp32 (auto)"]
        assert "-3.50 [-3.00, -4.00]" in rows["bf16"]


def test_a_run_evaluated_in_another_precision_says_so(tmp_path: Path) -> None:
    """precision=bf16 precision.eval_precision=fp32: its test figures are fp32's; the
    table said 'bf16' alone, and over seeds it was grouped with bf16-tested runs."""
    for index, (evaluated, seed) in enumerate([("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2)]):
        overrides = ["precision=bf16", f"precision.eval_precision={evaluated}", f"seed={seed}"]
        results = _results("bf16", overrides, CER=float(index))
        results["eval_precision"] = evaluated
        _write_job(tmp_path, f"{index}", overrides, results)
    summarize_sweep(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    main, seeds = summary.split("## Over seeds", 1)
    assert main.count("| bf16, eval fp32 |") == 2 and main.count("| bf16 |") == 2
    assert "| bf16, eval fp32 | 1,2 |" in seeds and "| bf16 | 1,2 |" in seeds


def test_held_out_speakers_over_seeds_get_a_table_per_seed(tmp_path: Path) -> None:
    """``-m 'data.test_speakers=[george],[lucas]' seed=1,2``: two runs per speaker in one
    (precision, model) group made the sort compare two metric dicts (a TypeError: no
    summary at all), and one mean would have mixed the seeds."""
    index = 0
    for seed in (1, 2):
        for speaker, wer in (("george", 40.0), ("lucas", 20.0)):
            overrides = [f"data.test_speakers=[{speaker}]", f"seed={seed}"]
            results = _results("fp32", overrides, CER=wer / 2, WER=wer + seed, loss=1.0)
            results["dataset"] = {"test_speakers": [speaker]}
            _write_job(tmp_path, f"{index}_{speaker}_{seed}", overrides, results)
            index += 1
    summarize_sweep(tmp_path)
    held_out = (tmp_path / "summary.md").read_text().split("## Held-out speakers", 1)[1]
    assert "conformer_ctc, fp32, seed=1:" in held_out and "conformer_ctc, fp32, seed=2:" in held_out
    per_seed = held_out.split("seed=2:")
    assert "| mean of 2 | 15.00 | 31.00 |" in per_seed[0]
    assert "| mean of 2 | 15.00 | 32.00 |" in per_seed[1]


@pytest.mark.parametrize("seed_key", ["seed", "++seed", "+seed"])
def test_a_sweep_over_seeds_gets_means_spreads_and_paired_differences_from_fp32(
    tmp_path: Path, seed_key: str
) -> None:
    """``-m precision=fp32,bf16 seed=1,2,3``: per precision the mean and min-max over seeds,
    and bf16 minus fp32 seed by seed (its mean first); a failed run and a single-seed group
    are left out."""
    cers = {"fp32": (3.5, 3.5, 3.83), "bf16": (3.33, 3.83, 3.5)}
    index = 0
    for precision, values in cers.items():
        for seed, cer in zip((1, 2, 3), values, strict=True):
            overrides = [f"precision={precision}", f"{seed_key}={seed}"]  # ++seed: forced
            results = _results(precision, overrides, CER=cer, WER=2 * cer, loss=0.1)
            _write_job(tmp_path, f"{index}_precision={precision},seed={seed}", overrides, results)
            index += 1
    _write_job(tmp_path, "6_precision=fp16,seed=1", ["precision=fp16", "seed=1"], None)
    summarize_sweep(tmp_path)
    section = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("| ")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [
        dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
    ]
    assert [row["precision"] for row in rows] == ["fp32", "bf16"]  # fp16 failed: no group
    fp32, bf16 = rows
    assert fp32["seeds"] == bf16["seeds"] == "1,2,3"
    assert fp32["test CER % mean (min-max)"] == "3.61 (3.50-3.83)"
    assert bf16["test CER % mean (min-max)"] == "3.55 (3.33-3.83)"
    assert fp32["test CER % vs fp32, per seed"] == "—"
    assert bf16["test CER % vs fp32, per seed"] == "-0.06 [-0.17, +0.33, -0.33]"
    assert bf16["test WER % vs fp32, per seed"] == "-0.11 [-0.34, +0.66, -0.66]"
    assert _signed(-1e-17) == _signed(0.0) == "+0.00"  # (+0.33 + 0 - 0.33) / 3 in floats
    assert "test loss" not in section
    assert (bf16["utt/s mean"], bf16["speed-up vs fp32"]) == ("150.00", "1.50x")

    single = tmp_path / "single"
    for seed in (1, 2):
        overrides = ["precision=fp32", f"seed={seed}", f"trainer.epochs={seed}"]
        _write_job(single, f"{seed}", overrides, _results("fp32", overrides))
    summarize_sweep(single)  # each group (its own epochs) has one seed
    assert "Over seeds" not in (single / "summary.md").read_text()


def _write_status(sweep_dir: Path, name: str, multirun: str | None, status: str) -> None:
    """The ``job_status.json`` that a sweep job's ``run_job`` writes."""
    record = {"multirun": multirun, "status": status, "error": None}
    (sweep_dir / name / JOB_STATUS_FILE).write_text(json.dumps(record))


def test_a_sweep_run_again_lists_its_own_jobs_as_they_went_this_time(tmp_path: Path) -> None:
    """A sweep run again into its folder: a job whose new attempt failed (or was killed)
    was listed as ok with the earlier attempt's results, and the exit status said all was
    well; jobs of an earlier sweep in the folder were listed beside this one's."""
    for index, precision in enumerate(("fp32", "bf16", "fp16")):
        overrides = [f"precision={precision}"]
        _write_job(tmp_path, f"{index}", overrides, _results(precision, overrides))
    _write_job(tmp_path, "9_old", ["precision=fp16", "seed=9"], None)  # an earlier sweep's
    _write_status(tmp_path, "0", "this", "finished")  # finished already, or trained now
    _write_status(tmp_path, "1", "this", "failed")  # the extension failed
    _write_status(tmp_path, "2", "this", "running")  # killed
    _write_status(tmp_path, "9_old", "earlier", "failed")
    rows = {row["run"]: row["status"] for row in summarize_sweep(tmp_path, "this")}
    assert rows == {"0": "ok", "1": "failed", "2": "failed"}
    every = {row["run"]: row["status"] for row in summarize_sweep(tmp_path)}  # no multirun
    assert every == {"0": "ok", "1": "ok", "2": "ok", "9_old": "failed"}


def test_a_job_trained_further_is_one_row_with_its_latest_results(tmp_path: Path) -> None:
    """A finished job trained further keeps its earlier record (``.hydra/`` and
    ``results.json`` of fewer epochs) in ``earlier/finished_<N>_epochs/``: it is neither a
    job of its own nor the job's results."""
    for index, precision in enumerate(("fp32", "bf16")):
        overrides = [f"precision={precision}"]
        _write_job(tmp_path, str(index), overrides, _results(precision, overrides, CER=1.0))
        earlier = Path(str(index), "earlier", "finished_5_epochs")
        _write_job(tmp_path, str(earlier), overrides, _results(precision, overrides, CER=9.0))
        _write_status(tmp_path, str(index), "this", "finished")
    for multirun in ("this", None):
        rows = summarize_sweep(tmp_path, multirun)
        assert [(row["run"], row["test CER %"]) for row in rows] == [("0", "1.00"), ("1", "1.00")]


def test_the_callback_summarizes_the_jobs_of_its_own_multirun(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv(MULTIRUN_ID_ENV, "")  # restored after the test: the callback sets it
    callback = SweepSummaryCallback()
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "sweep")}}})
    callback.on_multirun_start(config)
    multirun = (tmp_path / "sweep" / MULTIRUN_ID_FILE).read_text().strip()
    assert multirun == callback.multirun and len(multirun) == 32
    _write_job(tmp_path / "sweep", "0", ["precision=fp32"], _results("fp32", []))
    _write_status(tmp_path / "sweep", "0", multirun, "finished")
    _write_job(tmp_path / "sweep", "1", ["precision=bf16"], _results("bf16", []))
    _write_status(tmp_path / "sweep", "1", "an earlier one", "finished")
    callback.on_multirun_end(config)
    assert [r["run"] for r in read_summary_csv(tmp_path / "sweep")] == ["0"]


def read_summary_csv(sweep_dir: Path) -> list[dict[str, str]]:
    with (sweep_dir / "summary.csv").open() as file:
        return list(csv.DictReader(file))


def test_a_sweep_over_precision_name_pairs_with_fp32(tmp_path: Path) -> None:
    """``-m precision.name=fp32,bf16`` composes what ``precision=...`` does; only the key
    ``precision`` was recognised, so bf16 had no fp32 run to be compared with."""
    for index, (precision, seed) in enumerate([("fp32", 1), ("bf16", 1), ("fp32", 2), ("bf16", 2)]):
        overrides = [f"precision.name={precision}", f"seed={seed}"]
        _write_job(tmp_path, f"{index}", overrides, _results(precision, overrides, CER=1.0))
    rows = summarize_sweep(tmp_path)
    assert [row["precision"] for row in rows] == ["fp32", "bf16", "fp32", "bf16"]
    assert [row["speed-up vs fp32"] for row in rows] == ["1.00x", "1.50x"] * 2
    section = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    bf16 = next(line for line in section.splitlines() if "| bf16 |" in line)
    assert "+0.00 [+0.00, +0.00]" in bf16 and "| 1.50x |" in bf16


def test_over_seeds_a_single_surviving_fp32_seed_still_pairs(tmp_path: Path) -> None:
    """fp32's seed 2 failed: its one-seed group was dropped before bf16 looked up its
    reference, so bf16's seed 1 lost its pair."""
    for index, (precision, seed, cer) in enumerate(
        [("fp32", 1, 3.0), ("bf16", 1, 3.5), ("bf16", 2, 4.0)]
    ):
        overrides = [f"precision={precision}", f"seed={seed}"]
        _write_job(tmp_path, f"{index}", overrides, _results(precision, overrides, CER=cer))
    _write_job(tmp_path, "3", ["precision=fp32", "seed=2"], None)
    summarize_sweep(tmp_path)
    section = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    bf16 = next(line for line in section.splitlines() if "| bf16 |" in line)
    assert "+0.50 [+0.50]" in bf16 and "| 1.50x |" in bf16


def test_held_out_speakers_keep_auto_runs_apart_from_fp32_runs(tmp_path: Path) -> None:
    """``precision=fp32,auto`` with auto choosing fp32: one mean of 4 mixed both."""
    for index, (asked, speaker) in enumerate(
        [("fp32", "george"), ("fp32", "jackson"), ("auto", "george"), ("auto", "jackson")]
    ):
        overrides = [f"precision={asked}", f"data.test_speakers=[{speaker}]"]
        results = _results("fp32", overrides, WER=10.0 * (index + 1))
        results["precision_requested"] = asked
        results["dataset"] = {"test_speakers": [speaker]}
        _write_job(tmp_path, f"{index}", overrides, results)
    summarize_sweep(tmp_path)
    held_out = (tmp_path / "summary.md").read_text().split("## Held-out speakers", 1)[1]
    assert "conformer_ctc, fp32:" in held_out and "conformer_ctc, fp32 (auto):" in held_out
    assert held_out.count("| mean of 2 |") == 2 and "mean of 4" not in held_out


def _multirun_job_config(sweep_dir: Path, job: str):
    """Hydra's config as a job of a ``-m`` sweep into ``sweep_dir`` sees it."""
    from hydra import compose, initialize_config_dir
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas

    register_resolvers()
    register_schemas()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", [f"hydra.sweep.dir={sweep_dir}"], return_hydra_config=True)
    with read_write(cfg), open_dict(cfg):
        cfg.hydra.mode = RunMode.MULTIRUN
        cfg.hydra.runtime.output_dir = str(sweep_dir / job)
    return cfg


def test_two_sweeps_into_one_folder_each_summarize_their_own_jobs(
    tmp_path: Path, monkeypatch
) -> None:
    """torchrun -m (every rank a multirun) or sweeps run side by side into one folder:
    the last one to start overwrote .multirun_id, the others' jobs recorded its id, and
    their summaries found no run ("_No runs found._", exit 0 though a job failed)."""
    from hydra.core.hydra_config import HydraConfig

    from recipes.sweep_jobs import JobStatus

    monkeypatch.setenv(MULTIRUN_ID_ENV, "")
    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    first, second = SweepSummaryCallback(), SweepSummaryCallback()
    first.on_multirun_start(config)
    first_env = dict(os.environ)
    second.on_multirun_start(config)  # another process: the file now holds its id
    monkeypatch.setattr(os, "environ", first_env)  # back in the first one's process
    _write_job(sweep, "0", ["precision=fp32"], None)
    HydraConfig.instance().set_config(_multirun_job_config(sweep, "0"))
    JobStatus.for_this_job().write("failed", "RuntimeError: boom")
    with pytest.raises(SystemExit, match="1 of 1 sweep jobs failed"):
        first.on_multirun_end(config)


def test_only_rank_zero_records_and_summarizes_a_torchrun_sweep(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv(MULTIRUN_ID_ENV, "")
    monkeypatch.setenv("RANK", "1")
    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    callback = SweepSummaryCallback()
    callback.on_multirun_start(config)
    _write_job(sweep, "0", ["precision=fp32"], None)
    callback.on_multirun_end(config)
    assert not (sweep / MULTIRUN_ID_FILE).exists() and not (sweep / "summary.md").exists()


@pytest.mark.parametrize(
    ("field", "value"), [("device", "cuda"), ("world_size", 2), ("data", "fsdd_connected")]
)
def test_an_fp32_run_on_another_device_processes_or_data_is_no_baseline(
    tmp_path: Path, field: str, value: object
) -> None:
    """Runs of one set of overrides may differ in what the command line does not say: the
    device ``device=auto`` found, the processes a launcher started. bf16 on 2 processes
    against fp32 on 1 is no precision's speed-up, and the table must not show one."""
    _write_job(tmp_path, "0", ["precision=fp32"], _results("fp32", ["precision=fp32"]))
    other = _results("bf16", ["precision=bf16"])
    other[field] = value
    _write_job(tmp_path, "1", ["precision=bf16"], other)
    by_run = {row["run"]: row for row in summarize_sweep(tmp_path)}
    assert by_run["0"]["speed-up vs fp32"] == "1.00x"
    assert by_run["1"]["speed-up vs fp32"] == "—"


@pytest.mark.parametrize("with_fp32", [True, False])
def test_the_speed_up_is_against_the_run_that_asked_for_fp32(
    tmp_path: Path, with_fp32: bool
) -> None:
    """``-m precision=fp32,auto,bf16`` where auto picks fp32: the reference is the run that
    asked for fp32 (its own row reads 1.00x), not the auto one; without such a run the auto
    run that trained in fp32 is the reference (as over seeds)."""
    runs = [("auto", "fp32", 120.0), ("bf16", "bf16", 150.0)]
    if with_fp32:
        runs.append(("fp32", "fp32", 100.0))
    for asked, used, speed in runs:
        overrides = [f"precision={asked}"]
        results = _results(used, overrides)
        results["precision_requested"] = asked
        results["throughput"]["train_utterances_per_s"] = speed
        _write_job(tmp_path, asked, overrides, results)
    by_run = {row["run"]: row for row in summarize_sweep(tmp_path)}
    assert by_run["auto"]["precision"] == "fp32 (auto)"
    if with_fp32:
        assert [row["run"] for row in summarize_sweep(tmp_path)] == ["fp32", "bf16", "auto"]
        assert by_run["fp32"]["speed-up vs fp32"] == "1.00x"
        assert by_run["bf16"]["speed-up vs fp32"] == "1.50x"
        assert by_run["auto"]["speed-up vs fp32"] == "1.20x"
    else:
        assert by_run["auto"]["speed-up vs fp32"] == "1.00x"
        assert by_run["bf16"]["speed-up vs fp32"] == "1.25x"


def test_over_seeds_a_run_evaluated_in_another_precision_keeps_its_precisions_place(
    tmp_path: Path,
) -> None:
    """The over-seeds rows go fp32, fp16, bf16; "fp16, eval fp32" is an fp16 row. Its rank
    was looked up as "fp16," (split at spaces), which has none, so it sorted last."""
    runs = [("fp16", "fp32", 1), ("fp16", "fp32", 2), ("bf16", "bf16", 1), ("bf16", "bf16", 2)]
    for index, (trained, evaluated, seed) in enumerate(runs):
        overrides = [f"precision={trained}", f"seed={seed}"]
        results = _results(trained, overrides, CER=float(index))
        results["eval_precision"] = evaluated
        _write_job(tmp_path, f"{index}", overrides, results)
    summarize_sweep(tmp_path)
    seeds = (tmp_path / "summary.md").read_text().split("## Over seeds", 1)[1]
    labels = [line.split(" | ")[3] for line in seeds.splitlines() if "fsdd_digits" in line]
    assert labels == ["fp16, eval fp32", "bf16"]


def test_a_sweep_run_again_into_its_folder_keeps_the_earlier_summary(
    tmp_path: Path, monkeypatch
) -> None:
    """``-m precision=fp32,fp16,bf16`` and then ``-m precision=fp32`` into the same
    ``hydra.sweep.dir``: the second summary lists its own job only, and it was written over
    the first one, so the three-precision table was gone (and Hydra's ``multirun.yaml``
    held only the second sweep's config). The earlier files are kept under their date;
    a sweep run again to the same results leaves no copy."""
    monkeypatch.setenv(MULTIRUN_ID_ENV, "")
    sweep = tmp_path / "sweep"
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    records = ("summary.md", "summary.csv", "multirun.yaml")

    def multirun(jobs: list[str], master: str) -> None:
        callback = SweepSummaryCallback()
        callback.on_multirun_start(config)
        (sweep / "multirun.yaml").write_text(master)  # Hydra's sweeper saves it next
        for job in jobs:
            if not (sweep / job).exists():
                precision = job.partition("=")[2]
                _write_job(sweep, job, [f"precision={precision}"], _results(precision, []))
            _write_status(sweep, job, callback.multirun, "finished")
        callback.on_multirun_end(config)

    multirun(["0_precision=fp32", "1_precision=fp16", "2_precision=bf16"], "precisions: 3\n")
    earlier = {name: (sweep / name).read_text() for name in records}
    files = sorted(p.name for p in sweep.iterdir())
    multirun(["0_precision=fp32", "1_precision=fp16", "2_precision=bf16"], "precisions: 3\n")
    assert sorted(p.name for p in sweep.iterdir()) == files  # the same results: no copy

    multirun(["0_precision=fp32"], "precisions: 1\n")
    assert [row["run"] for row in read_summary_csv(sweep)] == ["0_precision=fp32"]
    texts = [p.read_text() for p in sweep.iterdir() if p.is_file()]
    lost = [name for name, text in earlier.items() if text not in texts]
    assert not lost, lost


def test_the_validation_figures_a_search_optimised_stand_beside_the_test_figures(
    tmp_path: Path,
) -> None:
    """A hyperparameter search picks its trial by the validation figure train.py returns;
    the summary showed test figures alone, so the trial Optuna named best could not be found
    in it (and a reader picked by test). The validation figures of the tested checkpoint
    stand before the test ones, in percent (a loss stays out: the test's is there)."""
    for index, cer in enumerate((4.5, 2.25)):
        overrides = [f"model.lr={0.001 * (index + 1)}"]
        results = _results("fp32", overrides)
        results["valid_metrics"] = {"CER": cer, "WER": 2 * cer, "loss": 0.3}
        _write_job(tmp_path, str(index), overrides, results)
    _write_job(tmp_path, "2", ["model.lr=1"], None)  # a failed trial

    rows = summarize_sweep(tmp_path)

    columns = list(rows[0])
    assert columns.index("valid CER %") < columns.index("test CER %")
    assert "valid WER %" in columns and "valid loss" not in columns
    by_run = {row["run"]: row for row in rows}
    assert by_run["0"]["valid CER %"] == "4.50" and by_run["1"]["valid CER %"] == "2.25"
    assert by_run["1"]["valid WER %"] == "4.50"
    assert by_run["2"]["valid CER %"] == "—"
