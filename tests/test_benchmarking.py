"""The benchmark's table: ratios against fp32, the bare loop and pre-staged batches."""

import json
from pathlib import Path

import pytest
import torch

from recipes.benchmarking import (
    PEER_MODES,
    compile_notes,
    compiled_code_calls,
    preflight_benchmark,
    step_graph_notes,
    summarize,
)
from tests.recipe_helpers import run_cli, run_recipe
from tests.test_host_reads import UserBlock


def row(mode: str, precision: str, utt_per_s: float, tf32: bool = False) -> dict:
    return {
        "mode": mode,
        "precision": precision,
        "tf32": tf32,
        "utt_per_s": utt_per_s,
        "steps_per_s": 1.0,
        "audio_s_per_s": utt_per_s,
        "p50_step_ms": 1.0,
        "p90_step_ms": 2.0,
        "peak_memory_mb": 100.0,
    }


def test_summary_ratios():
    rows = [
        row("bare", "fp32", 100),
        row("brain", "fp32", 95),
        row("staged", "fp32", 100),
        {**row("loader", "fp32", 95), "wait_ms_mean": 1.25, "wait_ms_max": 20.0},
        row("bare", "fp32", 120, tf32=True),
        row("bare", "bf16", 200),
        row("brain", "bf16", 196),
        row("speechbrain", "bf16", 98),
        {**row("bare", "fp16", 150), "tflops": 12.345, "mfu": 0.0125},
    ]
    lines = summarize(rows).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[10:] == [
        "vs fp32",
        "vs tf32",
        "Brain/bare",
        "loader/staged",
        "ours/peer",
        "wait ms",
    ]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert cells[0][1] == "fp32" and cells[0][10:] == ["1.00", "0.83", "—", "—", "—", "—"]
    assert cells[1][10:15] == ["1.00", "—", "0.95", "—", "—"]  # Brain/bare
    assert cells[2][10:15] == ["1.00", "—", "—", "—", "—"]
    assert cells[3][10:15] == ["1.00", "—", "—", "0.95", "—"]  # loader/staged: same batches
    assert cells[3][15] == "1.2 (20.0)"  # the loader's mean (max) wait per step
    assert cells[4][1] == "fp32+tf32" and cells[4][10:12] == ["1.20", "1.00"]
    assert cells[5][10:12] == ["2.00", "1.67"]  # bf16 against fp32 and against TF32
    assert cells[6][10:13] == ["2.06", "—", "0.98"]
    assert cells[7][10:15] == ["—", "—", "—", "—", "2.00"]  # ours (brain bf16) / SpeechBrain
    assert cells[8][8:10] == ["12.3", "1.2 %"] and cells[0][8:10] == ["—", "—"]


def test_step_graph_notes_say_whether_rows_replayed_graphs():
    rows = [
        {"mode": "bare", "precision": "bf16"},
        {"mode": "brain", "precision": "bf16", "step_graphs": None},
        {
            "mode": "staged",
            "precision": "bf16",
            "step_graphs": {"graphs": 9, "replays": 70, "eager_steps": 22},
        },
    ]
    assert step_graph_notes(rows) == [
        "brain bf16: whole-step CUDA graphs not in use (the log says why)",
        "staged bf16: whole-step CUDA graphs 9 graphs captured, 70 replays, 22 eager steps so far",
    ]


def _profiled(module: torch.nn.Module, steps: int = 2):
    x = torch.randn(4, 6)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            module(x).sum().backward()
    return prof.key_averages()


