"""Operations in one Brain training step under CUDA's autocast choices, counted on a CPU.

A small model's captured step on a GPU takes time in proportion to the kernels it runs
(the 2026-11-26 H200 profile: 3,856 kernels in the graphed bf16 step of the default recipe,
7.8 ms of kernel time in 13.2 ms). Autocast adds cast kernels that fp32 does not run. This
script counts, without a GPU, the aten operations of one steady-state training step (forward,
CTC loss, backward, gradient clipping, fused AdamW) run by ``amp_utils.Brain``:

- fp32;
- bf16 / fp16 with autocast's own per-weight casts (``precision.fused_weight_casts=false``);
- bf16 / fp16 with the weights cast together (the default);
- bf16 with the weights cast together and ``precision.low_precision_norms``;
- bf16 with the weights cast together and ``precision.norm_saves_16bit``.

The model runs with the choices CUDA makes (``benchmarks/activation_memory_cuda_policy``:
attention, depthwise convolutions and dropout as on CUDA; LayerNorms in fp32 as CUDA's
autocast runs them). An operation is one aten call that is not a view; a CUDA kernel count
differs (a matmul may launch two, a foreach op one per chunk), so compare the ratios.

    python -m benchmarks.kernel_count_cuda_policy            # the default small Conformer
    python -m benchmarks.kernel_count_cuda_policy --model m  # Conformer-M

(``-m`` from the repository root: the script imports other ``benchmarks`` modules.)
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from amp_utils import Brain
from amp_utils.step_operations import is_operation
from benchmarks.activation_memory_cuda_policy import CONFORMER_M, cuda_policy_conformer
from benchmarks.cuda_policy import use_cuda_kernel_choices

#: conf/model/conformer_ctc.yaml with the digits' 40 mel bands
CONFORMER_SMALL = dict(
    n_mels=40, d_model=144, num_layers=4, num_heads=4, ffn_dim=576, conv_kernel=15, subsampling=2
)
#: (label, precision, fused_weight_casts, how the LayerNorms run: see cuda_policy_conformer)
VARIANTS = [
    ("fp32", "fp32", False, "autocast"),
    ("bf16, per-weight casts", "bf16", False, "autocast"),
    ("bf16, weights cast together", "bf16", True, "autocast"),
    ("bf16, together + low_precision_norms", "bf16", True, "low_precision"),
    ("bf16, together + norm_saves_16bit", "bf16", True, "saves_16bit"),
    ("fp16, per-weight casts", "fp16", False, "autocast"),
    ("fp16, weights cast together", "fp16", True, "autocast"),
]


class OperationCount(TorchDispatchMode):
    """aten operations that are not views, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if is_operation(func):
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class CTCBrain(Brain):
    """The ASR step on features: encoder, log-softmax and CTC loss (PyTorch's)."""

    def compute_forward(self, batch, stage):  # noqa: ANN001, ANN201
        feats, lens, _ = batch
        return self.modules.model(feats, lens)

    def compute_objectives(self, predictions, batch, stage):  # noqa: ANN001, ANN201
        logits, out_lens = predictions
        targets = batch[2]
        log_probs = logits.float().log_softmax(-1).transpose(0, 1)
        target_lens = torch.full((targets.shape[0],), targets.shape[1])
        return F.ctc_loss(log_probs, targets, out_lens, target_lens, zero_infinity=True)


def count_step(sizes: dict, precision: str, fused: bool, norms: str) -> OperationCount:
    """Operations of the third training step (the first observes the weights' uses), with
    the LayerNorms run as ``norms`` says (:func:`cuda_policy_conformer`)."""
    brain = CTCBrain(
        {"model": cuda_policy_conformer(sizes, norms)},
        opt_class=lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
        run_opts={
            "device": "cpu",
            "noprogressbar": True,
            "precision": precision,
            "fused_weight_casts": fused,
            "max_grad_norm": 5.0,
        },
    )
    brain.on_fit_start()
    gen = torch.Generator().manual_seed(0)
    frames = 96
    batch = (
        torch.randn(2, frames, sizes["n_mels"], generator=gen),
        torch.full((2,), frames),
        torch.randint(1, 29, (2, 8), generator=gen),
    )
    for _ in range(2):
        brain.train_step(batch)
    brain.flush_pending()
    with OperationCount() as ops:
        brain.train_step(batch)
    brain.flush_pending()
    return ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["small", "m"], default="small")
    args = parser.parse_args()
    sizes = CONFORMER_SMALL if args.model == "small" else {**CONFORMER_M, "subsampling": 4}
    use_cuda_kernel_choices()
    print(f"| Conformer {args.model} step | operations | vs fp32 | casts (`_to_copy`) | cat |")
    print("|---|---:|---:|---:|---:|")
    fp32_total = None
    for label, precision, fused, norms in VARIANTS:
        ops = count_step(sizes, precision, fused, norms)
        total = sum(ops.counts.values())
        fp32_total = fp32_total or total
        print(
            f"| {label} | {total} | {total / fp32_total:.2f}x | {ops.counts['_to_copy']} "
            f"| {ops.counts['cat']} |"
        )


if __name__ == "__main__":
    main()
