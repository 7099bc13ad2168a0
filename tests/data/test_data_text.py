"""Tokenizer and greedy CTC decoding."""

from __future__ import annotations

import pytest
import torch

from data.errors import DataError
from data.text import DIGIT_WORDS, CharTokenizer, ctc_greedy_decode


def test_vocabulary() -> None:
    tokenizer = CharTokenizer()
    assert tokenizer.vocab_size == 29 and tokenizer.blank_id == 0
    assert tokenizer.encode("a z'") == [2, 1, 27, 28]
    assert tokenizer.encode("  A  Z' ") == [2, 1, 27, 28]  # normalised: as it is scored


def test_round_trip_lower_cases() -> None:
    tokenizer = CharTokenizer()
    text = " ".join(DIGIT_WORDS)
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode("Don't STOP")) == "don't stop"
    assert tokenizer.decode([0, 9, 0, 10]) == "hi"


def test_bad_characters_are_named() -> None:
    with pytest.raises(DataError, match="normalise transcripts") as info:
        CharTokenizer().encode("Call 911!")
    message = str(info.value)
    assert "'Call 911!'" in message and "'1'" in message and "'9'" in message
    assert "'!'" in message


def test_decode_rejects_out_of_range_ids() -> None:
    with pytest.raises(DataError, match="vocab_size"):
        CharTokenizer().decode([29])


def test_ctc_greedy_decode_hand_made() -> None:
    paths = [[1, 1, 0, 1, 2, 2], [2, 0, 2, 3, 3, 3]]
    log_probs = torch.nn.functional.one_hot(torch.tensor(paths), 4).float().log_softmax(-1)
    decoded = ctc_greedy_decode(log_probs, torch.tensor([6, 3]))
    assert decoded == [[1, 1, 2], [2, 2]]
    assert ctc_greedy_decode(log_probs, torch.tensor([0, 1])) == [[], [2]]
    assert ctc_greedy_decode(log_probs, torch.tensor([6, 6]), blank_id=2) == [[1, 0, 1], [0, 3]]