def test_compiled_code_calls_count_compiled_regions_and_not_eager_code():
    """Compiled code shows in a profile; eager code, and compiled code that TorchDynamo has
    come to skip (what a dispatch mode did to the captured steps on the H200), do not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch._dynamo.reset()
    block = UserBlock()
    assert compiled_code_calls(_profiled(block)) == 0
    block.compile(backend="eager", dynamic=True)
    block(torch.randn(4, 6))  # compile outside the profile
    assert compiled_code_calls(_profiled(block, steps=3)) == 3

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    skipped = UserBlock()
    skipped.compile(backend="eager", dynamic=True)
    with Mode():
        skipped(torch.randn(4, 6))  # TorchDynamo skips the frame, for good
    assert compiled_code_calls(_profiled(skipped)) == 0
    torch._dynamo.reset()


def test_compile_notes_warn_when_no_compiled_code_ran():
    rows = [
        {"mode": "bare", "precision": "bf16", "compiled_calls_per_step": 64.0},
        {"mode": "brain", "precision": "bf16", "compiled_calls_per_step": 0.0},
        {"mode": "staged", "precision": "bf16"},  # not profiled, or compile off
    ]
    notes = compile_notes(rows)
    assert notes[0] == "bare bf16: compiled code ran (64 calls per profiled step)"
    assert notes[1].startswith("brain bf16: WARNING: trainer.compile is on, but no compiled")
    assert len(notes) == 2


def run_small_benchmark(tmp_path: Path, fsdd_root: Path, *overrides: str) -> Path:
    """recipes/benchmark.py on the CPU with batches of 4 and one warm-up step; checks that
    it succeeded and returns its run folder."""
    run = run_recipe(
        "benchmark.py",
        tmp_path,
        fsdd_root,
        "device=cpu",
        "device.num_workers=0",
        "benchmark.batch_size=4",
        "benchmark.warmup_steps=1",
        *overrides,
    )
    # Hydra's record, written once the benchmark went ahead (RunFolder.accept), and the log
    # with its lines from before that
    assert (run / ".hydra" / "config.yaml").is_file() and (run / ".hydra" / "hydra.yaml").is_file()
    assert "utterances" in (run / "benchmark.log").read_text()
    return run


def test_benchmark_cli_times_every_mode_on_real_data(tmp_path, fsdd_root):
    """recipes/benchmark.py end to end on the CPU: every mode and precision gets a row."""
    out = run_small_benchmark(
        tmp_path,
        fsdd_root,
        "benchmark.steps=3",
        "benchmark.precisions=[fp32,bf16]",
        "benchmark.profile_steps=1",
        "data.max_batch_seconds=4",
    )
    rows = json.loads((out / "benchmark.json").read_text())["rows"]
    ours = [r for r in rows if r["mode"] not in PEER_MODES]
    assert [(r["mode"], r["precision"]) for r in ours] == [
        (mode, precision)
        for precision in ("fp32", "bf16")
        for mode in ("bare", "brain", "staged", "loader")
    ]
    peers = [r for r in rows if r["mode"] in PEER_MODES]  # timed, or skipped with the reason
    assert sorted((r["mode"], r["precision"]) for r in peers) == sorted(  # peer_precisions
        (mode, "bf16") for mode in PEER_MODES
    )
    for peer in peers:
        assert "skipped" in peer or peer["steps_per_s"] > 0, peer
    assert all(r["tflops"] > 0 for r in ours)  # model FLOPs counted per batch shape
    rows = ours
    staged, loader = ours[2], ours[3]
    assert staged["utterances"] == loader["utterances"]  # the same real batches
    assert staged["audio_seconds"] == pytest.approx(loader["audio_seconds"])
    assert all(r["steps_per_s"] > 0 and r["peak_memory_mb"] > 0 for r in rows)
    assert "loader/staged" in (out / "benchmark.md").read_text()
    profile = (out / "profile_loader_bf16.txt").read_text()
    assert "aten op calls" in profile and "aten::" in profile  # the profiler's op table
    assert len(list(out.glob("profile_*.txt"))) == 8
    compare = (out / "profile_compare_loader.md").read_text()
    assert "### bf16 against fp32" in compare and "| `aten::" in compare
    assert sorted(p.name for p in out.glob("profile_compare_*.md")) == [
        f"profile_compare_{mode}.md" for mode in ("bare", "brain", "loader", "staged")
    ]


def test_profile_comparison_lists_the_ops_that_cost_a_precision_its_time():
    """Op by op, per step: growth first (largest first), then the largest savings; an op
    one side lacks (bf16's casts) counts 0 there; the header sums every op."""
    from recipes.benchmarking import OpTime, compare_profiles

    fp32 = {"aten::mm": OpTime(10.0, 4), "aten::add": OpTime(1.0, 8), "aten::gelu": OpTime(3, 2)}
    bf16 = {
        "aten::mm": OpTime(4.0, 4),  # faster
        "aten::add": OpTime(2.0, 8),  # +1
        "aten::_to_copy": OpTime(5.0, 30),  # only in bf16: +5
        "aten::gelu": OpTime(3.0, 2),  # unchanged: not listed
    }
    table = compare_profiles(fp32, bf16, "bf16")
    lines = table.splitlines()
    assert lines[0] == (
        "### bf16 against fp32: 14.0 ms against 14.0 ms of op time per step (+0.0 ms)"
    )
    body = [line.split(" | ")[0].strip("| `") for line in lines[4:]]
    assert body == ["aten::_to_copy", "aten::add", "aten::mm"]
    assert "| `aten::_to_copy` | 0.00 | 5.00 | +5.00 | 0 | 30 |" in table
    assert "| `aten::mm` | 10.00 | 4.00 | -6.00 | 4 | 4 |" in table


def test_step_stats_percentiles_are_nearest_rank():
    """p90 of two steps is the slower one, never below the median."""
    from recipes.step_timing import step_stats

    stats = step_stats([0.002, 0.001], 0.003, 8, 4.0, torch.device("cpu"))
    assert stats["p50_step_ms"] == pytest.approx(1.5) and stats["p90_step_ms"] == pytest.approx(2)
    stats = step_stats([i / 1e3 for i in range(1, 21)], 0.21, 20, 10.0, torch.device("cpu"))
    assert stats["p90_step_ms"] == pytest.approx(18.0)  # 18 of 20 steps at or below


def test_time_steps_counts_only_the_timed_steps_of_any_batch_kind():
    """Warm-up steps are not timed or counted; ``size`` reads batches of any kind."""
    from recipes.step_timing import time_steps

    seen = []
    batches = iter([{"n": n} for n in range(5)])
    stats = time_steps(
        lambda b: seen.append(b["n"]),
        batches,
        warmup=2,
        steps=3,
        device=torch.device("cpu"),
        size=lambda b: (b["n"], 0.5, (b["n"],)),
    )
    assert seen == [0, 1, 2, 3, 4]
    assert stats["steps"] == 3 and stats["utterances"] == 2 + 3 + 4
    assert stats["audio_seconds"] == 1.5 and stats["shapes"] == [(2,), (3,), (4,)]


def test_time_steps_reports_the_wait_for_a_late_batch():
    """A batch the iterator is slow to give shows as host wait, apart from the step times
    (which include it: what training sees)."""
    import time

    from recipes.step_timing import time_steps

    def batches():
        for n in range(4):
            if n == 2:
                time.sleep(0.05)  # a loader refilling its workers
            yield {"n": n}

    stats = time_steps(
        lambda b: None,
        batches(),
        warmup=1,
        steps=3,
        device=torch.device("cpu"),
        size=lambda b: (1, 0.0, (1,)),
    )
    assert stats["wait_ms_max"] >= 50.0
    # the mean over 3 steps holds the 50 ms wait once (the other two: next() of a ready
    # generator, well under 25 ms even on a loaded host)
    assert stats["wait_ms_max"] / 3 <= stats["wait_ms_mean"] < stats["wait_ms_max"] / 2
    assert stats["p90_step_ms"] >= 50.0 and stats["p50_step_ms"] < 50.0  # one slow step


def test_a_compiled_benchmark_row_says_that_compiled_code_ran(tmp_path, fsdd_root):
    """With trainer.compile on and profiling, each row records its compiled-code calls and
    the table says they ran (aot_eager: TorchDynamo's regions without code generation)."""
    out = run_small_benchmark(
        tmp_path,
        fsdd_root,
        "benchmark.steps=2",
        "benchmark.precisions=[fp32]",
        "benchmark.modes=[brain]",
        "benchmark.profile_steps=1",
        "trainer.compile=true",
        "trainer.compile_backend=aot_eager",
        "trainer.compile_regions=true",
    )
    [row] = json.loads((out / "benchmark.json").read_text())["rows"]
    assert row["compiled_calls_per_step"] > 0, row
    assert "brain fp32: compiled code ran" in (out / "benchmark.md").read_text()


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("benchmark.modes=[bare,brian]", "benchmark.modes has ['brian']; valid: bare, brain"),
        ("benchmark.precisions=[auto]", "benchmark.precisions has ['auto']; valid: fp32"),
        ("trainer.epochs=0", "trainer.epochs=0 is not valid"),
        # an FFT traceback, and minutes of timing nothing
        ("benchmark.batch_size=0", "benchmark.batch_size=0 is not valid; it must be a positive"),
        ("benchmark.utterance_seconds=0", "benchmark.utterance_seconds=0.0 is not valid"),
        ("benchmark.steps=-1", "benchmark.steps=-1 is not valid; it must be a positive integer"),
    ],
)
def test_bad_benchmark_values_fail_with_one_line_before_any_work(arg, message, fsdd_root, tmp_path):
    """They ended in tracebacks (the modes only after the data had loaded)."""
    result = run_cli("benchmark.py", [arg, f"hydra.run.dir={tmp_path / 'run'}"], fsdd_root)
    assert result.returncode == 1 and f"error: {message}" in result.stderr
    assert "Traceback" not in result.stderr and "Preparing" not in result.stdout + result.stderr
    assert not (tmp_path / "run").exists()  # refused: no folder left behind


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        # int(inf * sample_rate) / int(nan * ...): a traceback once the benchmark had begun
        ("benchmark.utterance_seconds=inf", "benchmark.utterance_seconds=inf is not valid"),
        ("benchmark.utterance_seconds=nan", "benchmark.utterance_seconds=nan is not valid"),
        # a benchmark that times nothing, and says so only in an empty table
        ("benchmark.precisions=[]", r"benchmark.precisions=\[\] times nothing"),
        ("benchmark.modes=[]", r"benchmark.modes=\[\] times nothing"),
    ],
)
def test_benchmark_values_that_time_nothing_or_crash_are_refused_in_process(arg, message):
    """Found by walking every benchmark key with bad values (audit-config); in process, as
    ``ToolFolderCallback`` runs ``preflight_benchmark`` before any folder is written."""
    from hydra import compose, initialize_config_dir

    from recipes.config import ConfigError
    from recipes.resolvers import register_resolvers
    from recipes.schema import register_schemas
    from tests.recipe_helpers import CONF_DIR

    register_resolvers()
    register_schemas()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="benchmark", overrides=["debug=fast", arg])
    with pytest.raises(ConfigError, match=message):
        preflight_benchmark(cfg)


