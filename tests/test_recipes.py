"""End-to-end: real FSDD audio, the real config and entry points, a few steps on the CPU."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
import torchaudio
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from amp_utils import Checkpointer, Stage
from amp_utils.checkpoint import read_state
from amp_utils.run_results import RunResults
from amp_utils.sweep_summary import JOB_STATUS_FILE, MULTIRUN_ID_FILE
from data.connected_digits import read_plan
from data.fsdd import prepare_fsdd_digits
from data.text import DIGIT_WORDS, CharTokenizer
from recipes import experiment
from recipes.asr.brain import ASRBrain
from recipes.audio_brain import AudioBrain
from recipes.config import ConfigError, validate_config
from recipes.data_setup import build_data
from recipes.evaluate import evaluate_run
from recipes.experiment import tensorboard_hparams, train
from recipes.inference import load_trained
from tests.recipe_helpers import FAST, compose_config, manifest_config, run_cli

OPTIONS = {
    "precision": ["fp32", "fp16", "bf16"],
    "device": ["auto", "cpu", "cuda"],
    "model": ["conformer_ctc", "xvector"],
    "data": ["fsdd_digits", "fsdd_connected", "manifest"],
}


@pytest.fixture(scope="session")
def prepared_digits(fsdd_root: Path, tmp_path_factory) -> Path:
    """FSDD digit manifests, prepared once for the session."""
    out = tmp_path_factory.mktemp("prepared_digits")
    prepare_fsdd_digits(fsdd_root, out, download=False)
    return out


def fast_cfg(tmp_path: Path, fsdd_root: Path, prepared: Path, *extra: str):
    return compose_config(
        [
            *FAST,
            f"data.root={fsdd_root}",
            f"data.prepared_dir={prepared}",
            f"output_dir={tmp_path / 'run'}",
            *extra,
        ]
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def tags(event_dir: Path) -> dict[str, set[str]]:
    """Scalar and text tags found in all event files below ``event_dir``."""
    found = {"scalars": set(), "tensors": set()}
    for events in event_dir.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        found["scalars"] |= set(acc.Tags()["scalars"])
        found["tensors"] |= set(acc.Tags()["tensors"])
    return found


def test_every_config_option_composes_and_validates():
    for values in itertools.product(*OPTIONS.values()):
        overrides = [f"{group}={value}" for group, value in zip(OPTIONS, values, strict=True)]
        if "data=manifest" in overrides:  # its manifests are required values
            overrides += ["data.train=a.csv", "data.valid=b.csv", "data.test=c.csv"]
        cfg = compose_config([*overrides, "output_dir=unused"])
        validate_config(cfg)
        assert cfg.precision.name == values[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_asr_run_writes_metrics_checkpoints_and_tensorboard(
    tmp_path, fsdd_root, prepared_digits, precision, caplog
):
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, f"precision={precision}")
    caplog.set_level(logging.INFO, logger="recipes.experiment")
    results = train(cfg)
    run = tmp_path / "run"
    saved = json.loads((run / "results.json").read_text())
    assert saved == json.loads(json.dumps(results))
    assert saved["precision"] == precision and saved["device"] == "cpu"
    assert saved["model"] == "conformer_ctc" and saved["task"] == "asr"
    for key in ("CER", "WER", "loss"):
        assert 0 <= saved["test_metrics"][key] < 1e4
    assert saved["throughput"]["train_utterances_per_s"] > 0
    assert saved["throughput"]["train_audio_seconds_per_s"] > 0
    assert 0 <= saved["throughput"]["data_wait_share"] < 1  # share of training time
    assert saved["peak_memory_mb"] > 0 and saved["wall_time_s"] > 0
    # where the wall time went: training, validation, epoch ends (checkpoints), the rest
    speed = saved["throughput"]
    assert speed["valid_time_s"] > 0 and speed["epoch_end_time_s"] > 0
    parts = speed["train_time_s"] + speed["valid_time_s"] + speed["epoch_end_time_s"]
    assert parts < saved["wall_time_s"]
    assert "time: wall time" in caplog.text and "validation" in caplog.text
    assert saved["optimizer_steps"] == 4
    # A debug run tests its first 2 batches, not the 300 utterances of the split: the record
    # says how many the test metrics are of (the utterances of the error report's table).
    report = (run / "test_errors.md").read_text()
    assert 0 < saved["test_utterances"] < saved["dataset"]["splits"]["test"]["utterances"] == 300
    assert f" of {saved['test_utterances']} utterances wrong" in report
    assert "torch" in (run / "env.txt").read_text()
    # Four steps teach a CTC model the labels' prior: it says one thing (nothing, or one
    # word, depending on the draws) for most utterances; the error report and log say so.
    collapsed = saved["collapsed"]
    assert collapsed is not None and collapsed["share"] >= 0.5
    said = collapsed["said"]
    assert said == ("nothing" if collapsed["label"] == "∅" else f'"{collapsed["label"]}"')
    assert f"**Collapsed.** The model said {said}" in (run / "test_errors.md").read_text()
    assert f"The model said {said}" in caplog.text
    # The lexicon of the default decoder: the words of the training transcripts.
    labels = json.loads((run / "labels.json").read_text())
    assert labels["words"] == sorted(DIGIT_WORDS)
    ckpts = Checkpointer(run / "checkpoints").list_checkpoints()
    assert ckpts and all("CER" in c.meta for c in ckpts)
    # What was tested: the best checkpoint by validation CER, and its validation metrics.
    tested = saved["tested_checkpoint"]
    best = min(ckpts, key=lambda c: c.meta["CER"])
    assert (
        tested["checkpoint"] == best.path.name and tested["selected_by"] == "lowest validation CER"
    )
    assert tested["epoch"] == best.meta["epoch"] and tested["optimizer_step"] == 2 * tested["epoch"]
    assert tested["valid_metrics"] == best.meta["valid_metrics"]
    # The test averaged the 2 epochs' checkpoints (the ASR default averages the final 3):
    # valid_metrics are that average's (they were the best single checkpoint's, which a
    # sweeper then tuned on); test_evaluate_... checks them against evaluate.py's.
    assert len(tested["averaged_checkpoints"]) == 2
    assert saved["valid_metrics_of"] == "averaged_checkpoints"
    assert saved["valid_metrics"] != best.meta["valid_metrics"]
    # What it trained on: the data root and the size of every split.
    assert saved["dataset"]["root"] == str(fsdd_root)
    assert saved["dataset"]["splits"]["train"]["utterances"] == 2400
    assert all(0 < s["hours"] < 1 for s in saved["dataset"]["splits"].values())
    resolved = (run / "config_resolved.yaml").read_text()
    assert "${" not in resolved and f"root: {fsdd_root}" in resolved
    state = read_state(ckpts[-1].path / "state.pt")["state"]
    assert "module.model" in state and "optimizer" in state
    found = tags(run / "tb")
    for tag in (
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/utterances_per_s",
        "valid/loss",
        "valid/CER",
        "valid/WER",
        "epoch/train_loss",
        "time/train_s",
        "time/valid_s",
        "time/epoch_end_s",
    ):
        assert tag in found["scalars"], tag
    assert "valid/examples/text_summary" in found["tensors"]
    assert any(t.startswith("hparam/") for t in found["scalars"]) or (
        "_hparams_/session_start_info" in found["tensors"]
    )


def test_an_auto_run_records_the_precisions_it_used_and_the_one_asked_for(
    tmp_path, fsdd_root, prepared_digits, monkeypatch
):
    """precision=auto on a CPU without native bf16 trains and tests in fp32: results.json
    (and the sweep table, which reads it) must say fp32, not "auto", with "auto" kept as
    what was asked for."""
    from amp_utils.sweep_summary import precision_label

    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    train(fast_cfg(tmp_path, fsdd_root, prepared_digits, "precision=auto", "trainer.epochs=1"))
    saved = RunResults.read(tmp_path / "run" / "results.json")
    assert (saved.precision, saved.eval_precision, saved.precision_requested) == (
        "fp32",
        "fp32",
        "auto",
    )
    assert precision_label(saved) == "fp32 (auto)"


def plant_z_ero_evaluations(monkeypatch) -> dict[Stage, list[str]]:
    """Make every validation and test frame score "z" highest and "e", "r", "o" next: the
    best path reads "z", the lexicon search "zero". Returns the references each stage
    scored, in order."""
    tokenizer = CharTokenizer()
    planted_scores = torch.full((tokenizer.vocab_size,), -10.0)
    planted_scores[tokenizer.encode("z")[0]] = 10.0
    planted_scores[tokenizer.encode("ero")] = 5.0
    refs: dict[Stage, list[str]] = {Stage.VALID: [], Stage.TEST: []}
    compute_objectives = ASRBrain.compute_objectives

    def planted(self, predictions, batch, stage):
        if stage != Stage.TRAIN:
            logits, out_lens = predictions
            predictions = (planted_scores.to(logits).expand_as(logits).clone(), out_lens)
            refs[stage] += batch.transcripts
        return compute_objectives(self, predictions, batch, stage)

    monkeypatch.setattr(ASRBrain, "compute_objectives", planted)
    return refs


def test_epochs_validate_greedily_and_the_run_records_the_test_decoders_validation(
    tmp_path, fsdd_root, prepared_digits, monkeypatch
):
    """``model.valid_decoder=greedy`` (the default): each epoch's validation decodes the
    best path (the checkpoints' CER), the test decodes with ``model.decoder=lexicon``, and
    the run's recorded validation figures (a sweeper's objective) are the tested weights'
    decoded as the test decodes. One tested checkpoint here, so no average rescores them.

    Every evaluated frame is planted to score "z" highest and "e", "r", "o" next, so the
    best path reads "z" and the lexicon search "zero" for every utterance."""
    refs = plant_z_ero_evaluations(monkeypatch)
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.average_checkpoints=1")
    assert (cfg.model.decoder, cfg.model.valid_decoder) == ("lexicon", "greedy")
    saved = train(cfg)

    def cer(said: str, references: list[str]) -> float:
        edits = sum(torchaudio.functional.edit_distance(r, said) for r in references)
        return 100.0 * edits / sum(map(len, references))

    epochs = saved["epochs_completed"]
    valid = refs[Stage.VALID][: len(refs[Stage.VALID]) // epochs]  # one epoch's
    assert refs[Stage.VALID] == valid * epochs and cer("z", valid) != cer("zero", valid)
    ckpts = Checkpointer(tmp_path / "run" / "checkpoints").list_checkpoints()
    assert ckpts and all(c.meta["CER"] == pytest.approx(cer("z", valid)) for c in ckpts)
    assert all(c.meta["valid_decoder"] == "greedy" for c in ckpts)
    tested = saved["tested_checkpoint"]
    assert tested["valid_decoder"] == "greedy"  # what its valid_metrics were decoded with
    assert tested["averaged_checkpoints"] == [] and saved["valid_metrics_of"] == "tested_checkpoint"
    assert tested["valid_metrics"]["CER"] == pytest.approx(cer("z", valid))
    assert saved["valid_metrics"]["CER"] == pytest.approx(cer("zero", valid))
    # The test, then the tested weights' validation: both with the lexicon search.
    test = refs[Stage.TEST][: len(refs[Stage.TEST]) - len(valid)]
    assert refs[Stage.TEST][len(test) :] == valid
    assert saved["test_metrics"]["CER"] == pytest.approx(cer("zero", test))


def test_a_run_validated_with_the_lexicon_keeps_it_when_extended(
    tmp_path, fsdd_root, prepared_digits, monkeypatch, caplog
):
    """A run started before ``model.valid_decoder`` existed validated its epochs with
    ``model.decoder`` (lexicon), and its checkpoints record no ``valid_decoder``. Extended
    by today's code (``trainer.epochs`` raised), it must go on scoring its epochs with the
    lexicon: its checkpoints' CERs pick the best one and must compare."""
    refs = plant_z_ero_evaluations(monkeypatch)
    state_dict = ASRBrain.state_dict

    def as_before(self):
        return {k: v for k, v in state_dict(self).items() if k != "valid_decoder"}

    checkpoints = "trainer.average_checkpoints=1"
    first = fast_cfg(tmp_path, fsdd_root, prepared_digits, checkpoints, "trainer.epochs=1")
    first.model.valid_decoder = "lexicon"  # how the code before validated
    with monkeypatch.context() as old_code:
        old_code.setattr(ASRBrain, "state_dict", as_before)
        train(first)
    caplog.set_level(logging.WARNING, logger="recipes.asr.brain")
    extended = fast_cfg(tmp_path, fsdd_root, prepared_digits, checkpoints, "trainer.epochs=2")
    assert extended.model.valid_decoder == "greedy"
    train(extended)
    ckpts = Checkpointer(tmp_path / "run" / "checkpoints").list_checkpoints()
    by_epoch = {c.meta["epoch"]: c.meta["CER"] for c in ckpts if c.end_of_epoch}
    valid = refs[Stage.VALID][: len(refs[Stage.VALID]) // 2]
    lexicon_cer = (
        100.0
        * sum(torchaudio.functional.edit_distance(r, "zero") for r in valid)
        / sum(map(len, valid))
    )
    assert by_epoch == {1: pytest.approx(lexicon_cer), 2: pytest.approx(lexicon_cer)}
    assert "validated with the lexicon decoder (model.valid_decoder=greedy now)" in caplog.text
    # A run of today's code, extended the same way, goes on validating greedily.
    caplog.clear()
    refs[Stage.VALID].clear()
    today = tmp_path / "today"
    for epochs in (1, 2):
        cfg = fast_cfg(today, fsdd_root, prepared_digits, checkpoints, f"trainer.epochs={epochs}")
        train(cfg)
    ckpts = Checkpointer(today / "run" / "checkpoints").list_checkpoints()
    greedy_cer = (
        100.0
        * sum(torchaudio.functional.edit_distance(r, "z") for r in valid)
        / sum(map(len, valid))
    )
    assert [c.meta["CER"] for c in ckpts if c.end_of_epoch] == pytest.approx([greedy_cer] * 2)
    assert "validated with the" not in caplog.text


def test_tensorboard_records_the_batch_budget_the_sampler_used(
    tmp_path, fsdd_root, prepared_digits
):
    """hparams record the batch budget after device.batch_scale: what the sampler used."""
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, "device.batch_scale=3")
    data = build_data(cfg, torch.device("cpu"))
    hparams, _ = tensorboard_hparams(cfg, RunResults(precision="fp32", device="cpu"), data)
    used = data.train.batch_sampler.max_batch_seconds
    assert used == cfg.data.max_batch_seconds * 3 and hparams["max_batch_seconds"] == used


