"""Numerics report of the recipe's model: which modules are unsafe in fp16/bf16, and the fix.

    python recipes/diagnose.py precision=fp16                      # the default ASR recipe
    python recipes/diagnose.py precision=bf16 model=xvector diagnose.batches=8
    python recipes/diagnose.py precision=fp16 'precision.fp32_modules=[model.blocks.*.conv]'

Takes the same config groups and overrides as ``recipes/train.py``, trains a few batches
(from scratch; nothing is saved) and writes ``numerics.md`` and ``numerics.json`` into its run
folder and log2|x| histograms of activations and gradients into ``tb/<time>/`` (a TensorBoard
run per diagnosis). It also writes
``activation_memory.md``/``.json``: what the backward pass keeps of one batch under fp32 and
under the precision, by dtype and module (why bf16/fp16 save less memory than half), and
``step_operations.md``/``.json``: the operations of one training step under fp32 and under the
precision, with its casts sorted (why bf16/fp16 may be no faster on a GPU). With
``trainer.compile=true`` (e.g. ``experiment=gpu_asr``) it then compiles the model as training
does and writes ``activation_memory_compiled.md``/``.json``: what the compiled model keeps, by
dtype (compiled blocks keep what torch.compile's partitioner chooses, not what eager keeps).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from amp_utils.atomic import atomic_write_json, atomic_write_text
from amp_utils.brain import Brain
from amp_utils.compile import compile_modules
from amp_utils.loaders import shut_down_workers
from amp_utils.module_precision import UnknownModulePatternError, apply_fp32_modules
from amp_utils.numerics import probe_training_batches
from amp_utils.numerics_report import (
    NumericsReport,
    build_report,
    format_markdown,
    log_histograms,
)
from amp_utils.precision import resolve_device
from amp_utils.saved_activations import ActivationMemory, training_activation_memory
from amp_utils.step_operations import training_step_operations
from amp_utils.tensorboard import TensorBoardLogger
from recipes.config import (
    exit_on_unknown_override_keys,
)
from recipes.data_setup import build_data
from recipes.experiment import build_brain, seed_everything
from recipes.preflight import USER_ERRORS, run_options
from recipes.preflight import diagnosis_training_config as training_config
from recipes.resolvers import register_resolvers
from recipes.run_folder import RunFolder
from recipes.schema import DiagnoseRunConfig, register_schemas

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "conf")
logger = logging.getLogger(__name__)
register_resolvers()
register_schemas()


def build_recipe(cfg: DictConfig):
    """The recipe's Brain (fresh model, no checkpoints) and its training batches."""
    train_cfg = training_config(cfg)
    seed_everything(cfg.seed)
    data = build_data(train_cfg, resolve_device(run_options(train_cfg).device))
    return build_brain(train_cfg, data, None, None), data.train


def diagnose(cfg: DictConfig) -> NumericsReport:
    """Measure the configured recipe for ``diagnose.batches`` batches; write the report.

    A command refused before the measuring starts (a bad value, no GPU, data that cannot
    be read, an ``fp32_modules`` pattern that names no module) leaves no folder behind: the
    folder's ``.hydra/`` and log are written once the model is ready (``RunFolder``; Hydra's
    writes are taken over by ``DiagnosisFolderCallback``).
    """
    folder = RunFolder(Path(cfg.output_dir))
    try:
        brain, train_batches = build_recipe(cfg)
        try:
            return _diagnose(cfg, brain, train_batches, folder)
        finally:
            shut_down_workers(train_batches)  # the loader's workers end with the diagnosis
    finally:
        folder.abandon()  # refused before it started: no trace of it (else a no-op)


