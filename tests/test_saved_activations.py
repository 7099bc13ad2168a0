"""amp_utils.saved_activations: what autograd keeps for backward, by dtype and module."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from amp_utils.saved_activations import (
    OUTSIDE,
    ActivationMemory,
    SavedActivations,
    SavedBytes,
    activation_memory,
    measure_saved,
)
from recipes.asr.model import ConformerCTC


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_fp32_counts_each_saved_activation_once_and_no_parameter():
    """Linear saves its input, ReLU its output, which the second Linear saves again as its
    input: one storage, counted once; the weights are parameters, not counted."""
    model = mlp()
    x = torch.randn(3, 4)
    saved = measure_saved(model, lambda: model(x).sum(), "cpu", None)
    assert saved.by_dtype == {"fp32": x.nbytes + 3 * 8 * 4}
    assert saved.by_module == {"0": {"fp32": x.nbytes}, "1": {"fp32": 3 * 8 * 4}}


def test_bf16_keeps_the_casts_of_inputs_and_weights_and_no_fp32():
    """Under autocast a Linear keeps a bf16 copy of its input, and of its weight where the
    input needs a gradient (the copies are activation memory until backward; the fp32
    weights are not counted). The first layer's input needs none: no weight copy."""
    model = mlp()
    x = torch.randn(3, 4)
    saved = measure_saved(model, lambda: model(x).sum(), "cpu", torch.bfloat16)
    hidden = 3 * 8 * 2  # ReLU's output, the second Linear's input
    assert saved.by_module == {
        "0": {"bf16": x.numel() * 2},
        "1": {"bf16": hidden},
        "2": {"bf16": 2 * 8 * 2},  # its weight's bf16 copy
    }
    assert saved.by_dtype == {"bf16": x.numel() * 2 + hidden + 2 * 8 * 2}


def test_a_tensor_saved_by_several_ops_counts_once_and_outside_modules_goes_to_the_loss():
    x = torch.randn(5, requires_grad=True)
    model = nn.Identity()
    with SavedActivations(model) as saved:
        y = x * x  # saves x twice
        (y.exp() * 2).sum()  # exp saves its output
    assert saved.result.by_dtype == {"fp32": 2 * x.nbytes}
    assert set(saved.result.by_module) == {""}
    memory = ActivationMemory("bf16", saved.result, saved.result)
    assert memory.by_module_type(model) == {OUTSIDE: {"fp32": 2 * x.nbytes, "low": 2 * x.nbytes}}
    assert memory.fp32_holders() == [("", 2 * x.nbytes, 2 * x.nbytes)]
    assert f"| `{OUTSIDE}` |" in memory.markdown(model)


def test_fp32_holders_leave_out_the_noise():
    fp32 = SavedBytes({"fp32": 1000}, {"a": {"fp32": 996}, "b": {"fp32": 4}})
    low = SavedBytes(
        {"bf16": 500, "fp32": 504}, {"a": {"bf16": 500, "fp32": 500}, "b": {"fp32": 4}}
    )
    assert ActivationMemory("bf16", fp32, low).fp32_holders() == [("a", 500, 996)]