def test_each_run_of_a_sweep_process_warns_of_an_emulated_precision(
    tmp_path, fsdd_root, prepared_digits, monkeypatch, caplog
):
    """The warning came once per process: in a sweep, the jobs after the first had none in
    their own train.log."""
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    for name in ("a", "b"):
        cfg = fast_cfg(tmp_path / name, fsdd_root, prepared_digits, "precision=bf16")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="amp_utils.precision"):
            train(cfg)
        assert "precision=bf16 on a CPU without AVX512-BF16" in caplog.text, name


def test_tensorboard_records_the_eval_precision_used(
    tmp_path, fsdd_root, prepared_digits, monkeypatch
):
    """precision.eval_precision=auto on the command line: the hparams say what it chose, as
    they do for precision (they said 'auto' next to the resolved training precision)."""
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, "precision.eval_precision=auto", "seed=3")
    data = build_data(cfg, torch.device("cpu"))
    monkeypatch.setattr(
        "recipes.experiment._overrides",
        lambda: ["precision=auto", "precision.eval_precision=auto", "seed=3"],
    )
    results = RunResults(precision="bf16", eval_precision="fp32", device="cpu")
    hparams, _ = tensorboard_hparams(cfg, results, data)
    assert hparams["precision"] == "bf16" and hparams["precision.eval_precision"] == "fp32"
    assert hparams["seed"] == 3


@pytest.mark.parametrize("pad_to_buckets", [False, True])
def test_the_run_record_says_how_many_utterances_an_epoch_trains(
    tmp_path, fsdd_root, prepared_digits, pad_to_buckets, caplog
):
    """Fixed shapes leave out each bucket's partial batch: results.json counted the whole
    training split while an epoch used 16-27 % fewer utterances (FSDD)."""
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, f"data.pad_to_buckets={pad_to_buckets}")
    with caplog.at_level(logging.INFO, logger="recipes.data_setup"):
        data = build_data(cfg, torch.device("cpu"))
    used = data.record["train_utterances_per_epoch"]
    batches = list(data.train.batch_sampler)
    assert used == sum(len(batch) for batch in batches)
    train_size = len(data.train.dataset)
    assert (used < train_size) == pad_to_buckets and used <= train_size
    assert (f"Each training epoch uses {used} of the {train_size}" in caplog.text) == pad_to_buckets


