"""Whole-step CUDA graphs (``trainer.graph_step``): the bookkeeping, the capturable
optimizer, the graph-safe step of the ASR recipe (checked eagerly on the CPU against the
usual step), the fallbacks, and on a GPU the capture itself."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from amp_utils import Brain, Stage, TrainingInterrupted
from amp_utils.compile import unwrap_module
from amp_utils.step_graphs import (
    CapturableOptimizers,
    CaptureFailed,
    StepGraphs,
    clone_tensors,
    shape_key,
    tensor_leaves,
)
from amp_utils.step_ledger import StepInfo
from data.fsdd import prepare_fsdd_digits
from recipes.audio_brain import AudioBrain
from recipes.augment import WaveAugment
from recipes.config import ConfigError, validate_config
from recipes.data_setup import build_data
from recipes.experiment import build_brain, train
from tests.recipe_helpers import FAST, compose_config, run_cli
from tests.test_host_reads import UserBlock, counting_backend


@dataclass
class _Batch:
    x: torch.Tensor
    names: list[str]


# ------------------------------------------------------------ bookkeeping


def test_clone_tensors_copies_every_tensor_and_keeps_the_structure() -> None:
    info = StepInfo(torch.tensor(1.0), torch.tensor(False))
    value = (torch.ones(2), info, {"b": _Batch(torch.zeros(3), ["a"])}, None, 3)
    cloned = clone_tensors(value)
    assert isinstance(cloned[1], StepInfo) and isinstance(cloned[2]["b"], _Batch)
    assert cloned[2]["b"].names == ["a"] and cloned[3] is None and cloned[4] == 3
    for original, copy in zip(tensor_leaves(value), tensor_leaves(cloned), strict=True):
        assert torch.equal(original, copy) and original.data_ptr() != copy.data_ptr()


def test_shape_key_tells_batch_shapes_apart() -> None:
    a = _Batch(torch.zeros(4, 100), ["x"] * 4)
    assert shape_key(a) == shape_key(_Batch(torch.ones(4, 100), ["y"] * 4))
    assert shape_key(a) != shape_key(_Batch(torch.zeros(4, 120), ["x"] * 4))
    assert shape_key(a) != shape_key(_Batch(torch.zeros(4, 100, dtype=torch.float16), ["x"]))


def test_without_capture_every_step_runs_the_body_eagerly() -> None:
    seen = []

    def body(batch):
        seen.append(batch)
        return batch.x.sum()

    graphs = StepGraphs(body, clone_tensors, lambda s, b: None, capture=False)
    for n in (3, 3, 5, 3):
        assert graphs(_Batch(torch.ones(n), [])) == n
    assert len(seen) == 4 and graphs.stats() == {"graphs": 0, "replays": 0, "eager_steps": 4}
    with pytest.raises(ValueError, match="warmup_steps must be >= 1"):
        StepGraphs(body, clone_tensors, lambda s, b: None, warmup_steps=0, capture=False)


def test_compiled_modules_stay_compiled_after_the_checked_warm_up_step() -> None:
    """The last warm-up step of a shape runs under HostReads; the steps after it (the
    capture and the replays on CUDA, eager steps here) must still run the compiled code.
    On the 2026-11-26 H200 they did not: Conformer-M's compiled blocks ran eagerly inside
    every captured step (no inductor kernel in the profile, 37 ms instead of ~24 ms)."""
    torch._dynamo.reset()
    runs: list[int] = []
    module = UserBlock()
    module.compile(backend=counting_backend(runs), dynamic=True)
    graphs = StepGraphs(
        lambda batch: module(batch.x).sum(), clone_tensors, lambda s, b: None, capture=False
    )
    for _ in range(5):  # warm-up, checked warm-up, then the steps a GPU would capture
        graphs(_Batch(torch.ones(6), []))
    assert len(runs) == 4, f"compiled code ran in {len(runs)} of 4 unchecked steps"
    torch._dynamo.reset()


class _FakeCuda:
    """Stand-ins for the ``torch.cuda`` graph API, so that the bookkeeping of
    :class:`StepGraphs` runs on a CPU: a "capture" runs the body with ``capturing`` set
    (a real capture records instead of running), a "replay" is counted."""

    def __init__(self, monkeypatch) -> None:
        self.capturing = False
        self.replays = 0
        fake = self

        class Graph:
            def replay(self) -> None:
                fake.replays += 1

        class Capture:
            def __init__(self, graph, pool=None, capture_error_mode="global") -> None:
                assert capture_error_mode == "thread_local"

            def __enter__(self) -> None:
                fake.capturing = True

            def __exit__(self, *exc) -> None:
                fake.capturing = False

        class Stream:
            def wait_stream(self, other) -> None:
                pass

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())


def test_each_shape_warms_up_then_is_captured_once_and_replayed(monkeypatch, caplog) -> None:
    cuda = _FakeCuda(monkeypatch)
    calls: list[tuple[int, bool]] = []
    copies: list[int] = []

    def body(batch):
        calls.append((batch.x.shape[0], cuda.capturing))
        return StepInfo(batch.x.sum(), torch.tensor(False))

    def copy_into(static, batch):
        copies.append(batch.x.shape[0])
        static.x.copy_(batch.x)

    graphs = StepGraphs(body, clone_tensors, copy_into, warmup_steps=2, max_shapes=1)
    a = _Batch(torch.ones(3), [])
    outputs = [graphs(a) for _ in range(5)]
    # Two warm-up steps, then the capture (recorded and replayed once), then replays.
    assert calls == [(3, False), (3, False), (3, True)]
    assert cuda.replays == 3 and copies == [3, 3]
    assert graphs.stats() == {"graphs": 1, "replays": 3, "eager_steps": 2}
    static_outputs = graphs.graphs[shape_key(a)].outputs
    assert all(o.grad_norm.data_ptr() != static_outputs.grad_norm.data_ptr() for o in outputs)
    with caplog.at_level(logging.WARNING):
        for _ in range(4):  # a second shape: more than max_shapes allows
            graphs(_Batch(torch.ones(5), []))
    assert calls[3:] == [(5, False)] * 4 and len(graphs.graphs) == 1
    assert caplog.text.count("graph_step_max_shapes") == 1


def test_later_shapes_are_captured_after_their_own_shorter_warm_up(monkeypatch) -> None:
    """Once a graph exists, a new shape warms up with ``later_warmup_steps`` eager steps;
    a shape first seen before that keeps its count of the steps it already had."""
    cuda = _FakeCuda(monkeypatch)
    calls: list[tuple[int, bool]] = []

    def body(batch):
        calls.append((batch.x.shape[0], cuda.capturing))
        return batch.x.sum()

    graphs = StepGraphs(
        body, clone_tensors, lambda s, b: None, warmup_steps=2, later_warmup_steps=1
    )
    for size in (3, 4, 3, 3, 5, 5, 4, 4):
        graphs(_Batch(torch.ones(size), []))
    assert calls == [
        (3, False),
        (4, False),  # before the first capture: shape 4's first of its warm-up steps
        (3, False),
        (3, True),  # shape 3: two warm-up steps, then the capture
        (5, False),
        (5, True),  # shape 5, new after a capture: one warm-up step
        (4, True),  # shape 4 had its one step already
    ]
    assert graphs.stats() == {"graphs": 3, "replays": 4, "eager_steps": 4}
    with pytest.raises(ValueError, match="later_warmup_steps must be >= 1"):
        StepGraphs(body, clone_tensors, lambda s, b: None, later_warmup_steps=0, capture=False)


def test_the_brain_warms_later_shapes_up_once_unless_modules_are_compiled(
    fsdd_root, prepared, tmp_path, monkeypatch
) -> None:
    """One eager step before a later shape's capture: its cuDNN algorithm search. Compiled
    modules compile for a shape in its second step, so with them it is two; an explicit
    ``trainer.graph_step_later_warmup`` wins."""
    brain, _ = _brain(fsdd_root, prepared, tmp_path / "a")
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    assert brain.graph_step_later_warmup() == 1
    assert brain._step_graphs.later_warmup_steps == 1 and brain._step_graphs.warmup_steps == 2
    brain._compiled = True
    assert brain.graph_step_later_warmup() == 2
    brain.run_opts.graph_step_later_warmup = 3
    assert brain.graph_step_later_warmup() == 3


def test_a_capture_error_is_reported_as_capture_failed(monkeypatch) -> None:
    cuda = _FakeCuda(monkeypatch)

    def body(batch):
        if cuda.capturing:
            raise RuntimeError("operation not permitted when stream is capturing")
        return batch.x.sum()

    graphs = StepGraphs(body, clone_tensors, lambda s, b: None, warmup_steps=1)
    graphs(_Batch(torch.ones(2), []))
    with pytest.raises(CaptureFailed, match="RuntimeError: operation not permitted"):
        graphs(_Batch(torch.ones(2), []))
    assert not graphs.graphs


@pytest.mark.parametrize("capture", [True, False])
def test_a_shape_whose_warm_up_read_host_values_is_not_captured(monkeypatch, capture) -> None:
    """Only the last warm-up step of a shape is watched; its host reads stop that shape's
    capture (before anything is recorded) with the line that made them. Without capture
    (a CPU) the step after the warm-up fails alike, so CPU tests see what a GPU would."""
    cuda = _FakeCuda(monkeypatch)
    captured = []

    def body(batch):
        captured.append(cuda.capturing)
        if batch.x.shape[0] == 2:
            scale = float(batch.x.max())  # a host read
            return batch.x.sum() * scale
        return batch.x.sum()

    graphs = StepGraphs(body, clone_tensors, lambda s, b: None, warmup_steps=2, capture=capture)
    for _ in range(3):
        graphs(_Batch(torch.ones(3), []))  # reads nothing: warmed up and captured
    graphs(_Batch(torch.ones(2), []))
    graphs(_Batch(torch.ones(2), []))
    with pytest.raises(CaptureFailed, match=r"reads values on the host") as failed:
        graphs(_Batch(torch.ones(2), []))
    assert "test_step_graphs.py" in str(failed.value) and "in body" in str(failed.value)
    assert list(graphs.host_reads) == [shape_key(_Batch(torch.ones(2), []))]
    assert captured == [False, False, capture, False, False]
    assert len(graphs.graphs) == int(capture)


def test_the_step_before_each_capture_runs_compiled_code_as_compiled() -> None:
    """The host-read check is each shape's first warm-up step, so the last one runs outside
    the dispatch mode, where ``torch.compile``d code runs compiled: inductor compiles it
    there, not during the capture, which it cannot do (2026-11-27 H200: bf16 with the
    weights cast together observed the weights in the first warm-up step and checked the
    second, both eager, and every capture failed with "Cannot copy between CPU and CUDA
    tensors during CUDA graph capture")."""
    checked = []

    def body(batch):
        checked.append(torch._C._len_torch_dispatch_stack() > 0)
        return batch.x.sum()

    graphs = StepGraphs(body, clone_tensors, lambda s, b: None, warmup_steps=2, capture=False)
    for size in (3, 2):
        for _ in range(3):
            graphs(_Batch(torch.ones(size), []))
    assert checked == [True, False, False] * 2


def test_capturable_optimizers_hold_lr_tensors_only_during_the_step() -> None:
    params = [torch.nn.Parameter(torch.ones(3))]
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    capturable = CapturableOptimizers([opt], torch.device("cpu"))
    opt.param_groups[0]["lr"] = 5e-4  # the scheduler moved it
    capturable.refresh()
    with capturable.during_step():
        group = opt.param_groups[0]
        assert isinstance(group["lr"], torch.Tensor) and not group["capturable"]  # not capturing
        assert group["lr"].item() == pytest.approx(5e-4)
        params[0].grad = torch.ones(3)
        opt.step()
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, float) and lr == 5e-4 and not opt.param_groups[0]["capturable"]
    assert params[0].detach().lt(1.0).all()  # the step applied the tensor lr
    with pytest.raises(RuntimeError), capturable.during_step():
        raise RuntimeError("capture failed")
    assert opt.param_groups[0]["lr"] == 5e-4  # restored after an error too
    assert isinstance(opt.param_groups[0]["lr"], float)


