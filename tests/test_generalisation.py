"""Wiring of what makes models carry over to new voices (issue 13) and of per-module precision.

Held-out speakers, waveform augmentation and checkpoint averaging, each through the real
config and a real (debug-sized) run on FSDD audio.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from amp_utils import Checkpointer, Stage
from recipes.augment import WaveAugment
from recipes.config import ConfigError, validate_config
from recipes.data_setup import build_data
from recipes.experiment import build_brain, train
from recipes.inference import load_trained
from recipes.modules import build_modules
from tests.recipe_helpers import FAST, compose_config


def fast_cfg(tmp_path: Path, fsdd_root: Path, *extra: str):
    return compose_config(
        [
            *FAST,
            f"data.root={fsdd_root}",
            f"data.prepared_dir={tmp_path / 'prepared'}",
            f"output_dir={tmp_path / 'run'}",
            *extra,
        ]
    )


def test_held_out_speaker_is_the_whole_test_set_and_never_trained_on(tmp_path, fsdd_root):
    cfg = fast_cfg(tmp_path, fsdd_root, "data.test_speakers=[jackson]")
    validate_config(cfg)
    data = build_data(cfg, torch.device("cpu"))
    assert data.record["test_speakers"] == ["jackson"]
    assert data.record["splits"]["test"]["utterances"] == 500
    train_ids = [u.id for u in data.train.dataset.utterances]
    assert train_ids and not any("_jackson_" in i for i in train_ids)
    assert all("_jackson_" in u.id for u in data.test.dataset.utterances)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model=xvector", "data.test_speakers=[jackson]"], "closed-set"),
        (["data=fsdd_connected", "data.test_speakers=[jackson]"], "fsdd_digits only"),
    ],
)
def test_held_out_speakers_refused_where_they_cannot_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config([*FAST, *overrides]))


def test_wave_augment_is_built_from_the_config_and_keeps_ctc_lengths_right(tmp_path, fsdd_root):
    cfg = fast_cfg(
        tmp_path,
        fsdd_root,
        "data.wave_augment.speeds=[0.9]",
        "data.wave_augment.noise_prob=1.0",
        "data.spec_augment.freq_warp=0.1",
        "data.wave_augment.cut_end_prob=0",  # the speed change alone sets the lengths below
    )
    no_augment = fast_cfg(
        tmp_path, fsdd_root, "data.wave_augment.cut_end_prob=0", "data.wave_augment.channel_prob=0"
    )
    assert "wave_augment" not in build_modules(no_augment, ("s",))
    data = build_data(cfg, torch.device("cpu"))
    brain = build_brain(cfg, data, None, None)
    assert isinstance(brain.modules.wave_augment, WaveAugment)
    assert brain.modules.augment.freq_warp == 0.1  # VTLP from the config
    batch = next(iter(data.train)).to(brain.device)
    feats, feat_lens = brain.features(batch, Stage.TRAIN)
    # The host copy's lengths follow the speed change: CTC lengths from the host agree
    # with the features the model really gets.
    host_frames = brain.modules.features.frame_lengths(batch.host.wav_lens)
    assert torch.equal(host_frames, feat_lens.cpu())
    expected = torch.ceil(batch.wav_lens.double() / 0.9).long()
    assert torch.equal(batch.host.wav_lens, expected)
    valid_feats, valid_lens = brain.features(next(iter(data.valid)), Stage.VALID)
    assert valid_lens.max() <= valid_feats.shape[1]  # evaluation: no perturbation


def test_default_asr_end_cuts_keep_host_ctc_lengths_right(tmp_path, fsdd_root):
    """The ASR recipe cuts utterance ends by default: host lengths follow the cuts. Its
    other single-digit defaults reach the modules too: random channels and utterance
    normalisation."""
    cfg = fast_cfg(tmp_path, fsdd_root)
    assert cfg.data.wave_augment.cut_end_prob == 0.3
    data = build_data(cfg, torch.device("cpu"))
    brain = build_brain(cfg, data, None, None)
    assert brain.modules.wave_augment.channel_prob == 0.5
    assert brain.modules.features.normalize == "utterance"
    brain.modules.train()
    batch = next(iter(data.train)).to(brain.device)
    uncut = batch.host.wav_lens.clone()
    feats, feat_lens = brain.features(batch, Stage.TRAIN)
    assert torch.equal(brain.modules.features.frame_lengths(batch.host.wav_lens), feat_lens.cpu())
    cut = batch.host.wav_lens < uncut
    assert cut.any() and (batch.host.wav_lens >= (uncut * 0.6).floor()).all()


def test_fp32_modules_from_the_config_run_in_fp32_under_bf16(tmp_path, fsdd_root):
    cfg = fast_cfg(
        tmp_path, fsdd_root, "precision=bf16", "precision.fp32_modules=[model.blocks.*.attention]"
    )
    modules = build_modules(cfg, ("s",))
    model = modules["model"]
    dtypes: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:
            dtypes[name] = (output[0] if isinstance(output, tuple) else output).dtype

        return hook

    for name, module in model.named_modules():
        if name.endswith(".attention") or name.endswith(".ffn1"):
            module.register_forward_hook(record(name))
    feats = torch.randn(2, 50, cfg.data.features.n_mels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(feats, torch.tensor([50, 40]))
    pinned = {n: d for n, d in dtypes.items() if n.endswith("attention")}
    assert pinned and set(pinned.values()) == {torch.float32}
    others = {n: d for n, d in dtypes.items() if not n.endswith("attention")}
    assert others and set(others.values()) == {torch.bfloat16}


def test_checkpoint_averaging_tests_and_transcribes_with_the_average(tmp_path, fsdd_root):
    cfg = fast_cfg(
        tmp_path,
        fsdd_root,
        "model=xvector",
        "trainer.debug_epochs=3",
        "trainer.average_checkpoints=2",
        "trainer.average_from=best",
        "trainer.keep_checkpoints=1",
    )
    results = train(cfg)
    tested = results["tested_checkpoint"]
    assert len(tested["averaged_checkpoints"]) == 2 and tested["averaged_from"] == "best"
    assert tested["checkpoint"] == tested["averaged_checkpoints"][0]  # the best first
    ckpts = Checkpointer(tmp_path / "run" / "checkpoints").list_checkpoints()
    names = {c.path.name for c in ckpts}
    assert set(tested["averaged_checkpoints"]) <= names  # both kept although keep=1
    hydra_dir = tmp_path / "run" / ".hydra"  # what Hydra writes for a CLI run
    hydra_dir.mkdir()
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    trained = load_trained(tmp_path / "run", device="cpu")
    state = [
        torch.load(tmp_path / "run" / "checkpoints" / n / "state.pt", weights_only=True)
        for n in tested["averaged_checkpoints"]
    ]
    weights = [s["state"]["module.model"] for s in state]
    key = next(k for k in weights[0] if k.endswith("weight") and weights[0][k].dim() > 1)
    expected = (weights[0][key] + weights[1][key]) / 2
    assert torch.allclose(trained.model.state_dict()[key], expected, atol=1e-6)


def test_averaging_the_final_epochs_keeps_and_averages_them(tmp_path, fsdd_root):
    """``trainer.average_from=last`` (the default): the N final epochs are kept whatever
    ``keep_checkpoints`` says, tested as their average, and transcribe loads the same."""
    cfg = fast_cfg(
        tmp_path,
        fsdd_root,
        "model=xvector",
        "trainer.debug_epochs=4",
        "trainer.average_checkpoints=3",
        "trainer.keep_checkpoints=1",
    )
    assert cfg.trainer.average_from == "last"
    results = train(cfg)
    tested = results["tested_checkpoint"]
    assert tested["averaged_from"] == "last"
    ckpts = Checkpointer(tmp_path / "run" / "checkpoints").list_checkpoints()
    final = [c for c in ckpts if c.end_of_epoch][-3:][::-1]  # newest first
    assert [c.meta["epoch"] for c in final] == [4, 3, 2]
    assert tested["averaged_checkpoints"] == [c.path.name for c in final]
    hydra_dir = tmp_path / "run" / ".hydra"
    hydra_dir.mkdir()
    OmegaConf.save(cfg, hydra_dir / "config.yaml")
    trained = load_trained(tmp_path / "run", device="cpu")
    weights = [
        torch.load(c.path / "state.pt", weights_only=True)["state"]["module.model"] for c in final
    ]
    key = next(k for k in weights[0] if k.endswith("weight") and weights[0][k].dim() > 1)
    expected = sum(w[key].double() for w in weights) / 3
    assert torch.allclose(trained.model.state_dict()[key].double(), expected, atol=1e-6)


def test_averaging_the_final_epochs_never_averages_scattered_ones(caplog):
    """On disk after a run with average_from=best: epochs 6, 3 and 1. 'last 3' averaged
    those as "the final epochs"; it averages epoch 6 only now, and says why."""
    from types import SimpleNamespace

    from recipes.audio_brain import final_epochs

    def ckpts(*epochs):
        return [SimpleNamespace(meta={"epoch": e}, name=f"epoch {e}") for e in epochs]

    assert [c.meta["epoch"] for c in final_epochs(ckpts(6, 5, 4), 3)] == [6, 5, 4]
    assert [c.meta["epoch"] for c in final_epochs(ckpts(2, 1), 3)] == [2, 1]  # all there are
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert [c.meta["epoch"] for c in final_epochs(ckpts(6, 3, 1), 3)] == [6]
    assert "the checkpoints of epochs 4, 5 are not on disk" in caplog.text
    assert "averages epochs 6 only" in caplog.text
    legacy = [SimpleNamespace(meta={}), SimpleNamespace(meta={})]  # no epochs recorded
    assert final_epochs(legacy, 2) == legacy
