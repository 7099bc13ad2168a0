"""Hyperparameter search: train.py returns the validation metric, in the right direction."""

from __future__ import annotations

import json
import re

import pytest

from recipes.config import ConfigError
from recipes.experiment import sweep_objective
from recipes.preflight import check_sweep_direction
from tests.recipe_helpers import FAST, compose_config, run_cli


@pytest.mark.parametrize(
    ("model", "metric", "good", "bad"),
    [
        ("conformer_ctc", "CER", "minimize", "maximize"),
        ("xvector", "accuracy", "maximize", "minimize"),
    ],
)
def test_objective_is_the_validation_metric_never_the_test_one(model, metric, good, bad):
    cfg = compose_config([*FAST, f"model={model}"])
    results = {
        "valid_metrics": {"loss": 0.5, metric: 12.5},
        "test_metrics": {"loss": 0.1, metric: 99.0},
    }
    assert sweep_objective(cfg, results) == 12.5
    check_sweep_direction(cfg, good)
    check_sweep_direction(cfg, None)  # no sweeper: nothing to check
    with pytest.raises(ConfigError, match=f"hydra.sweeper.direction={good}"):
        check_sweep_direction(cfg, bad)
    with pytest.raises(ConfigError, match="no validation"):
        sweep_objective(cfg, {"valid_metrics": {}, "test_metrics": {metric: 1.0}})


def test_two_trial_optuna_sweep_tunes_on_validation_cer(tmp_path, fsdd_root):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        [
            "-m",
            "hparams_search=asr_optuna",
            "hydra.sweeper.n_trials=2",
            *FAST,
            "trainer.debug_epochs=1",
            f"data.root={fsdd_root}",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(sweep_dir.glob("*/results.json"))
    assert len(runs) == 2
    valid_cer = [json.loads(r.read_text())["valid_metrics"]["CER"] for r in runs]
    lrs = {
        o for r in runs for o in json.loads(r.read_text())["overrides"] if o.startswith("model.lr")
    }
    assert len(lrs) == 2  # two different trials
    best = float(re.search(r"Best value: ([0-9.eE+-]+)", result.stdout + result.stderr).group(1))
    assert best == pytest.approx(min(valid_cer))  # Optuna saw the validation CER, minimised
    assert (sweep_dir / "summary.md").is_file()  # the comparison table still appears


def test_a_sweeper_tuning_the_wrong_way_is_refused_before_its_first_trial(tmp_path, fsdd_root):
    """Each trial was refused the same way, after the sweep had started: a job folder per
    trial (and, since a failed job ends alone, every trial of the search)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        ["-m", "hparams_search=speaker_optuna", *FAST, f"hydra.sweep.dir={sweep_dir}"],
        fsdd_root,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: hydra.sweeper.direction=maximize but model=conformer_ctc" in result.stderr
    assert not sweep_dir.exists()


def test_an_optuna_search_goes_on_past_failed_trials(tmp_path, fsdd_root):
    """A failed trial (here refused: no data) returned NaN, which the Optuna sweeper
    (1.2) tells Optuna in two ways it refuses: the whole study stopped at the first
    failed trial, without the trials left or the summary. A failed trial is now the worst
    value for the direction, and the search goes on."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        [
            "-m",
            "model=xvector",
            "hparams_search=speaker_optuna",
            "hydra.sweeper.n_trials=2",
            *FAST,
            f"data.root={tmp_path / 'no_data'}",  # both trials refused before any training
            "data.download=false",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        fsdd_root,
    )
    assert "Values cannot be specified" not in result.stderr, result.stderr[-3000:]
    assert result.returncode == 1 and "2 of 2 sweep jobs failed" in result.stderr
    rows = (sweep_dir / "summary.md").read_text()
    assert rows.count("| failed |") == 2


