"""Characters to token ids and back, and greedy CTC decoding.

The vocabulary is deliberately tiny (blank, space, a-z, apostrophe): the recipes train
small CTC models on spoken digits, and a fixed vocabulary means checkpoints never depend
on the data they were trained on.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

import torch

from data.errors import DataError

#: Spoken words of the digits 0-9, indexed by digit.
DIGIT_WORDS: list[str] = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
]  # fmt: skip

BLANK_TOKEN = "<blank>"


class CharTokenizer:
    """Character tokenizer for CTC: index 0 is the blank, then space, a-z and apostrophe."""

    blank_id: int = 0

    def __init__(self) -> None:
        self.symbols: list[str] = [BLANK_TOKEN, " ", *string.ascii_lowercase, "'"]
        self._index = {symbol: i for i, symbol in enumerate(self.symbols) if i != 0}

    @property
    def vocab_size(self) -> int:
        """Number of output classes including the blank."""
        return len(self.symbols)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, normalised first (:func:`normalize_transcript`).

        Raises:
            DataError: if the text holds characters outside the vocabulary; the message
                names the text and the characters.
        """
        lowered = normalize_transcript(text)
        unknown = sorted({char for char in lowered if char not in self._index})
        if unknown:
            raise DataError(
                f"Transcript {text!r} contains characters the tokenizer cannot encode: "
                f"{', '.join(repr(c) for c in unknown)}. Fix: normalise transcripts to "
                "a-z, space and apostrophe (e.g. spell out numbers, drop punctuation)."
            )
        return [self._index[char] for char in lowered]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; blanks are dropped.

        Raises:
            DataError: if an id is outside ``[0, vocab_size)``.
        """
        chars = []
        for token in ids:
            token = int(token)
            if not 0 <= token < self.vocab_size:
                raise DataError(
                    f"Token id {token} is outside the vocabulary (0..{self.vocab_size - 1}). "
                    "Fix: the model's output size must equal CharTokenizer().vocab_size."
                )
            if token != self.blank_id:
                chars.append(self.symbols[token])
        return "".join(chars)


def normalize_transcript(text: str) -> str:
    """``text`` lower-cased, its words separated by single spaces (no leading or trailing
    space): what the model is trained to output, so also what its output is scored against
    (``"Seven  Two "`` -> ``"seven two"``)."""
    return " ".join(text.lower().split())


def lexicon_words(transcripts: Iterable[str]) -> tuple[str, ...]:
    """The sorted distinct words of ``transcripts``: the lexicon of a training split."""
    return tuple(sorted({word for text in transcripts for word in text.lower().split()}))


def ctc_greedy_decode(
    log_probs: torch.Tensor, lengths: torch.Tensor, blank_id: int = 0
) -> list[list[int]]:
    """Best-path CTC decoding: argmax per frame, collapse repeats, drop blanks.

    The argmax and masking run on the tensors' device and the result crosses to the CPU
    in one transfer, so decoding a GPU batch does not synchronise per utterance.

    Args:
        log_probs: ``[B, T, V]`` scores (log-probabilities or logits).
        lengths: ``[B]`` number of valid frames per utterance.
        blank_id: index of the blank symbol.

    Returns:
        Token ids per utterance.
    """
    if log_probs.dim() != 3:
        raise DataError(
            f"ctc_greedy_decode expects log_probs of shape [B, T, V], got "
            f"{tuple(log_probs.shape)}. Fix: pass the model output before any reshaping."
        )
    best = log_probs.argmax(dim=-1)  # [B, T]
    frames = torch.arange(best.shape[1], device=best.device)
    valid = frames.unsqueeze(0) < lengths.to(best.device).unsqueeze(1)
    changed = torch.ones_like(valid)
    changed[:, 1:] = best[:, 1:] != best[:, :-1]
    keep = valid & changed & (best != blank_id)
    kept = best.masked_fill(~keep, -1).cpu()
    return [[token for token in row if token >= 0] for row in kept.tolist()]