def test_layer_norm_keeps_fp32_under_bf16_and_the_report_names_it():
    """Autocast runs layer_norm in fp32: its saved input stays fp32, and the report lists
    it as the module that keeps fp32 bytes (why bf16 saves less than half)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    x = torch.randn(32, 16)
    memory = activation_memory(model, lambda: model(x).sum(), "cpu", "bf16", torch.bfloat16)
    assert memory.fp32.by_dtype.keys() == {"fp32"}
    assert memory.low.by_module["1"].get("fp32", 0) > 0  # the LayerNorm
    assert memory.fp32_holders()[0][0] == "1"
    assert 0 < memory.ratio < 1
    markdown = memory.markdown(model)
    assert markdown.startswith("# Activation memory: bf16 against fp32")
    assert f"**{memory.ratio:.2f}×** fp32" in markdown
    assert "| LayerNorm |" in markdown and "| `1` |" in markdown
    data = json.loads(json.dumps(memory.to_json()))
    assert data["ratio"] == pytest.approx(memory.ratio)
    assert data["bf16"]["by_module"]["1"]["fp32"] == memory.low.by_module["1"]["fp32"]


def test_both_passes_draw_the_same_dropout_masks_and_leave_no_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    masks = []
    model[1].register_forward_hook(lambda m, args, out: masks.append(out.ne(0)))
    activation_memory(model, lambda: model(x).sum(), "cpu", "bf16", torch.bfloat16)
    assert torch.equal(masks[0], masks[1])
    hooked = [m for m in model.modules() if m._forward_pre_hooks]
    assert hooked == [] and len(model[1]._forward_hooks) == 1  # only the test's own


def test_the_conformer_keeps_less_under_bf16_but_more_than_half():
    """The recipe's model: bf16 keeps less than fp32, but not half (fp32 norms, softmax,
    residual stream); the fp32 holders are named."""
    torch.manual_seed(0)
    model = ConformerCTC(n_mels=40, d_model=64, num_layers=2, num_heads=4, ffn_dim=128)
    model.train()
    feats = torch.randn(4, 200, 40)
    lens = torch.full((4,), 200)
    memory = activation_memory(
        model,
        lambda: model(feats, lens)[0].float().square().mean(),
        "cpu",
        "bf16",
        torch.bfloat16,
    )
    assert 0.5 < memory.ratio < 1.0, memory.ratio
    assert memory.fp32_holders(), memory.low.by_module


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.child(x).exp()  # exp runs in the parent, after its child returned


def test_an_op_after_a_child_module_returns_counts_for_the_parent():
    model = nn.Sequential(Parent())
    x = torch.randn(2, 4)
    saved = measure_saved(model, lambda: model(x).sum(), "cpu", None)
    assert saved.by_module == {"0.child": {"fp32": x.nbytes}, "0": {"fp32": x.nbytes}}


def _saved_on_cuda(plain: nn.Module, changed: nn.Module, device: torch.device):
    """A batch of 4 x 400 frames and what each model keeps for backward on it in bf16:
    ``(feats, lens, {"plain": ..., "changed": ...})``."""
    feats = torch.randn(4, 400, 40, device=device)
    lens = torch.full((4,), 400, device=device)
    saved = {
        name: measure_saved(model, lambda m=model: m(feats, lens)[0], "cuda", torch.bfloat16)
        for name, model in (("plain", plain), ("changed", changed))
    }
    return feats, lens, saved


@pytest.mark.gpu
def test_low_precision_norms_keep_fewer_bytes_on_cuda(cuda_device):
    """On CUDA autocast runs LayerNorm in fp32 and keeps an fp32 input for backward;
    ``precision.low_precision_norms`` keeps a bf16 copy instead. The recipe's Conformer
    under bf16 then keeps fewer bytes, with logits close to the plain model's."""
    from amp_utils.module_precision import apply_low_precision_norms

    torch.manual_seed(0)
    plain = ConformerCTC(n_mels=40, d_model=64, num_layers=2, num_heads=4, ffn_dim=128)
    plain = plain.to(cuda_device).eval()
    changed = ConformerCTC(n_mels=40, d_model=64, num_layers=2, num_heads=4, ffn_dim=128)
    changed = changed.to(cuda_device).eval()
    changed.load_state_dict(plain.state_dict())
    assert len(apply_low_precision_norms(changed)) == 2 * 6
    feats, lens, saved = _saved_on_cuda(plain, changed, cuda_device)
    assert saved["plain"].by_dtype.get("fp32", 0) > 0
    assert saved["changed"].by_dtype.get("fp32", 0) < 0.5 * saved["plain"].by_dtype["fp32"]
    assert saved["changed"].total < saved["plain"].total
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = plain(feats, lens)[0].float(), changed(feats, lens)[0].float()
    assert (a - b).norm() / a.norm() < 0.02