def _diagnose(
    cfg: DictConfig, brain: Brain, train_batches: DataLoader, folder: RunFolder
) -> NumericsReport:
    if brain.run_opts.compile:
        logger.warning(
            "trainer.compile=true: the diagnosis runs the model eagerly (uncompiled): its "
            "probes hook every module and every operation, which a compiled graph would not "
            "run; compiled training fuses operations (and the weight casts) its own way. "
            "activation_memory_compiled.md counts what the compiled model keeps."
        )
    patterns = list(OmegaConf.select(cfg, "precision.fp32_modules") or [])
    fp32_modules = apply_fp32_modules(brain.modules, patterns)
    folder.accept(cfg, run_record=False)  # the diagnosis goes ahead: its .hydra/ and log
    probes = probe_training_batches(brain, train_batches, int(cfg.diagnose.batches))
    report = build_report(
        probes.activations,
        probes.gradients,
        precision=brain.amp.name,
        batches=probes.batches,
        loss_scale_source=probes.loss_scale_source,
        fp32_modules=fp32_modules,
        context={
            "model": cfg.model.name,
            "data": f"{cfg.data.name} ({data_source(cfg.data)})",
            "device": brain.device.type,
        },
    )
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "numerics.md", format_markdown(report))
    atomic_write_json(out / "numerics.json", report.to_json())
    # one TensorBoard run per diagnosis: a second one into the folder would add its
    # histograms under the first one's tags
    started = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    tensorboard = TensorBoardLogger(out / "tb" / started)
    try:
        log_histograms(tensorboard.writer, probes.activations, probes.gradients)
    finally:
        tensorboard.close()
    batch = next(iter(train_batches))  # one batch for both measurements below
    memory = training_activation_memory(brain, batch)
    atomic_write_text(out / "activation_memory.md", memory.markdown(brain.modules))
    atomic_write_json(out / "activation_memory.json", memory.to_json())
    operations = training_step_operations(brain, batch)
    atomic_write_text(out / "step_operations.md", operations.markdown())
    atomic_write_json(out / "step_operations.json", operations.to_json())
    compiled = compiled_activation_memory(brain, batch) if brain.run_opts.compile else None
    if compiled is not None:  # last: the modules stay compiled
        atomic_write_text(out / "activation_memory_compiled.md", compiled.markdown(brain.modules))
        atomic_write_json(out / "activation_memory_compiled.json", compiled.to_json())
    for sentence in report.overall.values():
        logger.info(sentence)
    logger.info(
        "activation memory: %s keeps %.2fx fp32's bytes for the backward pass (%s)",
        memory.precision,
        memory.ratio,
        out / "activation_memory.md",
    )
    if compiled is not None:
        logger.info(
            "activation memory compiled as training compiles the model: %s keeps %.2fx "
            "fp32's bytes, %.2fx with parameters, gradients and optimizer state (%s)",
            compiled.precision,
            compiled.ratio,
            compiled.peak_ratio,
            out / "activation_memory_compiled.md",
        )
    logger.info(
        "step operations: %s runs %.2fx fp32's operations, %d of them casts (%s)",
        operations.precision,
        operations.ratio,
        operations.low.casts,
        out / "step_operations.md",
    )
    logger.info("fix: %s", report.fix_line() or "none needed")
    logger.info("report: %s", out / "numerics.md")
    return report


def compiled_activation_memory(brain: Brain, batch: Any) -> ActivationMemory:
    """What the training forward keeps for backward once the modules are compiled as
    training compiles them (``trainer.compile_*``): compiled blocks keep what torch.compile's
    partitioner chooses, not what eager autograd keeps (for Conformer-M in bf16: 0.59x fp32's
    bytes compiled against 0.63x eager, counted under CUDA's choices on a CPU). Without CUDA
    graphs (mode ``default``): the partitioner's choice is the same, and graph replays would
    own the tensors the count looks at. Compiles the modules in place."""
    run_opts = dataclasses.replace(brain.run_opts, compile_mode="default")
    compile_modules(brain.modules, run_opts, brain.device)
    return training_activation_memory(brain, batch, by_module=False)


def data_source(data_cfg: DictConfig) -> str:
    """Where the diagnosed data came from: FSDD's folder, or the manifests."""
    if data_cfg.name == "manifest":
        return ", ".join(str(data_cfg[split]) for split in ("train", "valid", "test"))
    return str(data_cfg.root)


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="diagnose")
def main(cfg: DictConfig) -> None:
    """Hydra entry point: bad input ends with one line, no traceback."""
    try:
        diagnose(cfg)
    except (*USER_ERRORS, UnknownModulePatternError) as err:
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    # a key typo, or a key of another option: one line naming the fix
    exit_on_unknown_override_keys(DiagnoseRunConfig, config_name="diagnose")
    main()
