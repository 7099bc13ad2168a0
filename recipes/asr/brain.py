"""CTC speech recognition recipe: forward, CTC objective, decoding, CER/WER."""

from __future__ import annotations

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
        if stage != Stage.TRAIN:
            self._score(self.decoder_for(stage), log_probs, out_lens, batch)
        return loss

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

    def decoder_for(self, stage: Stage) -> Decoder:
        """The transcript decoder of ``stage``: ``model.valid_decoder`` for the per-epoch
        validations, ``model.decoder`` for the test (cached by ``make_decoder``)."""
        labels: RunLabels = getattr(self.hparams, "labels", RunLabels(speakers=()))
        name = labels.epoch_decoder if stage == Stage.VALID else labels.decoder
        return make_decoder(name, labels.words, labels.beam_size)

    def validates_like_test(self) -> bool:
        labels: RunLabels = getattr(self.hparams, "labels", RunLabels(speakers=()))
        return labels.epoch_decoder == labels.decoder

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
