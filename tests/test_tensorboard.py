"""What the TensorBoard event files of a run say, read back without a browser (issue 12).

The browser check of the same things is ``benchmarks/tensorboard_check.py`` (slow test in
``tests/test_tensorboard_ui.py``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.summary.writer import event_file_writer

from amp_utils.run_results import metric_label, metric_tag
from amp_utils.step_ledger import StepInfo, StepLedger
from amp_utils.sweep_keys import override_items, sweep_job_name, swept_keys
from amp_utils.tensorboard import TensorBoardLogger, write_sweep_experiment


def _load(log_dir: Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


class _Recorder:
    """Stands in for TensorBoardLogger: remembers the steps scalars were logged at."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.steps.append(step)


def test_step_scalars_every_n_optimizer_steps_across_epochs() -> None:
    """The interval counts the run's optimizer steps; it does not restart each epoch."""
    recorder = _Recorder()
    ledger = StepLedger(nonfinite_patience=3, tensorboard=recorder, log_interval_steps=10)
    step_info = StepInfo(grad_norm=torch.tensor(1.0), skipped=torch.tensor(False))
    for _epoch in range(3):
        for batch in range(1, 18):  # 17 batches an epoch; Brain.step restarts at 1
            ledger.record(batch, torch.tensor(0.5), step_info, None)
        ledger.flush()
    assert ledger.steps_taken == 51
    assert recorder.steps == [10, 20, 30, 40, 50]


def test_step_interval_counts_optimizer_steps_not_accumulated_batches() -> None:
    """With gradient accumulation, batches without an optimizer step are not counted."""
    recorder = _Recorder()
    ledger = StepLedger(nonfinite_patience=3, tensorboard=recorder, log_interval_steps=2)
    step_info = StepInfo(grad_norm=torch.tensor(1.0), skipped=torch.tensor(False))
    for batch in range(1, 9):  # accumulation factor 2: a step every second batch
        ledger.record(batch, torch.tensor(0.5), step_info if batch % 2 == 0 else None, None)
    ledger.flush()
    assert recorder.steps == [2, 4]


def test_hparams_leave_the_experiment_to_tensorboard(tmp_path: Path) -> None:
    """Session infos only: no experiment summary that would fix the column order by name."""
    logger = TensorBoardLogger(tmp_path / "run")
    logger.log_scalars({"test/accuracy_percent": 90.0}, step=53)
    logger.log_hparams({"precision": "bf16", "compile": False}, ["test/accuracy_percent"])
    logger.close()

    tensors = _load(tmp_path / "run").Tags()["tensors"]
    assert "_hparams_/session_start_info" in tensors
    assert "_hparams_/session_end_info" in tensors
    assert "_hparams_/experiment" not in tensors
    event = _load(tmp_path / "run").Tensors("_hparams_/session_start_info")[0]
    # the plugin's content is the serialized HParamsPluginData of the summary metadata
    metadata = _load(tmp_path / "run").SummaryMetadata("_hparams_/session_start_info")
    data = plugin_data_pb2.HParamsPluginData.FromString(metadata.plugin_data.content)
    assert data.session_start_info.hparams["precision"].string_value == "bf16"
    assert event.step == 0


def _experiment_as_tensorboard_shows_it(logdir: Path):
    """The HParams experiment TensorBoard's own backend builds for ``logdir`` (5 columns)."""
    from tensorboard import context as request_context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(logdir))
    context = backend_context.Context(base_plugin.TBContext(data_provider=provider))
    ctx = request_context.RequestContext()
    return context.experiment_from_metadata(
        ctx,
        "",
        include_metrics=True,
        hparams_run_to_tag_to_content=context.hparams_metadata(ctx, ""),
        data_provider_hparams=None,
        hparams_limit=5,
    )


def test_tensorboard_sorts_the_differing_hparam_first(tmp_path: Path) -> None:
    """TensorBoard's own hparams backend lists ``precision`` (the one that differs) first."""
    for precision in ("fp32", "bf16"):
        logger = TensorBoardLogger(tmp_path / f"precision={precision}" / "tb")
        logger.log_scalars({"test/accuracy_percent": 90.0}, step=4)
        hparams = {"compile": False, "data": "fsdd", "device": "cpu", "epochs": 2}
        logger.log_hparams({**hparams, "lr": 1e-3, "precision": precision}, [])
        logger.close()
    experiment = _experiment_as_tensorboard_shows_it(tmp_path)
    names = [info.name for info in experiment.hparam_infos]
    assert names[0] == "precision", names
    assert experiment.hparam_infos[0].differs
    assert "test/accuracy_percent" in [m.name.tag for m in experiment.metric_infos]


