"""One training run, start to finish: ``train(cfg) -> results`` (what recipes/train.py calls).

Validate the config, prepare the data, build the model and its Brain, fit (resuming from
the run folder's checkpoints if any), test with the best checkpoint, and write
``results.json`` and ``env.txt`` next to the checkpoints and TensorBoard events. A run that
has finished already is left as it is; a run refused before it trains writes nothing into
its folder (``recipes/run_folder.py``).

Started by ``torchrun`` (or as a multi-task SLURM job), the same run trains with DDP:
every rank builds the same objects, and only rank 0 logs and writes the run's files.
"""

from __future__ import annotations

import logging
import math
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from amp_utils import (
    Checkpointer,
    EpochCounter,
    RunOptions,
    resolve_device,
)
from amp_utils.atomic import atomic_write_json, atomic_write_text
from amp_utils.compile import compile_stats
from amp_utils.distributed import (
    DistributedInfo,
    any_rank,
    broadcast_object,
    ddp_barrier,
    init_distributed,
    run_on_main,
)
from amp_utils.interruption import run_phase, signals_held
from amp_utils.precision import AUTO, reset_emulation_warnings
from amp_utils.run_clock import RunClock
from amp_utils.run_env import write_env_file
from amp_utils.run_results import RESULTS_FILE, RunResults, Throughput
from amp_utils.tensorboard import TENSORBOARD_DIR, TensorBoardLogger
from recipes.audio_brain import AudioBrain
from recipes.config import ConfigError
from recipes.data_setup import DataBundle, build_data
from recipes.error_analysis import TEST_ERRORS_FILE, error_report, find_collapse
from recipes.modules import build_modules
from recipes.preflight import preflight, run_options
from recipes.run_folder import LABELS_FILE, RunFolder
from recipes.run_overrides import (
    check_run_overrides,
    finished_results,
    hydra_task_overrides,
    override_dirname_excludes,
    planned_epochs,
    say_finished,
)
from recipes.task import RunLabels
from recipes.tasks import task_for

logger = logging.getLogger(__name__)


def warmup_cosine(warmup_steps: int, total_steps: int) -> Any:
    """LR multiplier: linear warm-up, then cosine decay to 5 % of the peak."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(warmup_steps, 1)
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        return 0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_brain(
    cfg: DictConfig,
    data: DataBundle,
    out_dir: Path | None,
    tensorboard: TensorBoardLogger | None,
    on_fit_ready: Callable[[], None] | None = None,
) -> AudioBrain:
    """Model, features, optimizer, schedule and checkpointer wired into the task's Brain.

    ``on_fit_ready``: called once the Brain has set up and resumed, before training.
    """
    opts = run_options(cfg)
    modules = build_modules(cfg, data.speakers)
    fused = bool(cfg.trainer.fused_optimizer)  # fused kernels skip bad steps without a sync
    # the Brain drops each epoch's unfinished accumulation window: whole windows only
    steps_per_epoch = max(1, len(data.train) // cfg.trainer.grad_accumulation_factor)

    def opt_class(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params,
            lr=cfg.model.lr,
            weight_decay=cfg.model.weight_decay,
            fused=fused or None,
            foreach=None if fused else True,
        )

    def lr_scheduler(optimizer: torch.optim.Optimizer) -> Any:
        schedule = warmup_cosine(cfg.model.warmup_steps, cfg.trainer.epochs * steps_per_epoch)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    return task_for(cfg.model).brain_class(
        modules=modules,
        opt_class=opt_class,
        hparams={
            "tokenizer": data.tokenizer,
            "speakers": data.speakers,
            "labels": RunLabels.from_config(cfg, data.speakers, data.words),
            "keep_checkpoints": cfg.trainer.keep_checkpoints,
            "average_checkpoints": cfg.trainer.average_checkpoints,
            "average_from": cfg.trainer.average_from,
            "label_smoothing": OmegaConf.select(cfg, "model.label_smoothing", default=0.0),
            "num_text_examples": cfg.trainer.num_text_examples,
            "lr_scheduler": lr_scheduler,
            "tensorboard": tensorboard,
            "on_fit_ready": on_fit_ready,
        },
        run_opts=opts,
        checkpointer=Checkpointer(out_dir / "checkpoints") if out_dir is not None else None,
    )


#: Command-line keys that say where files are, not how the model was trained.
NOT_HPARAMS = frozenset({"data.root", "data.prepared_dir", "output_dir", "trainer.noprogressbar"})


def tensorboard_hparams(
    cfg: DictConfig, results: RunResults, data: DataBundle
) -> tuple[dict[str, Any], dict[str, float]]:
    """TensorBoard's hparams of a run and its final metrics: ``(hparams, metrics)``.

    ``metrics`` maps TensorBoard tags with units (``test/CER_percent``) to the test
    figures; they are logged at the last optimizer step and the HParams tab refers to them.

    ``max_batch_seconds`` is the batch budget the samplers used (after the device's
    ``batch_scale``), not the configured value.
    """
    # Five settings that tell runs apart, then every key set on the command line (a sweep's
    # swept keys among them): TensorBoard lists the hparams that differ between runs first,
    # so what a sweep varies is visible without a click. The rest of the config is in the
    # run folder's config_resolved.yaml.
    hparams: dict[str, Any] = {
        "precision": results.precision,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "device": results.device,
        "max_batch_seconds": data.max_batch_seconds,
    }
    for item in _overrides():
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if key in hparams or key in NOT_HPARAMS or key.startswith("hydra."):
            continue
        if key == "precision.eval_precision":  # as used (auto resolved), as precision is
            hparams[key] = results.eval_precision
            continue
        selected = OmegaConf.select(cfg, key, default=None)
        hparams[key] = selected if isinstance(selected, bool | int | float | str) else value
    metrics = results.final_metrics()
    return hparams, metrics


def seed_everything(seed: int) -> None:
    """Seed Python and torch (all devices)."""
    random.seed(seed)
    torch.manual_seed(seed)


def _overrides() -> list[str]:
    """The command's overrides; none when composed outside ``@hydra.main`` (tests)."""
    return hydra_task_overrides() or []