def test_fp16_on_cpu_applies_updates_and_logs_loss_scale(
    tmp_path, fsdd_root, prepared_digits, monkeypatch
):
    """fp16 through the real recipe: the scaler backs off from torch's initial 65536 on
    the first overflowing steps, then applies updates that change the weights."""
    initial = {}
    build_brain = experiment.build_brain

    def recording_build_brain(*args, **kwargs):  # the weights training starts from
        brain = build_brain(*args, **kwargs)
        for name, module in brain.modules.items():
            initial[name] = {k: v.detach().clone() for k, v in module.state_dict().items()}
        return brain

    monkeypatch.setattr(experiment, "build_brain", recording_build_brain)
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, "precision=fp16")
    results = train(cfg)
    assert results["precision"] == "fp16"
    assert results["optimizer_steps"] >= 1, results  # not every step skipped
    assert "train/loss_scale" in tags(tmp_path / "run" / "tb")["scalars"]
    latest = Checkpointer(tmp_path / "run" / "checkpoints").find_checkpoint()
    state = read_state(latest.path / "state.pt")["state"]
    assert state["scaler"]["enabled"] and state["scaler"]["state"]["scale"] > 0
    weights = state["module.model"]
    assert initial["model"].keys() == weights.keys()
    changed = [k for k, v in initial["model"].items() if not torch.equal(v, weights[k])]
    assert changed, "fp16 training left every weight of the model unchanged"


def test_a_finished_run_leaves_no_loader_workers_behind(tmp_path, fsdd_root, prepared_digits):
    """A run's persistent loader workers end with it. Held in a reference cycle, they lived
    until a garbage collection, which closed their queues first: each then waited out a 5 s
    timeout, a 60 s stall inside the next sweep job or at the interpreter's exit (H200)."""
    import gc
    import multiprocessing

    before = set(multiprocessing.active_children())
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, "device.num_workers=2")
    gc.disable()  # no collection in between, as when the next job's came later
    try:
        train(cfg)
        left = set(multiprocessing.active_children()) - before
    finally:
        gc.enable()
    assert left == set(), f"{len(left)} loader worker processes outlived the run"


def test_speaker_id_run_reports_accuracy(tmp_path, fsdd_root, prepared_digits):
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, "model=xvector", "precision=bf16")
    results = train(cfg)
    assert results["task"] == "speaker"
    assert 0 <= results["test_metrics"]["accuracy"] <= 100
    # The error report counts what the accuracy counts (debug mode: 2 test batches).
    report = (tmp_path / "run" / "test_errors.md").read_text()
    wrong, tested = map(int, re.search(r"(\d+) of (\d+) utterances wrong", report).groups())
    assert tested > 0 and "confusions (speakers)" in report
    assert 100 * (tested - wrong) / tested == pytest.approx(results["test_metrics"]["accuracy"])
    ckpts = Checkpointer(tmp_path / "run" / "checkpoints").list_checkpoints()
    assert all("accuracy" in c.meta for c in ckpts)


def trained_model(cfg):
    """The run's model as transcribe.py loads it (the config file is what Hydra writes)."""
    (Path(cfg.output_dir) / ".hydra").mkdir()
    OmegaConf.save(cfg, Path(cfg.output_dir) / ".hydra" / "config.yaml")
    return load_trained(cfg.output_dir, device="cpu")


def test_connected_digits_run_reports_wer(tmp_path, fsdd_root, fsdd_recordings):
    cfg = compose_config(
        [
            *FAST,
            f"data.root={fsdd_root}",
            "data=fsdd_connected",
            f"data.prepared_dir={tmp_path / 'prep'}",
            f"output_dir={tmp_path / 'run'}",
            "data.num_train=12",
            "data.num_valid=4",
            "data.num_test=4",
        ]
    )
    results = train(cfg)
    assert set(results["test_metrics"]) == {"loss", "CER", "WER"}
    assert results["overrides"] is None  # trained from code: no command line to record
    (plans_path,) = (tmp_path / "prep").glob("plans-*/test.plan.jsonl")
    plans = read_plan(plans_path)
    assert len(plans) == 4 and all(2 <= len(p.transcript.split()) <= 7 for p in plans)
    assert not list((tmp_path / "prep").rglob("*.wav"))  # audio is built on the fly
    (transcript,) = trained_model(cfg).label([fsdd_recordings / "3_theo_0.wav"])
    assert set(transcript) <= set("abcdefghijklmnopqrstuvwxyz' ")


def test_connected_digits_speaker_id_run_reports_accuracy(tmp_path, fsdd_root, fsdd_recordings):
    cfg = compose_config(
        [
            *FAST,
            "model=xvector",
            f"data.root={fsdd_root}",
            "data=fsdd_connected",
            f"data.prepared_dir={tmp_path / 'prep'}",
            f"output_dir={tmp_path / 'run'}",
            "data.num_train=24",
            "data.num_valid=4",
            "data.num_test=4",
        ]
    )
    results = train(cfg)
    assert results["task"] == "speaker" and 0 <= results["test_metrics"]["accuracy"] <= 100
    (speaker,) = trained_model(cfg).label([fsdd_recordings / "3_theo_0.wav"])
    assert speaker in json.loads((tmp_path / "run" / "labels.json").read_text())["speakers"]


@pytest.mark.slow  # Conformer-M (25.6 M parameters), 200 steps: ~5 min on 2 cores
def test_conformer_m_leaves_the_ctc_plateau_within_its_warm_up(tmp_path, fsdd_root):
    """``model=conformer_ctc_m`` as ``experiment=gpu_asr`` trains it: after 200 steps of its
    warm-up, validation CER is far below the plateau where a CTC model knows only the
    label prior (CER ~65 %, every word "five"). At the former peak lr of 1e-3 every
    precision stayed there for 1500 steps on an H200, and so did CPU runs with 200-s and
    60-s batches (loss ~2.1 after 210 steps); at 5e-4 both batch sizes leave it within
    ~150 steps (benchmarks/results/2026-11-26-h200.md) in some batch orders: with 200-s
    batches seed 1's order stayed there past step 140, so the preset's first epoch now goes
    shortest bucket first (data.ascending_epochs=1, SortaGrad; 2026-11-27-h200-evening.md)."""
    cfg = compose_config(
        [
            "experiment=gpu_asr",
            "device=cpu",
            "device.num_workers=0",
            "fast_path=none",  # the same batches, eager (the fast path is a CUDA thing)
            "data.pad_to_buckets=true",
            "precision=fp32",
            f"data.root={fsdd_root}",
            f"data.prepared_dir={tmp_path / 'prep'}",
            f"output_dir={tmp_path / 'run'}",
            "data.num_train=10000",  # the schedule of a real run: 200 steps stay in warm-up
            "data.max_batch_seconds=60",  # CPU-sized batches
            "data.num_valid=100",
            "data.num_test=20",
            "trainer.debug=true",
            "trainer.debug_batches=200",
            "trainer.debug_epochs=1",
            "trainer.noprogressbar=true",
            "model.decoder=greedy",
        ]
    )
    results = train(cfg)
    assert results["optimizer_steps"] == 200
    assert results["tested_checkpoint"]["valid_metrics"]["CER"] < 45.0, results


def test_manifest_data_trains_on_user_manifests(tmp_path, fsdd_root, prepared_digits):
    for split in ("train", "valid", "test"):
        rows = read_csv(prepared_digits / f"{split}.csv")[:12]
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            for row in rows:
                row["path"] = str((prepared_digits / row["path"]).resolve())
                writer.writerow(row)
    splits = {s: tmp_path / f"{s}.csv" for s in ("train", "valid", "test")}
    cfg = manifest_config(splits, tmp_path / "run")
    assert train(cfg)["data"] == "manifest"


