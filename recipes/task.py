"""What a task (ASR, speaker ID) is to the recipes: the ``Task`` record of its parts.

Each task defines one ``Task`` next to its model and Brain (``recipes/asr/task.py``,
``recipes/speaker/task.py``); ``recipes/tasks.py`` collects them into the registry that
training, data setup, inference and the benchmark look tasks up in, so that no other module
branches on the task's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from recipes.audio_brain import AudioBrain

#: ``build_model(model_cfg, n_mels, speakers)``: the task's model for ``n_mels``-bin
#: features and the run's speaker names (the classes of speaker ID).
ModelBuilder = Callable[[DictConfig, int, tuple[str, ...]], torch.nn.Module]

#: The decoder of a config without ``model.decoder``: runs from before lexicon decoding were
#: validated and tested with best-path decoding, and keep it.
LEGACY_DECODER = "greedy"
#: ``model.beam_size`` of such a config.
LEGACY_BEAM_SIZE = 50


@dataclass(frozen=True)
class RunLabels:
    """What a trained run's outputs mean (its ``labels.json`` and decoding settings).

    Attributes:
        speakers: the run's speaker names (the classes of speaker ID).
        words: the training transcripts' words (the lexicon of ASR's lexicon decoder).
        decoder: ASR's ``model.decoder`` (``greedy`` | ``lexicon``): the test's, inference's
            and the tested weights' validation figures'.
        beam_size: ASR's ``model.beam_size`` for the lexicon decoder.
        valid_decoder: ASR's ``model.valid_decoder``, the decoder of the per-epoch
            validations (``None``: ``decoder``, as runs from before the option validated).
    """

    speakers: tuple[str, ...]
    words: tuple[str, ...] = field(default=())
    decoder: str = LEGACY_DECODER
    beam_size: int = LEGACY_BEAM_SIZE
    valid_decoder: str | None = None

    @property
    def epoch_decoder(self) -> str:
        """The decoder of the per-epoch validations (``valid_decoder``, else ``decoder``)."""
        return self.valid_decoder or self.decoder

    @classmethod
    def from_config(
        cls, cfg: DictConfig, speakers: Sequence[str], words: Sequence[str] = ()
    ) -> RunLabels:
        """The labels of a run with config ``cfg``: its decoder settings, else the legacy ones.

        The one place that reads ``model.decoder``/``model.beam_size``/``model.valid_decoder``:
        training, inference and ``evaluate.py`` decode alike, an old run's config (without
        them) keeps the greedy decoding it was tested with, and one from before
        ``valid_decoder`` validated its epochs with ``decoder``.
        """
        valid_decoder = OmegaConf.select(cfg, "model.valid_decoder", default=None)
        return cls(
            speakers=tuple(speakers),
            words=tuple(words),
            decoder=str(OmegaConf.select(cfg, "model.decoder", default=LEGACY_DECODER)),
            beam_size=int(OmegaConf.select(cfg, "model.beam_size", default=LEGACY_BEAM_SIZE)),
            valid_decoder=None if valid_decoder is None else str(valid_decoder),
        )


#: ``predict(model_outputs, labels)``: the model's outputs for a batch -> one label each
#: (a transcript, a speaker name).
Predictor = Callable[[Any, RunLabels], list[str]]


@dataclass(frozen=True)
class Task:
    """The task-specific parts of a recipe, looked up by name in ``recipes.tasks``.

    Attributes:
        name: the task's name, as in ``model.task`` (``asr``, ``speaker``).
        model_names: the ``model.name`` options that train this task.
        brain_class: its Brain (forward, objectives, metrics; the metric that picks the
            best checkpoint is the Brain's ``metric_key``/``metric_mode``).
        build_model: makes its model (see ``ModelBuilder``).
        predict: model outputs to labels, for inference (see ``Predictor``).
        needs_tokenizer: the batches carry character targets (``CharTokenizer``).
        closed_set_speakers: the speakers are the classes: only those of the training
            split are known, and evaluation speakers must be among them.
    """

    name: str
    model_names: tuple[str, ...]
    brain_class: type[AudioBrain]
    build_model: ModelBuilder
    predict: Predictor
    needs_tokenizer: bool
    closed_set_speakers: bool

    @property
    def selection_metric(self) -> tuple[str, str]:
        """``(metric, direction)`` that picks the best checkpoint and that sweepers tune:
        e.g. ``("CER", "minimize")``, ``("accuracy", "maximize")``."""
        mode = self.brain_class.metric_mode
        return self.brain_class.metric_key, "minimize" if mode == "min" else "maximize"

    def best_checkpoint_key(self) -> dict[str, str]:
        """``min_key=``/``max_key=`` that picks the best checkpoint by the task's metric."""
        return self.brain_class.best_checkpoint_key()
