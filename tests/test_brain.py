"""The Brain loop: precision, scaling, clipping, accumulation, non-finite losses, resume."""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from amp_utils import (
    Brain,
    Checkpointer,
    EpochCounter,
    NonFiniteLossError,
    RunOptions,
    Stage,
    TrainingInterrupted,
)
from amp_utils.checkpoint import STATE_FILE, CheckpointError, read_state
from amp_utils.distributed import DistributedInfo
from amp_utils.precision import ONEDNN_CACHE_VARIABLE, PrecisionNotSupportedError
from data.sampler import DurationBatchSampler


class RegressionBrain(Brain):
    """y = f(x) regression; records output dtypes seen per stage."""

    def compute_forward(self, batch, stage):
        x, _ = batch
        x = x.to(self.device)
        out = self.modules.model(x)
        self.seen_dtypes = getattr(self, "seen_dtypes", {})
        self.seen_dtypes[stage] = out.dtype
        return out

    def compute_objectives(self, predictions, batch, stage):
        _, y = batch
        return torch.nn.functional.mse_loss(predictions.float(), y.to(self.device))


def make_model(dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(16, 1)
    )


def make_data(n: int = 32) -> TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def run_opts(**kw):
    return {"device": "cpu", "noprogressbar": True, **kw}


def sgd(lr=0.05):
    return lambda params: torch.optim.SGD(params, lr=lr)


def test_speechbrain_docstring_example_runs_as_written():
    from torch.optim import SGD

    class SimpleBrain(Brain):
        def compute_forward(self, batch, stage):
            return self.modules.model(batch[0])

        def compute_objectives(self, predictions, batch, stage):
            return torch.nn.functional.l1_loss(predictions, batch[0])

    model = torch.nn.Linear(in_features=10, out_features=10)
    brain = SimpleBrain({"model": model}, opt_class=lambda x: SGD(x, 0.1))
    brain.fit(range(1), ([torch.rand(10, 10), torch.rand(10, 10)],))
    assert brain.optimizer_step == 1


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_forward_dtype_follows_precision_and_eval_precision(precision, dtype):
    brain = RegressionBrain(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(precision=precision, eval_precision="fp32"),
    )
    data = DataLoader(make_data(), batch_size=8)
    brain.fit(range(1), data, valid_set=data)
    assert brain.seen_dtypes[Stage.TRAIN] == dtype
    assert brain.seen_dtypes[Stage.VALID] == torch.float32
    assert brain.scaler.is_enabled() == (precision == "fp16")
    assert not torch.is_autocast_enabled("cpu")


def test_throughput_counts_training_time_only():
    import time

    class SlowBrain(RegressionBrain):
        """Each training batch takes >= 10 ms, each validation batch >= 50 ms."""

        def compute_forward(self, batch, stage):
            time.sleep(0.01 if stage == Stage.TRAIN else 0.05)
            return super().compute_forward(batch, stage)

    brain = SlowBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    data = DataLoader(make_data(), batch_size=8)
    start = time.perf_counter()
    brain.fit(range(3), data, valid_set=data)
    wall = time.perf_counter() - start
    assert brain.train_stats["utterances"] == 3 * 32  # 3 epochs of 32 examples
    train_sleep, valid_sleep = 3 * 4 * 0.01, 3 * 4 * 0.05
    assert train_sleep <= brain.train_stats["time_s"] <= wall - valid_sleep


def test_fit_records_where_its_time_goes_besides_training():
    """Validation loops and epoch ends (metrics, logs, the checkpoint) are timed apart from
    training, per run (``train_stats``, results.json) and per epoch (TensorBoard
    ``time/*``): on an H200 the default recipe trains ~0.2 s of each ~0.6 s epoch."""
    import time

    class SlowBrain(RegressionBrain):
        def compute_forward(self, batch, stage):
            time.sleep(0.01)  # each training and validation batch
            return super().compute_forward(batch, stage)

        def on_stage_end(self, stage, stage_loss, epoch=None):
            if stage == Stage.VALID:
                time.sleep(0.15)  # metrics, logs, the checkpoint

    tensorboard = RecordingLogger()
    brain = SlowBrain({"model": make_model()}, sgd(), run_opts=run_opts(), tensorboard=tensorboard)
    data = DataLoader(make_data(), batch_size=8)
    start = time.perf_counter()
    brain.fit(range(3), data, valid_set=data)
    wall = time.perf_counter() - start
    stats = brain.train_stats
    valid_sleep, end_sleep = 3 * 4 * 0.01, 3 * 0.15
    assert valid_sleep <= stats["valid_time_s"] < end_sleep  # the batches, not the ends
    assert end_sleep <= stats["epoch_end_time_s"] <= wall - valid_sleep - 3 * 4 * 0.01
    assert stats["time_s"] <= wall - valid_sleep - end_sleep  # training's own time
    epochs = [s for _, s in tensorboard.scalars if "time/valid_s" in s]
    assert len(epochs) == 3
    for epoch in epochs:
        assert epoch["time/train_s"] >= 0.04 and epoch["time/valid_s"] >= 0.04
        assert epoch["time/epoch_end_s"] >= 0.15
    assert sum(e["time/valid_s"] for e in epochs) == pytest.approx(stats["valid_time_s"])
    # Without validation each epoch still records its training time.
    tensorboard.scalars.clear()
    brain.fit(range(3, 5), data)
    alone = [s for _, s in tensorboard.scalars if "time/train_s" in s]
    assert len(alone) == 2 and all(e["time/train_s"] >= 0.04 for e in alone)


def test_throughput_leaves_out_each_sessions_first_epoch():
    """A process's first epoch pays its start-up (CUDA context, compilation, graph
    captures): the run's rates leave each session's first epoch out, as long as later
    epochs exist. Counted in, a sweep run in one process rated its first job (fp32, paying
    the H200's start-up) at half its speed: bf16 2.14x fp32 instead of 1.19x."""
    import time

    from amp_utils.run_results import Throughput

    class StartUpBrain(RegressionBrain):
        """The process's first training batch takes 0.3 s more (its start-up)."""

        started = False

        def compute_forward(self, batch, stage):
            if stage == Stage.TRAIN and not StartUpBrain.started:
                StartUpBrain.started = True
                time.sleep(0.3)
            return super().compute_forward(batch, stage)

    data = DataLoader(make_data(), batch_size=8)
    brain = StartUpBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    brain.fit(range(3), data)
    stats = brain.global_train_stats()
    assert stats["warmup_utterances"] == 32 and stats["utterances"] == 96
    assert stats["warmup_time_s"] >= 0.3
    rated = Throughput.from_train_stats(stats)
    steady_s = stats["time_s"] - stats["warmup_time_s"]
    assert rated.train_utterances_per_s == pytest.approx(64 / steady_s)
    assert rated.warmup_time_s == stats["warmup_time_s"]
    assert rated.train_time_s == stats["time_s"]  # all of it, warm-up included

    # A resumed session's first epoch is its own warm-up, kept apart as well.
    resumed = StartUpBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    resumed.load_state_dict(brain.state_dict())
    resumed.fit(range(2), data)
    assert resumed.train_stats["warmup_utterances"] == 64
    assert resumed.train_stats["utterances"] == 96 + 64

    # Only first epochs (a one-epoch run): rated over all of them.
    single = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    single.fit(range(1), data)
    stats = single.global_train_stats()
    rated = Throughput.from_train_stats(stats)
    assert rated.train_utterances_per_s == pytest.approx(32 / stats["time_s"])
    assert rated.warmup_time_s == 0.0


class _SlowData(TensorDataset):
    """``make_data()`` whose batches of 8 take ``delay`` seconds each to load."""

    def __init__(self, delay: float) -> None:
        super().__init__(*make_data().tensors)
        self.delay = delay

    def __getitem__(self, index):
        import time

        time.sleep(self.delay / 8)
        return super().__getitem__(index)


@pytest.mark.parametrize(("delay", "warned"), [(0.3, True), (0.0, False)])
def test_an_epoch_waiting_for_its_loader_is_measured_and_warned_about(delay, warned, caplog):
    """Time blocked on the loader is counted (``train_stats["data_wait_s"]``); the first
    epoch that waits a fifth of its time or more (and a second) says so, once, naming the
    workers; a quick loader's short waits say nothing."""
    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    with caplog.at_level("WARNING"):
        brain.fit(range(2), DataLoader(_SlowData(delay), batch_size=8))
    wait, total = brain.train_stats["data_wait_s"], brain.train_stats["time_s"]
    assert 2 * 4 * delay <= wait <= total
    assert caplog.text.count("waited for the next batch") == int(warned)
    if warned:
        assert "device.num_workers, now 0" in caplog.text and wait / total > 0.5


def test_every_train_stat_is_either_summed_or_the_slowest_ranks():
    """Restoring under another world size and gathering over DDP ranks read the split; a
    stat in neither list would be dropped from both."""
    from amp_utils.train_stats import SLOWEST_TRAIN_STATS, SUMMED_TRAIN_STATS, TRAIN_STATS

    assert sorted(SUMMED_TRAIN_STATS + SLOWEST_TRAIN_STATS) == sorted(TRAIN_STATS)


def test_train_stats_of_a_checkpoint_from_before_the_data_wait_load_with_zero():
    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    state = brain.state_dict()
    del state["train_stats"]["data_wait_s"]
    state["train_stats"]["utterances"] = 7
    brain.load_state_dict(state)
    assert brain.train_stats["data_wait_s"] == 0.0 and brain.train_stats["utterances"] == 7


