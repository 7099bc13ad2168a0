"""The CUDA fast path, checked on the CPU: fixed batch shapes, host-side CTC lengths,
regional compilation with a bounded number of compiles, and ``precision=auto``."""

from __future__ import annotations

import json
import logging
import random
import types
from pathlib import Path

import pytest
import torch

from amp_utils import Brain, Stage
from amp_utils.autocast import AMPConfig
from amp_utils.compile import compile_regions
from amp_utils.precision import (
    EMULATED_CPU_SLOWDOWN,
    cpu_vector_isa,
    resolve_precision,
    warn_if_emulated,
)
from data.dataset import PadToBuckets, collate_audio
from data.fsdd import prepare_fsdd_digits
from data.sampler import DurationBatchSampler
from recipes.asr.model import ConformerCTC
from recipes.benchmarking import shape_representatives
from recipes.data_setup import build_data
from recipes.experiment import build_brain
from tests.recipe_helpers import FAST, compose_config, run_cli


@pytest.fixture(scope="module")
def prepared(fsdd_root: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared_fast_path")
    prepare_fsdd_digits(fsdd_root, out, download=False)
    return out


def digits_cfg(fsdd_root: Path, prepared: Path, *extra: str):
    return compose_config(
        [*FAST, f"data.root={fsdd_root}", f"data.prepared_dir={prepared}", *extra]
    )


def epoch_shapes(loader) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(audio shape, token shape) of each batch of the first epoch."""
    loader.batch_sampler.set_epoch(0)
    return [(tuple(batch.wavs.shape), tuple(batch.tokens.shape)) for batch in loader]


# ------------------------------------------------------------ fixed batch shapes


def test_sampler_fills_each_bucket_with_one_batch_size():
    rng = random.Random(0)
    durations = [rng.uniform(0.3, 3.0) for _ in range(500)]
    sampler = DurationBatchSampler(durations, 20.0, num_buckets=5, pad_to_buckets=True, seed=3)
    edges = sampler.bucket_edges()
    assert edges == sorted(edges) and len(edges) == 5
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(500))  # each item once
    sizes_by_edge: dict[float, set[int]] = {}
    for batch in batches:
        longest = max(durations[i] for i in batch)
        edge = min(e for e in edges if e >= longest)
        sizes_by_edge.setdefault(edge, set()).add(len(batch))
        assert len(batch) * edge <= 20.0  # the padded batch fits the budget
    for edge, sizes in sizes_by_edge.items():
        full = int(20.0 // edge)
        assert max(sizes) == full and len(sizes) <= 2  # full batches + one partial one
    sampler.set_epoch(1)
    assert list(sampler) != batches and sampler.bucket_edges() == edges  # edges never move


def test_pad_to_buckets_collate_pads_to_the_next_edge():
    sampler = DurationBatchSampler(
        [0.3, 0.5, 0.9, 1.0], 4.0, num_buckets=2, pad_to_buckets=True, pad_quantum=64 / 8000
    )
    assert sampler.bucket_edges() == [0.504, 1.0]  # rounded up to multiples of 64 samples
    collate = PadToBuckets(sampler.bucket_edges(), sample_rate=8000)
    assert collate.edges == [4032, 8000]

    def item(samples: int) -> dict:
        return {
            "id": str(samples),
            "wav": torch.ones(samples),
            "tokens": torch.tensor([1, 2]),
            "speaker": 0,
            "transcript": "ab",
            "duration": samples / 8000,
        }

    assert collate([item(100), item(4000)]).wavs.shape == (2, 4032)
    batch = collate([item(4033), item(10)])
    assert batch.wavs.shape == (2, 8000) and batch.wav_lens.tolist() == [4033, 10]
    assert collate([item(9000)]).wavs.shape == (1, 9000)  # past the last edge: its own length
    assert collate_audio([item(100), item(4000)]).wavs.shape == (2, 4000)  # the default
    assert batch.tokens.shape == (2, 16) and batch.token_lens.tolist() == [2, 2]
    assert collate_audio([item(100)]).tokens.shape == (1, 2)  # the default: the longest


def test_an_epoch_of_real_batches_has_a_bounded_set_of_shapes(fsdd_root, prepared):
    """With pad_to_buckets every split has at most two shapes per bucket; without, many."""
    on = digits_cfg(fsdd_root, prepared, "data.pad_to_buckets=true", "data.max_batch_seconds=30")
    off = digits_cfg(fsdd_root, prepared, "data.max_batch_seconds=30")
    data_on, data_off = build_data(on, torch.device("cpu")), build_data(off, torch.device("cpu"))
    for split in ("train", "valid", "test"):
        shapes = epoch_shapes(getattr(data_on, split))
        assert len(set(shapes)) <= 2 * on.data.num_buckets, split
        assert all(size * samples / 8000 <= 30.0 + 0.1 for (size, samples), _ in shapes)
        assert all(tokens[1] % 16 == 0 for _, tokens in shapes)  # padded to a multiple
    shapes_off = set(epoch_shapes(data_off.train))
    assert len(shapes_off) > 4 * on.data.num_buckets  # what the fast path avoids
    # The benchmark warms up one batch per shape: together they cover the whole epoch.
    representatives = shape_representatives(data_on.train, torch.device("cpu"))
    assert {(tuple(b.wavs.shape), tuple(b.tokens.shape)) for b in representatives} == set(
        epoch_shapes(data_on.train)
    )


def test_connected_digits_token_lengths_add_few_shapes(fsdd_root, tmp_path):
    """Transcripts of 2-7 digits have 7-41 characters: padded to multiples of 16, the
    token dimension adds at most three shapes per audio shape (a captured step per shape)."""
    cfg = compose_config(
        [
            *FAST,
            "data=fsdd_connected",
            "data.pad_to_buckets=true",
            "data.num_train=400",
            f"data.root={fsdd_root}",
            f"data.prepared_dir={tmp_path}",
        ]
    )
    data = build_data(cfg, torch.device("cpu"))
    shapes = epoch_shapes(data.train)
    lengths = {tokens[1] for _, tokens in shapes}
    assert lengths <= {16, 32, 48} and len(lengths) >= 2
    assert len(set(shapes)) <= 2 * cfg.data.num_buckets * len(lengths)
    longest = {
        max(len(data.train.dataset.tokens[i]) for i in indices)
        for indices in data.train.batch_sampler
    }
    assert len(longest) > len(lengths)  # what the padding saves


# ------------------------------------------------------------ CTC lengths on the host


def test_a_batch_crosses_processes_with_only_its_audio_in_shared_memory():
    """A worker's batch reaches the main process through ``ForkingPickler``; each tensor
    shared costs the main thread a file descriptor and a socket round trip, so only the
    audio is shared: lengths, tokens, speakers and durations travel inside the pickle."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 (registers the tensor reductions)

    items = [
        {
            "id": str(n),
            "wav": torch.randn(n),
            "tokens": torch.tensor([1, 2, 3]),
            "speaker": 1,
            "transcript": "abc",
            "duration": n / 8000,
        }
        for n in (16000, 4000)  # 128 kB of audio: more than SMALL_TENSOR_BYTES
    ]
    batch = collate_audio(items)
    copy = ForkingPickler.loads(ForkingPickler.dumps(batch))
    assert batch.wavs.is_shared() and not batch.wav_lens.is_shared()
    assert not any(t.is_shared() for t in (batch.tokens, batch.speakers, batch.durations))
    for name in ("wavs", "wav_lens", "tokens", "token_lens", "speakers", "durations"):
        assert torch.equal(getattr(copy, name), getattr(batch, name)), name
        assert getattr(copy, name).dtype == getattr(batch, name).dtype
    assert copy.ids == batch.ids and copy.transcripts == batch.transcripts
    copy.wav_lens += 1  # writable, its own memory
    assert not torch.equal(copy.wav_lens, batch.wav_lens)


def test_batch_moved_to_a_device_keeps_its_host_copy():
    batch = collate_audio(
        [
            {
                "id": "a",
                "wav": torch.ones(5),
                "tokens": torch.tensor([1]),
                "speaker": 0,
                "transcript": "a",
                "duration": 1.0,
            }
        ]
    )
    moved = batch.to("cpu")
    assert moved.host is batch and batch.host is None
    assert moved.to("cpu").host is batch  # the original host batch, not a copy of a copy


def test_ctc_lengths_from_the_host_equal_the_models(fsdd_root, prepared, tmp_path):
    """The lengths the CTC loss reads on the host are exactly those the model computes."""
    cfg = digits_cfg(fsdd_root, prepared, "data.pad_to_buckets=true", f"output_dir={tmp_path}")
    data = build_data(cfg, torch.device("cpu"))
    brain = build_brain(cfg, data, None, None)
    brain.modules.eval()
    checked = 0
    for batch in data.valid:
        device_batch = batch.to(brain.device)
        with torch.no_grad():
            _, out_lens = brain.compute_forward(device_batch, Stage.VALID)
        host_lens, token_lens = brain.ctc_lengths(device_batch, out_lens)
        assert torch.equal(host_lens, out_lens) and torch.equal(token_lens, batch.token_lens)
        assert host_lens.device.type == "cpu" and (out_lens < batch.wavs.shape[1]).all()
        checked += 1
    assert checked > 3


# ------------------------------------------------------------ regional compilation


def test_compile_regions_compiles_each_block_in_place_and_keeps_checkpoint_keys():
    torch.manual_seed(0)
    model = ConformerCTC(n_mels=16, d_model=32, num_layers=3, num_heads=2, ffn_dim=64)
    keys = list(model.state_dict())
    feats, lens = torch.randn(2, 40, 16), torch.tensor([40, 30])
    model.eval()
    expected = model(feats, lens)[0]
    assert compile_regions(model, backend="eager", dynamic=True) == 3
    assert list(model.state_dict()) == keys  # a checkpoint loads with and without compile
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model.frontend._compiled_call_impl is None  # outside the repeated blocks
    torch.testing.assert_close(model(feats, lens)[0], expected)


def test_fast_path_compiles_a_bounded_number_of_times_over_an_epoch(fsdd_root, tmp_path):
    """fast_path=cuda_graphs on the CPU: a full epoch over many batch shapes traces the
    regionally compiled encoder block a few times at most, not once per shape.

    The CPU runs the traced graphs through AOTAutograd without code generation
    (``aot_eager``), which keeps this test fast: graph capture and dynamic-shape guards --
    what this checks -- are the same for every backend (``tests/test_compile.py`` runs the
    real CPU inductor)."""
    out = tmp_path / "run"
    result = run_cli(
        "train.py",
        [
            *FAST,
            "trainer.debug=false",
            "fast_path=cuda_graphs",
            "trainer.compile_backend=aot_eager",
            "trainer.epochs=1",
            "model.d_model=32",
            "model.ffn_dim=64",
            "model.num_layers=2",
            "model.num_heads=2",
            "data.max_batch_seconds=60",
            "data.num_buckets=6",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"hydra.run.dir={out}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    stats = results["compile"]
    assert stats["graph_breaks"] == 0, stats
    # dynamic shapes: one graph for training, one for evaluation, plus at most a couple of
    # recompiles for specialised sizes (a batch of one utterance), over 12+ batch shapes.
    assert 1 <= stats["graphs"] <= 6 and stats["recompiles"] <= 4, stats
    assert results["optimizer_steps"] > 20


# ------------------------------------------------------------ precision=auto


@pytest.mark.parametrize(
    ("native", "expected"), [(frozenset(), "fp32"), (frozenset({"bf16"}), "bf16")]
)
def test_auto_precision_on_the_cpu_follows_its_capabilities(monkeypatch, native, expected):
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: native)
    name, reason = resolve_precision("auto", torch.device("cpu"))
    assert name == expected
    assert ("natively" in reason) == (expected == "bf16") and reason
    assert resolve_precision("fp16", torch.device("cpu")) == ("fp16", "requested")


class _TwoGPUs:
    """Stand-ins for a machine with a Tesla T4 (no native bf16) as cuda:0 and an A100 as
    cuda:1; cuda:0 is the current device (a process on cuda:1 never changes that)."""

    names = {0: "Tesla T4", 1: "NVIDIA A100"}
    majors = {0: 7, 1: 8}

    def __init__(self, monkeypatch) -> None:
        def index(device=None) -> int:
            return torch.device(device if device is not None else "cuda").index or 0

        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: self.names[index(d)])
        monkeypatch.setattr(
            torch.cuda,
            "get_device_properties",
            lambda d=None: types.SimpleNamespace(major=self.majors[index(d)]),
        )


@pytest.mark.parametrize(("gpu", "expected"), [(1, "bf16"), (0, "fp16")])
def test_auto_precision_on_a_gpu_asks_that_gpu(monkeypatch, gpu, expected):
    """precision=auto on cuda:1 answers for cuda:1: torch.cuda.is_bf16_supported answered
    for the current GPU (cuda:0), so the A100 got fp16 and bf16 was refused on it."""
    from amp_utils.autocast import AMPConfig
    from amp_utils.precision import PrecisionNotSupportedError, check_precision_supported

    machine = _TwoGPUs(monkeypatch)
    device = torch.device("cuda", gpu)
    name, reason = resolve_precision("auto", device)
    assert name == expected and machine.names[gpu] in reason
    if expected == "bf16":
        check_precision_supported(AMPConfig.from_name("bf16"), device)
    else:
        with pytest.raises(PrecisionNotSupportedError, match="Tesla T4"):
            check_precision_supported(AMPConfig.from_name("bf16"), device)


def test_env_file_says_which_gpus_compute_bf16_natively(monkeypatch):
    from amp_utils import run_env

    _TwoGPUs(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (7 + d, 5 - 5 * d))
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91900)
    lines = run_env._cuda_lines()
    assert "gpu 0: Tesla T4 (compute capability 7.5, native bf16: no)" in lines
    assert "gpu 1: NVIDIA A100 (compute capability 8.0, native bf16: yes)" in lines
    assert "cpu vector isa: " in run_env.environment_report()


