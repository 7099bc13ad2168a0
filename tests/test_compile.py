"""``torch.compile`` as the loop uses it (``amp_utils/compile.py``): the options it passes,
and the real inductor backend on the CPU over changing batch shapes."""

from __future__ import annotations

import copy
import logging
import os
import shutil

import pytest
import torch
from torch._dynamo.utils import counters

from amp_utils.compile import (
    RECOMPILES,
    compile_modules,
    compile_options,
    compile_regions,
    compile_stats,
)
from amp_utils.run_options import RunOptions
from recipes.asr.model import ConformerCTC


def _cpp_compiler_found() -> bool:
    return any(shutil.which(name) for name in (os.environ.get("CXX", "g++"), "g++", "c++"))


cpu_inductor = pytest.mark.skipif(
    not _cpp_compiler_found(), reason="inductor's CPU backend needs a C++ compiler"
)


def test_compile_options_spell_out_the_mode_and_turn_layout_optimisation_off():
    assert compile_options("default", "inductor") == {
        "dynamic": True,
        "options": {"layout_optimization": False},
    }
    reduce_overhead = compile_options("reduce-overhead", "inductor")["options"]
    assert reduce_overhead == {"triton.cudagraphs": True, "layout_optimization": False}
    autotune = compile_options("max-autotune", "inductor")["options"]
    assert autotune["max_autotune"] and autotune["triton.cudagraphs"]
    assert not autotune["layout_optimization"]
    # backends other than inductor take no inductor options
    assert compile_options("default", "aot_eager") == {"backend": "aot_eager", "dynamic": True}


def _assert_trains_like_eager(
    net, model, reference, shapes, rtol: float, atol: float, cudagraphs: bool = False
) -> None:
    """Forward and backward of ``net`` (``model`` compiled) and its eager twin ``reference``
    over batches of ``(batch, frames)`` features; their gradients must agree for each shape."""
    device = next(model.parameters()).device
    for batch, frames in shapes:
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        feats = torch.randn(batch, frames, 40, device=device)
        lens = torch.randint(frames // 2, frames + 1, (batch,), device=device)
        lens[0] = frames
        for module in (net, reference):
            logits, _ = module(feats, lens)
            logits.square().mean().backward()
        pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
        for (name, param), expected in pairs:
            torch.testing.assert_close(param.grad, expected.grad, rtol=rtol, atol=atol, msg=name)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)


@cpu_inductor
@pytest.mark.parametrize("regions", [False, True], ids=["whole_model", "regions"])
def test_cpu_inductor_compiles_once_and_matches_eager_over_changing_shapes(regions, caplog):
    """The default ASR front end (one ``Conv2d`` over a one-channel input: subsampling 2)
    compiled whole, and the Conformer blocks compiled regionally, train over four batch
    shapes with one compile and eager's gradients. With inductor's layout optimisation on
    (torch 2.11), the whole model failed a stride assertion on its second shape and the
    regional blocks on theirs (about 30 s of compilation each on 2 cores)."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = dict(n_mels=40, d_model=32, num_layers=2, num_heads=2, ffn_dim=64, dropout=0.0)
    model = ConformerCTC(**config, subsampling=2)
    reference = copy.deepcopy(model)
    modules = torch.nn.ModuleDict({"model": model})
    options = RunOptions(compile=True, compile_regions=regions)
    with caplog.at_level(logging.WARNING, logger="amp_utils.compile"):
        assert not compile_modules(modules, options, torch.device("cpu"))  # no CUDA graphs
    assert "slower than eager" in caplog.text  # the user learns that eager is faster here
    assert (model.blocks[0]._compiled_call_impl is not None) == regions
    shapes = [(3, 61), (2, 38), (4, 120), (3, 29)]
    recompiles_before = compile_stats()["recompiles"]  # process-wide: other tests compile too
    _assert_trains_like_eager(modules["model"], model, reference, shapes, rtol=1e-4, atol=1e-6)
    stats = compile_stats()
    assert stats["recompiles"] == recompiles_before and stats["graph_breaks"] == 0, stats


def test_compile_stats_count_each_recompile() -> None:
    """``results.json``'s ``compile.recompiles``: a guard that fails (here the input's dtype)
    compiles the frame again, and the count says so. torch 2.11's own
    ``counters["recompiles"]`` stays empty, and the count read 0 before 2026-11-28."""
    torch._dynamo.reset()  # drops dynamo's callbacks: whatever compiles installs the count
    RECOMPILES.install()
    before = compile_stats()["recompiles"]
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=True)
    double(torch.ones(3))
    double(torch.ones(5))  # another size: dynamic shapes, the same compile
    assert compile_stats()["recompiles"] == before
    double(torch.ones(3, dtype=torch.float64))  # another dtype: a recompile
    assert compile_stats()["recompiles"] == before + 1
    torch._dynamo.reset()


def test_compile_warns_on_the_cpu_only_with_inductor(monkeypatch, caplog):
    """The CPU warning names the measured slowdown; other backends and CUDA stay quiet."""
    monkeypatch.setattr(torch, "compile", lambda module, **options: module)
    modules = torch.nn.ModuleDict({"model": torch.nn.Linear(2, 2)})
    cases = [("cpu", "inductor", True), ("cpu", "aot_eager", False), ("cuda", "inductor", False)]
    for device, backend, warned in cases:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="amp_utils.compile"):
            compile_modules(modules, RunOptions(compile_backend=backend), torch.device(device))
        assert ("slower than eager" in caplog.text) == warned, (device, backend)


@pytest.mark.gpu
def test_regional_compile_matches_eager_over_changing_shapes_on_cuda(cuda_device):
    """Regionally compiled blocks (CUDA graphs, dynamic shapes) give eager's outputs and
    gradients while batch size and length change, with the loop's compile options."""
    torch.manual_seed(0)
    config = dict(n_mels=40, d_model=64, num_layers=3, num_heads=2, ffn_dim=128, dropout=0.0)
    model = ConformerCTC(**config).to(cuda_device)
    reference = copy.deepcopy(model)
    compile_regions(model, **compile_options("reduce-overhead", "inductor"))
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = [(26, 230), (187, 33), (159, 38)] * 2
    _assert_trains_like_eager(model, model, reference, shapes, 1e-3, 1e-4, cudagraphs=True)


@pytest.mark.parametrize("model", ["conformer_ctc", "xvector"])
def test_trainer_compile_trains_a_recipe_without_graph_breaks(model, fsdd_root, tmp_path):
    """``trainer.compile=true`` on a recipe compiles its model, not its features and
    augmentations: those drew random shapes (a random channel curve of the waveform's
    length, torchaudio's resampling) and graph-broke or recompiled every few batches, up to
    TorchDynamo's recompile limit, after which they ran eagerly anyway (the default recipe's
    one epoch: 7 graph breaks, 16 recompiles). aot_eager: the graphs, no code generation."""
    import json

    from tests.recipe_helpers import FAST, run_recipe

    run = run_recipe(
        "train.py",
        tmp_path,
        fsdd_root,
        *FAST,
        f"model={model}",
        "precision=bf16",
        "trainer.epochs=1",
        "trainer.compile=true",
        "trainer.compile_backend=aot_eager",
    )
    stats = json.loads((run / "results.json").read_text())["compile"]
    assert stats["graph_breaks"] == 0, stats
    assert stats["recompiles"] <= 1, stats  # a dimension equal to another by chance: one