def test_each_precision_is_timed_without_the_previous_precisions_brain(
    tmp_path, fsdd_root, monkeypatch
):
    """Locals of the benchmark loop kept the last precision's Brain (weights, optimizer
    state, CUDA-graph pools) alive while the next one was timed: on the H200 bare bf16
    showed 1762 MB of peak memory against fp32's 930. Every row must be timed with one
    Brain alive: the last one's collected before the next is built, not left as cyclic
    garbage for whenever the collector runs."""
    import weakref

    from hydra import compose, initialize_config_dir

    import recipes.benchmarking as benchmarking
    from recipes import benchmark as benchmark_cli
    from recipes.audio_brain import AudioBrain
    from tests.recipe_helpers import CONF_DIR

    alive: weakref.WeakSet = weakref.WeakSet()
    original_init, original_time = AudioBrain.__init__, benchmarking.time_steps

    def tracked(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        alive.add(self)

    def counting(*args, **kwargs):
        brains.append(len(alive))  # no gc.collect() here: what the timing starts with
        return original_time(*args, **kwargs)

    brains: list[int] = []
    monkeypatch.setattr(AudioBrain, "__init__", tracked)
    monkeypatch.setattr(benchmarking, "time_steps", counting)
    overrides = [
        "device=cpu",
        "device.num_workers=0",
        "benchmark.batch_size=2",
        "benchmark.utterance_seconds=0.5",
        "benchmark.warmup_steps=1",
        "benchmark.steps=1",
        "benchmark.profile_steps=0",
        "benchmark.precisions=[fp32,bf16,fp16]",
        "benchmark.modes=[bare,brain]",
        f"data.root={fsdd_root}",
        f"data.prepared_dir={tmp_path / 'prepared'}",
        f"output_dir={tmp_path / 'out'}",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="benchmark", overrides=overrides)
    (tmp_path / "out").mkdir()
    rows = benchmark_cli.benchmark(cfg)
    assert len(rows) == 6 and brains == [1] * 6


def test_the_loader_rows_start_their_epochs_as_training_does():
    """The benchmark's loader rows run epoch after epoch through ``start_epoch``, as the
    Brain does: one streamed iteration of the loader (each restart cost ~20 ms of an
    H200 epoch, which the loader/staged ratio charged to the loader), same batches."""
    from itertools import islice

    from amp_utils.loaders import shut_down_workers
    from recipes.benchmarking import loader_batches
    from tests.test_loaders import _plan, _streaming_loader, iterations_per_start

    loader = _streaming_loader()
    try:
        expected = _plan(loader, 0) + _plan(loader, 1) + _plan(loader, 2)
        got = [b[0].tolist() for b in islice(loader_batches(loader), len(expected))]
        assert got == expected
        assert loader.batch_sampler.iterations == iterations_per_start()  # one start
    finally:
        shut_down_workers(loader)