def test_emulated_cpu_precision_warns_once_naming_the_capability(monkeypatch, caplog):
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    monkeypatch.setattr("amp_utils.precision.cpu_has_avx512_fp16", lambda: False)
    monkeypatch.setattr("amp_utils.precision.cpu_vector_isa", lambda: "AVX2")
    monkeypatch.setattr("amp_utils.precision._warned", set())
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="amp_utils.precision"):
        assert warn_if_emulated(AMPConfig.from_name("bf16"), cpu)
        assert warn_if_emulated(AMPConfig.from_name("bf16"), cpu)  # still emulated, no repeat
        assert not warn_if_emulated(AMPConfig.from_name("fp32"), cpu)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert "AVX512-BF16 or AMX" in messages[0] and "10x slower" in messages[0]
    assert "precision=fp32" in messages[0] and "precision=auto" in messages[0]
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset({"bf16"}))
    assert not warn_if_emulated(AMPConfig.from_name("bf16"), cpu)


def test_an_emulated_eval_precision_is_warned_about_naming_its_key(monkeypatch, caplog):
    """fp32 training with bf16 evaluation on a CPU without bf16: validation and test ran
    ~10x slower without a word."""
    from amp_utils import Brain

    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    monkeypatch.setattr("amp_utils.precision.cpu_has_avx512_fp16", lambda: False)
    monkeypatch.setattr("amp_utils.precision.cpu_vector_isa", lambda: "AVX2")
    monkeypatch.setattr("amp_utils.precision._warned", set())
    with caplog.at_level(logging.WARNING, logger="amp_utils.precision"):
        Brain(
            {"model": torch.nn.Linear(2, 2)},
            run_opts={"device": "cpu", "precision": "fp32", "eval_precision": "bf16"},
        )
    (message,) = [r.getMessage() for r in caplog.records]
    assert message.startswith("precision.eval_precision=bf16 on a CPU without AVX512-BF16")
    assert "Use precision.eval_precision=fp32" in message