def test_metric_names_carry_units() -> None:
    """Tags and summary columns say that they are test figures and in percent."""
    assert metric_tag("CER") == "test/CER_percent"
    assert metric_tag("accuracy") == "test/accuracy_percent"
    assert metric_tag("loss") == "test/loss"
    assert metric_label("accuracy") == "test accuracy %"
    assert metric_label("loss") == "test loss"


def test_override_items_keep_list_values_whole() -> None:
    assert override_items("a=1,data.test_speakers=[george,jackson],+b=x") == [
        "a=1",
        "data.test_speakers=[george,jackson]",
        "+b=x",
    ]
    assert override_items("") == []


def _write_multirun_yaml(sweep: Path, task: list[str], params: dict | None = None) -> None:
    """A ``multirun.yaml`` as Hydra's basic sweeper saves it (the parts read here)."""
    sweep.mkdir(parents=True, exist_ok=True)
    master = {"hydra": {"overrides": {"task": task}, "sweeper": {"params": params}}}
    OmegaConf.save(OmegaConf.create(master), sweep / "multirun.yaml")


def test_swept_keys_come_from_the_sweeps_master_config(tmp_path: Path) -> None:
    task = ["device=cpu", "model.lr=range(1,3)", "+seed=1,2", "data.test_speakers=[a,b],[c]"]
    _write_multirun_yaml(tmp_path, ["precision=fp32,bf16", *task], {"model.dropout": "0.1,0.2"})
    assert swept_keys(tmp_path) == [
        "precision",
        "model.lr",
        "seed",
        "data.test_speakers",
        "model.dropout",
    ]
    assert swept_keys(tmp_path / "no-sweep-here") == []


def test_sweep_jobs_are_named_by_the_swept_keys_precision_first(tmp_path: Path) -> None:
    """TensorBoard's run list cuts long names: a job is named by what the sweep varies."""
    _write_multirun_yaml(tmp_path, ["device=cpu", "model=xvector", "seed=1,2", "precision=a,b"])
    assert sweep_job_name(str(tmp_path), "device=cpu,model=xvector,precision=bf16,seed=2") == (
        "precision=bf16,seed=2"
    )
    # Without the master config (e.g. the Optuna sweeper): every override, precision first.
    assert sweep_job_name(str(tmp_path / "other"), "device=cpu,+precision=fp16") == (
        "+precision=fp16,device=cpu"
    )
    assert sweep_job_name(str(tmp_path / "other"), "") == ""


def test_sweep_experiment_lists_swept_hparams_first_and_test_metrics_only(tmp_path: Path) -> None:
    """The sweep folder's experiment fixes what the HParams tab shows, in TensorBoard itself."""
    run_dirs = []
    for num, (precision, seed) in enumerate([("fp32", 1), ("bf16", 1), ("fp32", 2)]):
        run_dirs.append(tmp_path / f"{num}_precision={precision},seed={seed}" / "tb")
        logger = TensorBoardLogger(run_dirs[-1])
        logger.log_scalars({"train/loss": 1.0, "test/accuracy_percent": 90.0 + num}, step=4)
        hparams = {"model": "xvector", "data": "fsdd", "device": "cpu", "max_batch_seconds": 60.0}
        logger.log_hparams({"precision": precision, **hparams, "seed": seed}, [])
        logger.close()
    names = write_sweep_experiment(
        tmp_path, run_dirs, ["seed", "precision"], ["test/accuracy_percent"]
    )
    assert names[:2] == ["seed", "precision"] and "model" in names
    # written twice (a re-summarised sweep), read once: the old experiment is replaced
    write_sweep_experiment(tmp_path, run_dirs, ["seed", "precision"], ["test/accuracy_percent"])
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1

    experiment = _experiment_as_tensorboard_shows_it(tmp_path)
    # swept first (TensorBoard orders them by name), the same-for-all ones after
    assert [info.name for info in experiment.hparam_infos][:2] == ["precision", "seed"]
    assert [info.differs for info in experiment.hparam_infos][:3] == [True, True, False]
    assert [m.name.tag for m in experiment.metric_infos] == ["test/accuracy_percent"]
    precision = experiment.hparam_infos[0]
    assert sorted(v.string_value for v in precision.domain_discrete.values) == ["bf16", "fp32"]


def test_reading_the_runs_hparams_prints_no_tensorboard_chatter(tmp_path: Path, caplog) -> None:
    """A sweep's summary reads each job's hparams with TensorBoard's EventAccumulator, whose
    directory watcher logs "No path found after .../events.out.tfevents..." at INFO for
    every job: lines in the sweep's console and log that say nothing (found by
    audit-speaker). Its warnings still come through."""
    import logging

    from amp_utils.tensorboard import session_hparams

    logger = TensorBoardLogger(tmp_path / "tb")
    logger.log_hparams({"precision": "bf16"}, [])
    logger.close()
    caplog.set_level(logging.INFO)
    assert session_hparams(tmp_path / "tb") == {"precision": "bf16"}
    assert not [r for r in caplog.records if r.name.startswith("tensorboard")], caplog.text
    assert logging.getLogger("tensorboard").level == logging.NOTSET  # left as it was


