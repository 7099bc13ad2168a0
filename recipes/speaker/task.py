"""The speaker-ID task's registry entry: the x-vector classifier and ``SpeakerBrain``."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from recipes.speaker.brain import SpeakerBrain
from recipes.speaker.model import XVector
from recipes.task import RunLabels, Task


def build_xvector(model_cfg: DictConfig, n_mels: int, speakers: tuple[str, ...]) -> torch.nn.Module:
    """An x-vector classifier with one class per speaker of the run."""
    m = model_cfg
    return XVector(
        n_mels=n_mels,
        num_speakers=len(speakers),
        channels=m.channels,
        embedding_dim=m.embedding_dim,
        dropout=m.dropout,
    )


def predict_speakers(logits: torch.Tensor, labels: RunLabels) -> list[str]:
    """The most likely speaker's name for each utterance of the batch."""
    return [labels.speakers[i] for i in logits.argmax(dim=-1).tolist()]


SPEAKER = Task(
    name="speaker",
    model_names=("xvector",),
    brain_class=SpeakerBrain,
    build_model=build_xvector,
    predict=predict_speakers,
    needs_tokenizer=False,
    closed_set_speakers=True,  # the speakers are the classes
)