def sweep_objective(cfg: DictConfig, results: dict[str, Any]) -> float:
    """What ``train.py`` returns to a sweeper: the validation value of the task's selection
    metric (CER, accuracy) of the tested checkpoint. Never a test figure: tuning on the
    test set would make the test figures meaningless."""
    metric, _ = task_for(cfg.model).selection_metric
    valid = results.get("valid_metrics") or {}
    if metric not in valid:
        raise ConfigError(
            f"The run recorded no validation {metric} (no epoch was validated); "
            "a sweep needs at least one epoch."
        )
    return float(valid[metric])


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def device_name(device: torch.device) -> str:
    """Human-readable name of the device (GPU model, or CPU model and thread count)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = _cpu_model()
    threads = f"{torch.get_num_threads()} threads"
    return f"cpu ({model}, {threads})" if model else f"cpu ({threads})"


def log_header(cfg: DictConfig, brain: AudioBrain, data: DataBundle, out_dir: Path) -> None:
    """What the run is about to do: device, precision, data, model, plan, folder."""
    record = data.record
    splits = ", ".join(
        f"{split} {s['utterances']} utterances ({s['hours']:.2f} h)"
        for split, s in record.get("splits", {}).items()
    )
    source = record.get("root") or ", ".join(record.get("manifests", {}).values())
    params = sum(p.numel() for p in brain.modules.model.parameters())
    opts = brain.run_opts
    epochs = planned_epochs(cfg.trainer)
    batches = min(len(data.train), opts.debug_batches) if opts.debug else len(data.train)
    steps = batches // opts.grad_accumulation_factor  # whole accumulation windows only
    done = brain.optimizer_step
    logger.info(
        "run folder: %s (%s)", out_dir, f"resumed at optimizer step {done}" if done else "new"
    )
    logger.info("device: %s", device_name(brain.device))
    logger.info(
        "precision: %s training, %s evaluation%s",
        brain.amp.name,
        brain.eval_amp.name,
        " (precision=auto)" if AUTO in (cfg.precision.name, cfg.precision.eval_precision) else "",
    )
    logger.info("data: %s from %s: %s", cfg.data.name, source, splits)
    logger.info("model: %s, %.2f M parameters", cfg.model.name, params / 1e6)
    logger.info(
        "plan: %d epochs%s x ~%d optimizer steps = ~%d steps",
        epochs,
        " (debug)" if opts.debug else "",
        steps,
        epochs * steps,
    )


def ensure_writable(out_dir: Path) -> Path:
    """Create the run folder and check it is writable, before any work is done."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"Output folder {out_dir} is not writable ({err.strerror or err}); point the run "
            "at a writable folder with hydra.run.dir=PATH (or output_dir=PATH in code)."
        ) from err
    return out_dir


