"""Speaker identification recipe: x-vector classifier, cross-entropy, accuracy."""

from __future__ import annotations

import torch

from amp_utils import Stage, fwd_default_precision
from data.dataset import AudioBatch
from recipes.audio_brain import AudioBrain


@fwd_default_precision
def classification_loss(
    logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0
) -> torch.Tensor:
    """Cross-entropy in fp32 even under autocast (``label_smoothing`` as in torch)."""
    return torch.nn.functional.cross_entropy(logits, targets, label_smoothing=label_smoothing)


class SpeakerBrain(AudioBrain):
    """Closed-set speaker ID; the best checkpoint is the one with the highest accuracy."""

    metric_key = "accuracy"
    metric_mode = "max"
    metric_counts = ("correct", "total")

    def compute_forward(self, batch: AudioBatch, stage: Stage) -> torch.Tensor:
        feats, feat_lens = self.features(batch, stage)
        return self.modules.model(feats, feat_lens)

    def compute_objectives(self, logits: torch.Tensor, batch: AudioBatch, stage: Stage):
        # Label smoothing regularises training only; validation/test report plain cross-entropy.
        smoothing = self.label_smoothing if stage == Stage.TRAIN else 0.0
        loss = classification_loss(logits, batch.speakers, smoothing)
        if stage != Stage.TRAIN and not self.graph_safe_step:  # captured: scored after
            self.score_predictions(logits, batch, stage)
        return loss

    def score_predictions(self, logits: torch.Tensor, batch: AudioBatch, stage: Stage) -> None:
        """Count a batch's correctly identified speakers (on the host), eager or after a
        CUDA graph's replay (``trainer.graph_eval``)."""
        predicted = logits.argmax(dim=-1)
        self.correct += int((predicted == batch.speakers).sum())
        self.total += len(batch)
        names = self.speaker_names(batch.speakers.tolist())
        self.record_outcomes(batch, self.speaker_names(predicted.tolist()), names)

    @property
    def label_smoothing(self) -> float:
        """Share of the target probability spread over the other speakers in training."""
        return float(getattr(self.hparams, "label_smoothing", 0.0) or 0.0)

    def speaker_names(self, indices: list[int]) -> list[str]:
        """The speaker names of class indices (the index itself without labels)."""
        names = getattr(getattr(self.hparams, "labels", None), "speakers", ())
        return [names[i] if 0 <= i < len(names) else str(i) for i in indices]

    def reset_metrics(self, stage: Stage) -> None:
        self.correct = self.total = 0

    def stage_metrics(self, stage: Stage) -> dict[str, float]:
        return {"accuracy": 100.0 * self.correct / max(self.total, 1)}
