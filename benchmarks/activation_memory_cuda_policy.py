"""Conformer-M's saved activations under CUDA's autocast choices, measured on a CPU.

Why bf16's peak memory is 0.63x fp32's on the GPU (target 0.6x), without a GPU: the model
runs on the CPU with the choices CUDA makes, and ``amp_utils.saved_activations`` counts what
autograd keeps for backward under fp32 and bf16:

- attention cores, depthwise convolutions and dropout as on CUDA (``fast_kernels``' CPU
  choices off: they keep attention and depthwise convolutions in fp32 on CPUs; dropout
  keeps CUDA's one-byte bool mask, not the CPU's mask in the input's dtype);
- LayerNorm as CUDA's autocast runs it (fp32 copy of the input, fp32 output), or with
  ``precision.low_precision_norms`` (a bf16 copy of the input, fp32 statistics inside).

    python -m benchmarks.activation_memory_cuda_policy --batch 20 --frames 1000 [--compiled]

(20 x 10 s of 10 ms feature frames, about the sweep's 200 s batches). The byte counts depend
on the ops' choices only, not on the CPU; the time does.

``--compiled`` compiles the blocks as ``experiment=gpu_asr`` does (``fast_path=cuda_graphs``:
regional ``torch.compile``, inductor, dynamic shapes): what each block's compiled graph keeps
is then the partitioner's choice, not eager autograd's, and counts by dtype only. Measured on
2026-11-28 (``benchmarks/results/2026-11-28-cpu-compiled-activation-memory.md``): compiled,
autocast's fp32 LayerNorms keep the fp32 residual stream (0.59x fp32's bytes, 0.64x with the
training state); ``precision.norm_saves_16bit`` first kept exactly as much (inductor folded
its casts to bf16 and back into one fp32 cast) and now keeps what ``low_precision_norms``
keeps, through an operation inductor cannot see into.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from amp_utils.compile import compile_options, compile_regions
from amp_utils.module_precision import (
    apply_low_precision_norms,
    apply_norm_saves_16bit,
    run_in_fp32,
)
from amp_utils.saved_activations import ActivationMemory, activation_memory
from benchmarks.cuda_policy import use_cuda_kernel_choices
from recipes.asr.model import ConformerCTC

#: How the LayerNorms run, each counted in turn (see :func:`cuda_policy_conformer`).
NORM_CHOICES = ("autocast", "low_precision", "saves_16bit")
#: conf/model/conformer_ctc_m.yaml with experiment=gpu_asr's 80 mel bands
CONFORMER_M = dict(n_mels=80, d_model=256, num_layers=16, num_heads=4, ffn_dim=1024, conv_kernel=31)


def cuda_policy_conformer(sizes: dict, norms: str) -> nn.Module:
    """A Conformer of ``sizes`` (seeded) with its LayerNorms as CUDA's autocast runs them
    (``"autocast"``), with ``precision.low_precision_norms`` (``"low_precision"``) or with
    ``precision.norm_saves_16bit`` (``"saves_16bit"``; under :func:`use_cuda_kernel_choices`,
    which has them compute in fp32 as on CUDA)."""
    torch.manual_seed(0)
    model = ConformerCTC(**sizes).train()
    if norms == "autocast":
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                run_in_fp32(module)  # CUDA's autocast: layer_norm in fp32 (input cast up)
    elif norms == "low_precision":
        apply_low_precision_norms(model)
    elif norms == "saves_16bit":
        apply_norm_saves_16bit(model)
    else:
        raise ValueError(f"norms={norms!r}: choose one of {', '.join(NORM_CHOICES)}")
    return model


def conformer_m(norms: str) -> nn.Module:
    """Conformer-M with its LayerNorms as :func:`cuda_policy_conformer` runs them."""
    return cuda_policy_conformer(CONFORMER_M, norms)


def count(
    norms: str,
    feats: torch.Tensor,
    lens: torch.Tensor,
    compiled: bool,
    sizes: dict = CONFORMER_M,
    backend: str = "inductor",
) -> tuple[nn.Module, ActivationMemory]:
    """Saved bytes of one training forward of the Conformer of ``sizes`` (LayerNorms as
    ``norms`` says) under fp32 and bf16, eager or with its blocks compiled as the sweep
    compiles them (``backend``: tests use a faster one); ``state_bytes``: parameters,
    gradients and AdamW's two moments."""
    model = cuda_policy_conformer(sizes, norms)
    if compiled:
        torch._dynamo.reset()  # each variant's own graphs, not the last one's
        compile_regions(model, **compile_options("default", backend))

    def forward() -> torch.Tensor:
        return model(feats, lens)[0].float().square().mean()

    memory = activation_memory(
        model, forward, "cpu", "bf16", torch.bfloat16, by_module=not compiled
    )
    memory.state_bytes = 4 * sum(p.nbytes for p in model.parameters())
    return model, memory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=20, help="utterances per batch")
    parser.add_argument("--frames", type=int, default=1000, help="feature frames each")
    parser.add_argument(
        "--compiled", action="store_true", help="blocks compiled as experiment=gpu_asr runs"
    )
    args = parser.parse_args()
    use_cuda_kernel_choices()
    feats = torch.randn(args.batch, args.frames, CONFORMER_M["n_mels"])
    lens = torch.full((args.batch,), args.frames)
    for norms in NORM_CHOICES:
        start = time.perf_counter()
        model, memory = count(norms, feats, lens, args.compiled)
        mode = "compiled blocks" if args.compiled else "eager"
        print(f"## LayerNorms: {norms}, {mode} ({time.perf_counter() - start:.0f} s)\n")
        print(memory.markdown(model))


if __name__ == "__main__":
    main()