@pytest.mark.parametrize("fused_weight_casts", [False, True])
@pytest.mark.parametrize("graph_step", [False, True])
def test_the_graph_safe_step_runs_autocast_without_its_weight_cache(
    monkeypatch, graph_step, fused_weight_casts
):
    """A capture would freeze the autocast cache's casts of the weights: the graph-safe
    step turns the cache off; the usual step keeps torch's default (on), with
    ``fused_weight_casts`` too, on its observing first step as on the others (so that the
    first step of a resumed session casts as the uninterrupted run's step did)."""
    seen = []

    class Probe(Brain):
        def compute_forward(self, batch, stage):
            seen.append(torch.is_autocast_cache_enabled())
            return self.modules.model(batch[0])

        def compute_objectives(self, outputs, batch, stage):
            return outputs.float().pow(2).mean()

    brain = Probe(
        {"model": torch.nn.Linear(4, 2)},
        opt_class=lambda params: torch.optim.AdamW(params, 1e-3, fused=True),
        run_opts={
            "device": "cpu",
            "precision": "bf16",
            "graph_step": graph_step,
            "fused_weight_casts": fused_weight_casts,
        },
    )
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    for _ in range(3):
        brain.train_step((torch.randn(3, 4),))
    brain.flush_pending()
    assert seen == [not graph_step] * 3 and brain.optimizer_step == 3


