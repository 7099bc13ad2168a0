"""``AudioBrain``: what the ASR and speaker recipes share on top of ``amp_utils.Brain``.

Batches move to the device once per step (non-blocking from pinned memory), log-mel
features are computed on the device in fp32, SpecAugment is applied in training, and at
the end of each validation the epoch's metrics go to the log and TensorBoard and a
checkpoint is saved with them (keeping the most recent ones and the best). Under DDP each
rank scores its own shard of the split and the metric counts are summed over the ranks
before the metrics are computed.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader

from amp_utils import Brain, Stage
from amp_utils.checkpoint import Checkpointer
from amp_utils.compile import unwrap_module
from amp_utils.distributed import all_gather_lists, all_reduce_counts
from amp_utils.run_results import PERCENT_METRICS
from data.dataset import AudioBatch
from recipes.error_analysis import Outcome

logger = logging.getLogger(__name__)

#: ``trainer.average_from`` of a config without it: runs from before that option averaged
#: the N best checkpoints (by the validation metric), and are re-tested the same way.
LEGACY_AVERAGE_FROM = "best"


class AudioBrain(Brain):
    """Brain over ``AudioBatch`` batches; subclasses define the model call and metrics.

    Subclasses set ``metric_key`` (the checkpoint-selection metric),
    ``metric_mode`` (``"min"`` or ``"max"``) and ``metric_counts`` (the attributes that
    accumulate the metrics, summed over the ranks under DDP), and implement
    ``stage_metrics``.
    """

    metric_key = "loss"
    metric_mode = "min"
    metric_counts: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Each validated/tested utterance of the current stage, for
        #: ``recipes/error_analysis.py``; empty until a stage scores one (a Brain used
        #: by a tool, or whose metric counts are set directly, has none).
        self.outcomes: list[Outcome] = []

    def on_fit_start(self) -> None:
        """Set up and resume (the Brain's), then call ``hparams.on_fit_ready`` if given.

        The recipe writes its run record there: the data are read and the checkpoint (if
        any) loaded, so the run is going ahead.
        """
        super().on_fit_start()
        on_fit_ready = getattr(self.hparams, "on_fit_ready", None)
        if on_fit_ready is not None:
            on_fit_ready()

    def fit_batch(self, batch: AudioBatch) -> torch.Tensor:
        return super().fit_batch(batch.to(self.device, non_blocking=True))

    def evaluate_batch(self, batch: AudioBatch, stage: Stage) -> torch.Tensor:
        return super().evaluate_batch(batch.to(self.device, non_blocking=True), stage)

    def graph_input(self, batch: AudioBatch) -> AudioBatch:
        """The batch without its host copy: a captured step reads device tensors only."""
        return replace(batch, host=None)

    def step_graph_blocker(self) -> str | None:
        blocker = super().step_graph_blocker()
        if blocker is None and "wave_augment" in self.modules:
            speeds = unwrap_module(self.modules.wave_augment).speeds
            if len(speeds) > 1:
                return (
                    f"speed perturbation (data.wave_augment.speeds={list(speeds)}) draws a speed "
                    "per batch on the host and changes the batch's shape"
                )
        return blocker

    def batch_stats(self, batch: AudioBatch) -> tuple[int, float]:
        return len(batch), float(batch.durations.sum())

    def features(self, batch: AudioBatch, stage: Stage) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features (fp32 even under autocast), augmented in training.

        In training the waveforms are first speed-perturbed and noised (``wave_augment``,
        if on; the batch's host lengths follow the speed change, so CTC lengths read from
        the host stay right), then the features are SpecAugment-ed (``augment``).
        """
        wavs, wav_lens = batch.wavs, batch.wav_lens
        if stage == Stage.TRAIN and "wave_augment" in self.modules:
            wave_augment = unwrap_module(self.modules.wave_augment)
            # A captured step draws on the device (host draws would be frozen in the graph).
            wavs, wav_lens = self.modules.wave_augment(
                wavs, wav_lens, host_draws=not self.graph_safe_step
            )
            if batch.host is not None:  # this step's copy of the batch: replace, not edit
                host_lens = wave_augment.lengths_after(batch.host.wav_lens)
                batch.host = replace(batch.host, wav_lens=host_lens)
        feats, feat_lens = self.modules.features(wavs, wav_lens)
        if stage == Stage.TRAIN and "augment" in self.modules:
            feats = self.modules.augment(feats, feat_lens)
        return feats, feat_lens

    # -------------------------------------------------------------- metrics
    def stage_metrics(self, stage: Stage) -> dict[str, float]:
        """Metrics of the stage that just ended (e.g. CER/WER or accuracy)."""
        raise NotImplementedError

    def text_examples(self) -> str | None:
        """A few predictions of the last validation, as markdown (or None)."""
        return None

    def on_stage_start(self, stage: Stage, epoch: int | None = None) -> None:
        self.outcomes = []
        self.reset_metrics(stage)

    def record_outcomes(
        self, batch: AudioBatch, predictions: list[str], references: list[str]
    ) -> None:
        """Keep what the model said for each utterance of an evaluation batch."""
        names = getattr(getattr(self.hparams, "labels", None), "speakers", ())
        speakers = batch.host.speakers if batch.host is not None else batch.speakers
        for utt_id, index, ref, hyp in zip(
            batch.ids, speakers.tolist(), references, predictions, strict=True
        ):
            speaker = names[index] if 0 <= index < len(names) else str(index)
            self.outcomes.append(Outcome(utt_id, speaker, ref, hyp))

    def reset_metrics(self, stage: Stage) -> None:
        """Clear the metric accumulators of ``stage``."""

    def on_stage_end(self, stage: Stage, stage_loss: float, epoch: int | None = None) -> None:
        if stage == Stage.TRAIN:  # its mean stays in the ledger (brain.avg_train_loss)
            return
        self._sum_metric_counts_over_ranks()
        metrics = {"loss": stage_loss, **self.stage_metrics(stage)}
        if stage == Stage.TEST:
            self.test_metrics = metrics
            logger.info("test: %s", format_metrics(metrics))
            return
        self.valid_metrics = metrics
        lr = self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else 0.0
        logger.info(
            "epoch %s: lr %.2e, train loss %.4f, valid %s",
            self.epoch_label(epoch),
            lr,
            self.avg_train_loss,
            format_metrics(metrics),
        )
        if self.tensorboard is not None:
            # At the optimizer step, like train/*: one x-axis for every chart of a run.
            step = self.ledger.steps_taken
            scalars = {
                "epoch/number": epoch,
                "epoch/train_loss": self.avg_train_loss,
            }
            scalars.update({f"valid/{k}": v for k, v in metrics.items()})
            self.tensorboard.log_scalars(scalars, step=step)
            examples = self.text_examples()
            if examples:
                self.tensorboard.log_text("valid/examples", examples, step=step)
        if self.checkpointer is not None:
            keys = {"min_keys" if self.metric_mode == "min" else "max_keys": [self.metric_key]}
            self.checkpointer.save_and_keep_only(
                meta={
                    **metrics,  # top level: what best-checkpoint selection reads
                    "epoch": epoch,
                    "optimizer_step": self.optimizer_step,
                    "valid_metrics": metrics,
                    **self.checkpoint_meta(),
                },
                num_to_keep=self.hparams.keep_checkpoints,
                num_best=self.num_averaged() if self.average_from() == "best" else 1,
                num_last_epochs=self.num_averaged() if self.average_from() == "last" else 0,
                **keys,
            )

    def _sum_metric_counts_over_ranks(self) -> None:
        if self.distributed.world_size == 1:
            return
        self.outcomes = all_gather_lists(self.outcomes)
        counts = all_reduce_counts({name: getattr(self, name) for name in self.metric_counts})
        for name, value in counts.items():
            setattr(self, name, value)

    @classmethod
    def best_checkpoint_key(cls) -> dict[str, str]:
        """``min_key=``/``max_key=`` that picks the best checkpoint by the recipe's metric."""
        return {"min_key" if cls.metric_mode == "min" else "max_key": cls.metric_key}

    def checkpoint_meta(self) -> dict[str, Any]:
        """What the recipe adds to each end-of-epoch checkpoint's meta (ASR: the decoder
        its validation CER came from, ``valid_decoder``)."""
        return {}

    def validates_like_test(self) -> bool:
        """Whether the per-epoch validations score as the test does (ASR: whether
        ``model.valid_decoder`` is ``model.decoder``). When not, the run's recorded
        validation figures are the tested weights' rescored as the test scores them."""
        return True

    def num_averaged(self) -> int:
        """How many checkpoints the test averages (``trainer.average_checkpoints``)."""
        return max(int(getattr(self.hparams, "average_checkpoints", 1) or 1), 1)

    def average_from(self) -> str:
        """Which checkpoints the test averages (``trainer.average_from``): last | best."""
        return str(getattr(self.hparams, "average_from", None) or LEGACY_AVERAGE_FROM)

    def on_evaluate_start(self, max_key: str | None = None, min_key: str | None = None) -> None:
        """Load the best checkpoint, then, with ``average_checkpoints`` > 1, the average of
        the modules' weights over the N final epochs or the N best (checkpoint averaging, as
        icefall and ESPnet evaluate: a flatter minimum than any single epoch's)."""
        super().on_evaluate_start(max_key=max_key, min_key=min_key)
        self.averaged_checkpoints: list[Any] = []
        if self.checkpointer is None or self.num_averaged() < 2:
            return
        chosen = checkpoints_to_average(
            self.checkpointer, self.num_averaged(), self.average_from(), min_key, max_key
        )
        if len(chosen) < 2:
            return
        names = [f"module.{name}" for name in self.modules]
        self.checkpointer.load_averaged(
            chosen, [n for n in names if n in self.checkpointer.recoverables], self.device
        )
        self.averaged_checkpoints = chosen

    def evaluate_best(self, test_loader: Any) -> dict[str, float]:
        """Evaluate with the best checkpoint by the recipe's metric; returns test metrics."""
        self.evaluate(test_loader, **self.best_checkpoint_key())
        return self.test_metrics

    def score_loaded_weights(self, loader: Any) -> dict[str, float]:
        """The metrics, as the test computes them, of the weights loaded now on ``loader``.

        After a test that averaged checkpoints, the validation figures of the weights it
        tested (no single checkpoint holds them). Logs nothing, saves nothing, and keeps the
        test's own record (``test_metrics``, ``outcomes``) as it was.
        """
        test_metrics, outcomes = self.test_metrics, self.outcomes
        counts = {name: getattr(self, name) for name in self.metric_counts}
        if not isinstance(loader, DataLoader):
            loader = self.make_dataloader(loader, Stage.TEST)
        try:
            with self.stall_watchdog:
                loss = self._run_eval_loop(loader, Stage.TEST, None, enable=False)
            self._sum_metric_counts_over_ranks()
            return {"loss": loss, **self.stage_metrics(Stage.TEST)}
        finally:
            self.test_metrics, self.outcomes, self.step = test_metrics, outcomes, 0
            for name, value in counts.items():
                setattr(self, name, value)

    def tested_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint the last test used: epoch, optimizer step, validation metrics."""
        ckpt = self.evaluated_checkpoint
        if ckpt is None:
            return None
        meta = ckpt.meta
        valid = meta.get("valid_metrics") or {
            k: meta[k] for k in ("loss", self.metric_key) if k in meta
        }
        best = "lowest" if self.metric_mode == "min" else "highest"
        averaged = [c.path.name for c in getattr(self, "averaged_checkpoints", [])]
        return {
            "checkpoint": ckpt.path.name,
            "selected_by": f"{best} validation {self.metric_key}",
            # Weights tested: the average of these checkpoints (empty: the one above),
            # the final epochs' (last) or the best ones (best).
            "averaged_checkpoints": averaged,
            "averaged_from": self.average_from() if averaged else None,
            "epoch": meta.get("epoch"),
            "optimizer_step": meta.get("optimizer_step"),
            "valid_metrics": valid,
            # ASR: the decoder of valid_metrics above (greedy by default; the run's
            # top-level valid_metrics are scored as the test scores). None: not recorded.
            "valid_decoder": meta.get("valid_decoder"),
        }


def format_metrics(metrics: dict[str, float]) -> str:
    """``loss 0.1234, CER 3.58 %``: each metric with its unit."""
    return ", ".join(
        f"{k} {v:.2f} %" if k in PERCENT_METRICS else f"{k} {v:.4g}" for k, v in metrics.items()
    )


AVERAGE_FROM = ("last", "best")  # trainer.average_from: which checkpoints the test averages


def checkpoints_to_average(
    checkpointer: Checkpointer,
    num: int,
    average_from: str,
    min_key: str | None = None,
    max_key: str | None = None,
) -> list[Any]:
    """The checkpoints whose average is tested: the ``num`` final epochs (``last``, as
    icefall) or the ``num`` best by the validation metric (``best``, as ESPnet).

    The final epochs sit in one basin at the schedule's low learning rate; the best ones,
    picked by a noisy 300-utterance validation, can lie epochs apart (docs/new_voices.md,
    "Checkpoint averaging", has the measurements).
    """
    if average_from == "last":
        return final_epochs(checkpointer.find_last_checkpoints(num), num)
    return checkpointer.find_best_checkpoints(num, min_key=min_key, max_key=max_key)


def final_epochs(newest_first: list[Any], num: int) -> list[Any]:
    """Of end-of-epoch checkpoints, newest first, those of the ``num`` final epochs (one
    per epoch). The newest ``num`` on disk need not be those: rotation may have removed some
    (a run trained with ``average_from=best`` keeps the best and the newest two), and a
    scattered set would be averaged as "the final epochs". Warns when some are missing."""
    epochs = [c.meta.get("epoch") for c in newest_first]
    if not newest_first or not all(isinstance(e, int) for e in epochs):
        return newest_first  # checkpoints from before epochs were recorded
    last = epochs[0]
    final: dict[int, Any] = {}
    for ckpt, epoch in zip(newest_first, epochs, strict=True):
        if epoch > last - num:
            final.setdefault(epoch, ckpt)
    wanted = list(range(last, max(last - num, 0), -1))
    if list(final) != wanted:
        logger.warning(
            "trainer.average_from=last averages the %d final epochs (%s), but the "
            "checkpoints of epochs %s are not on disk (trainer.keep_checkpoints rotated them "
            "away, or they were unreadable): the test averages epochs %s only.",
            num,
            ", ".join(map(str, wanted[::-1])),
            ", ".join(str(e) for e in wanted[::-1] if e not in final),
            ", ".join(map(str, sorted(final))),
        )
    return list(final.values())