def test_rerun_resumes_and_extends(tmp_path, fsdd_root, prepared_digits):
    first = train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=1", "trainer.epochs=1")
    )
    assert first["optimizer_steps"] == 2
    again = train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=2", "trainer.epochs=2")
    )
    assert again["optimizer_steps"] == 4  # one more epoch, not two


def test_a_finished_run_trained_further_keeps_its_earlier_record(
    tmp_path, fsdd_root, prepared_digits
):
    """Raising the epochs of a finished run wrote the longer run's results.json,
    test_errors.md and config over the earlier ones: the first epochs' figures were lost."""
    run = tmp_path / "run"
    first = train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=1", "trainer.epochs=1")
    )
    names = ["results.json", "test_errors.md", "config_resolved.yaml", "labels.json", "env.txt"]
    before = {name: (run / name).read_bytes() for name in names}
    again = train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=2", "trainer.epochs=2")
    )
    assert again["epochs_completed"] == 2 and first["epochs_completed"] == 1
    kept = run / "earlier" / "finished_1_epochs"
    assert {name: (kept / name).read_bytes() for name in names} == before
    assert RunResults.read(run / "results.json").completed_epochs == 2
    assert [p.name for p in (run / "earlier").iterdir()] == ["finished_1_epochs"]
    # A finished run run again changes nothing, its earlier record included.
    record = snapshot(run)
    train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=2", "trainer.epochs=2")
    )
    assert snapshot(run) == record


def test_an_interrupted_longer_session_keeps_one_copy_of_the_earlier_record(tmp_path):
    """The session that trains a finished run further, killed after it wrote its configs and
    resumed, finds the copy made first (the record is known by its results.json): no second
    one holding the longer run's configs. Another record of as many epochs gets a folder of
    its own."""
    from recipes.run_folder import keep_finished_record

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    RunResults(epochs_completed=3, test_metrics={"CER": 1.0}).write(run / "results.json")
    (run / ".hydra" / "config.yaml").write_text("a: 1\n")
    (run / "config_resolved.yaml").write_text("a: 1\n")
    kept = keep_finished_record(run, ".hydra")
    assert kept == run / "earlier" / "finished_3_epochs"
    assert (kept / ".hydra" / "config.yaml").read_text() == "a: 1\n"
    assert (kept / "results.json").read_bytes() == (run / "results.json").read_bytes()
    assert keep_finished_record(run, ".hydra") == kept
    # The longer session accepted (its configs written), then killed: the same record.
    (run / "config_resolved.yaml").write_text("a: 2\n")
    (run / ".hydra" / "config.yaml").write_text("a: 2\n")
    assert keep_finished_record(run, ".hydra") == kept
    assert (kept / "config_resolved.yaml").read_text() == "a: 1\n"
    assert (kept / ".hydra" / "config.yaml").read_text() == "a: 1\n"
    # Another record of as many epochs (a debug run's, its results rewritten): its own copy.
    RunResults(epochs_completed=3, test_metrics={"CER": 2.0}).write(run / "results.json")
    assert keep_finished_record(run, ".hydra") == run / "earlier" / "finished_3_epochs_2"
    assert (kept / "results.json").read_bytes() != (run / "results.json").read_bytes()
    assert sorted(p.name for p in (run / "earlier").iterdir()) == [
        "finished_3_epochs",
        "finished_3_epochs_2",
    ]
    assert keep_finished_record(tmp_path / "never_finished", ".hydra") is None


def test_a_copy_of_the_earlier_record_that_fails_leaves_nothing(tmp_path, monkeypatch):
    from recipes import run_folder

    run = tmp_path / "run"
    run.mkdir()
    RunResults(epochs_completed=1).write(run / "results.json")

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(run_folder.os, "rename", full_disk)
    with pytest.raises(
        ConfigError, match=r"Cannot keep the record of this run's first 1 epoch\(s\)"
    ):
        run_folder.keep_finished_record(run, ".hydra")
    assert list((run / "earlier").iterdir()) == []


def test_results_describe_the_whole_run_over_sessions(
    tmp_path, fsdd_root, prepared_digits, monkeypatch
):
    """Wall and training time add up over sessions; the peak memory is the highest one."""
    fit_batch = AudioBrain.fit_batch

    def slow_and_big(self, batch):  # session 1 only: +1 s and +300 MB per batch
        ballast = torch.ones(300 * 2**20 // 4)
        time.sleep(0.5)
        del ballast
        return fit_batch(self, batch)

    monkeypatch.setattr(AudioBrain, "fit_batch", slow_and_big)
    first = train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=1", "trainer.epochs=1")
    )
    monkeypatch.undo()
    assert first["sessions"] == 1 and first["throughput"]["train_time_s"] >= 1.0
    session_start = time.time()
    second = train(
        fast_cfg(tmp_path, fsdd_root, prepared_digits, "trainer.debug_epochs=2", "trainer.epochs=2")
    )
    session = time.time() - session_start
    assert second["sessions"] == 2 and second["optimizer_steps"] == 4
    train_time = second["throughput"]["train_time_s"]
    assert train_time > first["throughput"]["train_time_s"]  # both sessions' training
    assert second["wall_time_s"] >= session + 1.0 - 0.2  # + the first session's slow batches
    assert train_time <= second["wall_time_s"]
    assert second["peak_memory_mb"] >= first["peak_memory_mb"] > 300