@pytest.mark.gpu
def test_norm_saves_16bit_keeps_fewer_bytes_on_cuda_with_the_same_logits(cuda_device):
    """On CUDA ``precision.norm_saves_16bit`` keeps bf16 normalized inputs where autocast's
    fp32 LayerNorms keep fp32 inputs: fewer fp32 and fewer bytes in all, the same logits
    bit for bit (the forward pass is autocast's)."""
    from amp_utils.module_precision import apply_norm_saves_16bit

    torch.manual_seed(0)
    sizes = dict(n_mels=40, d_model=64, num_layers=2, num_heads=4, ffn_dim=128, dropout=0.0)
    plain = ConformerCTC(**sizes).to(cuda_device).train()
    changed = ConformerCTC(**sizes).to(cuda_device).train()
    changed.load_state_dict(plain.state_dict())
    assert len(apply_norm_saves_16bit(changed)) == 2 * 6
    feats, lens, saved = _saved_on_cuda(plain, changed, cuda_device)
    assert saved["changed"].by_dtype.get("fp32", 0) < 0.5 * saved["plain"].by_dtype["fp32"]
    assert saved["changed"].total < saved["plain"].total
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a, b = plain(feats, lens)[0], changed(feats, lens)[0]
    assert torch.equal(a, b)


def test_the_cuda_policy_benchmark_shows_the_layer_norms_fp32_bytes():
    """benchmarks/activation_memory_cuda_policy.py: with CUDA's choices emulated, the
    LayerNorms keep fp32 under bf16 (as CUDA's autocast runs them) and half of it in bf16
    with low_precision_norms; attention and depthwise convolutions keep no fp32 (on a CPU
    fast_kernels keeps them in fp32)."""
    from benchmarks.activation_memory_cuda_policy import conformer_m
    from benchmarks.cuda_policy import cuda_kernel_choices

    feats, lens = torch.randn(1, 64, 80), torch.tensor([64])
    kept = {}
    with cuda_kernel_choices():
        for norms in ("autocast", "low_precision", "saves_16bit"):
            model = conformer_m(norms)
            memory = activation_memory(
                model,
                lambda m=model: m(feats, lens)[0].float().sum(),
                "cpu",
                "bf16",
                torch.bfloat16,
            )
            kept[norms] = memory.by_module_type(model)
            holders = {name for name, _, _ in memory.fp32_holders(top=1000)}
            assert not any(name.endswith((".attention", ".depthwise")) for name in holders)
    autocast, low = kept["autocast"]["LayerNorm"], kept["low_precision"]["LayerNorm"]
    assert autocast["low"] == autocast["fp32"]  # fp32 copies of the inputs
    assert low["low"] < 0.6 * low["fp32"]
    # norm_saves_16bit: autocast's fp32 LayerNorms keep a bf16 normalized input (and their
    # fp32 inverse standard deviations, not the means the low-precision norms keep too)
    saves_16bit = kept["saves_16bit"]["LayerNorm"]
    assert saves_16bit["fp32"] == autocast["fp32"]
    assert saves_16bit["low"] < low["low"] < 0.6 * autocast["low"]
    # CUDA's dropout keeps a one-byte bool mask in both precisions (the CPU's F.dropout a
    # mask in the input's dtype: 4 bytes in fp32, which overstated bf16's saving)
    dropout = kept["autocast"]["Dropout"]
    assert dropout["low"] == dropout["fp32"] > 0