def test_hparams_have_dot_access_and_unknown_run_option_fails():
    brain = RegressionBrain({"model": make_model()}, hparams={"lr": 0.1}, run_opts=run_opts())
    assert brain.hparams.lr == 0.1
    with pytest.raises(ValueError, match="valid options are"):
        RegressionBrain({"model": make_model()}, run_opts={"precison": "bf16"})


def test_brain_sizes_the_onednn_cache_before_its_first_kernel(monkeypatch):
    monkeypatch.setenv(ONEDNN_CACHE_VARIABLE, "7")  # restored after the test
    monkeypatch.delenv(ONEDNN_CACHE_VARIABLE)
    RegressionBrain({"model": make_model()}, run_opts=run_opts())
    assert ONEDNN_CACHE_VARIABLE not in os.environ  # None: oneDNN's own default
    RegressionBrain({"model": make_model()}, run_opts=run_opts(onednn_cache_capacity=4096))
    assert os.environ[ONEDNN_CACHE_VARIABLE] == "4096"
    with pytest.raises(ValueError, match="onednn_cache_capacity must be >= 0"):
        RegressionBrain({"model": make_model()}, run_opts=run_opts(onednn_cache_capacity=-1))


@pytest.mark.parametrize("bad", ["fp8", "half"])
def test_unknown_precision_fails_at_construction(bad):
    with pytest.raises(ValueError, match="fp32.*fp16.*bf16"):
        RegressionBrain({"model": make_model()}, run_opts=run_opts(precision=bad))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_fails_clearly():
    with pytest.raises(RuntimeError, match="no CUDA GPU.*device=cpu"):
        RegressionBrain({"model": make_model()}, run_opts=run_opts(device="cuda"))


@dataclasses.dataclass
class _GPU:
    """What the precision checks read of ``torch.cuda.get_device_properties``."""

    major: int


def test_bf16_on_gpu_without_bf16_fails_clearly(monkeypatch):
    from amp_utils.autocast import AMPConfig
    from amp_utils.precision import check_precision_supported

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: _GPU(major=7))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(PrecisionNotSupportedError, match="V100.*precision=fp16"):
        check_precision_supported(AMPConfig.from_name("bf16"), torch.device("cuda"))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_on_an_unsupported_device_type_fails_clearly(precision):
    from amp_utils.autocast import AMPConfig
    from amp_utils.precision import check_precision_supported

    with pytest.raises(PrecisionNotSupportedError, match=f"precision={precision}.*fp32"):
        check_precision_supported(AMPConfig.from_name(precision), torch.device("meta"))


def test_unknown_device_names_the_choices():
    from amp_utils import resolve_device

    with pytest.raises(ValueError, match="auto, cpu, cuda, cuda:N"):
        resolve_device("tpu")


class ConstantGradBrain(Brain):
    """Loss = 1000 * sum of all parameters: every gradient element is 1000."""

    def compute_forward(self, batch, stage):
        return sum(p.sum() for p in self.modules.parameters())

    def compute_objectives(self, predictions, batch, stage):
        return 1000.0 * predictions


def test_clipping_covers_all_parameter_groups():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    before = torch.cat([p.detach().flatten().clone() for p in [*a.parameters(), *b.parameters()]])

    def two_groups(_params):
        return torch.optim.SGD([{"params": a.parameters()}, {"params": b.parameters()}], lr=1.0)

    brain = ConstantGradBrain({"a": a, "b": b}, two_groups, run_opts=run_opts(max_grad_norm=1.0))
    brain.fit(range(1), [0])
    after = torch.cat([p.detach().flatten() for p in [*a.parameters(), *b.parameters()]])
    # A single SGD step of lr 1 moves the weights by exactly the clipped gradient.
    assert torch.linalg.vector_norm(after - before).item() == pytest.approx(1.0, rel=1e-4)
    assert brain.last_grad_norm == pytest.approx(1000.0 * (24**0.5), rel=1e-4)


def test_clipping_disabled_with_nonpositive_norm():
    a = torch.nn.Linear(3, 3)
    before = torch.cat([p.detach().flatten().clone() for p in a.parameters()])
    brain = ConstantGradBrain({"a": a}, sgd(lr=1.0), run_opts=run_opts(max_grad_norm=0))
    brain.fit(range(1), [0])
    after = torch.cat([p.detach().flatten() for p in a.parameters()])
    assert torch.allclose(before - after, torch.full_like(after, 1000.0))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_fused_adamw_with_clipping_under_every_precision(precision):
    brain = RegressionBrain(
        {"model": make_model()},
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        run_opts=run_opts(precision=precision, max_grad_norm=1.0),
    )
    brain.fit(range(2), DataLoader(make_data(), batch_size=8))
    assert brain.optimizer_step + brain.skipped_steps == 8
    assert brain.optimizer_step >= 6