@pytest.mark.parametrize("epochs", ["trainer.epochs=2", "trainer.epochs=30"])
def test_in_process_rerun_of_a_finished_run_returns_its_results(
    tmp_path, fsdd_root, prepared_digits, epochs, capsys, monkeypatch
):
    """A debug run finishes after its debug_epochs (2) whatever trainer.epochs says: with
    more epochs configured (30, the default), a rerun trained two more and rewrote it."""
    cfg = fast_cfg(tmp_path, fsdd_root, prepared_digits, epochs)
    first = train(cfg)
    assert first["epochs_completed"] == 2
    before = snapshot(tmp_path / "run")
    capsys.readouterr()
    assert train(cfg) == json.loads(json.dumps(first))
    assert snapshot(tmp_path / "run") == before
    key = "trainer.epochs" if epochs == "trainer.epochs=2" else "trainer.debug_epochs"
    assert f"To train it further, raise {key} (e.g. {key}=3)" in capsys.readouterr().out
    # Under DDP every rank finds the run finished: the line comes from rank 0 alone (it was
    # printed once per rank); the other ranks get the same results.
    monkeypatch.setenv("RANK", "1")
    assert train(cfg) == json.loads(json.dumps(first))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["+trainer.epohcs=3"], r"trainer.epohcs is not a config key.*Did you mean trainer.epochs"),
        (["model=xvector", "+model.dropot=0.1"], r"model.dropot is not a .*Valid model keys: ch"),
        # a key of another option names it (Hydra's "+model.d_model" advice led here)
        (
            ["model=xvector", "+model.d_model=64"],
            r"model.d_model is a key of model=conformer_ctc and model=conformer_ctc_m, not of "
            r"this run's model=xvector: choose that option "
            r"\(model=conformer_ctc model.d_model=...\)",
        ),
        (["+data.num_train=9"], r"data.num_train is a key of data=fsdd_connected, not of"),
        (["+data.features.nmels=20"], r"data.features.nmels .*Did you mean data.features.n_mels"),
        (["+seeed=3"], r"seeed is not a config key.*Valid top-level keys: data, device, model"),
    ],
)
def test_keys_the_recipe_does_not_use_are_refused(tmp_path, overrides, message):
    cfg = compose_config([*FAST, *overrides, f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=message) as err:
        train(cfg)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists()


def test_resume_with_another_precision_drops_the_loss_scaler(
    tmp_path, fsdd_root, prepared_digits, caplog
):
    """Documented behaviour: precision may change on resume; fp16's scaler state is dropped."""
    train(
        fast_cfg(
            tmp_path,
            fsdd_root,
            prepared_digits,
            "precision=fp16",
            "trainer.debug_epochs=1",
            "trainer.epochs=1",
        )
    )
    resumed = train(
        fast_cfg(
            tmp_path,
            fsdd_root,
            prepared_digits,
            "precision=bf16",
            "trainer.debug_epochs=2",
            "trainer.epochs=2",
        )
    )
    assert (
        resumed["precision"] == "bf16"
        and resumed["optimizer_steps"] + resumed["skipped_steps"] == 4
    )
    assert "fp16 loss scaler state is dropped" in caplog.text


def cli_args(prepared: Path, run_dir: Path, *extra: str) -> list[str]:
    """The command line of the CLI run (two debug epochs, then it has finished)."""
    return [
        *FAST,
        "trainer.epochs=2",
        "data.download=false",
        f"data.prepared_dir={prepared}",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]


@pytest.fixture(scope="session")
def cli_run(fsdd_root, prepared_digits, tmp_path_factory) -> Path:
    """One real, finished ``recipes/train.py`` run (ASR, fp32) in its own folder."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    result = run_cli("train.py", cli_args(prepared_digits, run_dir), fsdd_root)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file's bytes (None for folders) below ``folder``, by relative path."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def test_cli_run_folder_holds_everything(cli_run, fsdd_root):
    for name in (
        ".hydra/config.yaml",
        ".hydra/hydra.yaml",
        ".hydra/overrides.yaml",
        "config_resolved.yaml",
        "train.log",
        "env.txt",
        "results.json",
        "labels.json",
        "test_errors.md",
        "checkpoints",
        "tb",
    ):
        assert (cli_run / name).exists(), name
    assert "test:" in (cli_run / "train.log").read_text()
    assert "epochs=2" in (cli_run / ".hydra" / "overrides.yaml").read_text()
    resolved = (cli_run / "config_resolved.yaml").read_text()
    assert "${" not in resolved and f"root: {fsdd_root}" in resolved
    assert f"output_dir: {cli_run}" in resolved


def test_every_file_of_a_run_folder_is_described_in_run_outputs_md(cli_run):
    """docs/run_outputs.md's "The run folder" lists what a run folder holds; a file the run
    writes that the list does not name (``run_overrides.yaml`` was missing) leaves users to
    guess whether it may be deleted."""
    from tests.conftest import REPO_ROOT

    page = (REPO_ROOT / "docs" / "run_outputs.md").read_text()
    section = page.split("## The run folder", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`/]+)/?[^`]*`", section))
    written = {entry.name for entry in cli_run.iterdir()}
    assert written - named == set(), f"not described in docs/run_outputs.md: {written - named}"


def test_rerunning_a_finished_run_changes_nothing(cli_run, fsdd_root, prepared_digits):
    before = snapshot(cli_run)
    result = run_cli("train.py", cli_args(prepared_digits, cli_run), fsdd_root)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "finished" in result.stdout and str(cli_run / "results.json") in result.stdout
    assert "trainer.epochs" in result.stdout  # how to train it further
    assert snapshot(cli_run) == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Refused before any work, by the config check.
        (["trainer.epochs=0"], "trainer.epochs=0 is not valid"),
        # Refused after Hydra has composed the run and the data step has begun.
        (
            [
                "trainer.epochs=3",
                "trainer.debug_epochs=3",
                "data.root=/nowhere",
            ],
            "FSDD v1.0.10 recordings not found",
        ),
    ],
    ids=["bad_value", "missing_data"],
)
def test_refused_command_leaves_a_finished_run_untouched(
    cli_run, fsdd_root, tmp_path, extra, message
):
    """Its .hydra/*.yaml, train.log and every other file stay byte-identical."""
    before = snapshot(cli_run)
    prepared = tmp_path / "prepared"  # empty: the missing data case must look for FSDD
    result = run_cli("train.py", cli_args(prepared, cli_run, *extra), fsdd_root)
    assert result.returncode == 1
    assert result.stderr.count("error:") == 1 and message in result.stderr
    assert "error" not in result.stdout.lower()  # printed once
    assert snapshot(cli_run) == before


class _StateHolder:
    """A recoverable that saves a given state dict (to write a crafted checkpoint)."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def plant_letter_model(run: Path, letter: str, runners_up: str = "") -> None:
    """Leave the run one best checkpoint: its own weights, but an output layer that scores
    ``letter`` highest on every frame (so greedy CTC decoding reads exactly ``letter``) and
    each of ``runners_up`` second (what a lexicon search may spell a word with).

    The two debug epochs of the CLI run leave a model that may well transcribe nothing;
    this makes the expected transcript known and non-empty.
    """
    checkpoints = Checkpointer(run / "checkpoints")
    best = checkpoints.find_checkpoint(min_key="CER")
    state = read_state(best.path / "state.pt")["state"]
    weights = state["module.model"]
    weights["output.weight"].zero_()
    weights["output.bias"].fill_(-10.0)
    weights["output.bias"][CharTokenizer().encode(letter)[0]] = 10.0
    for other in CharTokenizer().encode(runners_up):
        weights["output.bias"][other] = 5.0
    for ckpt in checkpoints.list_checkpoints():
        shutil.rmtree(ckpt.path)
    planted = Checkpointer(run / "checkpoints", {k: _StateHolder(v) for k, v in state.items()})
    planted.save_checkpoint(meta={**best.meta, "CER": 0.0})  # the rest of the run's state


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_transcribe_prints_a_transcript_per_file(cli_run, fsdd_recordings, precision, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    plant_letter_model(run, "z", runners_up="ero")
    wavs = [fsdd_recordings / "3_theo_0.wav", fsdd_recordings / "7_george_1.wav"]
    result = run_cli(
        "transcribe.py",
        [str(run), *map(str, wavs), "--precision", precision, "--device", "cpu"],
        fsdd_recordings,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split("\t") for line in result.stdout.rstrip("\n").split("\n")]
    assert [row[0] for row in rows] == [str(w) for w in wavs]
    assert all(set(row[1]) <= set("abcdefghijklmnopqrstuvwxyz' ") for row in rows)
    # The checkpoint's model, decoded by the run's lexicon decoder: every frame says "z"
    # (then e, r, o), and a known word must come out: "zero", not the best path "z".
    assert [row[1] for row in rows] == ["zero", "zero"]


def test_transcribe_decodes_greedily_when_the_run_did(cli_run, fsdd_recordings, tmp_path):
    """``model.decoder=greedy`` (and runs from before the lexicon decoder) spell freely."""
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    plant_letter_model(run, "z", runners_up="ero")
    config = run / ".hydra" / "config.yaml"
    config.write_text(config.read_text().replace("decoder: lexicon", "decoder: greedy"))
    wav = str(fsdd_recordings / "3_theo_0.wav")
    result = run_cli("transcribe.py", [str(run), wav, "--device", "cpu"], fsdd_recordings)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\t")[1].strip() == "z"


def test_evaluate_recomputes_the_runs_test_and_writes_nothing_there(cli_run) -> None:
    before = snapshot(cli_run)
    saved = json.loads((cli_run / "results.json").read_text())
    result = evaluate_run(cli_run)
    assert result["precision"] == saved["eval_precision"] == "fp32"  # what it computed in
    assert result["metrics"] == pytest.approx(saved["test_metrics"], rel=1e-6)
    assert result["tested_checkpoint"] == saved["tested_checkpoint"]
    # The run's valid_metrics are the tested weights' (an average of 2 checkpoints here).
    assert saved["valid_metrics_of"] == "averaged_checkpoints"
    valid = evaluate_run(cli_run, split="valid")
    assert valid["metrics"] == pytest.approx(saved["valid_metrics"], rel=1e-6)
    assert snapshot(cli_run) == before


def test_evaluate_re_tests_a_run_from_before_the_newest_options(cli_run, tmp_path) -> None:
    """A run folder written before ``model.valid_decoder`` and ``trainer.checkpoint_writes``
    existed (its saved config lacks them) is re-tested as it was, not refused."""
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    resolved = run / "config_resolved.yaml"
    lines = resolved.read_text().splitlines(keepends=True)
    old = [line for line in lines if not re.match(r"\s*(valid_decoder|checkpoint_writes):", line)]
    assert len(old) == len(lines) - 2
    resolved.write_text("".join(old))
    saved = json.loads((run / "results.json").read_text())
    result = evaluate_run(run)
    assert result["metrics"] == pytest.approx(saved["test_metrics"], rel=1e-6)


def test_evaluate_rescores_with_another_decoder(cli_run, fsdd_recordings, tmp_path) -> None:
    """Every frame says "z" (then e, r, o): the lexicon decoder reads "zero" everywhere (right
    for the 30 zeros of the 300 test digits), greedy decoding "z" (never right)."""
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    plant_letter_model(run, "z", runners_up="ero")
    before = snapshot(run)
    whole_test = "trainer.debug=false"  # the CLI run tested 2 batches only (debug)
    lexicon = evaluate_run(run, ["model.decoder=lexicon", whole_test])
    assert lexicon["metrics"]["WER"] == pytest.approx(90.0)
    # The error report: 270 wrong, 45 of each speaker's 50, every digit heard as "zero".
    report = lexicon["errors"].splitlines()
    assert "270 of 300 utterances wrong (90.00 %)." in report
    assert "| george | 50 | 45 | 90.00 |" in report
    assert sum(line.startswith("| ") and " | zero | 30 | " in line for line in report) == 9
    out = tmp_path / "greedy.json"
    errors = tmp_path / "errors.md"
    args = [str(run), "model.decoder=greedy", whole_test, "--json", str(out)]
    result = run_cli("evaluate.py", [*args, "--errors", str(errors)], fsdd_recordings)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "WER 100.00 %" in result.stdout
    assert "300 of 300 utterances wrong" in errors.read_text()  # greedy: "z" every time
    assert "errors" not in json.loads(out.read_text())
    assert json.loads(out.read_text())["metrics"]["WER"] == pytest.approx(100.0)
    assert snapshot(run) == before  # the run folder is not written
    again = run_cli("evaluate.py", args, fsdd_recordings)  # the result file is not rewritten
    assert again.returncode == 2 and "exists" in again.stderr
    typo = run_cli("evaluate.py", [str(run), "model.decodr=greedy"], fsdd_recordings)
    assert typo.returncode == 2 and "model.decodr is not a key" in typo.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_transcribe_errors_give_its_own_flags(cli_run, fsdd_recordings):
    wav = str(fsdd_recordings / "3_theo_0.wav")
    result = run_cli("transcribe.py", [str(cli_run), wav, "--device", "cuda"], fsdd_recordings)
    assert result.returncode == 2 and result.stderr.count("error:") == 1
    assert "--device cpu" in result.stderr and "device=cpu" not in result.stderr


def test_transcribe_labels_the_readable_files_and_names_each_bad_one(
    cli_run, fsdd_recordings, tmp_path
):
    """One bad file among several (missing, a folder, not audio) printed no label at all,
    only the first bad file's error: the good files are labelled, every bad one is named,
    and the exit status says that not everything was labelled."""
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("not audio")
    good = [str(fsdd_recordings / "3_theo_0.wav"), str(fsdd_recordings / "7_george_1.wav")]
    bad = [str(tmp_path / "missing.wav"), str(tmp_path), str(not_audio)]
    files = [good[0], *bad, good[1]]
    result = run_cli("transcribe.py", [str(cli_run), *files, "--device", "cpu"], fsdd_recordings)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert [line.split("\t")[0] for line in result.stdout.splitlines()] == good
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3
    for path, error in zip(bad, errors, strict=True):
        assert f" {path}" in error and error.endswith(
            "Fix: pass a readable audio file (wav, flac, ...)."
        )
    assert "it is a folder" in errors[1]


def test_transcribe_labels_many_files_in_batches_of_the_runs_budget(
    cli_run, fsdd_recordings, monkeypatch
):
    """All files went through the model as one padded batch: a folder of recordings with
    one long file padded every file to its length (a 60-s file among 3,000 digits asks
    the Conformer's attention for ~100 GB). Files are labelled shortest first in batches of
    at most ``data.max_batch_seconds`` padded seconds, and each label comes back to its
    file."""
    from recipes import inference
    from recipes.inference import load_trained

    trained = load_trained(cli_run, device="cpu")
    budget = 3.0
    trained.cfg.data.max_batch_seconds = budget
    rate = trained.cfg.data.sample_rate

    class FrameCounts:  # each file's label: its output frames (tells the files apart)
        @staticmethod
        def predict(outputs, labels):
            return [str(int(n)) for n in outputs[1]]

    monkeypatch.setattr(inference.TrainedModel, "task", property(lambda self: FrameCounts))
    padded: list[float] = []
    trained.features.register_forward_hook(
        lambda module, args, out: padded.append(args[0].shape[0] * args[0].shape[1] / rate)
    )
    files = sorted(fsdd_recordings.glob("*_jackson_1*.wav"))[:3]
    files += sorted(fsdd_recordings.glob("*_theo_2*.wav"))[:3]
    files += sorted(fsdd_recordings.glob("*_yweweler_3*.wav"))[:3]
    alone = [trained.label([path])[0] for path in files]
    padded.clear()

    together = trained.label(files)

    assert together == alone  # each file's own label, in the order given
    assert len(padded) > 1 and all(seconds <= budget for seconds in padded), padded
    assert len(set(alone)) > 1  # the files differ in length: the order is checked


def test_transcribe_warns_about_a_file_far_longer_than_the_training_audio(
    cli_run, fsdd_recordings, tmp_path
):
    """A 60-s recording given to the single-digit model (trained on clips of 0.16-2.28 s) was
    labelled without a word: one warning line names the file, its duration and the training
    range (``labels.json``; for runs from before, the training manifest)."""
    import soundfile

    digit = str(fsdd_recordings / "3_theo_0.wav")
    wav, rate = soundfile.read(digit, dtype="float32")
    long_file = tmp_path / "minute.wav"
    soundfile.write(long_file, wav.repeat(1 + 60 * rate // len(wav))[: 60 * rate], rate)
    record = json.loads((cli_run / "results.json").read_text())["dataset"]["splits"]["train"]
    shortest, longest = record["min_seconds"], record["max_seconds"]
    assert 0 < shortest < longest < 3
    assert json.loads((cli_run / "labels.json").read_text())["train_seconds"] == [
        shortest,
        longest,
    ]
    result = run_cli("transcribe.py", [str(cli_run), digit, str(long_file)], fsdd_recordings)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [line.split("\t")[0] for line in result.stdout.splitlines()] == [digit, str(long_file)]
    warnings = [line for line in result.stderr.splitlines() if "training audio" in line]
    assert warnings == [
        f"{long_file} holds 60.0 s of audio, far longer than the model's training audio "
        f"({shortest:.2f}-{longest:.2f} s): its label may be wrong. Fix: cut it into clips "
        "of the training lengths."
    ]
    # A run from before labels.json recorded the range: its training manifest gives it.
    older = tmp_path / "older_run"
    shutil.copytree(cli_run, older)
    labels = json.loads((older / "labels.json").read_text())
    del labels["train_seconds"]
    (older / "labels.json").write_text(json.dumps(labels))
    assert load_trained(older, device="cpu").train_seconds == pytest.approx(
        (shortest, longest), abs=1e-3
    )


def test_transcribe_says_a_clip_is_too_short_in_one_line(cli_run, fsdd_recordings, tmp_path):
    """16 ms of audio gives the subsampling fewer frames than its kernel (a traceback)."""
    import soundfile

    clip = tmp_path / "click.wav"
    soundfile.write(clip, torch.zeros(129).numpy(), 8000)
    result = run_cli("transcribe.py", [str(cli_run), str(clip)], fsdd_recordings)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: {clip} holds 16 ms of audio, too short" in result.stderr


def test_transcribe_refuses_a_checkpoint_that_would_run_code(cli_run, fsdd_recordings, tmp_path):
    from tests.test_checkpoint import plant_code_running_checkpoint

    run = tmp_path / "shared_run"  # a run folder someone passed around
    shutil.copytree(cli_run, run)
    marker = tmp_path / "pwned"
    best = Checkpointer(run / "checkpoints").find_checkpoint(min_key="CER")
    for ckpt in Checkpointer(run / "checkpoints").list_checkpoints():
        if ckpt.path != best.path:
            shutil.rmtree(ckpt.path)  # the planted one is then the one transcribe loads
    plant_code_running_checkpoint(run / "checkpoints", marker)
    wav = str(fsdd_recordings / "3_theo_0.wav")
    result = run_cli("transcribe.py", [str(run), wav, "--device", "cpu"], fsdd_recordings)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "error: Refused to load" in result.stderr and "weights_only" in result.stderr
    assert not marker.exists()


def test_transcribe_labels_in_the_precision_the_run_was_tested_in(cli_run, tmp_path):
    """Without ``--precision``, the run's tested precision (``results.json``), so labels come
    out as the test figures were computed; it was fp32 whatever the run used."""
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    assert load_trained(run, device="cpu").amp.name == "fp32"
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps({**results, "eval_precision": "bf16"}))
    assert load_trained(run, device="cpu").amp.name == "bf16"
    assert load_trained(run, device="cpu", precision="fp32").amp.name == "fp32"
    (run / "results.json").unlink()  # a run that never finished: fp32
    assert load_trained(run, device="cpu").amp.name == "fp32"


def test_labelling_in_a_precision_this_cpu_emulates_warns(cli_run, tmp_path, monkeypatch, caplog):
    """A run tested in bf16 (e.g. on a GPU) labels in bf16 by default; on a CPU that
    emulates it (2-10x slower than fp32) that now says so, with the flag to use instead."""
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    results = json.loads((run / "results.json").read_text())
    (run / "results.json").write_text(json.dumps({**results, "eval_precision": "bf16"}))
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    monkeypatch.setattr("amp_utils.precision._warned", set())
    with caplog.at_level(logging.WARNING):
        assert load_trained(run, device="cpu").amp.name == "bf16"
    assert "--precision=bf16 on a CPU without AVX512-BF16" in caplog.text
    assert "Use --precision=fp32" in caplog.text
    caplog.clear()
    monkeypatch.setattr("amp_utils.precision._warned", set())
    with caplog.at_level(logging.WARNING):
        load_trained(run, device="cpu", precision="fp32")
    assert "emulates" not in caplog.text


def test_an_unfinished_run_says_so_and_one_without_a_whole_epoch_is_refused(
    cli_run, fsdd_recordings, tmp_path, caplog
):
    """A run killed mid-training was labelled and re-tested without a word that its
    weights are not the final model's; one killed in its first epoch (only a mid-epoch
    checkpoint) was re-tested on that checkpoint as "the best by validation CER" while
    transcribe.py said only "No checkpoint to average"."""
    with caplog.at_level(logging.WARNING):
        load_trained(cli_run, device="cpu")
    assert "not finished" not in caplog.text  # a finished run: no note
    run = tmp_path / "run"
    shutil.copytree(cli_run, run)
    (run / "results.json").unlink()
    with caplog.at_level(logging.WARNING):
        load_trained(run, device="cpu")
        evaluate_run(run)
    note = (
        f"{run} has not finished training (no results.json): using its checkpoints so far "
        "(newest whole epoch: 2), not its final model."
    )
    assert caplog.text.count(note) == 2
    for meta in run.glob("checkpoints/CKPT+*/meta.json"):  # killed in its first epoch
        meta.write_text(json.dumps({**json.loads(meta.read_text()), "end_of_epoch": False}))
    wav = str(fsdd_recordings / "3_theo_0.wav")
    for script, args in (("transcribe.py", [str(run), wav]), ("evaluate.py", [str(run)])):
        result = run_cli(script, args, fsdd_recordings)
        assert result.returncode == 2 and result.stderr == (
            f"error: {run} has no checkpoint of a whole epoch: its training stopped in its "
            "first epoch. Fix: resume it (run its recipes/train.py command again) until at "
            "least one epoch has ended.\n"
        ), result.stderr[-2000:]


def test_transcribe_precision_auto_works_and_a_wrong_one_is_named(
    cli_run, fsdd_recordings, monkeypatch
):
    """The emulation warning advises ``--precision=auto``, which transcribe.py refused
    ("Specified autocast mode ('auto') incorrect"); a misspelled precision now names the
    flag and its choices."""
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset({"bf16"}))
    assert load_trained(cli_run, device="cpu", precision="auto").amp.name == "bf16"
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    assert load_trained(cli_run, device="cpu", precision="auto").amp.name == "fp32"
    wav = str(fsdd_recordings / "3_theo_0.wav")
    result = run_cli("transcribe.py", [str(cli_run), wav, "--precision", "auto"], fsdd_recordings)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"{wav}\t")
    result = run_cli("transcribe.py", [str(cli_run), wav, "--precision", "bf61"], fsdd_recordings)
    assert result.returncode == 2 and result.stderr == (
        "error: --precision bf61 is not valid; choose one of: fp32, fp16, bf16, auto.\n"
    )


