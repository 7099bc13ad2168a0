"""recipes/evaluate.py's argument handling (the re-tests themselves: tests/test_recipes.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.audio_brain import LEGACY_AVERAGE_FROM
from recipes.evaluate import main, mean_metrics, run_config, split_arguments
from recipes.task import LEGACY_DECODER
from tests.recipe_helpers import FAST, MANIFEST_8K, run_cli


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
    speaker_id = {"metrics": {"accuracy": 90.0, "loss": 0.3}}  # a sweep over both tasks
    assert mean_metrics([*results, speaker_id]) is None  # (a KeyError before)


def test_overrides_of_groups_null_keys_and_the_device_shorthand(tmp_path) -> None:
    """``device=cpu`` (what the device errors advise) sets ``device.name``; another group
    given one value is refused naming its keys (it crashed with an AttributeError); a key
    whose value is null is still a key."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config_resolved.yaml").write_text(
        "model: {name: conformer_ctc, task: asr, decoder: lexicon}\n"
        "trainer: {average_from: last, compile_module_keys: null}\n"
        "device: {name: cuda, num_workers: 2}\n"
        "precision: {name: bf16, eval_precision: bf16}\n"
    )
    cfg = run_config(run, ["device=cpu", "trainer.compile_module_keys=[model]"])
    assert cfg.device == {"name": "cpu", "num_workers": 2}
    assert list(cfg.trainer.compile_module_keys) == ["model"]
    with pytest.raises(ValueError, match=r"precision is a group .*eval_precision.*"):
        run_config(run, ["precision=fp32"])
    with pytest.raises(ValueError, match="model.decodr is not a key"):
        run_config(run, ["model.decodr=greedy"])


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


def test_a_run_from_before_the_newer_options_is_re_tested_as_it_was_tested(tmp_path) -> None:
    """An old run's config lacks ``trainer.average_from`` and ``model.decoder``: it averaged
    the N best checkpoints and decoded greedily, and a re-test does the same; a run that
    has them keeps its own, and an override still wins."""
    old = tmp_path / "old"
    old.mkdir()
    (old / "config_resolved.yaml").write_text(
        "model: {name: conformer_ctc, task: asr}\ntrainer: {average_checkpoints: 3}\n"
    )
    cfg = run_config(old, [])
    assert cfg.trainer.average_from == LEGACY_AVERAGE_FROM == "best"
    assert cfg.model.decoder == LEGACY_DECODER == "greedy"
    assert run_config(old, ["trainer.average_from=last"]).trainer.average_from == "last"
    new = tmp_path / "new"
    new.mkdir()
    (new / "config_resolved.yaml").write_text(
        "model: {name: conformer_ctc, task: asr, decoder: lexicon, beam_size: 8}\n"
        "trainer: {average_checkpoints: 3, average_from: last}\n"
    )
    cfg = run_config(new, [])
    assert (cfg.trainer.average_from, cfg.model.decoder, cfg.model.beam_size) == (
        "last",
        "lexicon",
        8,
    )


def test_a_sweep_folder_stands_for_its_jobs_and_transcribe_names_them(tmp_path) -> None:
    """A sweep's own folder was refused as "not a training run folder" with the advice to
    pass "e.g. outputs/...": evaluate.py now tests each of its jobs (as ``sweep/*``), and
    the tools that take one run name the jobs to choose from."""
    from recipes.inference import RunNotFoundError, find_run_dir

    sweep = tmp_path / "sweep"
    jobs = [
        make_run(sweep / f"{n}_precision={p}") for n, p in [(10, "x"), (2, "bf16"), (0, "fp32")]
    ]
    make_run(sweep / "3_precision=fp16", started=False)  # stopped before it trained
    (sweep / "multirun.yaml").write_text("{}\n")
    (sweep / "summary.md").write_text("")
    assert split_arguments([str(sweep), "model.decoder=greedy"]) == (
        [jobs[2], jobs[1], jobs[0]],  # in job order
        ["model.decoder=greedy"],
    )
    with pytest.raises(RunNotFoundError) as refusal:
        find_run_dir(sweep)
    assert str(refusal.value) == (
        f"{sweep} is the folder of a -m sweep, not of one run. Pass one of its jobs, e.g. "
        f"{jobs[2]} (jobs: 0_precision=fp32, 2_precision=bf16, 10_precision=x)."
    )
    assert find_run_dir(jobs[2]) == Path(jobs[2]).resolve()  # what it advises works
    empty = tmp_path / "empty_sweep"
    empty.mkdir()
    (empty / "multirun.yaml").write_text("{}\n")
    assert split_arguments([str(empty)]) == ([str(empty)], [])
    with pytest.raises(RunNotFoundError, match="sweep whose jobs have not started training"):
        find_run_dir(empty)