#: The log record factory before ``tag_log_records_with_rank`` wrapped it (None: not yet).
_untagged_record_factory: Callable[..., logging.LogRecord] | None = None


def tag_log_records_with_rank(rank: int) -> None:
    """Start every later log message of this process with ``[rank N]``.

    Under DDP every rank appends to the run's one ``train.log`` (and the console): rank 0
    everything, the others their warnings and errors. Untagged, a warning that each rank
    logs (a SIGTERM caught, a stall) appeared twice, identical, and one only rank 1 logged
    (a signal that reached it alone) read as rank 0's. A record factory, not a handler
    filter, so that log files opened later (``RunFolder.accept``) get the tag too. Calling
    it again replaces the tag instead of adding a second one.
    """
    global _untagged_record_factory
    if _untagged_record_factory is None:
        _untagged_record_factory = logging.getLogRecordFactory()
    untagged = _untagged_record_factory
    tag = f"[rank {rank}] "

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = untagged(*args, **kwargs)
        record.msg = tag + str(record.msg)
        return record

    logging.setLogRecordFactory(factory)


def start_distributed(opts: RunOptions, device: torch.device) -> DistributedInfo:
    """Join the DDP process group if launched for it; quiet the logs of ranks other than 0
    and tag theirs with the rank (``tag_log_records_with_rank``)."""
    info = init_distributed(opts.distributed_backend, device.type)
    if not info.is_main:  # rank 0 logs the run; the others only warnings and errors
        logging.getLogger().setLevel(logging.WARNING)
        tag_log_records_with_rank(info.rank)
    return info