@pytest.mark.parametrize("avx512_fp16", [True, False])
def test_cpu_fp16_warning_tells_fp32_speed_from_emulation(monkeypatch, caplog, avx512_fp16):
    """With AVX512-FP16 (no AMX-FP16) fp16 reaches fp32's speed, not 10x slower: the warning
    says which, and points to precision=auto."""
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset({"bf16"}))
    monkeypatch.setattr("amp_utils.precision.cpu_has_avx512_fp16", lambda: avx512_fp16)
    monkeypatch.setattr("amp_utils.precision.cpu_vector_isa", lambda: "AVX2")
    monkeypatch.setattr("amp_utils.precision._warned", set())
    with caplog.at_level(logging.WARNING, logger="amp_utils.precision"):
        assert warn_if_emulated(AMPConfig.from_name("fp16"), torch.device("cpu"))
    (message,) = [r.getMessage() for r in caplog.records]
    assert "AMX-FP16" in message and "precision=auto" in message
    assert ("as fast as fp32" in message) == avx512_fp16
    assert ("10x slower" in message) == (not avx512_fp16)


@pytest.mark.parametrize(
    ("isa", "precision", "expected"),
    [
        ("AVX2", "bf16", "about 10x slower"),
        ("AVX2", "fp16", "about 10x slower"),
        ("AVX512", "bf16", "about 2x slower"),
        ("AVX512", "fp16", "up to 20x slower"),
        ("DEFAULT", "bf16", "about 10x slower"),
    ],
)
def test_the_emulation_warning_quotes_what_was_measured_on_such_a_cpu(
    monkeypatch, caplog, isa, precision, expected
):
    """bf16 emulated with AVX512 ran at 0.5x fp32, not the 0.1x of an AVX2-only CPU; fp16
    with AVX512 at 0.05x (benchmarks/results/2026-11-26-cpu-avx512-no-bf16.md)."""
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset())
    monkeypatch.setattr("amp_utils.precision.cpu_has_avx512_fp16", lambda: False)
    monkeypatch.setattr("amp_utils.precision.cpu_vector_isa", lambda: isa)
    monkeypatch.setattr("amp_utils.precision._warned", set())
    with caplog.at_level(logging.WARNING, logger="amp_utils.precision"):
        assert warn_if_emulated(AMPConfig.from_name(precision), torch.device("cpu"))
    (message,) = [r.getMessage() for r in caplog.records]
    assert expected in message and "precision=fp32" in message
    assert ("AVX512 but no" in message) == (isa == "AVX512")
    name, reason = resolve_precision("auto", torch.device("cpu"))
    assert name == "fp32"
    assert EMULATED_CPU_SLOWDOWN.get(("bf16", isa), "about 10x slower") in reason