def test_compiled_blocks_are_counted_without_recompiling_each_block():
    """``by_module=False`` counts a regionally compiled model as it trains: dtype totals
    from the compiled blocks, with one recompile (fp32, then bf16's autocast). With the
    per-module hooks TorchDynamo guarded on each block's labels and recompiled every
    block; past ``recompile_limit`` (8) the blocks of Conformer-M ran eagerly."""
    from amp_utils.compile import RECOMPILES, compile_options, compile_regions

    torch._dynamo.reset()
    RECOMPILES.install()
    torch.manual_seed(0)
    sizes = dict(n_mels=16, d_model=32, num_layers=3, num_heads=2, ffn_dim=64, conv_kernel=5)
    model = ConformerCTC(**sizes).train()
    compile_regions(model, **compile_options("default", "aot_eager"))
    feats, lens = torch.randn(2, 40, 16), torch.tensor([40, 31])
    before = RECOMPILES.count
    memory = activation_memory(
        model,
        lambda: model(feats, lens)[0].float().sum(),
        "cpu",
        "bf16",
        torch.bfloat16,
        by_module=False,
    )
    assert RECOMPILES.count - before == 1
    assert set(memory.fp32.by_module) == set(memory.low.by_module) == {""}
    assert memory.fp32.total > 0 and "bf16" in memory.low.by_dtype
    torch._dynamo.reset()


def test_the_cuda_policy_benchmark_counts_compiled_blocks():
    """``--compiled``: the blocks compiled as ``experiment=gpu_asr`` compiles them.
    Autocast's fp32 LayerNorms keep the fp32 residual stream there; both options keep
    fewer bytes and almost no fp32 (``norm_saves_16bit`` through its opaque operation: as
    a plain autograd function inductor folded its casts and it kept the same bytes as
    autocast's LayerNorms)."""
    from benchmarks.activation_memory_cuda_policy import count
    from benchmarks.cuda_policy import cuda_kernel_choices

    sizes = dict(n_mels=16, d_model=64, num_layers=2, num_heads=4, ffn_dim=128, conv_kernel=7)
    feats, lens = torch.randn(4, 80, 16), torch.full((4,), 80)
    kept = {}
    with cuda_kernel_choices():
        for norms in ("autocast", "low_precision", "saves_16bit"):
            # inductor's partitioner without its code generation (a minute less); the
            # casts inductor folds are tested in test_numerics.py, with inductor
            _, memory = count(norms, feats, lens, True, sizes, backend="aot_eager_decomp_partition")
            assert set(memory.low.by_module) == {""}  # by dtype only
            kept[norms] = memory
    torch._dynamo.reset()
    autocast, low, saves = kept["autocast"], kept["low_precision"], kept["saves_16bit"]
    assert autocast.low.by_dtype["fp32"] > 0.05 * autocast.low.total  # fp32 residuals
    assert low.low.total < autocast.low.total
    assert low.low.by_dtype.get("fp32", 0) < 0.2 * autocast.low.by_dtype["fp32"]
    assert saves.low.total < autocast.low.total
    assert saves.low.by_dtype.get("fp32", 0) < 0.2 * autocast.low.by_dtype["fp32"]
    assert low.state_bytes == autocast.state_bytes > 0


def test_training_state_counts_parameters_gradients_and_adam_moments():
    from amp_utils.saved_activations import training_state_bytes

    model = nn.Linear(4, 2)  # 10 parameters, 40 bytes
    optimizer = torch.optim.AdamW(model.parameters())
    assert training_state_bytes(model, [optimizer]) == 2 * 40  # no step yet: no moments
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    steps = sum(state["step"].nbytes for state in optimizer.state.values())
    assert training_state_bytes(model, [optimizer]) == 2 * 40 + 2 * 40 + steps


def test_the_peak_ratio_adds_the_training_state_to_both_precisions():
    fp32, low = SavedBytes({"fp32": 600}), SavedBytes({"bf16": 300})
    memory = ActivationMemory("bf16", fp32, low, state_bytes=400)
    assert memory.ratio == 0.5 and memory.peak_ratio == 0.7
    assert "bf16 **0.70×** fp32" in memory.markdown(nn.Identity())
    assert memory.to_json()["peak_ratio"] == 0.7
