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