def test_cpu_vector_isa_is_torchs():
    assert cpu_vector_isa() == torch.backends.cpu.get_cpu_capability()


def test_cpu_has_avx512_fp16_reads_cpuinfo(monkeypatch):
    from amp_utils import precision

    flags = {"cpuinfo": "flags : fpu avx2 avx512_fp16 amx_bf16\n"}
    monkeypatch.setattr(precision.Path, "read_text", lambda self, *a, **k: flags["cpuinfo"])
    assert precision.cpu_has_avx512_fp16()
    flags["cpuinfo"] = "flags : fpu avx2 avx512_bf16 avx512_fp16x\n"
    assert not precision.cpu_has_avx512_fp16()


def test_brain_resolves_auto_and_logs_why(monkeypatch, caplog):
    monkeypatch.setattr("amp_utils.precision.cpu_native_precisions", lambda: frozenset({"bf16"}))

    class Tiny(Brain):
        pass

    with caplog.at_level(logging.INFO, logger="amp_utils.brain"):
        brain = Tiny(
            {"m": torch.nn.Linear(2, 2)},
            run_opts={"device": "cpu", "precision": "auto", "eval_precision": "auto"},
        )
    assert brain.amp.name == "bf16" and brain.eval_amp.name == "bf16"
    assert any("precision=auto -> bf16" in r.getMessage() for r in caplog.records)