@pytest.mark.parametrize("skip_hint", [None, "or drop it from the manifest"])
def test_transcribe_advice_for_a_bad_file_is_about_the_file_given(monkeypatch, tmp_path, skip_hint):
    """Audio errors are written for a dataset (re-run data preparation, data.skip_bad_files);
    transcribe's user passed the file. The advice follows the error's type, not its wording
    (it matched the text 'data.skip_bad_files': a reworded hint kept the dataset's fix)."""
    import data.audio
    from recipes.transcribe import as_transcribe_advice

    if skip_hint:
        monkeypatch.setattr(data.audio, "_SKIP_HINT", skip_hint)
    bad = tmp_path / "a.wav"
    bad.write_bytes(b"not audio at all")
    for path in (bad, tmp_path / "missing.wav"):
        with pytest.raises(data.audio.AudioError) as caught:
            data.audio.load_audio(path, 8000)
        advice = as_transcribe_advice(caught.value)
        assert advice.startswith(("Bad audio file", "Audio file not found")) and str(path) in advice
        assert "skip_bad_files" not in advice and "data preparation" not in advice
        assert "manifest" not in advice and "data.root" not in advice
        assert advice.endswith("Fix: pass a readable audio file (wav, flac, ...).")
    assert as_transcribe_advice(ValueError("use device=cpu")) == "use --device cpu"