def check_same_run_folder(out_dir: Path) -> None:
    """Under DDP, every rank must have composed the same run folder as rank 0."""
    differs = broadcast_object(str(out_dir)) != str(out_dir)
    if any_rank(differs)[0]:
        raise ConfigError(
            f"The DDP processes composed different run folders (this one: {out_dir}); the "
            "folder name holds a clock (e.g. a -m sweep under torchrun). Fix: give a fixed "
            "folder (hydra.run.dir=PATH, or hydra.sweep.dir=PATH for -m), or run sweeps "
            "through hydra/launcher=submitit_local or slurm."
        )


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run one experiment described by ``cfg``; returns what it writes to results.json.

    A run whose folder holds the results of at least ``trainer.epochs`` epochs has
    finished: its results are returned and nothing is written.

    SIGTERM/SIGINT (a preemption, ``kill``, Ctrl-C) stop the run: inside the epochs after
    a checkpoint (``Brain.fit``), anywhere else at once (``RunSignals``, installed here
    unless the entry point did), with one line saying what was interrupted and how to
    resume. The same command then goes on as if nothing had happened.
    """
    with run_phase("starting the run", install=True):
        start = time.time()
        reset_emulation_warnings()  # each run's log says it, a sweep's later jobs' too
        preflight(cfg)
        overrides = hydra_task_overrides()
        if overrides is not None:  # a sweep's job folder, or a fixed one, of other overrides?
            from hydra.core.hydra_config import HydraConfig

            excludes = override_dirname_excludes(HydraConfig.get())
            check_run_overrides(Path(cfg.output_dir), overrides, excludes)
        finished = _finished_run(Path(cfg.output_dir), cfg.trainer)
        if finished is not None:
            return finished
        folder = RunFolder(Path(cfg.output_dir))
        try:
            return _train(cfg, folder, start)
        finally:
            folder.release()
            folder.abandon()  # refused before it trained: no trace in the folder (else no-op)


def _finished_run(out_dir: Path, trainer: DictConfig) -> dict[str, Any] | None:
    """The results of the run in ``out_dir`` if it has finished (saying so), else None.

    To the console only: in a sweep the job's log file is open, and a finished run's files
    stay byte-identical (``say_finished``: under DDP by rank 0 alone)."""
    finished = finished_results(out_dir, trainer)
    if finished is None:
        return None
    say_finished(out_dir, finished, trainer)
    return finished.to_dict()


def _train(cfg: DictConfig, folder: RunFolder, start: float) -> dict[str, Any]:
    opts = run_options(cfg)
    device = resolve_device(opts.device)
    dist_info = start_distributed(opts, device)
    check_same_run_folder(Path(cfg.output_dir))
    out_dir = run_on_main(ensure_writable, args=(Path(cfg.output_dir),))
    run_on_main(folder.lock)  # one process (rank 0 for DDP) trains in a folder at a time
    finished = _finished_run(out_dir, cfg.trainer)  # by the process that held the folder
    if finished is not None:
        return finished
    seed_everything(cfg.seed)
    with run_phase("preparing the data"):
        data = build_data(cfg, device, dist_info)
    main = dist_info.is_main

    def on_fit_ready() -> None:  # data read, checkpoint loaded: the run goes ahead
        clock.resumed()
        with signals_held():  # the run's record (.hydra/, train.log, labels) whole
            folder.accept(cfg, write_files=main)
            if main:
                log_header(cfg, brain, data, out_dir)
                write_env_file(out_dir / "env.txt")
                atomic_write_json(
                    out_dir / LABELS_FILE,
                    {
                        "task": cfg.model.task,
                        "speakers": list(data.speakers),
                        "words": list(data.words),
                        # transcribe.py warns about a file far longer than these
                        "train_seconds": train_seconds(data.record),
                    },
                )

    tensorboard = TensorBoardLogger(out_dir / TENSORBOARD_DIR) if main else None
    try:
        with run_phase("setting up the model"):
            brain = build_brain(cfg, data, out_dir, tensorboard, on_fit_ready)
            clock = RunClock(brain.peak_memory_mb, start=start)
            if brain.checkpointer is not None:  # optional: checkpoints from before still load
                brain.checkpointer.add_recoverable("run_clock", clock, optional=True)
            epochs = EpochCounter(cfg.trainer.epochs)
        with run_phase("training"):  # the epochs themselves: Brain.fit's StopSignals
            brain.fit(epochs, data.train, data.valid)
        epochs_completed = epochs.current  # before testing loads the best checkpoint
        with run_phase("testing the best checkpoint"):
            tested = _test_best(brain, data)
        with run_phase("writing the results"):
            results = _run_results(cfg, brain, data, dist_info, clock, tested, epochs_completed)
            ddp_barrier()  # ranks > 0 leave first: rank 0 may host the rendezvous store
            if main:
                _write_records(cfg, brain, data, results, out_dir, tensorboard)
            return results.to_dict()
    finally:
        # loader workers shut down and the event file closed whole, whatever ended the run
        with run_phase("finishing the run"), signals_held():
            try:
                data.close()  # this job's loader workers end with it, not at a later collection
            finally:
                if tensorboard is not None:
                    tensorboard.close()


def train_seconds(record: dict[str, Any]) -> list[float] | None:
    """``[shortest, longest]`` training utterance in seconds, from the data's record
    (``data_record``); None if it has none."""
    train = record.get("splits", {}).get("train", {})
    if "min_seconds" not in train:
        return None
    return [train["min_seconds"], train["max_seconds"]]


def _test_best(brain: AudioBrain, data: DataBundle) -> dict[str, Any]:
    """Test the best checkpoint (or the average of the best ones); returns the test metrics,
    the tested checkpoint's record and the tested weights' validation metrics, as
    ``RunResults`` fields."""
    test_metrics = brain.evaluate_best(data.test)
    tested = brain.tested_checkpoint()
    valid_metrics = tested["valid_metrics"] if tested else {}
    valid_metrics_of = "tested_checkpoint"
    if tested and (tested["averaged_checkpoints"] or not brain.validates_like_test()):
        # The run's validation figures (and a sweeper's objective) are the tested weights'
        # scored as the test scores them: an average of checkpoints' (no single checkpoint
        # holds them), and with the test's decoder where the epochs validated with another
        # (model.valid_decoder).
        valid_metrics = brain.score_loaded_weights(data.valid)
        if tested["averaged_checkpoints"]:
            valid_metrics_of = "averaged_checkpoints"
    return {
        "test_metrics": test_metrics,
        "tested_checkpoint": tested,
        "valid_metrics": valid_metrics,  # the tested weights', not the last epoch's
        "valid_metrics_of": valid_metrics_of,
    }


def _run_results(
    cfg: DictConfig,
    brain: AudioBrain,
    data: DataBundle,
    dist_info: DistributedInfo,
    clock: RunClock,
    tested: dict[str, Any],
    epochs_completed: int,
) -> RunResults:
    """The run's ``results.json`` record, over all its sessions; ``tested``: ``_test_best``."""
    return RunResults(
        precision=brain.amp.name,  # as used (precision=auto resolved)
        eval_precision=brain.eval_amp.name,
        precision_requested=cfg.precision.name,
        device=brain.device.type,
        device_name=device_name(brain.device),
        world_size=dist_info.world_size,
        distributed_backend=dist_info.backend,
        model=cfg.model.name,
        task=cfg.model.task,
        data=cfg.data.name,
        dataset=data.record,
        overrides=hydra_task_overrides(),  # None outside @hydra.main: not recorded
        test_utterances=len(brain.outcomes),  # all ranks'; a debug run tests a few batches
        **tested,
        throughput=Throughput.from_train_stats(brain.global_train_stats()),
        peak_memory_mb=clock.peak_memory_mb(),
        peak_memory_kind="cuda_max_reserved" if brain.device.type == "cuda" else "process_rss",
        wall_time_s=clock.wall_time_s(),
        sessions=clock.sessions,
        epochs=cfg.trainer.epochs,
        epochs_completed=epochs_completed,
        optimizer_steps=brain.optimizer_step,
        skipped_steps=brain.skipped_steps,
        num_parameters=sum(p.numel() for p in brain.modules.model.parameters()),
        skipped_files=len(data.skipped_files),
        compile=compile_stats() if cfg.trainer.compile else None,
        step_graphs=brain.step_graph_stats(),
        eval_graphs=brain.eval_graph_stats(),
        torch_version=torch.__version__,
    )