def test_results_record_the_precision_actually_used(fsdd_root, prepared, tmp_path):
    out = tmp_path / "run"
    result = run_cli(
        "train.py",
        [*FAST, "precision=auto", f"data.prepared_dir={prepared}", f"hydra.run.dir={out}"],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    used, _ = resolve_precision("auto", torch.device("cpu"))  # this machine's CPU
    assert results["precision"] == used and results["precision_requested"] == "auto"
    assert f"precision=auto -> {used}" in (out / "train.log").read_text()


# ------------------------------------------------------------ on a GPU


class _Speaker(Brain):
    """A speaker-ID-like step: conv + pooling + cross-entropy (no CTC, whose CUDA kernel
    copies its offsets to the GPU synchronously)."""

    def compute_forward(self, batch, stage):
        return self.modules.model(batch[0])

    def compute_objectives(self, logits, batch, stage):
        return torch.nn.functional.cross_entropy(logits.float(), batch[1])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_training_steps_never_wait_for_the_gpu(cuda_device, precision):
    """With fused AdamW, clipping and (fp16) loss scaling, a step queues its work and
    returns: no operation in it synchronises with the device (CUDA sync debug mode)."""
    model = torch.nn.Sequential(
        torch.nn.Conv1d(8, 32, 5),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool1d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(32, 4),
    )
    brain = _Speaker(
        {"model": model},
        opt_class=lambda p: torch.optim.AdamW(p, 1e-3, fused=True),
        run_opts={"device": "cuda", "precision": precision, "max_grad_norm": 1.0},
    )
    brain.on_fit_start()
    batch = (
        torch.randn(16, 8, 50, device=cuda_device),
        torch.randint(0, 4, (16,), device=cuda_device),
    )
    for step in range(1, 3):
        brain.step = step
        brain.fit_batch(batch)
    brain.flush_pending()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3, 7):
            brain.step = step
            brain.fit_batch(batch)  # reads the previous step's values through an event only
    finally:
        torch.cuda.set_sync_debug_mode("default")
    brain.flush_pending()
    assert brain.optimizer_step + brain.skipped_steps == 6 and brain.optimizer_step >= 3


