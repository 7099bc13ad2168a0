"""CTC decoding: best path vs the lexicon beam search (``model.decoder``)."""

from __future__ import annotations

import sys

import pytest
import torch

from data.text import DIGIT_WORDS, CharTokenizer, lexicon_words
from recipes.asr.decoding import (
    DecoderUnavailableError,
    LexiconDecoder,
    check_lexicon_decoder_available,
    greedy_transcripts,
    make_decoder,
)
from recipes.config import ConfigError, validate_config
from recipes.preflight import preflight
from tests.recipe_helpers import compose_config

TOKENIZER = CharTokenizer()
WORDS = tuple(sorted(DIGIT_WORDS))


def emissions(frames: list[dict[str, float]]) -> torch.Tensor:
    """``[1, T, V]`` log-probabilities; each frame gives probabilities to a few symbols
    (``"_"``: blank, ``" "``: word separator) and shares a little among the rest."""
    rows = []
    for frame in frames:
        probs = torch.full((TOKENIZER.vocab_size,), 1e-4)
        for symbol, p in frame.items():
            index = 0 if symbol == "_" else TOKENIZER.symbols.index(symbol)
            probs[index] = p
        rows.append((probs / probs.sum()).log())
    return torch.stack(rows).unsqueeze(0)


def spell(text: str, alternatives: dict[int, dict[str, float]] | None = None):
    """Frames that spell ``text`` (a blank after each character), with ``alternatives`` for
    the frame of the i-th character."""
    frames: list[dict[str, float]] = []
    for i, char in enumerate(text):
        frames.append((alternatives or {}).get(i, {char: 0.95}))
        frames.append({"_": 0.95})
    return emissions(frames), torch.tensor([len(frames)])


def test_a_non_word_becomes_the_closest_known_word() -> None:
    """ "nive": greedy spells the non-word, the lexicon search the word that fits best."""
    log_probs, lengths = spell("nive", {2: {"v": 0.55, "n": 0.4}})
    assert greedy_transcripts(log_probs, lengths, TOKENIZER) == ["nive"]
    assert LexiconDecoder(WORDS)(log_probs, lengths) == ["nine"]
    assert make_decoder("lexicon", WORDS)(log_probs, lengths) == ["nine"]


def test_repeated_letters_and_several_words_decode() -> None:
    """Doubled letters ("three": e, blank, e) and a word separator between words."""
    log_probs, lengths = spell("three seven")
    assert LexiconDecoder(WORDS)(log_probs, lengths) == ["three seven"]
    log_probs, lengths = spell("zero")
    assert LexiconDecoder(WORDS)(log_probs, lengths) == ["zero"]


def test_only_words_of_the_lexicon_are_output() -> None:
    log_probs, lengths = spell("tour")  # "four" and "two" are close; only "two" is known
    assert LexiconDecoder(("one", "two"))(log_probs, lengths) == ["two"]


def test_greedy_decoder_is_the_best_path() -> None:
    log_probs, lengths = spell("nive", {2: {"v": 0.55, "n": 0.4}})
    assert make_decoder("greedy")(log_probs, lengths) == ["nive"]


def test_greedy_transcripts_are_normalised_as_the_references() -> None:
    """A space emitted twice or at an end is not a character error: references are
    normalised (single spaces, none at the ends), so the hypotheses are too (they counted
    as 2 character edits with a WER of 0, and as a wrong utterance with no confusion)."""
    log_probs, lengths = spell(" seven  two ")
    assert greedy_transcripts(log_probs, lengths, TOKENIZER) == ["seven two"]


def test_a_batch_decodes_each_utterance_to_its_length() -> None:
    a, _ = spell("one")
    b, _ = spell("eight")
    batch = torch.cat([torch.nn.functional.pad(a, (0, 0, 0, b.shape[1] - a.shape[1])), b])
    lengths = torch.tensor([a.shape[1], b.shape[1]])
    assert LexiconDecoder(WORDS)(batch, lengths) == ["one", "eight"]


def test_lexicon_words_are_the_distinct_words_of_the_transcripts() -> None:
    assert lexicon_words(["one two", "Two", "nine one"]) == ("nine", "one", "two")


@pytest.mark.parametrize(
    ("name", "words", "message"),
    [
        ("beam", WORDS, "choose one of: greedy, lexicon"),
        ("lexicon", (), "needs the training transcripts' words"),
    ],
)
def test_bad_decoder_requests_are_refused(name, words, message) -> None:
    with pytest.raises(ValueError, match=message):
        make_decoder(name, words)


def test_words_the_model_cannot_spell_are_refused() -> None:
    with pytest.raises(Exception, match="cannot encode"):
        LexiconDecoder(("one", "2"))


def test_a_missing_flashlight_text_names_the_fix(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashlight.lib.text", None)  # import fails
    with pytest.raises(DecoderUnavailableError, match="pip install flashlight-text.*greedy"):
        check_lexicon_decoder_available()


def test_config_refuses_an_unknown_decoder_naming_the_choices() -> None:
    cfg = compose_config(["model.decoder=beam"])
    with pytest.raises(ConfigError, match="model.decoder='beam'.*greedy, lexicon"):
        validate_config(cfg)
    with pytest.raises(ConfigError, match="model.beam_size"):
        validate_config(compose_config(["model.beam_size=0"]))
    with pytest.raises(ConfigError, match="model.valid_decoder='beam'.*greedy, lexicon"):
        validate_config(compose_config(["model.valid_decoder=beam"]))


@pytest.mark.parametrize(
    "decoders", [["model.decoder=lexicon"], ["model.decoder=greedy", "model.valid_decoder=lexicon"]]
)
def test_preflight_refuses_a_lexicon_decoder_it_cannot_run(monkeypatch, decoders) -> None:
    """Either decoder (the test's or the epochs' validations') needs flashlight-text: a run
    must not train for an hour and then fail at its first validation or its test."""
    monkeypatch.setitem(sys.modules, "flashlight.lib.text", None)  # import fails
    with pytest.raises(DecoderUnavailableError, match="pip install flashlight-text"):
        preflight(compose_config(decoders))
    preflight(compose_config(["model.decoder=greedy", "model.valid_decoder=greedy"]))
