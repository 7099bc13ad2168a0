"""``RunResults``: the one record of results.json that the run and its readers share."""

from __future__ import annotations

import json
from pathlib import Path

from amp_utils.run_results import RunResults, Throughput

#: results.json's keys, in order: users and tests read them by these names.
RESULTS_KEYS = [
    "precision",
    "eval_precision",
    "precision_requested",
    "device",
    "device_name",
    "world_size",
    "distributed_backend",
    "model",
    "task",
    "data",
    "dataset",
    "overrides",
    "test_metrics",
    "test_utterances",
    "collapsed",
    "tested_checkpoint",
    "valid_metrics",
    "valid_metrics_of",
    "throughput",
    "peak_memory_mb",
    "peak_memory_kind",
    "wall_time_s",
    "sessions",
    "epochs",
    "epochs_completed",
    "optimizer_steps",
    "skipped_steps",
    "num_parameters",
    "skipped_files",
    "compile",
    "step_graphs",
    "eval_graphs",
    "torch_version",
]


def test_keys_and_round_trip(tmp_path: Path) -> None:
    results = RunResults(
        precision="bf16",
        model="xvector",
        test_metrics={"accuracy": 99.0, "loss": 0.1},
        throughput=Throughput(train_utterances_per_s=120.0, train_time_s=3.0),
        epochs=2,
        epochs_completed=2,
    )
    data = json.loads(results.to_json())
    assert list(data) == RESULTS_KEYS
    assert list(data["throughput"]) == [
        "train_utterances_per_s",
        "train_audio_seconds_per_s",
        "train_time_s",
        "data_wait_share",
        "warmup_time_s",
        "valid_time_s",
        "epoch_end_time_s",
    ]
    results.write(tmp_path / "results.json")
    assert RunResults.read(tmp_path / "results.json") == results


def test_older_files_missing_keys_take_defaults_and_unknown_keys_are_ignored() -> None:
    old = RunResults.from_json(
        json.dumps({"precision": "fp32", "epochs": 3, "throughput": {"utt": 1}, "new_key": 1})
    )
    assert old.precision == "fp32" and old.world_size == 1 and old.test_metrics == {}
    assert old.completed_epochs == 3  # older files recorded only the planned epochs
    assert old.throughput == Throughput()


def test_the_time_split_says_where_the_wall_time_went() -> None:
    results = RunResults(
        throughput=Throughput(train_time_s=60.0, valid_time_s=20.0, epoch_end_time_s=10.0),
        wall_time_s=100.0,
    )
    assert results.time_split() == (
        "wall time 100.0 s: training 60.0 s (60 %), validation 20.0 s (20 %), epoch ends "
        "(metrics, logs, checkpoints) 10.0 s (10 %), the rest (start-up, test) 10.0 s (10 %)"
    )
    # a run from before the split was recorded says nothing rather than 0 s of validation
    old = RunResults(throughput=Throughput(train_time_s=60.0), wall_time_s=100.0)
    assert old.time_split() is None


def test_a_file_that_is_not_an_object_is_refused() -> None:
    for text in ("[1, 2]", "{not json"):
        try:
            RunResults.from_json(text)
        except ValueError:
            continue
        raise AssertionError(f"{text!r} was accepted")