@pytest.mark.gpu
def test_fast_path_trains_the_asr_recipe_on_cuda(fsdd_root, prepared, tmp_path):
    """fast_path=cuda_graphs end to end on a GPU: every graph captured, finite metrics,
    updates applied, and the CTC lengths read on the host."""
    out = tmp_path / "run"
    args = FAST  # device=cuda below replaces its device=cpu
    result = run_cli(
        "train.py",
        [
            *args,
            "device=cuda",
            "device.num_workers=2",
            "fast_path=cuda_graphs",
            "precision=bf16",
            "trainer.debug_batches=6",
            f"data.prepared_dir={prepared}",
            f"hydra.run.dir={out}",
        ],
        fsdd_root,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["compile"]["cudagraph_skips"] == 0, results["compile"]
    assert results["optimizer_steps"] > 0 and results["precision"] == "bf16"
    assert all(v == v for v in results["test_metrics"].values())  # no NaN


def test_the_lr_schedule_ends_at_the_runs_last_optimizer_step(fsdd_root, prepared, tmp_path):
    """With gradient accumulation the Brain steps once per whole window (an epoch's
    unfinished window is dropped): the cosine schedule was sized for a step per started
    window, so it never reached its end (e.g. 0.357 of the peak instead of 0.05)."""
    data = build_data(
        digits_cfg(fsdd_root, prepared, f"output_dir={tmp_path}"), torch.device("cpu")
    )
    batches = len(data.train)
    factor = next(f for f in (3, 4, 5, 7) if batches % f)  # the case that differs
    cfg = digits_cfg(
        fsdd_root, prepared, f"trainer.grad_accumulation_factor={factor}", f"output_dir={tmp_path}"
    )
    brain = build_brain(cfg, data, None, None)
    brain.on_fit_start()  # makes the optimizer and its schedule
    steps = cfg.trainer.epochs * (batches // factor)
    schedule = brain.lr_scheduler.lr_lambdas[0]
    assert schedule(steps) == pytest.approx(0.05) and schedule(steps - 1) > 0.05
