"""LogMelFeatures and SpecAugment."""

from __future__ import annotations

import pytest
import torch

from recipes.augment import SpecAugment
from recipes.frontend import LogMelFeatures


@pytest.fixture
def wavs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    wavs = torch.randn(2, 8000, generator=generator) * 0.1
    wavs[1, 4000:] = 0
    return wavs, torch.tensor([8000, 4000])


def test_shapes_lengths_and_normalisation(wavs) -> None:
    feats, lens = LogMelFeatures()(*wavs)
    assert feats.shape == (2, 101, 40) and feats.dtype == torch.float32
    assert lens.tolist() == [101, 51] and lens.dtype == torch.int64
    assert not feats[1, 51:].any()
    valid = feats[1, :51]
    torch.testing.assert_close(valid.mean(0), torch.zeros(40), atol=1e-4, rtol=0)
    torch.testing.assert_close(valid.std(0, unbiased=False), torch.ones(40), atol=1e-2, rtol=0)


@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
def test_fp32_under_autocast(wavs, input_dtype: torch.dtype) -> None:
    module = LogMelFeatures()
    reference, _ = module(*wavs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        feats, lens = module(wavs[0].to(input_dtype), wavs[1])
    assert feats.dtype == torch.float32
    if input_dtype == torch.float32:
        torch.testing.assert_close(feats, reference)


def test_specaugment_identity_in_eval_and_masks_in_training() -> None:
    feats = torch.randn(3, 120, 40) + 5.0
    augment = SpecAugment()
    augment.eval()
    assert torch.equal(augment(feats), feats)
    augment.train()
    torch.manual_seed(0)
    masked = augment(feats)
    assert masked.shape == feats.shape
    assert (masked == 0).any() and not torch.equal(masked, feats)


def test_utterance_normalisation_keeps_the_spectral_shape(wavs) -> None:
    """``utterance``: one mean and variance over all bins and valid frames, so a bin that is
    louder on average stays louder (``per_bin`` makes every bin's mean zero)."""
    tone = torch.sin(2 * torch.pi * 500 * torch.arange(8000) / 8000)  # energy in the low bins
    batch = wavs[0] + tone, wavs[1]
    per_bin, _ = LogMelFeatures()(*batch)
    utterance, lens = LogMelFeatures(normalize="utterance")(*batch)
    for b, n in enumerate(lens.tolist()):
        valid = utterance[b, :n]
        torch.testing.assert_close(valid.mean(), torch.tensor(0.0), atol=1e-4, rtol=0)
        torch.testing.assert_close(valid.std(unbiased=False), torch.tensor(1.0), atol=1e-3, rtol=0)
        assert not utterance[b, n:].any()
        bin_means = valid.mean(0)
        assert bin_means.max() - bin_means.min() > 1.0  # the tone's bins stand out
        assert per_bin[b, :n].mean(0).abs().max() < 1e-4  # per_bin flattens them
    # A gain change reaches neither.
    louder, _ = LogMelFeatures(normalize="utterance")(batch[0] * 8.0, batch[1])
    torch.testing.assert_close(louder, utterance, atol=1e-3, rtol=0)


def test_unknown_normalisation_names_the_choices() -> None:
    with pytest.raises(ValueError, match="per_bin, utterance"):
        LogMelFeatures(normalize="global")


def test_runs_from_before_the_option_keep_per_bin_normalisation() -> None:
    """A finished run's saved config without ``features.normalize`` (older runs) rebuilds the
    front end it was trained with: per-bin, not the newer ASR default."""
    from omegaconf import OmegaConf

    from recipes.frontend import build_features

    old = OmegaConf.create(
        {
            "sample_rate": 8000,
            "features": {"n_mels": 40, "n_fft": 256, "win_length": 200, "hop_length": 80},
        }
    )
    assert build_features(old).normalize == "per_bin"
    old.features.normalize = "utterance"
    assert build_features(old).normalize == "utterance"


def test_an_utterance_has_the_same_features_alone_and_in_any_batch() -> None:
    """With torchaudio's reflect padding the batch's longest utterance ended on mirrored
    samples and the others on their zero padding: one frame differed by up to ~1.8 after
    normalisation (the statistics with it), so test metrics and labels depended on the
    batch. Constant padding (the default) pads every utterance's end alike."""
    torch.manual_seed(0)
    features = LogMelFeatures()
    short, long = torch.randn(1, 4000), torch.randn(1, 8000)
    alone, _ = features(short, torch.tensor([4000]))
    batch = torch.zeros(2, 8000)
    batch[0, :4000], batch[1] = short[0], long[0]
    batched, _ = features(batch, torch.tensor([4000, 8000]))
    torch.testing.assert_close(batched[0, : alone.shape[1]], alone[0], atol=1e-4, rtol=0)


def test_runs_from_before_the_pad_mode_keep_reflect_padding() -> None:
    """A saved config without ``features.pad_mode`` rebuilds the front end it was trained
    with (reflect); a new config gets constant, and a typo names the choices."""
    from omegaconf import OmegaConf

    from recipes.config import ConfigError, validate_config
    from recipes.frontend import build_features
    from tests.recipe_helpers import compose_config

    old = OmegaConf.create(
        {
            "sample_rate": 8000,
            "features": {"n_mels": 40, "n_fft": 256, "win_length": 200, "hop_length": 80},
        }
    )
    assert build_features(old).mel.spectrogram.pad_mode == "reflect"
    cfg = compose_config(["device=cpu"])
    assert build_features(cfg.data).mel.spectrogram.pad_mode == "constant"
    with pytest.raises(ConfigError, match="data.features.pad_mode='edge'.*constant, reflect"):
        validate_config(compose_config(["device=cpu", "data.features.pad_mode=edge"]))