def test_the_ranks_stop_flag_is_read_with_the_batch_and_leaves_the_loss_scale_alone() -> None:
    """DDP: the number of ranks that caught a signal rides with the batch's values; it is
    read at the flush (not before), and the fp16 loss scale beside it still reads right."""
    scales: list[float] = []

    class Scales:
        def log_scalars(self, scalars: dict[str, float], step: int) -> None:
            scales.append(scalars["train/loss_scale"])

    ledger = StepLedger(nonfinite_patience=3, tensorboard=Scales(), log_interval_steps=1)
    step_info = StepInfo(grad_norm=torch.tensor(1.0), skipped=torch.tensor(False))
    ledger.record(1, torch.tensor(0.5), step_info, torch.tensor(1024.0), torch.tensor(0.0))
    ledger.flush()
    assert not ledger.stop_requested
    ledger.record(2, torch.tensor(0.5), step_info, torch.tensor(2048.0), torch.tensor(1.0))
    assert not ledger.stop_requested  # pending: not read yet
    ledger.flush()
    assert ledger.stop_requested and ledger.optimizer_step == 2
    assert scales == [1024.0, 2048.0]


def _regression_session(tmp_path: Path, kill_before: int | None = None, **opts) -> None:
    """One session of a small regression Brain that checkpoints into ``tmp_path/ckpt`` and
    logs each step to ``tmp_path/tb``; ``kill_before``: dies (``StopAfter``) before that
    step, as a killed process would."""
    from torch.utils.data import DataLoader

    from amp_utils import Checkpointer, EpochCounter
    from tests.test_brain import RegressionBrain, dying_before, make_data, make_model, run_opts, sgd

    brain = dying_before(RegressionBrain, kill_before)(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(log_interval_steps=1, **opts),
        checkpointer=Checkpointer(tmp_path / "ckpt"),
        tensorboard=TensorBoardLogger(tmp_path / "tb"),
    )
    try:
        brain.fit(EpochCounter(1), DataLoader(make_data(32), batch_size=4))
    finally:
        brain.tensorboard.close()


def _fresh_writer_counter(monkeypatch) -> None:
    """Both sessions run in this process, likely within one second: their event files then
    sort by TensorBoard's process-wide writer counter, and a reader that loads the resumed
    session's file first (counter 10 before 9) sees its steps before the killed session's.
    A fresh counter keeps the files in the order they were written, as two processes'
    files (another second, another pid) are in a real resume."""
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))


def test_a_resumed_run_has_one_point_per_step(tmp_path: Path, monkeypatch):
    """Killed some steps after its last checkpoint, then resumed: the killed session's
    steps after the checkpoint are superseded (one point per step, the resumed ones), where
    every scalar after the checkpoint used to have two (kill -9 and resume)."""
    from amp_utils import Checkpointer
    from amp_utils.checkpoint import STATE_FILE, read_state
    from tests.test_brain import StopAfter

    _fresh_writer_counter(monkeypatch)
    with contextlib.suppress(StopAfter):
        _regression_session(tmp_path, kill_before=8, ckpt_interval_steps=4)
    newest = Checkpointer(tmp_path / "ckpt").list_checkpoints()[-1]
    saved = read_state(newest.path / STATE_FILE)["state"]["brain"]["optimizer_step"]
    killed_logged = [event.step for event in _load(tmp_path / "tb").Scalars("train/loss")]
    assert max(killed_logged) > saved  # steps after the checkpoint, logged and then lost
    _regression_session(tmp_path, ckpt_interval_steps=4)
    steps = [event.step for event in _load(tmp_path / "tb").Scalars("train/loss")]
    assert steps == list(range(1, 9))


def test_a_run_killed_before_its_first_checkpoint_has_one_point_per_step(
    tmp_path: Path, monkeypatch
):
    """Killed before its first checkpoint (with the default 5-minute interval: any run
    killed in its first minutes), the run starts again from step 1 and logs those steps
    again; the killed session's points stayed beside them, two per step (found by the
    2026-11-28 records audit with a real run: train/loss at steps 1, 2, 3, 1, 2, ...)."""
    from amp_utils import Checkpointer
    from tests.test_brain import StopAfter

    _fresh_writer_counter(monkeypatch)
    with contextlib.suppress(StopAfter):
        _regression_session(tmp_path, kill_before=6)
    assert not Checkpointer(tmp_path / "ckpt").list_checkpoints()
    assert [event.step for event in _load(tmp_path / "tb").Scalars("train/loss")]
    _regression_session(tmp_path)
    steps = [event.step for event in _load(tmp_path / "tb").Scalars("train/loss")]
    assert steps == list(range(1, 9))