@pytest.mark.parametrize(
    ("choice", "message"),
    [
        ("precision=choice(fp32,bf61)", "precision=bf61 does not compose: In 'config': Could not"),
        ("model.dropout=choice(0.1,abc)", "model.dropout=abc does not compose"),
        ("model.dropout=choice(0.1,1.5)", "the sweep's model.dropout=1.5 is refused: model="),
    ],
)
def test_a_choice_an_optuna_search_cannot_compose_is_refused_before_its_first_trial(
    tmp_path, fsdd_root, choice, message
):
    """The Optuna sweeper composes a trial when it draws it: a typo in a choice ended the
    search at the first trial that drew it, after the earlier ones had trained."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        ["-m", "model=xvector", "hparams_search=speaker_optuna", choice, *FAST]
        + [f"hydra.sweep.dir={sweep_dir}"],
        fsdd_root,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert message in result.stderr and not sweep_dir.exists()


def test_folder_names_over_255_bytes_are_cut_with_a_hash_of_the_whole_name():
    """Run and sweep job folders are named by their overrides: a long list of them (an
    Optuna search names its jobs by every override) ended in "File name too long"."""
    from recipes.resolvers import run_name
    from recipes.sweep_jobs import numbered_folder

    items = [f"data.wave_augment.speeds=[0.9,0.95,1.0,1.05,1.{i}]" for i in range(10)]
    long_name = ",".join(items)
    assert len(long_name.encode()) > 255
    for name in (run_name(long_name), numbered_folder(12, long_name)):
        assert len(name.encode()) <= 255
        assert re.fullmatch(r".*\]\.\.[0-9a-f]{12}", name)  # whole items, then the hash
    assert numbered_folder(12, long_name).startswith("12_data.wave_augment.speeds=")
    assert run_name(long_name) == run_name(long_name)  # a rerun finds its folder
    other = long_name[:-2] + "8]"  # differs only in its last, cut, item
    assert run_name(other) != run_name(long_name)
    assert run_name("model.lr=0.001,seed=2") == "model.lr=0.001,seed=2"  # short: unchanged
    assert run_name("") == "default" and run_name("a/b=1") == "a_b=1"
    assert len(run_name("é" * 200).encode()) <= 255  # bytes, never half a character


def test_an_optuna_search_with_many_overrides_runs_in_folders_of_255_bytes(tmp_path, fsdd_root):
    """The Optuna sweeper names a job by all its overrides: with a few more on the command
    line the name passed 255 bytes and the search ended in a traceback at its first trial."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        [
            "-m",
            "model=xvector",
            "hparams_search=speaker_optuna",
            "hydra.sweeper.n_trials=1",
            *FAST,
            "trainer.debug_epochs=1",
            "data.wave_augment.speeds=[0.9,0.95,1.0,1.05,1.1]",
            "data.wave_augment.noise_prob=0.5",
            "model.weight_decay=0.01",
            "trainer.max_grad_norm=5.0",
            "data.max_batch_seconds=7",
            "model.dropout=interval(0.0,1.0)",  # 1.0 is refused, but never drawn
            f"data.root={fsdd_root}",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (job,) = [p for p in sweep_dir.iterdir() if p.is_dir()]
    assert job.name.startswith("0_") and len(job.name.encode()) <= 255
    assert (job / "results.json").is_file()


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (
            "model.lr=interval(-0.001,0.001)",
            "error: the sweep's model.lr=interval(-0.001,0.001) can draw model.lr=-0.001, which "
            "is refused: model.lr=-0.001 is not valid; it must be a positive number",
        ),
        (  # the preset's search space, replaced
            'hydra.sweeper.params={model.lr:"tag(log,interval(3e-4,3e-3))",'
            'model.dropout:"interval(0.5,1.5)"}',
            "error: the sweep's model.dropout=interval(0.5,1.5) can draw model.dropout=1.499999, "
            "which is refused: model=xvector: dropout probability has to be between 0 and 1",
        ),
        (
            'hydra.sweeper.params={model.lr:"tag(log,interval(0,3e-3))"}',
            "error: the sweep's model.lr=tag(log,interval(0,3e-3)) is refused: a log interval "
            "needs a low end above 0 (got 0.0).",
        ),
    ],
)
def test_a_search_space_that_can_draw_a_refused_value_is_refused_before_its_first_trial(
    tmp_path, fsdd_root, space, message
):
    """An interval (on the command line or in the sweeper's params: a preset's search
    space) was not checked: each trial that drew a refused value failed, and a log interval
    from 0 ended the search in Optuna's traceback."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        ["-m", "model=xvector", "hparams_search=speaker_optuna", space, *FAST]
        + ["hydra.sweeper.n_trials=1", f"hydra.sweep.dir={sweep_dir}"],
        fsdd_root,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert message in result.stderr and "No trial has run" in result.stderr
    assert not any(p.is_dir() for p in sweep_dir.glob("*"))  # no trial folder


@pytest.mark.parametrize("count", [0, -3])
def test_a_search_of_no_trials_is_refused_in_one_line(tmp_path, fsdd_root, count):
    """``hydra.sweeper.n_trials=0`` ended in Optuna's ``ValueError: No trials are completed
    yet`` traceback after the search had started (found by audit-search)."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        ["-m", "model=xvector", "hparams_search=speaker_optuna", *FAST]
        + [f"hydra.sweeper.n_trials={count}", f"hydra.sweep.dir={sweep_dir}"],
        fsdd_root,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        f"error: hydra.sweeper.n_trials={count}: a search needs at least one trial. "
        "Fix: hydra.sweeper.n_trials=N with N of 1 or more." in result.stderr
    )
    assert not any(p.is_dir() for p in sweep_dir.glob("*"))  # no trial folder


def test_a_study_database_optuna_2_cannot_open_is_named_with_its_fix():
    """Optuna 2 (hydra-optuna-sweeper 1.2 requires it) with SQLAlchemy 2 ended a search with
    ``storage: sqlite:///...`` at its start in an AssertionError traceback."""
    from recipes.search_space import sweeper_storage_problem

    versions = {"optuna": "2.10.1", "sqlalchemy": "2.1.9"}
    problem = sweeper_storage_problem("sqlite:///s.db", versions.get)
    assert problem.startswith("hydra.sweeper.storage=sqlite:///s.db needs SQLAlchemy 1.x")
    assert 'pip install "sqlalchemy<2" "alembic<1.14"' in problem and "\n" not in problem
    assert sweeper_storage_problem(None, versions.get) is None  # in memory
    for fine in ({"sqlalchemy": "1.4.54"}, {"optuna": "3.6.1"}):  # SQLAlchemy 1, Optuna 3
        assert sweeper_storage_problem("sqlite:///s.db", {**versions, **fine}.get) is None


def _sqlalchemy_major() -> int:
    from importlib import metadata

    return int(metadata.version("sqlalchemy").split(".")[0])


def test_an_optuna_search_on_a_database_it_cannot_open_is_refused_in_one_line(tmp_path, fsdd_root):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    if _sqlalchemy_major() < 2:
        pytest.skip("SQLAlchemy 1.x opens the study's database")
    sweep_dir = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        ["-m", "model=xvector", "hparams_search=speaker_optuna", *FAST]
        + [f"hydra.sweeper.storage=sqlite:///{tmp_path / 'study.db'}"]
        + [f"hydra.sweep.dir={sweep_dir}"],
        fsdd_root,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "error: hydra.sweeper.storage=sqlite:///" in result.stderr
    assert not (tmp_path / "study.db").exists()
    assert not any(p.is_dir() for p in sweep_dir.glob("*"))  # no trial folder