def test_an_override_without_its_value_is_named_as_one(tmp_path, capsys) -> None:
    """``evaluate.py RUN model.decoder`` (the ``=value`` forgotten) was taken for a run
    folder: "model.decoder does not exist (relative paths are read from ...)"."""
    run = make_run(tmp_path / "run")
    assert main([run, "model.decoder"]) == 2
    assert capsys.readouterr().err == (
        "error: model.decoder is neither a run folder nor a key=value override: give the key "
        "a value (e.g. model.decoder=...).\n"
    )


def _train_on_manifests(
    tmp_path: Path,
    fsdd_root: Path,
    recordings: Path,
    words: str | tuple[str, ...],
    overrides: list[str],
) -> dict[str, Path]:
    """Train a run in ``tmp_path/run`` on manifests of lucas's and theo's digits 0-2 (train:
    takes 10-12, valid: 5, test: 0), each transcribed ``words[digit]`` (or ``words`` for
    all); returns the manifests by split, for a test to change one after training."""
    manifests = {}
    for split, indices in (("train", range(10, 13)), ("valid", (5,)), ("test", (0,))):
        rows = [
            f"{d}_{s}_{i},{recordings / f'{d}_{s}_{i}.wav'},0.5,"
            f"{words if isinstance(words, str) else words[d]},{s}"
            for s in ("lucas", "theo")
            for d in range(3)
            for i in indices
        ]
        manifests[split] = tmp_path / f"{split}.csv"
        manifests[split].write_text("id,path,duration,transcript,speaker\n" + "\n".join(rows))
    args = [
        *FAST,
        *MANIFEST_8K,
        *(f"data.{split}={path}" for split, path in manifests.items()),
        *overrides,
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    result = run_cli("train.py", args, fsdd_root)
    assert result.returncode == 0, result.stderr[-3000:]
    return manifests


def test_a_speaker_run_whose_training_speakers_changed_is_refused(
    tmp_path, fsdd_root, fsdd_recordings, capsys
) -> None:
    """A speaker-ID run's classes are its training speakers as its labels.json lists them;
    a re-test rebuilds the data from the manifests as they read now. With a speaker added
    to the training manifest since, the checkpoint failed to load "written by a different
    model or configuration" (with a speaker swapped instead, as many classes as before,
    they were silently read as other speakers). It is refused, naming both lists."""
    manifests = _train_on_manifests(
        tmp_path,
        fsdd_root,
        fsdd_recordings,
        "x",
        ["model=xvector", "model.channels=16", "model.embedding_dim=8"],
    )
    with open(manifests["train"], "a") as file:  # the manifest gains a speaker
        file.write(f"\n0_george_10,{fsdd_recordings / '0_george_10.wav'},0.5,x,george")
    assert main([str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "trained on, ['lucas', 'theo']" in err and "['george', 'lucas', 'theo']" in err


def test_an_asr_run_is_re_tested_with_the_lexicon_it_was_trained_with(
    tmp_path, fsdd_root, fsdd_recordings, caplog, monkeypatch
) -> None:
    """The lexicon decoder's words are the training transcripts' words (``labels.json``
    records them; transcribe.py decodes with those). A re-test rebuilt them from the
    training manifest as it reads now: a row added since ("nine") silently changed what the
    decoder could say, and the re-test no longer measured the run's model as its test did.
    It decodes with the run's words, and says that the manifest's differ (found by
    audit-speaker)."""
    manifests = _train_on_manifests(
        tmp_path, fsdd_root, fsdd_recordings, ("zero", "one", "two"), ["model.decoder=lexicon"]
    )
    with open(manifests["train"], "a") as file:  # the training manifest gains a word
        file.write(f"\n9_george_10,{fsdd_recordings / '9_george_10.wav'},0.5,nine,george")
    from recipes.asr import brain as asr_brain

    decoders: list[tuple[str, ...]] = []
    make_decoder = asr_brain.make_decoder

    def recording(name, lexicon, beam_size):
        decoders.append(tuple(lexicon))
        return make_decoder(name, lexicon, beam_size)

    monkeypatch.setattr(asr_brain, "make_decoder", recording)
    assert main([str(tmp_path / "run")]) == 0
    assert decoders and set(decoders) == {("one", "two", "zero")}
    (warning,) = [r.getMessage() for r in caplog.records if "lexicon" in r.getMessage()]
    assert "new words: nine" in warning and "labels.json" in warning  # the difference named
