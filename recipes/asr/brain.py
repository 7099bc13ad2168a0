"""CTC speech recognition recipe: forward, CTC objective, decoding, CER/WER."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torchaudio

from amp_utils import Stage
from amp_utils.compile import unwrap_module
from data.dataset import AudioBatch
from recipes.asr.ctc_on_device import ctc_loss_on_device
from recipes.asr.decoding import Decoder, make_decoder
from recipes.asr.model import ctc_log_probs, ctc_loss
from recipes.audio_brain import AudioBrain
from recipes.task import RunLabels

logger = logging.getLogger(__name__)


class ASRBrain(AudioBrain):
    """Character CTC recognizer; the best checkpoint is the one with the lowest CER.

    Transcripts come from ``hparams.labels`` (a ``RunLabels``; without labels, greedy):
    the test (and ``score_loaded_weights``) decodes with its ``decoder`` (``greedy`` or
    ``lexicon`` over the training transcripts' words), the per-epoch validations with its
    ``epoch_decoder`` (``model.valid_decoder``). SpeechBrain's CTC recipes split them the
    same way (best path in validation, the beam search in the test): the lexicon search
    runs on one CPU core and would cost every epoch ~0.25 s per 300 utterances.
    """

    metric_key = "CER"
    metric_mode = "min"
    metric_counts = ("char_edits", "char_total", "word_edits", "word_total")

    def compute_forward(self, batch: AudioBatch, stage: Stage):
        feats, feat_lens = self.features(batch, stage)
        return self.modules.model(feats, feat_lens)

    def compute_objectives(self, predictions, batch: AudioBatch, stage: Stage) -> torch.Tensor:
        logits, out_lens = predictions
        log_probs = ctc_log_probs(logits)  # fp32 under autocast
        if self.graph_safe_step:  # a captured step: lengths stay on the device
            loss = ctc_loss_on_device(log_probs, out_lens, batch.tokens, batch.token_lens)
        else:
            loss_lens, token_lens = self.ctc_lengths(batch, out_lens)
            loss = ctc_loss(log_probs, loss_lens, batch.tokens, token_lens)
        if stage != Stage.TRAIN and not self.graph_safe_step:  # captured: scored after
            self._score(self.decoder_for(stage), log_probs, out_lens, batch)
        return loss

    def score_predictions(self, predictions, batch: AudioBatch, stage: Stage) -> None:
        """Decode and score a batch evaluated through a CUDA graph (``trainer.graph_eval``)
        on the host, as ``compute_objectives`` does in an eager evaluation."""
        logits, out_lens = predictions
        self._score(self.decoder_for(stage), ctc_log_probs(logits), out_lens, batch)

    def ctc_lengths(
        self, batch: AudioBatch, out_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(output lengths, target lengths) for the CTC loss, on the host when possible.

        ``F.ctc_loss`` copies both length tensors to the CPU: from the GPU that copy waits
        for everything queued so far. The batch's host copy gives the same lengths without
        waiting (the model's length arithmetic applied to the host's sample counts).
        PyTorch's CUDA CTC kernel still copies its own offsets to the GPU synchronously.
        """
        host = batch.host
        if host is None:
            return out_lens, batch.token_lens
        frames = unwrap_module(self.modules.features).frame_lengths(host.wav_lens)
        return unwrap_module(self.modules.model).output_lengths(frames), host.token_lens

    @property
    def labels(self) -> RunLabels:
        """The run's ``RunLabels`` (``hparams.labels``; without them, greedy decoding)."""
        return getattr(self.hparams, "labels", None) or RunLabels(speakers=())

    @property
    def epoch_decoder(self) -> str:
        """The decoder of the per-epoch validations: ``model.valid_decoder``, unless the
        run's checkpoints were validated with another (see ``load_state_dict``)."""
        return getattr(self, "_checkpoints_decoder", None) or self.labels.epoch_decoder

    def decoder_for(self, stage: Stage) -> Decoder:
        """The transcript decoder of ``stage``: ``epoch_decoder`` for the per-epoch
        validations, ``model.decoder`` for the test (cached by ``make_decoder``)."""
        labels = self.labels
        if stage == Stage.VALID and self.epoch_decoder != labels.epoch_decoder:
            self._warn_checkpoints_decoder()
        name = self.epoch_decoder if stage == Stage.VALID else labels.decoder
        return make_decoder(name, labels.words, labels.beam_size)

    def validates_like_test(self) -> bool:
        return self.epoch_decoder == self.labels.decoder

    def checkpoint_meta(self) -> dict[str, Any]:
        return {"valid_decoder": self.epoch_decoder}

    def state_dict(self) -> dict[str, Any]:
        """The loop's state, and the decoder its validations score with (their CERs rank
        the checkpoints: a resumed run must go on scoring as its checkpoints were)."""
        return {**super().state_dict(), "valid_decoder": self.epoch_decoder}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loop, and keep validating with the decoder the checkpoints' CERs
        come from: a run started before ``model.valid_decoder`` existed validated with
        ``model.decoder``, and its resume or extension (``trainer.epochs`` raised) would
        otherwise rank lexicon CERs against greedy ones when picking the best checkpoint."""
        super().load_state_dict(state)
        used = str(state.get("valid_decoder", self.labels.decoder))
        self._checkpoints_decoder = used if used != self.labels.epoch_decoder else None

    def _warn_checkpoints_decoder(self) -> None:
        if getattr(self, "_warned_checkpoints_decoder", False):
            return
        self._warned_checkpoints_decoder = True
        logger.warning(
            "This run's checkpoints were validated with the %s decoder (model.valid_decoder=%s"
            " now): its validations go on decoding with %s, so that their CERs, which pick "
            "the best checkpoint, stay comparable.",
            self.epoch_decoder,
            self.labels.epoch_decoder,
            self.epoch_decoder,
        )

    def reset_metrics(self, stage: Stage) -> None:
        self.char_edits = self.char_total = self.word_edits = self.word_total = 0
        self.examples: list[tuple[str, str]] = []

    def _score(
        self, decode: Decoder, log_probs: torch.Tensor, out_lens: torch.Tensor, batch: AudioBatch
    ) -> None:
        hyps = decode(log_probs, out_lens)
        self.record_outcomes(batch, hyps, batch.transcripts)
        for ref, hyp in zip(batch.transcripts, hyps, strict=True):
            self.char_edits += torchaudio.functional.edit_distance(ref, hyp)
            self.char_total += len(ref)
            self.word_edits += torchaudio.functional.edit_distance(ref.split(), hyp.split())
            self.word_total += len(ref.split())
            if len(self.examples) < self.hparams.num_text_examples:
                self.examples.append((ref, hyp))

    def stage_metrics(self, stage: Stage) -> dict[str, float]:
        return {
            "CER": 100.0 * self.char_edits / max(self.char_total, 1),
            "WER": 100.0 * self.word_edits / max(self.word_total, 1),
        }

    def text_examples(self) -> str | None:
        rows = [f"| {ref} | {hyp} |" for ref, hyp in self.examples]
        return "| reference | hypothesis |\n|---|---|\n" + "\n".join(rows) if rows else None
