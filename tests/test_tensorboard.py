"""What the TensorBoard event files of a run say, read back without a browser (issue 12).

The browser check of the same things is ``benchmarks/tensorboard_check.py`` (slow test in
``tests/test_tensorboard_ui.py``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from amp_utils.run_results import metric_label, metric_tag
from amp_utils.step_ledger import StepInfo, StepLedger
from amp_utils.tensorboard import TensorBoardLogger
from recipes.config import precision_first


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


def test_tensorboard_sorts_the_differing_hparam_first(tmp_path: Path) -> None:
    """TensorBoard's own hparams backend lists ``precision`` (the one that differs) first."""
    from tensorboard import context as request_context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context

    for precision in ("fp32", "bf16"):
        logger = TensorBoardLogger(tmp_path / f"precision={precision}" / "tb")
        logger.log_scalars({"test/accuracy_percent": 90.0}, step=4)
        hparams = {"compile": False, "data": "fsdd", "device": "cpu", "epochs": 2}
        logger.log_hparams({**hparams, "lr": 1e-3, "precision": precision}, [])
        logger.close()
    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(tmp_path))
    multiplexer.Reload()
    provider = data_provider.MultiplexerDataProvider(multiplexer, str(tmp_path))
    context = backend_context.Context(base_plugin.TBContext(data_provider=provider))
    ctx = request_context.RequestContext()
    experiment = context.experiment_from_metadata(
        ctx,
        "",
        include_metrics=True,
        hparams_run_to_tag_to_content=context.hparams_metadata(ctx, ""),
        data_provider_hparams=None,
        hparams_limit=5,
    )
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


def test_sweep_job_names_put_precision_first() -> None:
    """The run list cuts long names: what a precision sweep varies comes first."""
    assert precision_first("device=cpu,model=xvector,precision=bf16") == (
        "precision=bf16,device=cpu,model=xvector"
    )
    assert precision_first("device=cpu,+precision=fp16") == "+precision=fp16,device=cpu"
    assert precision_first("") == ""