def test_transcribe_rejects_a_folder_that_is_not_a_run(tmp_path, fsdd_recordings):
    result = run_cli(
        "transcribe.py", [str(tmp_path), str(fsdd_recordings / "3_theo_0.wav")], fsdd_recordings
    )
    assert result.returncode == 2
    assert "not a training run folder" in result.stderr
    missing = run_cli("transcribe.py", ["no_such_run", "a.wav"], fsdd_recordings)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "error: no_such_run does not exist (relative paths are read from" in missing.stderr


def test_a_failed_sweep_job_ends_alone_and_the_summary_lists_it(
    fsdd_root, prepared_digits, tmp_path
):
    """Two jobs refused when their data are prepared (speakers FSDD does not have), one that
    trains: the sweep runs all three, writes the table with the failures in it, and exits
    with status 1 naming them; each failed job's train.log says why. (A job that crashes
    goes the same way: test_a_crashed_sweep_job_returns_nan_and_logs_its_traceback. A value
    the config check refuses in every job, such as trainer.epochs=0, fails the sweep before
    any job: test_a_bad_value_in_a_sweep_list_fails_before_any_job_trains.)"""
    sweep = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        [
            "-m",
            "data.test_speakers=[nobody],[theo],[somebody]",
            *FAST,
            "trainer.debug_epochs=1",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"hydra.sweep.dir={sweep}",
        ],
        fsdd_root,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    rows = {r["run"]: r["status"] for r in read_csv(sweep / "summary.csv")}
    names = ["0_data.test_speakers=[nobody]", "2_data.test_speakers=[somebody]"]
    trained = "1_data.test_speakers=[theo]"
    assert rows == {**dict.fromkeys(names, "failed"), trained: "ok"}
    assert (sweep / trained / "results.json").is_file()
    assert "2 of 3 sweep jobs failed" in result.stderr
    for name, speaker in zip(names, ["nobody", "somebody"], strict=True):
        assert f"names ['{speaker}'], not FSDD speakers" in (sweep / name / "train.log").read_text()


def one_epoch_fp32_sweep(prepared: Path, sweep: Path) -> list[str]:
    """The arguments of a one-job fp32 sweep of one debug epoch into ``sweep``."""
    return [
        "-m",
        "precision=fp32",
        *FAST,
        "trainer.epochs=1",
        "trainer.debug_epochs=1",
        f"data.prepared_dir={prepared}",
        f"hydra.sweep.dir={sweep}",
    ]


