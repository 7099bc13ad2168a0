"""Train a recipe on a CPU as CUDA's autocast computes it: CUDA's numerics without a GPU.

    python -m benchmarks.train_cuda_policy precision=bf16 precision.norm_saves_16bit=true ...

It takes ``recipes/train.py``'s overrides and trains with CUDA's choices of
``benchmarks/cuda_policy.py`` for the whole run: CUDA autocast's fp32 ops (reductions,
softmaxes, LayerNorms, losses) in fp32, attention, depthwise convolutions and dropout as on
CUDA. A CPU's own autocast keeps LayerNorms, and so the Conformer's residual stream, in bf16;
CUDA's keeps them in fp32. Options that change what CUDA's LayerNorms do
(``precision.low_precision_norms``, ``precision.norm_saves_16bit``) can then be trained on
a CPU to see whether they train as the plain precision does (a GPU lease is the place for
their speed). Kernels differ (oneDNN's, not cuBLAS's), so compare runs made with this script,
not with GPU runs. Slower than a plain CPU run: every op passes a ``TorchFunctionMode``.
"""

from __future__ import annotations

from benchmarks.cuda_policy import cuda_fp32_ops, cuda_kernel_choices


def main() -> None:
    import recipes.train as train_script
    from recipes.config import exit_on_unknown_override_keys
    from recipes.schema import Config

    exit_on_unknown_override_keys(Config)
    with cuda_kernel_choices(), cuda_fp32_ops() as mode:
        train_script.main()
    print(f"CUDA's autocast choices emulated: {mode.calls} calls computed in fp32 as on CUDA")


if __name__ == "__main__":
    main()
