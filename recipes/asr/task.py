"""The ASR task's registry entry: Conformer-CTC models, ``ASRBrain``, CTC decoding."""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from data.text import CharTokenizer
from recipes.asr.brain import ASRBrain
from recipes.asr.decoding import make_decoder
from recipes.asr.model import ConformerCTC, ctc_log_probs
from recipes.task import RunLabels, Task


def build_conformer_ctc(
    model_cfg: DictConfig, n_mels: int, speakers: tuple[str, ...]
) -> torch.nn.Module:
    """A Conformer-CTC recognizer over the character vocabulary (speakers play no role)."""
    m = model_cfg
    return ConformerCTC(
        n_mels=n_mels,
        vocab_size=CharTokenizer().vocab_size,
        d_model=m.d_model,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        ffn_dim=m.ffn_dim,
        conv_kernel=m.conv_kernel,
        dropout=m.dropout,
        subsampling=m.subsampling,
    )


def predict_transcripts(outputs: tuple[torch.Tensor, torch.Tensor], labels: RunLabels) -> list[str]:
    """Transcripts of the model's ``(logits, output lengths)`` by the run's decoder."""
    logits, out_lens = outputs
    decode = make_decoder(labels.decoder, labels.words, labels.beam_size)
    return decode(ctc_log_probs(logits), out_lens)


ASR = Task(
    name="asr",
    model_names=("conformer_ctc", "conformer_ctc_m"),
    brain_class=ASRBrain,
    build_model=build_conformer_ctc,
    predict=predict_transcripts,
    needs_tokenizer=True,
    closed_set_speakers=False,  # test speakers may be unseen
)