def test_check_run_overrides_compares_values_and_their_kind(tmp_path):
    """~key is not key=null, true is not 1; 1e-3 is 0.001; a run trained from code (no
    overrides recorded: results.json's overrides null) is not checked."""
    from recipes.run_overrides import RUN_OVERRIDES_FILE, check_run_overrides

    def record(*overrides: str) -> None:
        OmegaConf.save(OmegaConf.create(list(overrides)), tmp_path / RUN_OVERRIDES_FILE)

    record("model.lr=1e-3", "trainer.compile=true", "~data.test_speakers")
    check_run_overrides(
        tmp_path, ["model.lr=0.001", "trainer.compile=true", "~data.test_speakers"], []
    )
    for changed, shown in (
        ("trainer.compile=1", "trainer.compile: True there, 1 now"),
        ("data.test_speakers=null", "data.test_speakers: deleted there, None now"),
    ):
        now = ["model.lr=0.001", "trainer.compile=true", "~data.test_speakers"]
        now = [o for o in now if o.split("=")[0].lstrip("~") != changed.split("=")[0]]
        with pytest.raises(ConfigError, match=re.escape(shown)):
            check_run_overrides(tmp_path, [*now, changed], [])
    (tmp_path / RUN_OVERRIDES_FILE).unlink()
    (tmp_path / "results.json").write_text(json.dumps({"overrides": None}))
    check_run_overrides(tmp_path, ["model=xvector"], [])  # nothing recorded: not checked


def test_rerunning_a_finished_sweep_changes_no_file(fsdd_root, prepared_digits, tmp_path):
    """The job's train.log gained the "has finished" line and the sweep's HParams event
    file was deleted and written anew under another name. What changes is the sweep's
    bookkeeping: the new multirun's id, and the job's record of its new attempt."""
    sweep = tmp_path / "sweep"
    args = one_epoch_fp32_sweep(prepared_digits, sweep)
    first = run_cli("train.py", args, fsdd_root)
    assert first.returncode == 0, first.stderr[-3000:]
    bookkeeping = (MULTIRUN_ID_FILE, JOB_STATUS_FILE)
    before = {k: v for k, v in snapshot(sweep).items() if not k.endswith(bookkeeping)}
    again = run_cli("train.py", args, fsdd_root)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "has finished" in again.stdout + again.stderr
    assert {k: v for k, v in snapshot(sweep).items() if not k.endswith(bookkeeping)} == before
    multirun = (sweep / MULTIRUN_ID_FILE).read_text().strip()
    (status,) = sweep.glob(f"*/{JOB_STATUS_FILE}")
    assert json.loads(status.read_text())["multirun"] == multirun
    assert json.loads(status.read_text())["status"] == "finished"


def test_a_folder_of_a_run_with_other_overrides_is_neither_resumed_nor_reported(
    fsdd_root, prepared_digits, tmp_path
):
    """A sweep run again into its folder with another fixed value (model.lr): each job
    reported the first sweep's results as its own ("has finished", exit 0), and with more
    epochs it would have resumed the other configuration's checkpoint. A single run into a
    fixed folder the same. Both are refused, naming the key, and leave the run as it was;
    what the folder name leaves out (trainer.epochs) may still change."""
    sweep = tmp_path / "sweep"
    common = one_epoch_fp32_sweep(prepared_digits, sweep)
    common.append("hydra.sweep.subdir=job${hydra.job.num}")  # as swept values would name it
    first = run_cli("train.py", [*common, "model.lr=1e-3"], fsdd_root)
    assert first.returncode == 0, first.stderr[-3000:]
    (job,) = (p.parent for p in sweep.glob("*/results.json"))
    results = json.loads((job / "results.json").read_text())
    checkpoints = snapshot(job / "checkpoints")
    again = run_cli("train.py", [*common, "model.lr=0.002"], fsdd_root)
    assert again.returncode == 1, again.stderr[-3000:]
    assert "model.lr: 0.001 there, 0.002 now" in (job / "train.log").read_text()
    assert json.loads((job / "results.json").read_text()) == results  # the first run's
    assert snapshot(job / "checkpoints") == checkpoints
    assert [row["status"] for row in read_csv(sweep / "summary.csv")] == ["failed"]

    run = sweep / "single"
    single = ["precision=fp32", *FAST, "trainer.epochs=1", "trainer.debug_epochs=1"]
    single += [f"data.prepared_dir={prepared_digits}", f"hydra.run.dir={run}"]
    assert run_cli("train.py", [*single, "model.lr=1e-3"], fsdd_root).returncode == 0
    before = snapshot(run)
    refused = run_cli("train.py", [*single, "model.lr=0.002"], fsdd_root)
    assert refused.returncode == 1 and "model.lr: 0.001 there, 0.002 now" in refused.stderr
    assert snapshot(run) == before
    same = run_cli("train.py", [*single, "model.lr=0.001", "trainer.epochs=2"], fsdd_root)
    assert same.returncode == 0 and "has finished" in same.stdout  # debug_epochs=1 done


def test_a_crashed_sweep_job_returns_nan_and_logs_its_traceback(monkeypatch, caplog):
    """In a sweep a crash (a bug, out of memory) ends its job alone, with the traceback in
    the job's log; outside a sweep it propagates, bad input exits with one line, and a
    signal's TrainingInterrupted ends the sweep too (it is resumed as a whole)."""
    from amp_utils import TrainingInterrupted
    from recipes import sweep_jobs

    def crash() -> float:
        raise RuntimeError("CUDA out of memory")

    def refused() -> float:
        raise ConfigError("trainer.epochs=0 is not valid")

    def interrupted() -> float:
        raise TrainingInterrupted("Run the same command again to resume")

    monkeypatch.setattr(sweep_jobs, "in_single_process_sweep", lambda: True)
    with caplog.at_level(logging.ERROR):
        assert math.isnan(sweep_jobs.run_job(crash))
    assert (
        "This sweep job failed" in caplog.text and "RuntimeError: CUDA out of memory" in caplog.text
    )
    assert math.isnan(sweep_jobs.run_job(refused))
    with pytest.raises(TrainingInterrupted):
        sweep_jobs.run_job(interrupted)
    monkeypatch.setattr(sweep_jobs, "in_single_process_sweep", lambda: False)
    with pytest.raises(RuntimeError, match="out of memory"):
        sweep_jobs.run_job(crash)
    with pytest.raises(SystemExit, match="error: trainer.epochs=0 is not valid"):
        sweep_jobs.run_job(refused)


def hparams_experiment(log_dir: Path):
    """The HParams experiment proto written directly into ``log_dir``."""
    from tensorboard.plugins.hparams import metadata, plugin_data_pb2

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    content = accumulator.SummaryMetadata(metadata.EXPERIMENT_TAG).plugin_data.content
    return plugin_data_pb2.HParamsPluginData.FromString(content).experiment


def test_multirun_over_three_precisions_writes_summary(fsdd_root, prepared_digits, tmp_path):
    sweep = tmp_path / "sweep"
    result = run_cli(
        "train.py",
        [
            "-m",
            "precision=fp32,fp16,bf16",
            *FAST,
            "trainer.debug_epochs=1",
            f"data.prepared_dir={prepared_digits}",
            f"hydra.sweep.dir={sweep}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_csv(sweep / "summary.csv")
    assert sorted(r["precision"] for r in rows) == ["bf16", "fp16", "fp32"]
    assert all(r["status"] == "ok" for r in rows)
    # after 4 steps a model may still say one thing (nothing, or one word) to most
    # utterances, and the table says so
    for row in rows:
        assert re.fullmatch(r'no|(nothing|"[a-z]+") \((5\d|[6-9]\d|100) %\)', row["collapsed to"])
    fp32 = next(r for r in rows if r["precision"] == "fp32")
    assert fp32["speed-up vs fp32"] == "1.00x"
    assert "test CER %" in rows[0] and "test WER %" in rows[0]  # test figures, with units
    markdown = (sweep / "summary.md").read_text()
    assert markdown.count("\n|") >= 4 and "speed-up vs fp32" in markdown
    assert "speed-up vs fp32" in result.stdout + result.stderr  # the table is printed
    # Job folders (TensorBoard's run names) carry what the sweep varies, nothing else.
    job_dirs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert job_dirs == [f"{num}_precision={p}" for num, p in enumerate(["fp32", "fp16", "bf16"])]
    # The sweep folder holds the HParams experiment: precision first, test metrics only.
    experiment = hparams_experiment(sweep)
    assert experiment.hparam_infos[0].name == "precision" and experiment.hparam_infos[0].differs
    assert {m.name.tag for m in experiment.metric_infos} >= {"test/CER_percent", "test/WER_percent"}
    assert not [m for m in experiment.metric_infos if m.name.tag.startswith(("train/", "valid/"))]
