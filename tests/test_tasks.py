"""The task registry: each model belongs to one task; unknown names fail naming valid ones."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from amp_utils import Stage
from data.text import CharTokenizer
from recipes.asr.brain import ASRBrain
from recipes.asr.decoding import LexiconDecoder
from recipes.speaker.brain import SpeakerBrain
from recipes.task import RunLabels
from recipes.tasks import MODEL_TASKS, TASKS, UnknownTaskError, get_task, task_for


def test_every_model_belongs_to_one_task() -> None:
    assert MODEL_TASKS == {"conformer_ctc": "asr", "conformer_ctc_m": "asr", "xvector": "speaker"}
    assert TASKS["asr"].brain_class is ASRBrain and TASKS["speaker"].brain_class is SpeakerBrain
    assert TASKS["asr"].best_checkpoint_key() == {"min_key": "CER"}
    assert TASKS["speaker"].best_checkpoint_key() == {"max_key": "accuracy"}
    assert TASKS["asr"].needs_tokenizer and not TASKS["asr"].closed_set_speakers
    assert TASKS["speaker"].closed_set_speakers and not TASKS["speaker"].needs_tokenizer


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"name": "xvector", "task": "tts"}, "model.task='tts' is not a task; choose one of: asr"),
        ({"name": "lstm", "task": "asr"}, "model.name='lstm' is not a model; choose one of: conf"),
        ({"name": "xvector", "task": "asr"}, "does not fit model.name='xvector'"),
    ],
)
def test_unknown_names_fail_with_the_valid_ones(model, message) -> None:
    with pytest.raises(UnknownTaskError, match=message):
        task_for(OmegaConf.create(model))


def test_predictions_are_labels() -> None:
    labels = RunLabels(speakers=("george", "jackson"))
    logits = torch.tensor([[0.1, 2.0], [3.0, 0.0]])
    assert get_task("speaker").predict(logits, labels) == ["jackson", "george"]
    # Greedy CTC: "a" (2) twice in a row collapses, the blank (0) separates "b" (3).
    ids = torch.tensor([[2, 2, 0, 3, 0]])
    logits = torch.nn.functional.one_hot(ids, CharTokenizer().vocab_size).float() * 10
    assert get_task("asr").predict((logits, torch.tensor([5])), labels) == ["ab"]


def test_run_labels_read_the_decoder_from_the_config_and_keep_greedy_for_old_runs() -> None:
    """One reader of ``model.decoder``: a run's config decides; an old config (from before
    lexicon decoding) keeps the greedy decoding its run was tested with, in training,
    inference and evaluate.py alike."""
    words = ("one", "two")
    new = OmegaConf.create({"model": {"decoder": "lexicon", "beam_size": 7}})
    labels = RunLabels.from_config(new, ["george"], words)
    assert labels == RunLabels(("george",), words, "lexicon", 7)
    old = OmegaConf.create({"model": {"name": "conformer_ctc"}})
    assert RunLabels.from_config(old, ["george"], words).decoder == "greedy"
    # The ASR Brain decodes with the labels it is given; without any, greedily.
    brain = ASRBrain.__new__(ASRBrain)
    brain.hparams = type("H", (), {"labels": labels})()
    assert isinstance(brain.decoder_for(Stage.TEST), LexiconDecoder)
    assert isinstance(brain.decoder_for(Stage.VALID), LexiconDecoder)  # no valid_decoder
    brain.hparams = type("H", (), {})()
    assert not isinstance(brain.decoder_for(Stage.TEST), LexiconDecoder)


def test_epoch_validations_decode_with_valid_decoder_and_the_test_with_decoder() -> None:
    """``model.valid_decoder=greedy`` (the ASR models' default): the per-epoch validations
    decode the best path, the test the lexicon search, as SpeechBrain's CTC recipes split
    ``valid_search``/``test_search``. A config from before the option validates with
    ``model.decoder``, as its run did."""
    words = ("one", "two")
    cfg = OmegaConf.create(
        {"model": {"decoder": "lexicon", "beam_size": 7, "valid_decoder": "greedy"}}
    )
    labels = RunLabels.from_config(cfg, ["george"], words)
    assert (labels.decoder, labels.valid_decoder, labels.epoch_decoder) == (
        "lexicon",
        "greedy",
        "greedy",
    )
    brain = ASRBrain.__new__(ASRBrain)
    brain.hparams = type("H", (), {"labels": labels})()
    assert not isinstance(brain.decoder_for(Stage.VALID), LexiconDecoder)
    assert isinstance(brain.decoder_for(Stage.TEST), LexiconDecoder)
    before = OmegaConf.create({"model": {"decoder": "lexicon", "beam_size": 7}})
    assert RunLabels.from_config(before, ["george"], words).epoch_decoder == "lexicon"


class _Batch:
    """The part of an AudioBatch the speaker objective reads."""

    def __init__(self, speakers: torch.Tensor) -> None:
        self.speakers = speakers
        self.ids = [f"utt{i}" for i in range(len(speakers))]
        self.host = None  # on the host already

    def __len__(self) -> int:
        return len(self.speakers)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_speaker_label_smoothing_shapes_the_training_loss_only(smoothing) -> None:
    """``model.label_smoothing`` enters the training cross-entropy; validation stays plain."""
    from amp_utils import Stage

    brain = SpeakerBrain(
        modules={}, hparams={"label_smoothing": smoothing}, run_opts={"noprogressbar": True}
    )
    logits = torch.tensor([[4.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    batch = _Batch(torch.tensor([0, 1]))
    plain = torch.nn.functional.cross_entropy(logits, batch.speakers)
    smoothed = torch.nn.functional.cross_entropy(logits, batch.speakers, label_smoothing=smoothing)
    torch.testing.assert_close(brain.compute_objectives(logits, batch, Stage.TRAIN), smoothed)
    brain.reset_metrics(Stage.VALID)
    torch.testing.assert_close(brain.compute_objectives(logits, batch, Stage.VALID), plain)
    assert brain.stage_metrics(Stage.VALID) == {"accuracy": 100.0}
    assert [(o.id, o.reference, o.prediction) for o in brain.outcomes] == [
        ("utt0", "0", "0"),  # no labels: speakers by class index
        ("utt1", "1", "1"),
    ]