def test_a_replayed_step_copies_its_batch_in_before_waiting_for_the_previous_step(
    monkeypatch,
) -> None:
    """Before each replay the Brain waits for the previous step (its loss, and the LR of
    the next step). Whatever host work comes after that wait leaves the GPU idle, so the
    batch's shape key and its copies into the graph's inputs come before it; they came
    after, ~0.5 ms a step on a 2-core CPU, for steps of ~7 ms on the 2026-11-27 H200."""
    cuda = _FakeCuda(monkeypatch)
    events: list[str] = []

    class Probe(Brain):
        def compute_forward(self, batch, stage):
            return self.modules.model(batch[0])

        def compute_objectives(self, outputs, batch, stage):
            return outputs.float().pow(2).mean()

        def copy_into_static(self, static, batch):
            events.append("copy")
            super().copy_into_static(static, batch)

        def flush_pending(self):
            events.append("wait")
            super().flush_pending()

    brain = Probe(
        {"model": torch.nn.Linear(4, 2)},
        opt_class=lambda params: torch.optim.AdamW(params, 1e-3, fused=True),
        run_opts={"device": "cpu", "graph_step": True},
    )
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    brain._step_graphs.capture = True  # the fake CUDA graphs: a capture runs, replays count
    for _ in range(5):  # two warm-up steps, the capture, two replays
        events.clear()
        brain.train_step((torch.randn(3, 4),))
    assert cuda.replays == 3 and events == ["copy", "wait"]
    brain.flush_pending()
    assert brain.optimizer_step == 5


def test_end_cuts_draw_on_the_batchs_device_for_a_captured_step() -> None:
    aug = WaveAugment(8000, cut_end_prob=1.0).train()
    wavs, lens = torch.zeros(4, 800, device="meta"), torch.full((4,), 800, device="meta")
    aug(wavs, lens, host_draws=False)
    assert aug._kept_permille.device.type == "meta"
    aug(wavs, lens)
    assert aug._kept_permille.device.type == "cpu"  # the host draws of the usual step


# ------------------------------------------------------------ the recipe's step


