"""recipes/evaluate.py's argument handling (the re-tests themselves: tests/test_recipes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.evaluate import main, mean_metrics, split_arguments


def make_run(folder: Path, started: bool = True) -> str:
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("{}\n")
    if started:
        (folder / "labels.json").write_text("{}\n")
    return str(folder)


def test_sweep_job_folders_with_equals_signs_are_runs_and_the_rest_overrides(tmp_path) -> None:
    george = make_run(tmp_path / "0_data.test_speakers=[george]")
    lucas = make_run(tmp_path / "1_data.test_speakers=[lucas]")
    (tmp_path / "summary.md").write_text("")
    (tmp_path / "tb").mkdir()
    stopped = make_run(tmp_path / "2_data.test_speakers=[theo]", started=False)
    items = [george, lucas, str(tmp_path / "summary.md"), str(tmp_path / "tb"), stopped]
    runs, overrides = split_arguments([*items, "model.decoder=lexicon", "trainer.debug=false"])
    assert runs == [george, lucas]  # a glob's files and non-run folders are left out
    assert overrides == ["model.decoder=lexicon", "trainer.debug=false"]


def test_a_missing_sweep_job_folder_is_a_run_not_an_override(tmp_path) -> None:
    missing = str(tmp_path / "elsewhere" / "0_data.test_speakers=[george]")
    assert split_arguments([missing, "model.decoder=greedy"]) == (
        [missing],
        ["model.decoder=greedy"],
    )


def test_a_single_path_stays_a_run_even_when_it_is_not_one(tmp_path) -> None:
    """One folder that is not a run is not silently dropped: evaluating it fails clearly."""
    assert split_arguments([str(tmp_path), "model.decoder=greedy"]) == (
        [str(tmp_path)],
        ["model.decoder=greedy"],
    )


def test_mean_metrics_average_each_metric() -> None:
    results = [{"metrics": {"CER": 10.0, "WER": 20.0}}, {"metrics": {"CER": 30.0, "WER": 50.0}}]
    assert mean_metrics(results) == {"CER": 20.0, "WER": 35.0}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model.decoder=lexicon"], "No run folder given"),
        (["/nonexistent/run"], "/nonexistent/run does not exist"),
        # A sweep job folder given from the wrong directory: a missing run, not an override.
        (["runs/0_data.test_speakers=[george]"], "0_data.test_speakers=[george] does not exist"),
        (
            ["runs/0_data.test_speakers=[george]", "runs/1_data.test_speakers=[lucas]"],
            "0_data.test_speakers=[george] does not exist",
        ),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(args, message, capsys) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err