def _write_records(
    cfg: DictConfig,
    brain: AudioBrain,
    data: DataBundle,
    results: RunResults,
    out_dir: Path,
    tensorboard: TensorBoardLogger,
) -> None:
    """Rank 0's records of a finished run: ``test_errors.md``, the final TensorBoard figures
    and hparams, then ``results.json``, which marks the run finished."""
    words = task_for(cfg.model).needs_tokenizer
    atomic_write_text(
        out_dir / TEST_ERRORS_FILE,
        error_report(
            brain.outcomes,
            words=words,
            title=f"Test errors of {out_dir.name} ({cfg.model.name}, {cfg.data.name})",
        ),
    )
    collapse = find_collapse(brain.outcomes, words)
    if collapse is not None:
        logger.warning("collapsed: %s (%s)", collapse.message(), out_dir / TEST_ERRORS_FILE)
        results.collapsed = collapse.record()
    # The TensorBoard record is complete and on disk before results.json marks the run
    # finished: a rerun of a finished run changes nothing, so a run killed between the two
    # would lack its test figures and hparams for good. (Killed before results.json, the
    # rerun tests again and logs the same figures at the same step once more.) A signal
    # waits for both: the run then stops finished, its records whole.
    with signals_held():
        hparams, metrics = tensorboard_hparams(cfg, results, data)
        tensorboard.log_scalars(metrics, step=brain.ledger.steps_taken)
        tensorboard.log_hparams(hparams, list(metrics))
        tensorboard.flush()
        results.write(out_dir / RESULTS_FILE)
    split = results.time_split()
    if split is not None:
        logger.info("time: %s", split)
    logger.info("results: %s", out_dir / RESULTS_FILE)