@pytest.fixture(scope="module")
def prepared(fsdd_root: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared_step_graphs")
    prepare_fsdd_digits(fsdd_root, out, download=False)
    return out


def _config(fsdd_root, prepared, out, *extra: str):
    """The fast test config with ``fast_path=step_graphs``, writing into ``out``."""
    return compose_config(
        [
            *FAST,
            f"data.root={fsdd_root}",
            f"data.prepared_dir={prepared}",
            f"output_dir={out}",
            "fast_path=step_graphs",
            *extra,
        ]
    )


def _brain(fsdd_root, prepared, tmp_path, *extra: str):
    cfg = _config(fsdd_root, prepared, tmp_path, *extra)
    torch.manual_seed(0)
    data = build_data(cfg, torch.device("cpu"))
    return build_brain(cfg, data, None, None), data


def _train(brain, batches) -> list[float]:
    torch.manual_seed(1)
    losses = [float(brain.train_step(batch)) for batch in batches]
    brain.flush_pending()
    return losses


def _fp32_lr(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` step with each group's lr rounded to fp32, as the captured step's
    lr tensors hold it (the groups keep their float lr between steps).

    The CPU's AdamW otherwise computes with the float64 lr: 1 ulp of fp32 apart, which a
    few Adam steps amplify chaotically (measured on the x-vector in fp32: 3e-5 of the loss
    at step 3, 7e-3 at step 5, 3 % at step 6; a thread count of 1 instead of 2 does the
    same). Rounded, the graph-safe step of a model without CTC equals the usual one bit
    for bit on any CPU."""
    saved: list[float] = []

    def before(opt, args, kwargs) -> None:
        saved[:] = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = float(torch.tensor(group["lr"], dtype=torch.float32))

    def after(opt, args, kwargs) -> None:
        for group, lr in zip(opt.param_groups, saved, strict=True):
            group["lr"] = lr

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


@pytest.mark.parametrize(
    ("model", "precision", "rel"),
    [
        # The CTC loss with device lengths rounds differently from F.ctc_loss: ~3e-7 of
        # the loss in fp32, up to 1e-4 after fp16's first applied steps.
        ("conformer_ctc", "fp32", 1e-5),
        ("conformer_ctc", "fp16", 3e-4),
        ("xvector", "fp32", 0.0),  # the same arithmetic: equal bit for bit
        ("xvector", "bf16", 0.0),
    ],
)
def test_graph_safe_step_trains_as_the_usual_step(
    fsdd_root, prepared, tmp_path, monkeypatch, model, precision, rel
):
    """The step a graph records (device-side CTC lengths and end cuts, lr tensors, no
    autocast cache), run eagerly on the CPU, trains as the usual step does: same losses,
    same weights, same applied/skipped steps (fp16's first steps overflow), lr schedule.
    The usual step runs with the lr rounded to fp32 as the lr tensors hold it
    (:func:`_fp32_lr`): that 1-ulp difference is chaotic, not a property of the step (it
    failed this test on a 16-core CPU that passed on 2 cores)."""
    extra = (f"model={model}", f"precision={precision}")
    usual, data = _brain(fsdd_root, prepared, tmp_path / "a", *extra)
    graphed, _ = _brain(fsdd_root, prepared, tmp_path / "b", *extra)
    monkeypatch.setattr(graphed, "step_graph_blocker", lambda: None)
    usual.on_fit_start()
    graphed.on_fit_start()
    _fp32_lr(usual.optimizer)
    assert usual.step_graph_stats() is None and graphed.step_graph_stats() is not None
    batches = [batch for _, batch in zip(range(4), data.train, strict=False)]
    assert _train(usual, batches) == pytest.approx(_train(graphed, batches), rel=rel, abs=0)
    assert graphed.step_graph_stats() == {"graphs": 0, "replays": 0, "eager_steps": 4}
    assert (usual.optimizer_step, usual.skipped_steps) == (
        graphed.optimizer_step,
        graphed.skipped_steps,
    )
    lr = graphed.optimizer.param_groups[0]["lr"]
    assert isinstance(lr, float) and lr == usual.optimizer.param_groups[0]["lr"]
    pairs = list(zip(usual.modules.parameters(), graphed.modules.parameters(), strict=True))
    if rel == 0:
        assert all(torch.equal(a, b) for a, b in pairs)
    # Adam moves a weight by ~lr whatever its gradient's size: weights whose gradient is
    # ~0 may step either way on a rounding difference of the losses (a few in 10^4).
    moved = sum(int((a - b).abs().gt(2e-4).sum()) for a, b in pairs)
    assert moved < 1e-3 * sum(p.numel() for p in usual.modules.parameters())


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("model", ["conformer_ctc", "xvector"])
def test_the_graph_safe_step_reads_no_host_values(
    fsdd_root, prepared, tmp_path, monkeypatch, model, precision
):
    """Every shape's warm-up step (here the first: ``graph_step_warmup=1``) runs under
    HostReads, as on a GPU before a capture: the recipes' graph-safe steps read nothing on
    the host (a read would be frozen at the capture or break it), with the default
    augmentation on. (Speed perturbation drew its one factor on the host until this test.)"""
    brain, data = _brain(
        fsdd_root,
        prepared,
        tmp_path,
        f"model={model}",
        f"precision={precision}",
        "trainer.graph_step_warmup=1",
    )
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    if model == "conformer_ctc":
        assert unwrap_module(brain.modules.wave_augment).enabled
    _train(brain, [batch for _, batch in zip(range(2), data.train, strict=False)])
    assert brain._step_graphs is not None, "the graph-safe step was given up"
    assert len(brain._step_graphs.seen) == 2  # two shapes, each checked
    assert brain._step_graphs.host_reads == {}


def _validate(brain, batches) -> tuple[list[float], dict[str, float], list]:
    """One validation over ``batches`` as the loop runs it: losses, metrics, outcomes."""
    brain.modules.eval()
    brain.on_stage_start(Stage.VALID, 1)
    losses = [float(brain.evaluate_batch(batch, Stage.VALID)) for batch in batches]
    return losses, brain.stage_metrics(Stage.VALID), list(brain.outcomes)


@pytest.mark.parametrize(
    ("model", "precision"),
    [("conformer_ctc", "fp32"), ("conformer_ctc", "bf16"), ("xvector", "fp32")],
)
def test_validation_through_the_eval_graphs_scores_as_eager_validation(
    fsdd_root, prepared, tmp_path, monkeypatch, model, precision
):
    """``trainer.graph_eval``: validation's forward pass and loss from device tensors
    alone (what a CUDA graph records: device CTC lengths, no scoring inside), then the
    recipe's ``score_predictions`` on the host. Run eagerly on the CPU over two
    validations, it gives eager validation's metrics and outcomes exactly, and its losses
    to rounding (the device CTC loss against ``F.ctc_loss``); its first pass of each shape,
    the one checked before a capture, reads no host value."""
    extra = (f"model={model}", f"precision={precision}")
    graphed, data = _brain(fsdd_root, prepared, tmp_path / "a", *extra)
    eager, _ = _brain(fsdd_root, prepared, tmp_path / "b", *extra, "trainer.graph_eval=false")
    for brain in (graphed, eager):
        monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
        brain.on_fit_start()
    assert graphed._eval_graphs is not None and eager._eval_graphs is None
    batches = [batch for _, batch in zip(range(3), data.valid, strict=False)]
    for _ in range(2):
        losses, metrics, outcomes = _validate(graphed, batches)
        expected_losses, expected_metrics, expected_outcomes = _validate(eager, batches)
        assert metrics == expected_metrics and outcomes == expected_outcomes
        assert losses == pytest.approx(expected_losses, rel=1e-5)
    assert graphed._eval_graphs is not None, "the graph-safe evaluation was given up"
    assert graphed._eval_graphs.host_reads == {}
    shapes = len({shape_key(graphed.graph_input(b)) for b in batches})
    assert graphed.eval_graph_stats() == {"graphs": 0, "replays": 0, "eager_steps": 6}
    assert len(graphed._eval_graphs.seen) == shapes


def test_validation_replays_its_graphs_and_scores_each_replay(
    fsdd_root, prepared, tmp_path, monkeypatch
):
    """With CUDA graphs faked on the CPU (a replay runs the recorded body again on the
    graph's static inputs and writes the graph's output tensors, as a real one does), each
    validation shape is run eagerly once, captured the next time it comes and replayed
    after; every batch is scored from its own replay's outputs, as eager validation."""
    cuda = _FakeCuda(monkeypatch)
    capture = StepGraphs._capture

    def capture_replaying(self, key, batch):
        outputs = capture(self, key, batch)
        entry = self.graphs[key]

        def replay() -> None:
            fresh = self.body(entry.static_batch)
            for dst, src in zip(tensor_leaves(entry.outputs), tensor_leaves(fresh), strict=True):
                dst.copy_(src)
            cuda.replays += 1

        entry.graph = type("Replaying", (), {"replay": staticmethod(replay)})()
        return outputs

    monkeypatch.setattr(StepGraphs, "_capture", capture_replaying)
    brain, data = _brain(fsdd_root, prepared, tmp_path / "a")
    eager, _ = _brain(fsdd_root, prepared, tmp_path / "b", "trainer.graph_eval=false")
    for b in (brain, eager):
        monkeypatch.setattr(b, "step_graph_blocker", lambda: None)
        b.on_fit_start()
    brain._eval_graphs.capture = True  # what CUDA does; the fake records and replays
    batches = [batch for _, batch in zip(range(4), data.valid, strict=False)]
    shapes = len({shape_key(brain.graph_input(b)) for b in batches})
    _, expected, expected_outcomes = _validate(eager, batches)
    for _ in range(3):
        _, metrics, outcomes = _validate(brain, batches)
        assert metrics == expected and outcomes == expected_outcomes
    steps = 3 * len(batches)
    assert brain.eval_graph_stats() == {
        "graphs": shapes,
        "replays": steps - shapes,
        "eager_steps": shapes,
    }
    assert cuda.replays == steps - shapes


def test_a_recipe_that_scores_inside_its_objectives_validates_eagerly(
    fsdd_root, prepared, tmp_path, monkeypatch, caplog
):
    """``score_predictions`` is what lets validation replay graphs; a recipe without it
    (SpeechBrain's way: scoring in ``compute_objectives``) validates as before, and the
    log says why."""
    brain, _ = _brain(fsdd_root, prepared, tmp_path)
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    monkeypatch.setattr(type(brain), "scores_predictions", lambda self: False)
    with caplog.at_level(logging.INFO, logger="amp_utils.brain"):
        brain.on_fit_start()
    assert brain._step_graphs is not None and brain._eval_graphs is None
    assert "override score_predictions" in caplog.text


def test_validation_compiled_for_evaluation_warms_each_shape_up_twice(
    fsdd_root, prepared, tmp_path, monkeypatch
):
    """Modules compiled for evaluation (``trainer.compile_eval``) compile for a shape in
    its second pass (the first, checked for host reads, runs them eagerly): captured at
    the first pass, they would compile inside the capture and fail it."""
    brain, _ = _brain(fsdd_root, prepared, tmp_path)
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    assert brain._eval_graphs.warmup_steps == 1
    brain._compiled = True
    brain._set_up_eval_graphs()
    assert brain._eval_graphs.warmup_steps == 1  # evaluation runs eagerly (compile_eval off)
    brain.run_opts.compile_eval = True
    brain._set_up_eval_graphs()
    assert brain._eval_graphs.warmup_steps == 2


def test_a_step_that_reads_host_values_is_not_captured_and_says_where(
    fsdd_root, prepared, tmp_path, monkeypatch, caplog
):
    """A recipe whose step reads a value on the host (here the loss, as a float) is told
    at its first shape's capture which line does it, and trains on as usual."""
    brain, data = _brain(fsdd_root, prepared, tmp_path, "trainer.graph_step_warmup=1")
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    objectives = brain.compute_objectives

    def reading(outputs, batch, stage):
        loss = objectives(outputs, batch, stage)
        if float(loss.detach()) > 1e9:  # a host read of the loss
            raise AssertionError
        return loss

    monkeypatch.setattr(brain, "compute_objectives", reading)
    batch = next(iter(data.train))
    with caplog.at_level(logging.WARNING):
        losses = _train(brain, [batch, batch, batch])
    assert "could not be captured" in caplog.text and "reads values on the host" in caplog.text
    assert "test_step_graphs.py" in caplog.text and "in reading" in caplog.text
    assert brain.step_graph_stats() is None and len(losses) == 3
    assert brain.optimizer_step + brain.skipped_steps == 3


def test_a_whole_run_through_the_graph_safe_step_ends_as_the_usual_run(
    fsdd_root, prepared, tmp_path, monkeypatch
):
    """Two epochs, validation and checkpoints between them, the LR schedule across them,
    the test: with every training step taken by the graph-safe step (run eagerly on the
    CPU, as a GPU runs a shape's warm-up steps), the run ends where the usual one does."""

    def run(name: str, graphed: bool) -> dict:
        graph_step = f"trainer.graph_step={str(graphed).lower()}"
        cfg = _config(fsdd_root, prepared, tmp_path / name, graph_step, "trainer.debug_batches=3")
        if graphed:  # the CPU's blocker lifted: StepGraphs runs every step eagerly here
            monkeypatch.setattr(AudioBrain, "step_graph_blocker", lambda self: None)
        return train(cfg)

    usual, graphed = run("usual", False), run("graphed", True)
    assert usual["step_graphs"] is None
    assert graphed["step_graphs"] == {"graphs": 0, "replays": 0, "eager_steps": 6}
    assert graphed["optimizer_steps"] == usual["optimizer_steps"] == 6
    assert graphed["test_metrics"] == pytest.approx(usual["test_metrics"], rel=1e-3)
    assert graphed["valid_metrics"] == pytest.approx(usual["valid_metrics"], rel=1e-3)


def _interrupted_and_uninterrupted(
    fsdd_root, prepared, tmp_path, monkeypatch, stop_at: int, *overrides: str
) -> tuple[dict, dict, list[int]]:
    """Results of a run stopped by SIGTERM after step ``stop_at`` (a checkpoint, then exit)
    and run again by the same call (resume), of the same run uninterrupted, and the steps
    that were stopped at."""
    original = AudioBrain.on_fit_batch_end
    interrupted: list[int] = []

    def stop_once(self, batch, outputs, loss, should_step):
        original(self, batch, outputs, loss, should_step)
        if self.step == stop_at and not interrupted and self.run_opts.graph_step:
            interrupted.append(self.step)
            self.stop_signals.received = signal.SIGTERM  # as the handler records it

    def run(name: str, stop: bool) -> dict:
        cfg = _config(fsdd_root, prepared, tmp_path / name, *overrides)
        if stop:
            monkeypatch.setattr(AudioBrain, "on_fit_batch_end", stop_once)
            with pytest.raises(TrainingInterrupted):
                train(cfg)
            monkeypatch.setattr(AudioBrain, "on_fit_batch_end", original)
        return train(cfg)

    resumed = run("resumed", stop=True)
    return resumed, run("uninterrupted", stop=False), interrupted


def test_an_interrupted_run_through_the_graph_safe_step_resumes_exactly(
    fsdd_root, prepared, tmp_path, monkeypatch
):
    """SIGTERM in the middle of the first epoch (a checkpoint, then exit), the same call
    again (resume): the run ends exactly where an uninterrupted one does -- the lr tensors,
    device-side draws and ledger carry nothing a checkpoint misses."""
    monkeypatch.setattr(AudioBrain, "step_graph_blocker", lambda self: None)
    resumed, uninterrupted, interrupted = _interrupted_and_uninterrupted(
        fsdd_root, prepared, tmp_path, monkeypatch, 2, "trainer.debug_batches=4"
    )
    assert interrupted == [2] and resumed["sessions"] == 2
    assert resumed["optimizer_steps"] == uninterrupted["optimizer_steps"] == 8
    assert resumed["test_metrics"] == uninterrupted["test_metrics"]  # exactly
    assert resumed["valid_metrics"] == uninterrupted["valid_metrics"]


def test_a_failed_capture_logs_why_and_trains_the_batch_as_usual(
    fsdd_root, prepared, tmp_path, monkeypatch, caplog
):
    """A capture that fails part-way (here after the fp16 unscale) leaves no half step
    behind: the batch trains as usual, and so does every later one."""
    brain, data = _brain(fsdd_root, prepared, tmp_path, "precision=fp16")
    monkeypatch.setattr(brain, "step_graph_blocker", lambda: None)
    brain.on_fit_start()
    body = brain._step_graphs.body

    def failing(batch):
        original = brain.amp_step.step

        def step_then_fail(optimizers):
            optimizers = list(optimizers)
            for opt in optimizers:
                brain.scaler.unscale_(opt)
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(brain.amp_step, "step", step_then_fail)
        try:
            body(batch)
        except RuntimeError as err:
            raise CaptureFailed(str(err)) from err
        finally:
            monkeypatch.setattr(brain.amp_step, "step", original)

    brain._step_graphs.body = failing
    monkeypatch.setattr(brain._step_graphs, "capture", True)
    monkeypatch.setattr(brain._step_graphs, "_warm_up", lambda key, batch, check: failing(batch))
    batches = [batch for _, batch in zip(range(3), data.train, strict=False)]
    with caplog.at_level(logging.WARNING):
        losses = _train(brain, batches)
    assert "could not be captured" in caplog.text and "not permitted" in caplog.text
    assert brain.step_graph_stats() is None and len(losses) == 3
    assert brain.optimizer_step + brain.skipped_steps == 3


def test_a_run_resumed_after_a_failed_capture_trains_eagerly_as_the_uninterrupted_run(
    fsdd_root, prepared, tmp_path, monkeypatch, caplog
):
    """The capture fails at step 2 of each session (after one graph-safe step); SIGTERM at
    step 3, then the same call again. The uninterrupted run trains eagerly from step 2 on;
    the resumed session must not take graph-safe steps (other draws, another CTC) again."""
    monkeypatch.setattr(AudioBrain, "step_graph_blocker", lambda self: None)
    original = StepGraphs.run

    def fails_on_the_second_call(self, prepared):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 2:
            raise CaptureFailed("RuntimeError: operation not permitted when stream is capturing")
        return original(self, prepared)

    monkeypatch.setattr(StepGraphs, "run", fails_on_the_second_call)
    with caplog.at_level(logging.WARNING):
        resumed, uninterrupted, interrupted = _interrupted_and_uninterrupted(
            fsdd_root, prepared, tmp_path, monkeypatch, 3, "trainer.debug_batches=4"
        )
    assert interrupted == [3] and resumed["sessions"] == 2
    assert "an earlier session of this run could not capture" in caplog.text
    assert resumed["optimizer_steps"] == uninterrupted["optimizer_steps"] == 8
    assert resumed["test_metrics"] == uninterrupted["test_metrics"]  # exactly
    assert resumed["valid_metrics"] == uninterrupted["valid_metrics"]


def test_graph_step_on_a_cpu_logs_why_and_trains_as_usual(fsdd_root, prepared, tmp_path, caplog):
    brain, _ = _brain(fsdd_root, prepared, tmp_path)
    with caplog.at_level(logging.WARNING):
        brain.on_fit_start()
    assert "need a CUDA device (this run: cpu)" in caplog.text
    assert brain.step_graph_stats() is None
    assert brain.eval_graph_stats() is None  # validation graphs only with the step's


def test_speed_perturbation_blocks_whole_step_graphs(fsdd_root, prepared, tmp_path):
    brain, _ = _brain(fsdd_root, prepared, tmp_path, "data.wave_augment.speeds=[0.9,1.0,1.1]")
    assert "need a CUDA device" in brain.step_graph_blocker()
    brain.init_optimizers()
    brain.device = torch.device("cuda")  # what the recipe's own check says on a GPU
    assert "speed perturbation" in brain.step_graph_blocker()


def test_graph_step_with_compiled_cuda_graphs_is_a_config_error(fsdd_root) -> None:
    cfg = compose_config(
        [
            *FAST,
            "fast_path=step_graphs",
            "trainer.compile=true",
            "trainer.compile_mode=reduce-overhead",
        ]
    )
    with pytest.raises(ConfigError, match="compile_mode=default"):
        validate_config(cfg)


def test_one_warm_up_step_before_capturing_compiled_code_is_a_config_error() -> None:
    """With one warm-up step (the host-read check, where compiled code runs eagerly) the
    compiled blocks would compile inside the capture: it fails, and the whole run trains
    without graphs. Refused before any work, naming the default; without compile it runs."""
    graphed = ["fast_path=step_graphs", "trainer.graph_step_warmup=1"]
    cfg = compose_config([*FAST, *graphed, "trainer.compile=true"])
    with pytest.raises(ConfigError, match=r"graph_step_warmup=1 with trainer.compile=true.*=2"):
        validate_config(cfg)
    validate_config(compose_config([*FAST, *graphed]))
    validate_config(compose_config([*FAST, *graphed[:1], "trainer.compile=true"]))
    later = [graphed[0], "trainer.graph_step_later_warmup=1"]
    cfg = compose_config([*FAST, *later, "trainer.compile=true"])
    with pytest.raises(ConfigError, match=r"later_warmup=1 with trainer.compile=true.*or 2"):
        validate_config(cfg)
    validate_config(compose_config([*FAST, *later]))


def test_graph_step_without_fixed_batch_shapes_is_a_config_error() -> None:
    cfg = compose_config([*FAST, "trainer.graph_step=true"])
    with pytest.raises(ConfigError, match="data.pad_to_buckets=true"):
        validate_config(cfg)


def test_fast_path_step_graphs_composes() -> None:
    cfg = compose_config(["fast_path=step_graphs"])
    assert cfg.trainer.graph_step and cfg.data.pad_to_buckets and not cfg.trainer.compile
    validate_config(cfg)


@pytest.mark.parametrize(
    ("device", "cuda_available", "graphed"),
    [
        ("device=cuda", False, True),  # named: the run fails clearly if there is none
        ("device.name=cuda:1", False, True),
        ("device=auto", True, True),
        ("device=auto", False, False),
        ("device=cpu", True, False),
    ],
)
def test_the_default_fast_path_graphs_whole_steps_on_cuda_only(
    monkeypatch, device, cuda_available, graphed
) -> None:
    """``fast_path=auto`` (the default): ``step_graphs`` where the run trains on a CUDA GPU
    (on the H200, bf16 1.20x fp32 instead of the eager step's 0.61x), ``none`` elsewhere."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    cfg = compose_config([device])
    assert cfg.trainer.graph_step is graphed and cfg.data.pad_to_buckets is graphed
    assert not cfg.trainer.compile
    validate_config(cfg)
    other = compose_config([device, "fast_path=none"])
    assert not other.trainer.graph_step and not other.data.pad_to_buckets


def test_the_benchmark_times_the_training_default() -> None:
    from hydra import compose, initialize_config_dir

    from tests.recipe_helpers import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        on_gpu = compose(config_name="benchmark", overrides=["device=cuda", "output_dir=x"])
        eager = compose(
            config_name="benchmark", overrides=["device=cuda", "fast_path=none", "output_dir=x"]
        )
    assert on_gpu.trainer.graph_step and on_gpu.data.pad_to_buckets
    assert not eager.trainer.graph_step


def test_diagnose_runs_eager_steps_whatever_the_fast_path() -> None:
    """The numerics probes hook every module in every step: a captured step would run them
    at its capture only."""
    from hydra import compose, initialize_config_dir

    from recipes.diagnose import training_config
    from tests.recipe_helpers import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="diagnose", overrides=["device=cuda", "output_dir=unused"])
    assert cfg.trainer.graph_step
    assert not training_config(cfg).trainer.graph_step


# ------------------------------------------------------------ on a GPU


def _no_noise(model: str, *extra: str) -> list[str]:
    """Deterministic training (no augmentation, no dropout): graphed equals eager."""
    asr = ["model.cut_end_prob=0", "model.channel_prob=0"] if model == "conformer_ctc" else []
    return [
        f"model={model}",
        "data.spec_augment.enabled=false",
        *asr,
        "model.dropout=0",
        *extra,
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model", ["conformer_ctc", "xvector"])
def test_captured_validation_scores_as_eager_validation_on_cuda(
    fsdd_root, prepared, tmp_path, monkeypatch, model, precision, cuda_device
):
    """``trainer.graph_eval`` on a GPU: three validations of the same batches (eager, then
    captured, then replayed) give eager validation's metrics and outcomes (bf16: metrics
    within half a point), and its losses to rounding (deterministic cuDNN, TF32 off)."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    extra = _no_noise(model, "device=cuda", f"precision={precision}", "precision.allow_tf32=false")
    graphed, data = _brain(fsdd_root, prepared, tmp_path / "a", *extra)
    eager, _ = _brain(fsdd_root, prepared, tmp_path / "b", *extra, "trainer.graph_eval=false")
    graphed.on_fit_start()
    eager.on_fit_start()
    assert graphed._eval_graphs is not None and eager._eval_graphs is None
    batches = [batch for _, batch in zip(range(4), data.valid, strict=False)]
    expected_losses, expected, expected_outcomes = _validate(eager, batches)
    for _ in range(3):
        losses, metrics, outcomes = _validate(graphed, batches)
        if precision == "fp32":
            assert metrics == expected and outcomes == expected_outcomes
        else:  # a kernel chosen differently under capture may flip a rare near-tie
            assert metrics == pytest.approx(expected, abs=0.5)
        assert losses == pytest.approx(expected_losses, rel=1e-3 if precision == "fp32" else 2e-2)
    stats = graphed.eval_graph_stats()
    assert stats["graphs"] >= 1 and stats["replays"] >= len(batches), stats


def test_the_deterministic_gpu_configs_compose() -> None:
    """The GPU tests' overrides compose (checked here, where there is no GPU to find out)."""
    for model in ("conformer_ctc", "xvector"):
        cfg = compose_config([*FAST, "fast_path=step_graphs", *_no_noise(model, "device=cuda")])
        validate_config(cfg)
        assert cfg.model.dropout == 0 and not cfg.data.spec_augment.enabled


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("model", "precision"),
    [
        ("conformer_ctc", "fp32"),
        ("conformer_ctc", "bf16"),
        ("conformer_ctc", "fp16"),
        ("xvector", "fp32"),
    ],
)
def test_captured_steps_train_as_eager_steps_on_cuda(
    fsdd_root, prepared, tmp_path, monkeypatch, model, precision, cuda_device
):
    """Two batch shapes, six steps each: the first captured after two warm-up steps, the
    second after one (``graph_step_later_warmup``), and replayed, with the losses of the
    usual eager step (TF32 off, no randomness, deterministic cuDNN kernels, the eager step's
    lr rounded to fp32 as the lr tensors hold it). The x-vector
    amplifies any rounding difference chaotically (see :func:`_fp32_lr`): on the
    2026-11-26 H200, without deterministic cuDNN and the rounded lr, its steps 7-11 were
    0.1-0.23 % off."""
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    extra = _no_noise(model, "device=cuda", f"precision={precision}", "precision.allow_tf32=false")
    eager, data = _brain(fsdd_root, prepared, tmp_path / "a", *extra, "trainer.graph_step=false")
    graphed, _ = _brain(fsdd_root, prepared, tmp_path / "b", *extra)
    eager.on_fit_start()
    graphed.on_fit_start()
    _fp32_lr(eager.optimizer)
    shapes: dict[tuple, object] = {}
    for batch in data.train:
        shapes.setdefault(tuple(batch.wavs.shape), batch)
        if len(shapes) == 2:
            break
    batches = [b for b in shapes.values() for _ in range(6)]
    expected, got = _train(eager, batches), _train(graphed, batches)
    assert graphed.step_graph_stats() == {"graphs": 2, "replays": 9, "eager_steps": 3}
    tol = 1e-3 if precision == "fp32" else 2e-2
    assert got == pytest.approx(expected, rel=tol)
    assert graphed.optimizer_step == eager.optimizer_step


_COMPILED_BLOCKS = (
    "trainer.compile=true",
    "trainer.compile_regions=true",
    "trainer.compile_mode=default",  # inductor kernels, no CUDA graphs of its own
)


def test_the_compiled_blocks_config_composes() -> None:
    cfg = compose_config(
        [
            *FAST,
            "fast_path=step_graphs",
            *_no_noise("conformer_ctc", "device=cuda"),
            *_COMPILED_BLOCKS,
        ]
    )
    validate_config(cfg)
    assert cfg.trainer.graph_step and cfg.trainer.compile


@pytest.mark.gpu
def test_captured_steps_replay_the_compiled_blocks_kernels(
    fsdd_root, prepared, tmp_path, cuda_device
):
    """With compiled encoder blocks, the captured step replays inductor's kernels (not the
    eager ones) and trains as the eager compiled step does."""
    from torch.profiler import ProfilerActivity, profile

    extra = _no_noise(
        "conformer_ctc", "device=cuda", "precision=bf16", "precision.allow_tf32=false"
    )
    eager, data = _brain(fsdd_root, prepared, tmp_path / "a", *extra, "trainer.graph_step=false")
    graphed, _ = _brain(fsdd_root, prepared, tmp_path / "b", *extra, *_COMPILED_BLOCKS)
    eager.on_fit_start()
    graphed.on_fit_start()
    batch = next(iter(data.train))
    batches = [batch] * 5  # two warm-up steps, the capture, two replays
    expected, got = _train(eager, batches), _train(graphed, batches)
    assert graphed.step_graph_stats() == {"graphs": 1, "replays": 3, "eager_steps": 2}
    assert got == pytest.approx(expected, rel=2e-2)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graphed.train_step(batch)
        graphed.flush_pending()
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(name.startswith("triton_") for name in kernels), sorted(set(kernels))[:20]


@pytest.mark.gpu
def test_layer_norms_saving_16bit_train_in_captured_steps_on_cuda(
    fsdd_root, prepared, tmp_path, cuda_device, monkeypatch
):
    """precision.norm_saves_16bit on CUDA: the first eager step's loss is the plain
    model's bit for bit (its forward pass is autocast's), the LayerNorms' autograd
    function runs, and the captured and replayed steps train as the eager ones do."""
    import amp_utils.module_precision as module_precision

    calls = []
    apply = module_precision._LayerNormSaving16Bit.apply
    monkeypatch.setattr(
        module_precision._LayerNormSaving16Bit, "apply", lambda *a: calls.append(1) or apply(*a)
    )
    extra = _no_noise(
        "conformer_ctc", "device=cuda", "precision=bf16", "precision.allow_tf32=false"
    )
    saves = "precision.norm_saves_16bit=true"
    plain, data = _brain(fsdd_root, prepared, tmp_path / "a", *extra, "trainer.graph_step=false")
    eager, _ = _brain(
        fsdd_root, prepared, tmp_path / "b", *extra, saves, "trainer.graph_step=false"
    )
    graphed, _ = _brain(fsdd_root, prepared, tmp_path / "c", *extra, saves)
    for brain in (plain, eager, graphed):
        brain.on_fit_start()
    batch = next(iter(data.train))
    batches = [batch] * 5  # two warm-up steps, the capture, two replays
    first = _train(plain, batches[:1])
    assert not calls
    expected = _train(eager, batches)
    assert calls and expected[0] == first[0]
    got = _train(graphed, batches)
    assert graphed.step_graph_stats() == {"graphs": 1, "replays": 3, "eager_steps": 2}
    assert got == pytest.approx(expected, rel=2e-2)


@pytest.mark.gpu
def test_replayed_steps_never_wait_for_the_gpu(fsdd_root, prepared, tmp_path, cuda_device):
    brain, data = _brain(fsdd_root, prepared, tmp_path, "device=cuda", "precision=bf16")
    brain.on_fit_start()
    batch = next(iter(data.train)).to(cuda_device)  # no host copy in the timed steps
    for _ in range(4):  # two warm-up steps, the capture, a replay
        brain.train_step(batch)
    brain.flush_pending()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            brain.train_step(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    brain.flush_pending()
    assert brain.step_graph_stats()["replays"] == 5


@pytest.mark.gpu
def test_fast_path_step_graphs_trains_the_asr_recipe_on_cuda(fsdd_root, prepared, tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train.py",
        [
            *FAST,
            "device=cuda",
            "device.num_workers=2",
            "fast_path=step_graphs",
            "precision=bf16",
            "trainer.debug_batches=12",
            "trainer.graph_step_warmup=1",  # 24 batches over <= 10 shapes: some repeat
            f"data.prepared_dir={prepared}",
            f"hydra.run.dir={out}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["step_graphs"]["graphs"] >= 1 and results["step_graphs"]["replays"] >= 1
    assert "could not be captured" not in result.stderr
    assert all(v == v for v in results["test_metrics"].values())  # no NaN


_RESUME_ON_CUDA = (
    "device=cuda",
    "device.num_workers=0",
    "trainer.debug_batches=8",
    "trainer.graph_step_warmup=1",  # shapes repeat within 16 batches: replays on both sides
    "precision.allow_tf32=false",
)


def test_the_gpu_resume_config_composes() -> None:
    validate_config(compose_config([*FAST, "fast_path=step_graphs", *_RESUME_ON_CUDA]))


@pytest.mark.gpu
def test_an_interrupted_run_with_replayed_graphs_resumes_as_an_uninterrupted_one(
    fsdd_root, prepared, tmp_path, monkeypatch, cuda_device
):
    """SIGTERM after step 5 (replays before it), then the same call again: the resumed run
    warms up and captures its shapes afresh where the uninterrupted one replays, and still
    ends where that one does -- replays advance the CUDA random stream (dropout,
    augmentation) and the optimizer as eager steps do. (The CPU test above covers the
    graph-safe step run eagerly; this one the replays.)"""
    resumed, uninterrupted, interrupted = _interrupted_and_uninterrupted(
        fsdd_root, prepared, tmp_path, monkeypatch, 5, *_RESUME_ON_CUDA
    )
    assert interrupted == [5] and resumed["sessions"] == 2
    assert uninterrupted["step_graphs"]["replays"] >= 1, uninterrupted["step_graphs"]
    assert resumed["optimizer_steps"] == uninterrupted["optimizer_steps"] == 16
    # not bit-exact: the CUDA kernels' float sums may differ in order between runs
    assert resumed["test_metrics"]["loss"] == pytest.approx(
        uninterrupted["test_metrics"]["loss"], rel=1e-4
    )
