"""``torch.compile`` for the loop: whole modules or regions, CUDA-graph modes, counters.

The Brain calls :func:`compile_modules` once from ``on_fit_start``; recipes and tools use
:func:`unwrap_module` to reach their own module's methods through DDP and compile wrappers.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from amp_utils.run_options import RunOptions

logger = logging.getLogger(__name__)

#: torch.compile modes that replay CUDA graphs (cudagraph trees) on CUDA.
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


def unwrap_module(module: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP and ``torch.compile`` wrappers (for its own methods)."""
    while True:
        if isinstance(module, DistributedDataParallel):
            module = module.module
        elif hasattr(module, "_orig_mod"):  # torch.compile's OptimizedModule
            module = module._orig_mod
        else:
            return module


def compile_regions(module: torch.nn.Module, **options: Any) -> int:
    """Compile each block of the ``ModuleList``s in ``module`` in place; returns how many.

    Regional compilation (PyTorch's recipe for repeated layers): the blocks share their
    code, so one compile serves all of them -- seconds instead of minutes for a deep
    encoder (measured on an H100: 16 Conformer blocks, 15-40 s instead of 250 s for the
    whole model with dynamic shapes). ``Module.compile`` keeps the state-dict keys, so
    checkpoints load with and without it. Only blocks of the user's own classes count
    (TorchDynamo does not trace into ``torch.nn`` containers compiled in place); without
    such blocks the whole module is compiled in place.
    """
    blocks: list[torch.nn.Module] = []
    inside: set[int] = set()  # modules within a block already chosen (nested lists)
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and id(child) not in inside:
            own = [block for block in child if not type(block).__module__.startswith("torch.")]
            blocks.extend(own)
            inside.update(id(m) for block in own for m in block.modules())
    for block in blocks or [module]:
        block.compile(**options)
    return len(blocks) or 1


class RecompileCount:
    """Counts TorchDynamo's recompiles in this process: compiles of a frame it had compiled
    before (compile id ``frame/n`` with ``n > 0``, the ``[0/1]`` of ``TORCH_LOGS=recompiles``).

    torch 2.11 keeps no such counter: ``torch._dynamo.utils.counters["recompiles"]`` stays
    empty, so the ``recompiles`` that ``results.json`` recorded read 0 whatever happened
    (the device CTC loss's trial compile, 2026-11-28, was followed by two recompiles).
    Dynamo's compile-start callback sees every compile. ``torch._dynamo.reset()`` drops the
    callbacks, so whatever compiles calls :meth:`install` first (:func:`compile_modules`, the
    CTC loss's compiled update); one process-wide instance counts: :data:`RECOMPILES`.
    """

    def __init__(self) -> None:
        self.count = 0

    def install(self) -> None:
        """Register with dynamo's compile-start callbacks, unless it is already there."""
        handler = torch._dynamo.callback_handler
        if self not in handler.start_callbacks:
            handler.register_start_callback(self)

    def __call__(self, args: Any) -> None:
        """Dynamo's start callback: one compile begins (``args``: ``CallbackArgs``)."""
        from torch._dynamo.callback import CallbackTrigger
        from torch._guards import CompileId

        if args.callback_trigger is not CallbackTrigger.DYNAMO:
            return  # a deferred backward or a cudagraph recording: no new frame compile
        compile_id = CompileId.from_string(str(args.compile_id))
        if compile_id is not None and (compile_id.frame_compile_id or 0) > 0:
            self.count += 1


RECOMPILES = RecompileCount()
RECOMPILES.install()


def compile_stats() -> dict[str, int]:
    """Process-wide ``torch.compile`` counters: graphs compiled, recompiles, CUDA-graph skips."""
    from torch._dynamo.utils import counters

    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "recompiles": RECOMPILES.count,
        "graph_breaks": int(sum(counters["graph_break"].values())),
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
    }


def compile_options(mode: str, backend: str) -> dict[str, Any]:
    """Keyword arguments of ``torch.compile`` for the loop: dynamic shapes, ``mode``'s
    optimisations, and inductor's layout optimisation off.

    On a CPU, inductor (torch 2.11) turns every convolution's tensors channels-last for
    oneDNN ("layout optimisation"; on CUDA it is skipped under dynamic shapes) and then
    bakes the first batch shape's strides into the graph: the second shape of a model with
    a one-channel ``Conv2d`` (the ASR front end) fails a stride assertion, and regionally
    compiled Conformer blocks did the same, or recompiled for every new shape. Without it,
    one compile serves every shape and the gradients equal eager's
    (``tests/test_compile.py``). ``torch.compile`` takes a mode or options, not both, so the
    mode's own options (``torch._inductor.list_mode_options``) are spelled out.
    """
    if backend != "inductor":
        return {"backend": backend, "dynamic": True}  # modes are inductor's
    from torch._inductor import list_mode_options

    options = {**list_mode_options(mode, dynamic=True), "layout_optimization": False}
    return {"dynamic": True, "options": options}


def compile_modules(
    modules: torch.nn.ModuleDict, run_opts: RunOptions, device: torch.device
) -> bool:
    """``torch.compile`` the modules ``run_opts`` selects (dynamic shapes: one compile each).

    With a CUDA-graph mode (``reduce-overhead``) on CUDA, each distinct batch shape is
    captured once and replayed afterwards, which removes the launch overhead of small
    kernels; batches padded to bucket edges keep the set of shapes small. A graph that
    cannot be captured runs without CUDA graphs, and PyTorch logs why.

    Returns:
        Whether the compiled modules replay CUDA graphs (the loop then marks each step).

    Raises:
        ValueError: ``compile_module_keys`` names a module that does not exist.
    """
    keys = run_opts.compile_module_keys or list(modules.keys())
    unknown = sorted(set(keys) - set(modules.keys()))
    if unknown:
        raise ValueError(f"compile_module_keys {unknown} are not modules; valid: {list(modules)}.")
    options = compile_options(run_opts.compile_mode, run_opts.compile_backend)
    RECOMPILES.install()
    if device.type == "cpu" and run_opts.compile_backend == "inductor":
        logger.warning(
            "torch.compile on a CPU: compiled training steps measured slower than eager ones "
            "(0.58-0.78x the steps/s on a 2-core Xeon, benchmarks/results/2026-11-26-cpu-"
            "compile.md) and compiling takes minutes; trainer.compile=false trains faster here."
        )
    for key in keys:
        if run_opts.compile_regions:
            compile_regions(unwrap_module(modules[key]), **options)
        else:
            modules[key] = torch.compile(modules[key], **options)
    return device.type == "cuda" and run_opts.compile_mode in CUDAGRAPH_MODES