def test_gradient_accumulation_matches_full_batch():
    data = make_data(16)
    full = RegressionBrain({"model": make_model()}, sgd(0.1), run_opts=run_opts())
    full.fit(range(1), DataLoader(data, batch_size=16))
    accum = RegressionBrain(
        {"model": make_model()}, sgd(0.1), run_opts=run_opts(grad_accumulation_factor=2)
    )
    accum.fit(range(1), DataLoader(data, batch_size=8))
    assert accum.optimizer_step == full.optimizer_step == 1
    for p, q in zip(full.modules.parameters(), accum.modules.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


class InjectedLossBrain(RegressionBrain):
    """Returns NaN (or a huge loss) on the batches listed in ``hparams.bad_steps``."""

    def compute_objectives(self, predictions, batch, stage):
        loss = super().compute_objectives(predictions, batch, stage)
        if stage == Stage.TRAIN and self.step in self.hparams.bad_steps:
            return loss * self.hparams.factor
        return loss


def test_nonfinite_losses_are_skipped_then_stop_after_patience():
    data = DataLoader(make_data(64), batch_size=4)
    tolerant = InjectedLossBrain(
        {"model": make_model()},
        sgd(),
        hparams={"bad_steps": {2, 3, 5}, "factor": float("nan")},
        run_opts=run_opts(nonfinite_patience=3),
    )
    tolerant.fit(range(1), data)
    assert tolerant.optimizer_step == 16 - 3
    assert all(torch.isfinite(p).all() for p in tolerant.modules.parameters())

    stopping = InjectedLossBrain(
        {"model": make_model()},
        sgd(),
        hparams={"bad_steps": set(range(1, 100)), "factor": float("inf")},
        run_opts=run_opts(nonfinite_patience=3),
    )
    # A ValueError too, as SpeechBrain's: code written for it catches it.
    with pytest.raises(ValueError, match="4 consecutive.*bf16 instead of fp16") as err:
        stopping.fit(range(1), data)
    assert isinstance(err.value, NonFiniteLossError)
    assert stopping.step == 5  # losses are read one batch late, so no step waits for them


def test_fp16_overflow_skips_step_and_not_the_scheduler():
    brain = InjectedLossBrain(
        {"model": make_model()},
        sgd(),
        hparams={
            "bad_steps": {1},
            "factor": 1e6,  # finite fp32 loss whose scaled fp16 gradients overflow
            "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
        },
        run_opts=run_opts(precision="fp16"),
    )
    brain.fit(range(1), DataLoader(make_data(16), batch_size=4))
    assert brain.skipped_steps >= 1
    assert brain.optimizer_step >= 1
    assert brain.optimizer_step + brain.skipped_steps == 4
    assert brain.lr_scheduler.last_epoch == brain.optimizer_step  # only applied steps count
    assert brain.scaler.get_scale() == 2.0**16 * 0.5**brain.skipped_steps
    assert all(torch.isfinite(p).all() for p in brain.modules.parameters())


def test_run_options_missing_from_run_opts_come_from_hparams(caplog):
    """As in SpeechBrain, whose recipes set precision, max_grad_norm or
    grad_accumulation_factor in their hparams YAML: they were ignored (fp32, no
    accumulation, clipping at 5.0) without a word. run_opts wins where it has the key."""
    hparams = {"precision": "bf16", "grad_accumulation_factor": 4, "max_grad_norm": 1.0}
    with caplog.at_level(logging.INFO, logger="amp_utils.run_options"):
        brain = RegressionBrain(
            {"model": make_model()}, sgd(), hparams=hparams, run_opts={"max_grad_norm": 2.0}
        )
    opts = brain.run_opts
    assert (opts.precision, opts.grad_accumulation_factor, opts.max_grad_norm) == ("bf16", 4, 2.0)
    assert brain.amp.name == "bf16" and brain.hparams.precision == "bf16"
    assert "Run option precision='bf16' comes from hparams." in caplog.text
    assert "max_grad_norm" not in caplog.text
    with pytest.raises(ValueError, match="grad_accumulation_factor must be >= 1"):
        RegressionBrain({"model": make_model()}, sgd(), hparams={"grad_accumulation_factor": 0})


def test_a_fit_batch_overridden_the_speechbrain_way_is_accounted():
    """SpeechBrain documents overriding fit_batch (forward, backward, optimizers_step(),
    return the loss). The loop ignored its return and its steps: 10 SGD steps gave
    optimizer_step 0, an LR schedule that never moved and a training loss of 0."""

    class SpeechBrainStyle(RegressionBrain):
        def fit_batch(self, batch):
            outputs = self.compute_forward(batch, Stage.TRAIN)
            loss = self.compute_objectives(outputs, batch, Stage.TRAIN)
            loss.backward()
            self.optimizers_step()
            return loss.detach().cpu()

    brain = SpeechBrainStyle(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    )
    losses = []
    brain.on_stage_end = lambda stage, loss, epoch=None: losses.append((stage, loss))
    brain.fit(range(2), DataLoader(make_data(20), batch_size=4))
    assert brain.optimizer_step == 10 and brain.lr_scheduler.last_epoch == 10
    assert brain.optimizer.param_groups[0]["lr"] == pytest.approx(0.05 * 0.5**10)
    assert [stage for stage, _ in losses] == [Stage.TRAIN, Stage.TRAIN]
    assert all(loss > 0 for _, loss in losses)


def test_speechbrain_brain_attributes_and_hooks_exist():
    """Code written for SpeechBrain's Brain reads its options as attributes, runs its
    forward under training_ctx/evaluation_ctx and overrides freeze_optimizers: all were
    missing (AttributeError)."""
    frozen = make_model()

    class TwoOptimizers(RegressionBrain):
        def init_optimizers(self):
            super().init_optimizers()
            self.frozen_opt = torch.optim.SGD(frozen.parameters(), lr=0.1)
            self.optimizers_dict["frozen"] = self.frozen_opt

        def freeze_optimizers(self, optimizers):
            return {k: v for k, v in optimizers.items() if k != "frozen"}

        def fit_batch(self, batch):
            with self.training_ctx:
                outputs = self.compute_forward(batch, Stage.TRAIN)
                assert torch.is_autocast_enabled("cpu")
                loss = self.compute_objectives(outputs, batch, Stage.TRAIN)
                loss = loss + frozen(batch[0]).float().sum() * 1e-3  # it gets gradients
            loss.backward()
            self.optimizers_step()
            return loss.detach()

    brain = TwoOptimizers(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(precision="bf16", max_grad_norm=2.0, debug=True),
    )
    assert (brain.precision, brain.eval_precision) == ("bf16", "fp32")
    assert (brain.max_grad_norm, brain.grad_accumulation_factor) == (2.0, 1)
    assert brain.noprogressbar and brain.debug
    with brain.evaluation_ctx:
        assert not torch.is_autocast_enabled("cpu")  # fp32 evaluation: a no-op
    before = [p.detach().clone() for p in frozen.parameters()]
    brain.fit(range(1), DataLoader(make_data(16), batch_size=4))
    assert brain.optimizer_step == 2  # debug: 2 batches
    assert all(torch.equal(p, q) for p, q in zip(frozen.parameters(), before, strict=True))
    brain.device = torch.device("cuda")  # the blocker's other reasons do not apply then
    assert "freeze_optimizers is overridden" in brain.step_graph_blocker()


def test_debug_mode_limits_batches_and_epochs():
    class Counting(RegressionBrain):
        def on_stage_start(self, stage, epoch=None):
            self.calls = getattr(self, "calls", [])
            self.calls.append((stage, epoch))

    brain = Counting(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(debug=True, debug_batches=2, debug_epochs=2),
    )
    data = DataLoader(make_data(64), batch_size=4)
    brain.fit(range(10), data, valid_set=data)
    assert brain.optimizer_step == 4
    assert brain.calls == [(Stage.TRAIN, 0), (Stage.VALID, 0), (Stage.TRAIN, 1), (Stage.VALID, 1)]
    assert brain.evaluate(data) > 0
    assert brain.step == 0


def test_a_resumed_debug_run_ends_where_the_uninterrupted_one_does():
    """Debug mode with an EpochCounter runs its epochs 1..debug_epochs. It counted the
    epochs of each fit call: a debug run resumed in epoch 2 trained epochs 2 and 3, and one
    resumed after its last epoch trained two more (a rerun rewrote a finished run)."""
    from amp_utils.epoch_counter import EpochCounter

    def fit(counter: EpochCounter) -> list[int]:
        class Counting(RegressionBrain):
            def on_stage_start(self, stage, epoch=None):
                if stage == Stage.TRAIN:
                    epochs.append(epoch)
                    labels.append(self.epoch_label(epoch))

        epochs: list[int] = []
        brain = Counting(
            {"model": make_model()},
            sgd(),
            run_opts=run_opts(debug=True, debug_batches=2, debug_epochs=2),
        )
        brain.fit(counter, DataLoader(make_data(64), batch_size=4))
        return epochs

    labels: list[str] = []
    assert fit(EpochCounter(10)) == [1, 2]
    # the logs' "epoch 1/10" promised 10 epochs where debug mode trains 2 (audit-speaker)
    assert labels == ["1/2", "2/2"]
    again = EpochCounter(10)
    again.current = 1  # killed in epoch 2 (a mid-epoch checkpoint's counter, set back by one)
    assert fit(again) == [2] and again.current == 2
    finished = EpochCounter(10)
    finished.current = 2
    assert fit(finished) == [] and finished.current == 2


def test_compile_wraps_selected_modules():
    brain = RegressionBrain(
        {"model": make_model(), "other": torch.nn.Linear(2, 2)},
        sgd(),
        run_opts=run_opts(compile=True, compile_module_keys=["model"]),
    )
    brain._compile()
    assert isinstance(brain.modules.model, torch._dynamo.eval_frame.OptimizedModule)
    assert not isinstance(brain.modules.other, torch._dynamo.eval_frame.OptimizedModule)


# ----------------------------------------------------------------- checkpoints


class ShuffledRegression(RegressionBrain):
    """Dropout + shuffled loader: resume must restore RNG and loader position exactly."""

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == Stage.VALID and self.checkpointer is not None:
            self.checkpointer.save_and_keep_only(meta={"loss": stage_loss}, min_keys=["loss"])


class StopAfter(Exception):
    pass


def dying_before(base: type[Brain], step: int | None) -> type[Brain]:
    """``base`` whose run dies at the start of batch ``step`` of an epoch (``StopAfter``,
    as a kill would: nothing saved then); ``None``: it never dies."""

    class Dying(base):
        def on_fit_batch_start(self, batch, should_step):
            if self.step == step:
                raise StopAfter
            super().on_fit_batch_start(batch, should_step)

    return Dying


def train_shuffled(ckpt_dir, epochs=3, stop_at=None, **opts):
    class Interrupted(ShuffledRegression):
        """Dies at the start of batch ``stop_at`` (as a kill would); saves every step."""

        def on_fit_batch_start(self, batch, should_step):
            if stop_at is not None and (self._epoch_counter.current, self.step) == stop_at:
                raise StopAfter

    torch.manual_seed(123)
    brain = Interrupted(
        {"model": make_model(dropout=0.3)},
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        hparams={"lr_scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 5, gamma=0.9)},
        run_opts=run_opts(ckpt_interval_steps=1, **opts),
        checkpointer=Checkpointer(ckpt_dir),
    )

    # The loader is rebuilt per process, as after a restart; its sampler is seeded per epoch.
    class EpochSeeded(torch.utils.data.Sampler):
        def __init__(self, n):
            self.n, self.epoch = n, 0

        def set_epoch(self, epoch):
            self.epoch = epoch

        def __iter__(self):
            return iter(
                torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
            )

        def __len__(self):
            return self.n

    loader = DataLoader(make_data(48), batch_size=4, sampler=EpochSeeded(48))
    brain.fit(EpochCounter(epochs), loader, valid_set=DataLoader(make_data(8), batch_size=4))
    return brain


def params_of(brain):
    return [p.detach().clone() for p in brain.modules.parameters()]


def test_resume_mid_epoch_gives_identical_weights(tmp_path):
    reference = params_of(train_shuffled(tmp_path / "ref"))
    with pytest.raises(StopAfter):
        train_shuffled(tmp_path / "run", stop_at=(2, 5))
    with pytest.raises(StopAfter):
        train_shuffled(tmp_path / "run", stop_at=(3, 1))
    resumed = train_shuffled(tmp_path / "run")
    assert resumed.optimizer_step == 36
    for p, q in zip(reference, params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_a_mid_epoch_checkpoint_counts_the_epochs_training_time_so_far(tmp_path):
    """train_stats gains an epoch's time at its end; a checkpoint inside the epoch adds the
    time trained so far, or a resumed run would under-report its training time."""
    with pytest.raises(StopAfter):
        train_shuffled(tmp_path / "run", stop_at=(2, 5))
    states = [
        read_state(c.path / STATE_FILE)["state"]
        for c in Checkpointer(tmp_path / "run").list_checkpoints()
    ]
    [epoch_end] = [s for s in states if s["brain"]["step"] == 0]
    [mid_epoch] = [s for s in states if s["brain"]["step"] == 4]
    assert mid_epoch["brain"]["train_stats"]["time_s"] > epoch_end["brain"]["train_stats"]["time_s"]


def fit_duration_batched(
    ckpt_dir, sampler_skips, stop_at=None, progressbar=False, durations=(1.0,) * 48
):
    """Two epochs of 12 batches, a checkpoint per step; dies before batch ``stop_at``.

    ``sampler_skips``: a ``DurationBatchSampler`` through 2 loader workers (the sampler
    skips the finished batches on resume); else a plain loader (the loop skips them).
    """

    class Interrupted(ShuffledRegression):
        def on_fit_batch_start(self, batch, should_step):
            if stop_at is not None and (self._epoch_counter.current, self.step) == stop_at:
                raise StopAfter

    brain = Interrupted(
        {"model": make_model()},
        lambda p: torch.optim.SGD(p, lr=0.01),
        run_opts=run_opts(ckpt_interval_steps=1, noprogressbar=not progressbar),
        checkpointer=Checkpointer(ckpt_dir),
    )
    if sampler_skips:
        sampler = DurationBatchSampler(list(durations), max_batch_seconds=4, seed=1, num_buckets=1)
        loader = DataLoader(make_data(48), batch_sampler=sampler, num_workers=2)
    else:
        loader = DataLoader(make_data(48), batch_size=4)
    brain.fit(EpochCounter(2), loader)
    return brain


@pytest.mark.parametrize("sampler_skips", [True, False], ids=["sampler_workers2", "loop"])
def test_resume_mid_epoch_trains_each_batch_once_and_counts_it_once(
    tmp_path, capsys, sampler_skips
):
    reference = fit_duration_batched(tmp_path / "ref", sampler_skips)
    assert reference.optimizer_step == 24
    with pytest.raises(StopAfter):
        fit_duration_batched(tmp_path / "run", sampler_skips, stop_at=(2, 6))
    capsys.readouterr()
    resumed = fit_duration_batched(tmp_path / "run", sampler_skips, progressbar=True)
    assert resumed.optimizer_step == 24  # not 29: the 5 done batches are not trained again
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.equal(p, q)
    # The resumed epoch's bar starts at 5 of 12 and ends at 12 of 12.
    counts = re.findall(r"epoch 2/2 train:[^|]*\|[^|]*\| *(\d+)/(\d+)", capsys.readouterr().err)
    assert counts[0] == ("5", "12") and counts[-1] == ("12", "12"), counts


def test_a_mid_epoch_resume_into_another_batch_plan_says_it_is_not_exact(tmp_path, caplog):
    """The data changed between the kill and the resume (here two durations, as a manifest
    whose durations now come from the audio headers): skipping the 5 batches trained leaves
    other utterances out than the interrupted run would have, which went unnoticed."""
    with pytest.raises(StopAfter):
        fit_duration_batched(tmp_path / "same", True, stop_at=(2, 6))
    with caplog.at_level(logging.WARNING):
        fit_duration_batched(tmp_path / "same", True)
    assert "not exact" not in caplog.text  # the same plan: nothing to say
    with pytest.raises(StopAfter):
        fit_duration_batched(tmp_path / "changed", True, stop_at=(2, 6))
    changed = (0.5, 1.5, *(1.0,) * 46)
    with caplog.at_level(logging.WARNING):
        fit_duration_batched(tmp_path / "changed", True, durations=changed)
    assert "epoch 2/2 resumes 5 batches in" in caplog.text and "not exact" in caplog.text


def test_resume_at_epoch_end_gives_identical_weights(tmp_path):
    reference = params_of(train_shuffled(tmp_path / "ref", epochs=3))
    train_shuffled(tmp_path / "run", epochs=2)
    resumed = train_shuffled(tmp_path / "run", epochs=3)
    for p, q in zip(reference, params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_checkpoint_round_trip_restores_everything(tmp_path):
    """Weights, optimizer, scheduler, loss scale, loop counters and the RNGs come back."""

    def fp16_brain(seed: int, scale: float) -> RegressionBrain:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        brain = RegressionBrain(
            {"model": model},
            lambda p: torch.optim.AdamW(p, lr=1e-3),
            hparams={"lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)},
            run_opts=run_opts(precision="fp16"),
            checkpointer=Checkpointer(tmp_path),
        )
        brain.scaler.load_state_dict({**brain.scaler.state_dict(), "scale": scale})
        return brain

    brain = fp16_brain(0, scale=1024.0)  # the default 2**16 overflows: no step applied
    brain.fit(range(1), DataLoader(make_data(24), batch_size=8))
    assert brain.optimizer_step == 3 and brain.scaler.get_scale() == 1024.0
    torch.manual_seed(7)
    random.seed(7)
    saved = brain.checkpointer.save_checkpoint(meta={"CER": 3.1})
    expected_draws = (torch.rand(3), random.random())

    restored = fp16_brain(99, scale=2.0**16)  # other weights, fresh optimizer and scaler
    restored.init_optimizers()
    torch.manual_seed(99)
    random.seed(99)
    found = restored.checkpointer.recover_if_possible()

    assert found.path == saved.path and found.meta["CER"] == 3.1
    assert torch.equal(torch.rand(3), expected_draws[0])
    assert random.random() == expected_draws[1]
    for p, q in zip(brain.modules.parameters(), restored.modules.parameters(), strict=True):
        assert torch.equal(p, q)
    torch.testing.assert_close(
        restored.optimizer.state_dict(), brain.optimizer.state_dict(), rtol=0, atol=0
    )
    assert restored.lr_scheduler.state_dict() == brain.lr_scheduler.state_dict()
    assert restored.scaler.state_dict() == brain.scaler.state_dict()
    assert (restored.optimizer_step, restored.avg_train_loss) == (3, brain.avg_train_loss)


def test_brain_checkpoint_restores_rng(tmp_path):
    ckpt = Checkpointer(tmp_path)
    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts(), checkpointer=ckpt)
    torch.manual_seed(5)
    ckpt.save_checkpoint()
    expected = torch.rand(3)
    torch.manual_seed(6)
    ckpt.recover_if_possible()
    assert torch.equal(torch.rand(3), expected)
    assert brain.optimizer_step == 0


def test_each_ddp_rank_gets_its_own_rng_state_back():
    """A DDP checkpoint holds every rank's generators (their dropout and SpecAugment drew
    for different batches); rank r restores its own, not rank 0's."""
    from amp_utils.distributed import DistributedInfo
    from amp_utils.rng_state import capture_rng_state

    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    state = brain.state_dict()
    assert "rank_rng" not in state  # one process: its own state is "rng"
    torch.manual_seed(11)
    rank1 = capture_rng_state()
    expected = torch.rand(3)
    torch.manual_seed(10)
    rank0 = capture_rng_state()
    brain.distributed = DistributedInfo(world_size=2, rank=1, backend="gloo")
    brain.load_state_dict({**state, "world_size": 2, "rng": rank0, "rank_rng": [rank0, rank1]})
    assert torch.equal(torch.rand(3), expected)


def test_evaluate_loads_best_checkpoint(tmp_path):
    ckpt = Checkpointer(tmp_path)
    model = make_model()
    brain = RegressionBrain({"model": model}, sgd(), run_opts=run_opts(), checkpointer=ckpt)
    values = {}
    for i, cer in enumerate([5.0, 1.0, 3.0]):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i))
        values[cer] = i
        ckpt.save_and_keep_only(meta={"CER": cer}, num_to_keep=1, min_keys=["CER"])
    kept = sorted(c.meta["CER"] for c in ckpt.list_checkpoints())
    assert kept == [1.0, 3.0]  # best + most recent
    brain.evaluate(make_data(8), min_key="CER", test_loader_kwargs={"batch_size": 4})
    assert all(torch.all(p == values[1.0]) for p in model.parameters())


def test_sigterm_saves_checkpoint_and_exits_with_resume_hint(tmp_path):
    class Preempted(ShuffledRegression):
        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            if self.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    ckpt = Checkpointer(tmp_path)
    brain = Preempted({"model": make_model()}, sgd(), run_opts=run_opts(), checkpointer=ckpt)
    with pytest.raises(TrainingInterrupted, match="Run the same command again"):
        brain.fit(EpochCounter(2), DataLoader(make_data(32), batch_size=4))
    [saved] = ckpt.list_checkpoints()
    assert not saved.end_of_epoch
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("writes", ["foreground", "background"])
@pytest.mark.parametrize("stage", [Stage.TRAIN, Stage.VALID])
def test_a_sigterm_save_that_fails_says_so_instead_of_saved(tmp_path, monkeypatch, writes, stage):
    """A full disk at the signal's save: the run must not exit saying it saved a
    checkpoint, whether the save ran in the loop or in the writer thread, in training or
    in validation."""
    from amp_utils import checkpoint

    class Preempted(ShuffledRegression):
        def compute_forward(self, batch, stage_now):
            if stage_now == stage and self.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return super().compute_forward(batch, stage_now)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    brain = Preempted(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(checkpoint_writes=writes),
        checkpointer=Checkpointer(tmp_path),
    )
    loader = DataLoader(make_data(32), batch_size=4)
    with pytest.raises(CheckpointError, match="No space left on device"):
        brain.fit(EpochCounter(2), loader, loader)
    assert Checkpointer(tmp_path).list_checkpoints() == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def preempted_mid_accumulation(
    ckpt_dir, precision: str, signal_at=None, nan_at=None, epochs=2, accumulation=3
) -> ShuffledRegression:
    """Two epochs of 12 batches, gradient accumulation over 3, dropout and AdamW; SIGTERM
    after batch ``signal_at`` of the first epoch (a checkpoint, then ``TrainingInterrupted``);
    a NaN loss on batch ``nan_at`` of the first epoch.
    """

    class Preempted(ShuffledRegression):
        def compute_objectives(self, predictions, batch, stage):
            loss = super().compute_objectives(predictions, batch, stage)
            if stage == Stage.TRAIN and (self._epoch_counter.current, self.step) == nan_at:
                return loss * float("nan")
            return loss

        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            if (self._epoch_counter.current, self.step) == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)

    torch.manual_seed(7)
    brain = Preempted(
        {"model": make_model(dropout=0.3)},
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        run_opts=run_opts(grad_accumulation_factor=accumulation, precision=precision),
        checkpointer=Checkpointer(ckpt_dir),
    )
    valid = DataLoader(make_data(8), batch_size=4)  # its end saves the epoch's checkpoint
    brain.fit(EpochCounter(epochs), DataLoader(make_data(48), batch_size=4), valid_set=valid)
    return brain


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_sigterm_mid_accumulation_stops_after_that_batch_and_resumes_exactly(tmp_path, precision):
    """A signal after batch 4 of an accumulation over 3 checkpoints after batch 4, not 6:
    a signal to the whole process group has ended the loader's workers, so the loop may
    not ask them for another batch. The checkpoint keeps the accumulated gradients (and
    the window's finite-loss flag), so the resumed run ends with the same weights."""
    reference = preempted_mid_accumulation(tmp_path / "ref", precision)
    assert reference.optimizer_step + reference.skipped_steps == 8  # fp16 skips its first
    with pytest.raises(TrainingInterrupted, match="epoch 1, batch 4"):
        preempted_mid_accumulation(tmp_path / "run", precision, signal_at=(1, 4))
    resumed = preempted_mid_accumulation(tmp_path / "run", precision)
    assert (resumed.optimizer_step, resumed.skipped_steps) == (
        reference.optimizer_step,
        reference.skipped_steps,
    )
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_a_nan_loss_before_a_mid_accumulation_stop_still_skips_the_step(tmp_path):
    """The NaN loss of batch 4 and the signal after it: the resumed run must skip the
    step at batch 6 as the uninterrupted one does (its NaN gradients are not applied)."""
    reference = preempted_mid_accumulation(tmp_path / "ref", "fp32", nan_at=(1, 4))
    assert reference.skipped_steps == 1
    with pytest.raises(TrainingInterrupted):
        preempted_mid_accumulation(tmp_path / "run", "fp32", signal_at=(1, 4), nan_at=(1, 4))
    resumed = preempted_mid_accumulation(tmp_path / "run", "fp32")
    assert resumed.skipped_steps == 1
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.isfinite(q).all() and torch.equal(p, q)


def test_an_epoch_end_checkpoint_drops_the_unfinished_window_as_the_next_epoch_does(
    tmp_path,
):
    """12 batches, accumulation over 5: the last 2 batches' gradients are zeroed when the
    next epoch starts, so the epoch's checkpoint holds none and a resume must not add any."""
    reference = preempted_mid_accumulation(tmp_path / "ref", "fp32", accumulation=5)
    preempted_mid_accumulation(tmp_path / "run", "fp32", epochs=1, accumulation=5)
    [saved] = Checkpointer(tmp_path / "run").list_checkpoints()
    assert read_state(saved.path / STATE_FILE)["state"]["brain"]["pending_grads"] is None
    resumed = preempted_mid_accumulation(tmp_path / "run", "fp32", accumulation=5)
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.equal(p, q)


def preempted_in_validation(
    ckpt_dir, signal_in_epoch=None, seen=None, tensorboard=None
) -> ShuffledRegression:
    """Two epochs of 12 training and 10 validation batches; SIGTERM during the first
    validation batch of epoch ``signal_in_epoch``. ``seen`` collects the validation
    batches run, as (epoch, batch)."""

    class Preempted(ShuffledRegression):
        def evaluate_batch(self, batch, stage):
            loss = super().evaluate_batch(batch, stage)
            if stage == Stage.VALID and seen is not None:
                seen.append((self._epoch_counter.current, self.step))
                if (self._epoch_counter.current, self.step) == (signal_in_epoch, 1):
                    seen.append(self.train_stats["time_s"])  # the trained epochs' time
                    os.kill(os.getpid(), signal.SIGTERM)
            return loss

    torch.manual_seed(11)
    brain = Preempted(
        {"model": make_model(dropout=0.3)},
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        run_opts=run_opts(),
        checkpointer=Checkpointer(ckpt_dir),
        tensorboard=tensorboard,
    )
    brain.fit(
        EpochCounter(2),
        DataLoader(make_data(48), batch_size=4),
        valid_set=DataLoader(make_data(40), batch_size=4),
    )
    return brain


def test_a_session_that_trains_no_batch_logs_no_epoch_data_wait(tmp_path):
    """Resumed after a signal in validation, the session skips all of epoch 1's batches:
    it logged a second, wrong epoch/data_wait_share at that epoch's step (and counted the
    skipping as training time)."""
    logged = RecordingLogger()
    with pytest.raises(TrainingInterrupted):
        preempted_in_validation(tmp_path / "run", signal_in_epoch=1, seen=[], tensorboard=logged)
    preempted_in_validation(tmp_path / "run", tensorboard=logged)
    waits = [step for step, s in logged.scalars if "epoch/data_wait_share" in s]
    assert waits == [12, 24]


def test_a_signal_during_validation_saves_the_trained_epoch_at_once_and_resumes_exactly(
    tmp_path,
):
    """The epoch's own checkpoint comes only after validation, which can outlast a
    scheduler's grace period: the trained epoch would be lost. A signal in validation
    saves at once (after that validation batch, not 10); the resumed run skips the
    epoch's 12 trained batches, validates epoch 1 in full and ends as an uninterrupted
    run does."""
    reference = preempted_in_validation(tmp_path / "ref")
    seen: list[tuple[int, int]] = []
    with pytest.raises(TrainingInterrupted, match="epoch 1, batch 12"):
        preempted_in_validation(tmp_path / "run", signal_in_epoch=1, seen=seen)
    assert seen[0] == (1, 1) and len(seen) == 2
    [saved] = Checkpointer(tmp_path / "run").list_checkpoints()
    assert not saved.end_of_epoch
    state = read_state(saved.path / STATE_FILE)["state"]["brain"]
    assert state["train_stats"]["time_s"] == seen[1]  # not the validation's time on top
    seen.clear()
    resumed = preempted_in_validation(tmp_path / "run", seen=seen)
    assert [batch for epoch, batch in seen if epoch == 1] == list(range(1, 11))
    assert resumed.optimizer_step == reference.optimizer_step == 24
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_window_gradients_that_do_not_fit_the_model_are_refused_clearly():
    brain = RegressionBrain(
        {"model": make_model()}, sgd(), run_opts=run_opts(grad_accumulation_factor=2)
    )
    brain.on_fit_start()
    brain._resume_grads = {"grads": [torch.zeros(3)], "window_finite": True}
    with pytest.raises(CheckpointError, match="unfinished accumulation window"):
        brain._restore_pending_grads()


@pytest.mark.parametrize("saved_by", [1, 2])
def test_window_gradients_saved_by_another_number_of_processes_are_refused(saved_by):
    """A window's gradients are each rank's partial sum over its own shard of the window:
    another world size cannot finish that window as the interrupted run would have."""
    brain = RegressionBrain(
        {"model": make_model()}, sgd(), run_opts=run_opts(grad_accumulation_factor=4)
    )
    brain.on_fit_start()
    for batch in list(DataLoader(make_data(12), batch_size=4))[:2]:
        brain.train_step(batch)
    brain._resume_step = brain.step  # 2 batches into the window: any world size divides
    state = brain.state_dict()
    if saved_by == 2:  # as DDP saves it: one entry per rank
        state["world_size"] = 2
        state["rank_pending_grads"] = [state.pop("pending_grads")] * 2
    brain.distributed = DistributedInfo(world_size=3 - saved_by, backend="gloo")
    with pytest.raises(CheckpointError, match=f"saved by {saved_by} process"):
        brain.load_state_dict(state)


def test_a_nan_in_an_epochs_unfinished_window_does_not_skip_the_next_epochs_first_step(
    tmp_path,
):
    """Batches 11-12 of 12 (accumulation over 5) are dropped with their gradients at the
    next epoch's start; a NaN loss among them must go with them, in an uninterrupted run
    and in one resumed from the epoch-end checkpoint (which holds no window)."""
    reference = preempted_mid_accumulation(tmp_path / "ref", "fp32", accumulation=5, nan_at=(1, 11))
    assert (reference.optimizer_step, reference.skipped_steps) == (4, 0)
    preempted_mid_accumulation(tmp_path / "run", "fp32", epochs=1, accumulation=5, nan_at=(1, 11))
    resumed = preempted_mid_accumulation(tmp_path / "run", "fp32", accumulation=5)
    assert (resumed.optimizer_step, resumed.skipped_steps) == (4, 0)
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.equal(p, q)


def test_a_run_resumed_in_a_streak_of_nonfinite_losses_stops_where_it_would_have(tmp_path):
    """Patience 2, NaN losses on batches 3-5; killed before batch 4 (a checkpoint after
    every batch): the resumed run counts batch 3's NaN and stops at batch 5 too."""

    def run(folder, kill_before=None):
        brain = dying_before(InjectedLossBrain, kill_before)(
            {"model": make_model()},
            sgd(),
            hparams={"bad_steps": {3, 4, 5}, "factor": float("nan")},
            run_opts=run_opts(nonfinite_patience=2, ckpt_interval_steps=1),
            checkpointer=Checkpointer(folder),
        )
        brain.fit(EpochCounter(1), DataLoader(make_data(48), batch_size=4))

    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        run(tmp_path / "whole")
    with pytest.raises(StopAfter):
        run(tmp_path / "run", kill_before=4)
    with pytest.raises(NonFiniteLossError, match="3 consecutive"):
        run(tmp_path / "run")


def test_a_dataset_shuffled_by_the_brain_resumes_in_the_same_order(tmp_path, caplog):
    """``fit(dataset, train_loader_kwargs={"shuffle": True})``: each epoch's order comes
    from seed + epoch (torch's RandomSampler moves its generator on from epoch to epoch,
    and a resumed process would draw another order). A DataLoader that shuffles with
    torch's RandomSampler is warned about."""

    def run(folder, kill_at=None, seen=None):
        class Brain(ShuffledRegression):
            def on_fit_batch_start(self, batch, should_step):
                if (self._epoch_counter.current, self.step) == kill_at:
                    raise StopAfter
                seen.append((self._epoch_counter.current, batch[0][:, 0].tolist()))

        torch.manual_seed(123)
        brain = Brain(
            {"model": make_model()},
            sgd(),
            run_opts=run_opts(ckpt_interval_steps=1),
            checkpointer=Checkpointer(folder),
        )
        train = {"batch_size": 4, "shuffle": True}
        brain.fit(EpochCounter(2), make_data(16), train_loader_kwargs=train)
        return brain

    expected, first, second = [], [], []
    reference = run(tmp_path / "whole", seen=expected)
    assert expected[0][1] != expected[4][1]  # another order in epoch 2
    with pytest.raises(StopAfter):
        run(tmp_path / "run", kill_at=(2, 2), seen=first)
    resumed = run(tmp_path / "run", seen=second)
    assert len(first) == 5 and first + second == expected  # each batch once, in order
    for p, q in zip(params_of(reference), params_of(resumed), strict=True):
        assert torch.equal(p, q)
    assert "RandomSampler" not in caplog.text
    brain = ShuffledRegression(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(),
        checkpointer=Checkpointer(tmp_path / "plain"),
    )
    brain.fit(EpochCounter(1), DataLoader(make_data(8), batch_size=4, shuffle=True))
    assert "shuffles with torch's RandomSampler" in caplog.text


def test_a_checkpoint_at_an_accumulation_boundary_holds_no_gradients(tmp_path):
    brain = RegressionBrain(
        {"model": make_model()}, sgd(), run_opts=run_opts(grad_accumulation_factor=2)
    )
    brain.on_fit_start()
    data = list(DataLoader(make_data(12), batch_size=4))
    brain.train_step(data[0])
    brain._resume_step = brain.step  # as the loop sets it after each batch
    assert brain.state_dict()["pending_grads"] is not None  # mid-window
    brain.train_step(data[1])
    brain._resume_step = brain.step
    assert brain.state_dict()["pending_grads"] is None  # the step used them


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_brain_trains_on_cuda_with_fused_adamw(cuda_device, precision):
    from amp_utils import PRECISIONS

    brain = RegressionBrain(
        {"model": make_model()},
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        run_opts=run_opts(device="cuda", precision=precision, max_grad_norm=1.0),
    )
    brain.fit(range(2), DataLoader(make_data(), batch_size=8))
    assert brain.optimizer_step + brain.skipped_steps == 8
    assert brain.seen_dtypes[Stage.TRAIN] == PRECISIONS[precision]
    assert brain.scaler.is_enabled() == (precision == "fp16")
    assert all(torch.isfinite(p).all() for p in brain.modules.parameters())


def cuda_batch(device, n=16, seed=1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return x.to(device), x.sum(dim=1, keepdim=True).to(device)


@pytest.mark.gpu
def test_fp16_inf_gradient_on_cuda_halves_the_scale_and_leaves_the_weights(cuda_device):
    """The CUDA GradScaler path with fused AdamW (found_inf read on the device): a step
    whose gradient holds an inf is not applied (weights and optimizer state unchanged),
    the scale halves, and the next finite step is applied at the halved scale."""
    brain = RegressionBrain(
        {"model": make_model()},
        lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
        run_opts=run_opts(device="cuda", precision="fp16", max_grad_norm=1.0),
    )
    brain.on_fit_start()
    batch = cuda_batch(cuda_device)
    while brain.optimizer_step == 0:  # torch's initial scale may overflow first
        assert brain.step < 8, "no fp16 step was applied"
        brain.train_step(batch)
        brain.flush_pending()
    applied, skipped = brain.optimizer_step, brain.skipped_steps
    first = brain.modules.model[0].weight
    weights = {k: v.clone() for k, v in brain.modules.state_dict().items()}
    moments = {k: v.clone() for k, v in brain.optimizer.state[first].items()}
    scale = brain.scaler.get_scale()

    def inf_gradient(grad):
        return grad.index_fill(0, torch.tensor([0], device=grad.device), float("inf"))

    handle = first.register_hook(inf_gradient)
    try:
        brain.train_step(batch)
        brain.flush_pending()
    finally:
        handle.remove()
    assert (brain.optimizer_step, brain.skipped_steps) == (applied, skipped + 1)
    assert brain.scaler.get_scale() == scale * 0.5
    for key, value in brain.modules.state_dict().items():
        assert torch.equal(value, weights[key]), key
    for key, value in brain.optimizer.state[first].items():
        assert torch.equal(value, moments[key]), key

    brain.train_step(batch)
    brain.flush_pending()
    assert (brain.optimizer_step, brain.skipped_steps) == (applied + 1, skipped + 1)
    assert brain.scaler.get_scale() == scale * 0.5  # growth only after growth_interval
    assert not torch.equal(first, weights["model.0.weight"])
    assert all(torch.isfinite(p).all() for p in brain.modules.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize(("precision", "tol"), [("fp32", 1e-5), ("bf16", 2e-2)])
def test_compiled_brain_trains_like_eager_on_cuda(cuda_device, precision, tol):
    """trainer.compile (whole modules, inductor) against eager on the GPU: the same losses
    and weights after a few steps, within the precision's tolerance (TF32 is off)."""
    trained = {}
    for compiled in (False, True):
        brain = RegressionBrain(
            {"model": make_model()},
            sgd(),
            run_opts=run_opts(device="cuda", precision=precision, compile=compiled),
        )
        brain.on_fit_start()
        losses = []
        for step in range(4):
            losses.append(brain.train_step(cuda_batch(cuda_device, seed=step)).float())
        brain.flush_pending()
        assert brain.optimizer_step == 4
        trained[compiled] = (torch.stack(losses).cpu(), params_of(brain))
    (eager_losses, eager), (compiled_losses, compiled) = trained[False], trained[True]
    torch.testing.assert_close(compiled_losses, eager_losses, rtol=tol, atol=tol)
    for p, q in zip(compiled, eager, strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach().cpu(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_checkpoint_round_trip_restores_the_cuda_rng(cuda_device, tmp_path):
    """Dropout and SpecAugment on the GPU draw from the CUDA generator: a resume replays
    it (the state goes through the file and back onto the device)."""
    ckpt = Checkpointer(tmp_path)
    RegressionBrain(
        {"model": make_model(dropout=0.5)},
        sgd(),
        run_opts=run_opts(device="cuda"),
        checkpointer=ckpt,
    )
    torch.cuda.manual_seed_all(5)
    torch.rand(7, device=cuda_device)  # an advanced state, not a freshly seeded one
    saved_state = torch.cuda.get_rng_state(cuda_device)
    ckpt.save_checkpoint()
    expected = torch.rand(3, device=cuda_device)
    torch.cuda.manual_seed_all(6)
    assert not torch.equal(torch.cuda.get_rng_state(cuda_device), saved_state)
    ckpt.recover_if_possible(map_location=cuda_device)
    assert torch.equal(torch.cuda.get_rng_state(cuda_device), saved_state)
    assert torch.equal(torch.rand(3, device=cuda_device), expected)


class RecordingLogger:
    """A stand-in ``TensorBoardLogger`` that keeps the scalars it is given."""

    def __init__(self):
        self.scalars = []

    def log_scalars(self, scalars, step):
        self.scalars.append((step, dict(scalars)))


@pytest.mark.parametrize("passed_as", ["arguments", "hparams"])
def test_scheduler_and_logger_are_arguments_and_hparams_keys_still_work(passed_as):
    def schedule(opt):
        return torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    tensorboard = RecordingLogger()
    both = {"lr_scheduler": schedule, "tensorboard": tensorboard}
    brain = RegressionBrain(
        {"model": make_model()},
        sgd(),
        hparams=both if passed_as == "hparams" else None,
        run_opts=run_opts(log_interval_steps=1),
        **(both if passed_as == "arguments" else {}),
    )
    brain.fit(range(1), DataLoader(make_data(16), batch_size=4))
    assert brain.optimizer_step == 4 and brain.lr_scheduler.last_epoch == 4
    assert [step for step, s in tensorboard.scalars if "train/loss" in s] == [1, 2, 3, 4]
    assert tensorboard.scalars[-2] == (4, {"epoch/data_wait_share": pytest.approx(0, abs=0.5)})
    assert tensorboard.scalars[-1][0] == 4 and set(tensorboard.scalars[-1][1]) == {"time/train_s"}
    first = tensorboard.scalars[0][1]
    assert "train/grad_norm" in first
    # each step's point holds the rate that step used (it held the next step's)
    rates = [s["train/lr"] for _, s in tensorboard.scalars if "train/lr" in s]
    assert rates == [0.05, 0.025, 0.0125, 0.00625]


def test_train_step_drives_the_loop_like_fit():
    data = list(DataLoader(make_data(16), batch_size=4))
    by_fit = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    by_fit.fit(range(1), data)
    by_step = RegressionBrain(
        {"model": make_model()}, sgd(), run_opts=run_opts(grad_accumulation_factor=2)
    )
    by_step.on_fit_start()
    for batch in data:
        by_step.train_step(batch)
    by_step.flush_pending()
    assert by_step.step == 4 and by_step.optimizer_step == 2  # every second batch steps
    assert by_step.avg_train_loss > 0
    single = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    single.on_fit_start()
    for batch in data:
        single.train_step(batch)
    single.flush_pending()
    assert single.optimizer_step == by_fit.optimizer_step == 4
    assert single.avg_train_loss == pytest.approx(by_fit.avg_train_loss)
    for p, q in zip(params_of(by_fit), params_of(single), strict=True):
        assert torch.equal(p, q)


def test_a_dropped_window_leaves_no_gradient_for_the_next_epoch_to_apply():
    """An epoch's unfinished accumulation window is dropped with its gradients set to None,
    as after a step: a zero gradient made AdamW (momentum, weight decay) move a parameter
    that the next epoch's first window does not use."""
    torch.manual_seed(0)
    data = [(torch.randn(4, 8), torch.randn(4, 2), torch.tensor(float(i))) for i in range(1, 8)]
    uses_b = {3, 7}  # batch 3 is in a stepped window; batch 7 in the dropped one (epoch 1)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)

        def forward(self, x, use_b):
            return self.a(x) + (self.b(x) if use_b else 0)

    snapshots = []

    class TwoHeads(Brain):
        def compute_forward(self, batch, stage):
            return self.modules.model(batch[0], int(batch[2]) in uses_b and self.epoch == 1)

        def compute_objectives(self, predictions, batch, stage):
            return torch.nn.functional.mse_loss(predictions, batch[1])

        def on_stage_start(self, stage, epoch=None):
            self.epoch = epoch

        def on_fit_batch_end(self, batch, outputs, loss, should_step):
            if should_step:
                snapshots.append((self.epoch, self.modules.model.b.weight.detach().clone()))

    torch.manual_seed(1)
    brain = TwoHeads(
        {"model": Net()},
        opt_class=lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1),
        run_opts={"grad_accumulation_factor": 3, "noprogressbar": True, "max_grad_norm": 0},
    )
    brain.fit(range(1, 3), data, train_loader_kwargs={"batch_size": None})
    assert [epoch for epoch, _ in snapshots] == [1, 1, 2, 2]
    assert torch.equal(snapshots[2][1], snapshots[1][1])  # b unused in epoch 2: unmoved


def test_a_session_interrupted_in_its_first_epoch_keeps_its_start_up_apart(tmp_path):
    """A mid-epoch checkpoint in a session's first epoch saves that partial epoch as warm-up:
    the resumed session's own first epoch is its warm-up, and the interrupted session's
    start-up (CUDA, compilation, captures) must not land in the steady rate (preemptible
    jobs resume the most)."""
    import time

    from amp_utils.run_results import Throughput

    def run(epochs: int, stop_at=None):
        class StartingUp(ShuffledRegression):
            started = False  # per session (a new class per process, as after a restart)

            def compute_forward(self, batch, stage):
                if stage == Stage.TRAIN and not StartingUp.started:
                    StartingUp.started = True
                    time.sleep(0.3)
                return super().compute_forward(batch, stage)

            def on_fit_batch_start(self, batch, should_step):
                if stop_at is not None and (self._epoch_counter.current, self.step) == stop_at:
                    raise StopAfter

        brain = StartingUp(
            {"model": make_model()},
            sgd(0.01),
            run_opts=run_opts(ckpt_interval_steps=1),
            checkpointer=Checkpointer(tmp_path / f"ckpt{epochs}"),
        )
        loader = DataLoader(make_data(48), batch_size=4)  # 12 batches of 4 per epoch
        brain.fit(EpochCounter(epochs), loader)
        return brain.global_train_stats()

    for epochs in (3, 1):
        with pytest.raises(StopAfter):
            run(epochs, stop_at=(1, 6))  # dies before batch 6: 5 batches trained, saved
        stats = run(epochs)
        assert stats["utterances"] == 48 * epochs
        # session 1's 5 batches and session 2's rest of epoch 1 (7 batches): both warm-ups
        assert stats["warmup_utterances"] == 48
        assert stats["warmup_time_s"] >= 0.6  # both sessions' start-up
        rated = Throughput.from_train_stats(stats)
        if epochs == 3:
            steady_s = stats["time_s"] - stats["warmup_time_s"]  # neither start-up in it
            assert rated.train_utterances_per_s == pytest.approx(96 / steady_s)
        else:  # every epoch trained was a session's first: rated over all of them
            assert rated.warmup_time_s == 0.0
            assert rated.train_utterances_per_s == pytest.approx(48 / stats["time_s"])


class SavingRegression(RegressionBrain):
    """Saves a checkpoint at each validation's end, as the recipes' Brains do; can fail
    in the training of epoch ``fail_in_epoch``."""

    fail_in_epoch: int | None = None

    def on_stage_start(self, stage, epoch=None):
        if stage == Stage.TRAIN and epoch == self.fail_in_epoch:
            raise RuntimeError("a failure in the next epoch")

    def on_stage_end(self, stage, stage_loss, epoch=None):
        if stage == Stage.VALID:
            self.checkpointer.save_and_keep_only(meta={"epoch": epoch}, num_to_keep=5)


@pytest.mark.parametrize(
    ("writes", "device_type", "background"),
    [("auto", "cpu", False), ("background", "cpu", True), ("foreground", "cpu", False)],
)
def test_checkpoint_writes_option_picks_where_checkpoints_are_written(
    tmp_path, writes, device_type, background
):
    """``auto`` writes in the background on CUDA only (on a CPU the writer thread would
    take the cores that train); the CUDA branch is a GPU test below."""
    brain = RegressionBrain(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(checkpoint_writes=writes),
        checkpointer=Checkpointer(tmp_path),
    )
    assert brain.device.type == device_type
    assert brain.checkpointer.background_writes is background


@pytest.mark.gpu
def test_on_cuda_checkpoints_are_written_in_the_background_by_default(tmp_path):
    brain = RegressionBrain(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(device="cuda"),
        checkpointer=Checkpointer(tmp_path),
    )
    assert brain.checkpointer.background_writes is True
    loader = DataLoader(make_data(16), batch_size=8)
    brain.fit(range(1, 3), loader, loader)
    assert brain.checkpointer.save_checkpoint(meta={"epoch": 2}) is None  # being written
    (saved,) = brain.checkpointer.list_checkpoints()  # waits for it
    assert saved.meta["epoch"] == 2


def test_an_unknown_checkpoint_writes_value_names_the_choices():
    with pytest.raises(ValueError, match="checkpoint_writes must be one of auto, background"):
        RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts(checkpoint_writes="x"))


@pytest.mark.parametrize("fails", [False, True])
def test_fit_returns_or_raises_only_once_its_last_checkpoint_is_on_disk(
    tmp_path, monkeypatch, fails
):
    """With background writes ``fit`` may not end while the writer thread still writes:
    the test that follows loads the checkpoints, and a process that exits (its error
    raised) must leave the epoch it finished on disk."""
    import threading
    import time

    from amp_utils import checkpoint

    write, writing = checkpoint.Checkpointer._write, threading.Event()

    def slow_write(self, *args, **kwargs):
        writing.set()
        time.sleep(0.3)
        return write(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Checkpointer, "_write", slow_write)
    brain = SavingRegression(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(checkpoint_writes="background"),
        checkpointer=Checkpointer(tmp_path),
    )
    brain.fail_in_epoch = 3 if fails else None
    loader = DataLoader(make_data(16), batch_size=8)
    if fails:
        with pytest.raises(RuntimeError, match="a failure in the next epoch"):
            brain.fit(range(1, 4), loader, loader)
    else:
        brain.fit(range(1, 3), loader, loader)
    assert writing.is_set()
    epochs = [c.meta["epoch"] for c in Checkpointer(tmp_path).list_checkpoints()]
    assert epochs == [1, 2]


def test_a_failed_background_write_while_fit_fails_is_logged_not_swapped_in(
    tmp_path, monkeypatch, caplog
):
    """The error that ended ``fit`` is the one raised; the lost checkpoint is logged."""
    from amp_utils import checkpoint

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    brain = SavingRegression(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(checkpoint_writes="background"),
        checkpointer=Checkpointer(tmp_path),
    )
    brain.fail_in_epoch = 2
    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    loader = DataLoader(make_data(16), batch_size=8)
    with pytest.raises(RuntimeError, match="a failure in the next epoch"):
        brain.fit(range(1, 3), loader, loader)
    assert "The last checkpoint could not be written" in caplog.text
    assert "No space left on device" in caplog.text


def test_evaluation_stages_end_without_autograd_as_in_speechbrain():
    """SpeechBrain calls on_stage_end of VALID and TEST inside torch.no_grad() (TRAIN's
    outside it); here they ran with autograd on, so a hook that runs the model (an extra
    scoring pass, an embedding of an enrolment set) built graphs and kept activations."""

    class Recording(RegressionBrain):
        def on_stage_end(self, stage, stage_loss, epoch=None):
            self.grad_at_end = {**getattr(self, "grad_at_end", {}), stage: torch.is_grad_enabled()}

    brain = Recording({"model": make_model()}, sgd(), run_opts=run_opts())
    data = DataLoader(make_data(8), batch_size=4)
    brain.fit(range(1), data, valid_set=data)
    brain.evaluate(data)
    assert brain.grad_at_end == {Stage.TRAIN: True, Stage.VALID: False, Stage.TEST: False}


def test_check_loss_isfinite_in_a_speechbrain_style_fit_batch_counts_each_loss_once():
    """SpeechBrain's fit_batch calls check_loss_isfinite on each batch's loss. The loop
    counted that loss again when it read it back, so 3 non-finite losses in a row (within
    the default patience of 3) counted 4 and stopped the run, as the built-in fit_batch
    does not."""

    class SpeechBrainStyle(InjectedLossBrain):
        def fit_batch(self, batch):
            should_step = self.step % self.grad_accumulation_factor == 0
            with self.training_ctx:
                outputs = self.compute_forward(batch, Stage.TRAIN)
                loss = self.compute_objectives(outputs, batch, Stage.TRAIN)
            scaled_loss = self.scaler.scale(loss / self.grad_accumulation_factor)
            self.check_loss_isfinite(scaled_loss)
            scaled_loss.backward()
            if should_step:
                self.optimizers_step()
            return loss.detach().cpu()

    for brain_class in (InjectedLossBrain, SpeechBrainStyle):
        brain = brain_class(
            {"model": make_model()},
            sgd(),
            hparams={"bad_steps": {2, 3, 4}, "factor": float("nan")},
            run_opts=run_opts(nonfinite_patience=3, skip_nonfinite_grads=True),
        )
        brain.fit(range(1), DataLoader(make_data(32), batch_size=4))
        assert (brain.optimizer_step, brain.skipped_steps) == (5, 3), brain_class
        assert brain.nonfinite_count == 0


#: SpeechBrain's run options that RunOptions has too, read as Brain attributes there.
SPEECHBRAIN_RUN_OPTIONS = (
    "max_grad_norm",
    "grad_accumulation_factor",
    "skip_nonfinite_grads",
    "nonfinite_patience",
    "noprogressbar",
    "ckpt_interval_minutes",
    "ckpt_interval_steps",
    "debug",
    "debug_batches",
    "debug_epochs",
    "compile",
    "compile_module_keys",
    "compile_mode",
    "distributed_backend",
    "find_unused_parameters",
)


def test_speechbrain_run_options_read_as_brain_attributes():
    """SpeechBrain's Brain has every run option as an attribute (``self.skip_nonfinite_grads``,
    ``self.ckpt_interval_minutes``, ...); here only four were, and code written for it
    failed with AttributeError on the others."""
    brain = RegressionBrain(
        {"model": make_model()},
        sgd(),
        run_opts=run_opts(skip_nonfinite_grads=True, ckpt_interval_minutes=2.5, debug_batches=3),
    )
    for name in SPEECHBRAIN_RUN_OPTIONS:
        assert getattr(brain, name) == getattr(brain.run_opts, name), name
    assert (brain.skip_nonfinite_grads, brain.ckpt_interval_minutes, brain.debug_batches) == (
        True,
        2.5,
        3,
    )
    with pytest.raises(AttributeError):
        brain.nonfinite_patience = 5  # read-only, as the options they mirror


def test_every_run_option_speechbrain_shares_is_a_brain_attribute():
    """The list above is complete: each field of SpeechBrain's RunOptions that ours has
    (but ``device``: here the torch.device in use; and the precisions, in use) reads."""
    speechbrain_core = pytest.importorskip("speechbrain.core")
    shared = {f.name for f in dataclasses.fields(speechbrain_core.RunOptions)} & {
        f.name for f in dataclasses.fields(RunOptions)
    }
    assert shared - {"device", "precision", "eval_precision"} == set(SPEECHBRAIN_RUN_OPTIONS)


def test_an_init_optimizers_that_sets_only_self_optimizer_trains_as_in_speechbrain():
    """SpeechBrain steps ``self.optimizer`` when an ``init_optimizers`` override (written
    before ``optimizers_dict`` existed) sets only that; here such a Brain trained silently
    without a single step."""

    class OldStyle(RegressionBrain):
        def init_optimizers(self):
            self.optimizer = self.opt_class(self.modules.parameters())

    data = DataLoader(make_data(16), batch_size=4)
    old_style = OldStyle({"model": make_model()}, sgd(), run_opts=run_opts())
    old_style.fit(range(1), data)
    built_in = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    built_in.fit(range(1), data)
    assert old_style.optimizer_step == built_in.optimizer_step == 4
    for ours, reference in zip(
        old_style.modules.parameters(), built_in.modules.parameters(), strict=True
    ):
        torch.testing.assert_close(ours, reference)


def layout_warnings(caplog) -> list[str]:
    """The resume's warnings about the batches per optimizer step."""
    return [r.getMessage() for r in caplog.records if "effective batch" in r.getMessage()]


def test_a_resume_with_another_accumulation_factor_says_the_effective_batch_changed(
    tmp_path, caplog
):
    """A run may change trainer.grad_accumulation_factor on resume (docs/command_line.md);
    a change of the batches per optimizer step is named once, with the factor that keeps
    it. The same factor resumes silently, and testing the best checkpoint (which loads the
    Brain's state again) says nothing."""
    train_shuffled(tmp_path / "run", epochs=1, grad_accumulation_factor=2)
    with caplog.at_level(logging.INFO):
        train_shuffled(tmp_path / "same", epochs=1, grad_accumulation_factor=2)
        train_shuffled(tmp_path / "same", epochs=2, grad_accumulation_factor=2)
    assert layout_warnings(caplog) == []
    with caplog.at_level(logging.INFO):
        brain = train_shuffled(tmp_path / "run", epochs=2, grad_accumulation_factor=1)
        assert "Resumed from" in caplog.text
        [warning] = layout_warnings(caplog)
        assert "1 process(es) x trainer.grad_accumulation_factor=2 = 2 batches" in warning
        assert "this session trains 1 x 1 = 1" in warning
        assert "trainer.grad_accumulation_factor=2." in warning
        caplog.clear()
        brain.checkpointer.recover_if_possible()  # as the test stage loads the best one
    assert layout_warnings(caplog) == []


@pytest.mark.parametrize(
    ("saved", "now", "rank", "expected"),
    [
        (2, 1, 0, "trainer.grad_accumulation_factor=2."),  # DDP -> one process
        (1, 2, 0, "No factor keeps it with 2 process(es)."),  # one process -> DDP
        (1, 2, 1, None),  # only rank 0 reports
        (2, 2, 0, None),  # nothing changed
    ],
)
def test_a_resume_under_another_number_of_processes_says_the_effective_batch_changed(
    caplog, saved, now, rank, expected
):
    """DDP <-> one process (docs/scaling.md): each optimizer step then averages another
    number of batches. The resumed session used to say nothing of it."""
    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    state = brain.state_dict()  # end of an epoch: any world size may resume it
    state["world_size"] = saved
    brain.distributed = DistributedInfo(world_size=now, rank=rank, backend="gloo")
    with caplog.at_level(logging.INFO):
        brain.load_state_dict(state)
        brain._report_batch_layout_change()
    warnings = layout_warnings(caplog)
    if expected is None:
        assert warnings == []
    else:
        [warning] = warnings
        assert f"trained with {saved} process(es)" in warning and expected in warning


def test_a_checkpoint_without_its_factor_still_resumes_and_names_the_process_change(caplog):
    """Checkpoints saved before the factor was recorded load as before; a change of the
    number of processes is still named."""
    brain = RegressionBrain({"model": make_model()}, sgd(), run_opts=run_opts())
    state = brain.state_dict()
    del state["grad_accumulation_factor"]
    state["world_size"] = 2
    with caplog.at_level(logging.WARNING):
        brain.load_state_dict(state)
        brain._report_batch_layout_change()
    assert "saved by 2 process(es) with 1 process(es)" in caplog.text


def test_an_evaluation_loss_left_out_as_non_finite_is_warned_about(caplog):
    """A test batch whose loss overflowed (inf) was left out of the test loss without a
    word, so the reported loss was that of the other batches only."""

    class Overflowing(RegressionBrain):
        def compute_objectives(self, predictions, batch, stage):
            loss = super().compute_objectives(predictions, batch, stage)
            return loss * float("inf") if batch[0][0, 0] > 10.0 else loss

    data = make_data(32)
    x, y = data.tensors
    x[8, 0] = 50.0  # the first item of the third batch of 4
    brain = Overflowing({"model": make_model()}, sgd(), run_opts=run_opts())
    loader = DataLoader(data, batch_size=4)
    with caplog.at_level(logging.WARNING, logger="amp_utils.brain"):
        loss = brain.evaluate(loader)
    assert 0 < loss < float("inf")
    assert "test: 1 evaluated batch(es) had a non-finite loss" in caplog.text
    caplog.clear()
    clean = make_data(32)
    with caplog.at_level(logging.WARNING, logger="amp_utils.brain"):
        brain.evaluate(DataLoader(clean, batch_size=4))
    assert "non-finite" not in caplog.text
