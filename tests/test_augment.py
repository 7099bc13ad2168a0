"""Waveform augmentation: speed perturbation and noise keep lengths, padding and SNR right."""

from __future__ import annotations

import math

import pytest
import torch

from recipes.augment import SpecAugment, WaveAugment, pink_noise, vtlp, vtlp_source_bins

SR = 8000


def _batch(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(max(lengths)) / SR
    wavs = torch.stack([torch.sin(2 * math.pi * 440 * t) for _ in lengths])
    lens = torch.tensor(lengths)
    wavs = wavs * (torch.arange(max(lengths)) < lens.unsqueeze(1))
    return wavs, lens


def test_eval_mode_and_defaults_leave_the_batch_untouched() -> None:
    wavs, lens = _batch([8000, 4000])
    aug = WaveAugment(SR, speeds=[1.1], noise_prob=1.0).eval()
    out, out_lens = aug(wavs, lens)
    assert out is wavs and out_lens is lens
    off = WaveAugment(SR).train()
    assert not off.enabled
    out, out_lens = off(wavs, lens)
    assert out is wavs and out_lens is lens


@pytest.mark.parametrize("factor", [0.9, 1.1])
def test_speed_changes_lengths_pitch_and_keeps_padding_zero(factor: float) -> None:
    wavs, lens = _batch([8000, 4000])
    out, out_lens = WaveAugment(SR, speeds=[factor]).train()(wavs, lens)
    expected = [math.ceil(n / factor) for n in lens.tolist()]
    assert out_lens.tolist() == expected
    assert out.shape[1] >= max(expected)
    assert out[1, expected[1] :].abs().max() == 0  # padding stays silent
    # The 440 Hz tone is now at 440 * factor Hz (pitch moves with speed).
    spectrum = torch.fft.rfft(out[0, : expected[0]]).abs()
    peak_hz = spectrum.argmax().item() * SR / expected[0]
    assert peak_hz == pytest.approx(440 * factor, rel=0.01)


def test_one_speed_per_batch_drawn_from_the_global_generator() -> None:
    wavs, lens = _batch([8000])
    aug = WaveAugment(SR, speeds=[0.9, 1.0, 1.1]).train()
    torch.manual_seed(0)
    draws = [aug(wavs, lens)[1].item() for _ in range(30)]
    assert set(draws) == {math.ceil(8000 / f) for f in (0.9, 1.0, 1.1)}
    torch.manual_seed(0)
    assert [aug(wavs, lens)[1].item() for _ in range(30)] == draws  # seeded: resumable


@pytest.mark.parametrize("pink_share", [0.0, 1.0])
def test_noise_reaches_the_drawn_snr_on_valid_samples_only(pink_share: float) -> None:
    wavs, lens = _batch([16000, 8000])
    aug = WaveAugment(SR, noise_prob=1.0, snr_db=(20.0, 20.0), pink_share=pink_share).train()
    torch.manual_seed(1)
    out, out_lens = aug(wavs, lens)
    assert torch.equal(out_lens, lens)
    assert out[1, 8000:].abs().max() == 0
    for row, n in enumerate(lens.tolist()):
        noise = out[row, :n] - wavs[row, :n]
        snr = 10 * math.log10(wavs[row, :n].pow(2).mean() / noise.pow(2).mean())
        assert snr == pytest.approx(20.0, abs=0.5)


def test_noise_probability_spares_the_other_utterances() -> None:
    wavs, lens = _batch([8000] * 64)
    torch.manual_seed(2)
    out, _ = WaveAugment(SR, noise_prob=0.25).train()(wavs, lens)
    noisy = (out - wavs).abs().amax(dim=1) > 0
    assert 4 <= int(noisy.sum()) <= 30


def test_pink_noise_has_more_power_at_low_frequencies() -> None:
    torch.manual_seed(3)
    noise = pink_noise((4, 16000), torch.device("cpu"))
    power = torch.fft.rfft(noise).abs().pow(2).mean(dim=0)
    assert power[10:100].mean() > 10 * power[4000:6000].mean()
    assert noise.std(dim=1) == pytest.approx(torch.ones(4), rel=1e-3)


def test_bad_settings_fail_with_the_fix() -> None:
    with pytest.raises(ValueError, match="speeds"):
        WaveAugment(SR, speeds=[0.0])
    with pytest.raises(ValueError, match="snr_db"):
        WaveAugment(SR, snr_db=(30.0, 10.0))
    with pytest.raises(ValueError, match="noise_prob"):
        WaveAugment(SR, noise_prob=2.0)
    with pytest.raises(ValueError, match="cut_end_max"):
        WaveAugment(SR, cut_end_prob=0.5, cut_end_max=1.0)


def test_end_cuts_shorten_a_share_of_the_utterances_and_the_host_lengths_agree() -> None:
    """A cut keeps the start of an utterance, silences the rest, and a host copy of the
    lengths (read for the CTC lengths without waiting for the device) gets the same ones."""
    wavs, lens = _batch([8000] * 63 + [3])
    aug = WaveAugment(SR, cut_end_prob=0.5, cut_end_max=0.4).train()
    assert aug.enabled
    torch.manual_seed(4)
    out, out_lens = aug(wavs, lens)
    assert torch.equal(aug.lengths_after(lens.clone()), out_lens)
    cut = out_lens < lens
    assert 16 <= int(cut.sum()) <= 48  # about half
    assert (out_lens >= (0.6 * lens).floor()).all() and (out_lens >= 1).all()
    for row, n in enumerate(out_lens.tolist()):
        assert torch.equal(out[row, :n], wavs[row, :n])  # the start is untouched
        assert out[row, n:].abs().sum() == 0  # the cut part is padding
    torch.manual_seed(4)
    assert torch.equal(aug(wavs, lens)[1], out_lens)  # seeded by the global generator


def test_end_cuts_follow_a_speed_change_in_the_host_lengths() -> None:
    wavs, lens = _batch([8000, 6000])
    aug = WaveAugment(SR, speeds=[1.1], cut_end_prob=1.0, cut_end_max=0.3).train()
    torch.manual_seed(5)
    _, out_lens = aug(wavs, lens)
    assert torch.equal(aug.lengths_after(lens), out_lens)
    sped = [math.ceil(n / 1.1) for n in lens.tolist()]
    assert all(0.7 * s - 1 <= n <= s for n, s in zip(out_lens.tolist(), sped, strict=True))


def test_a_speed_change_ignores_the_previous_batchs_end_cuts() -> None:
    """perturb_speed computed its lengths with lengths_after, which also applied the
    previous batch's end cuts: shortened lengths (the CTC loss then saw other lengths than
    the host's) and, for a batch of another size, a size-mismatch error. The README's
    speed-perturbation command (with the Conformer's cut_end_prob 0.3) ran into it."""
    torch.manual_seed(0)
    aug = WaveAugment(8000, speeds=[1.1], cut_end_prob=1.0, cut_end_max=0.5).train()
    aug(torch.randn(4, 8000), torch.full((4,), 8000))  # a batch with end cuts
    _, lens = aug.perturb_speed(torch.randn(4, 8000), torch.full((4,), 8000))
    assert lens.tolist() == [math.ceil(8000 / 1.1)] * 4
    wavs, lens = aug(torch.randn(3, 8000), torch.full((3,), 8000))  # another batch size
    host = aug.lengths_after(torch.full((3,), 8000))
    assert torch.equal(lens, host) and wavs.shape[0] == 3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wave_augmentation_computes_in_fp32_under_autocast(dtype) -> None:
    """bf16/fp16 runs must augment the same audio as fp32 runs: the resampling convolution
    and the channel curve's matmul ran in the autocast dtype (~52 dB SNR after a bf16 speed
    change), so the precision comparison trained on different data."""
    aug = WaveAugment(SR, speeds=[0.9], channel_prob=1.0, channel_db=6.0).train()
    wavs, lens = _batch([8000, 6000])
    torch.manual_seed(3)
    expected, expected_lens = aug(wavs, lens)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=dtype):
        out, out_lens = aug(wavs, lens)
    assert out.dtype == torch.float32 and torch.equal(out_lens, expected_lens)
    torch.testing.assert_close(out, expected)


def test_vtlp_with_factor_one_is_the_identity() -> None:
    feats = torch.randn(3, 20, 40)
    assert torch.equal(vtlp(feats, torch.ones(3)), feats)


@pytest.mark.parametrize(("factor", "moved_to"), [(1.2, 12), (0.8, 8)])
def test_vtlp_moves_a_formant_by_its_factor(factor: float, moved_to: int) -> None:
    """A peak at bin 10 of 40 (below the knee) lands at 10 x factor: a shorter vocal tract
    (factor > 1) raises the formants, a longer one lowers them."""
    feats = torch.zeros(1, 5, 40)
    feats[..., 10] = 1.0
    warped = vtlp(feats, torch.tensor([factor]))
    assert int(warped[0, 0].argmax()) == moved_to
    assert torch.equal(warped[0, 0], warped[0, 4])  # every frame the same way


def test_vtlp_keeps_the_axis_ends_and_order() -> None:
    factors = torch.tensor([0.7, 0.9, 1.1, 1.3])
    source = vtlp_source_bins(40, factors)
    assert torch.all(source[:, 0] == 0) and torch.allclose(source[:, -1], torch.tensor(39.0))
    assert torch.all(source[:, 1:] >= source[:, :-1])  # no band overtakes another


def test_spec_augment_warps_each_utterance_reproducibly_in_training_only() -> None:
    augment = SpecAugment(freq_mask=0, time_mask=0, n_freq_masks=0, n_time_masks=0, freq_warp=0.2)
    feats = torch.randn(4, 30, 40)
    torch.manual_seed(7)
    first = augment(feats)
    torch.manual_seed(7)  # the global generator, which checkpoints save
    assert torch.equal(augment(feats), first)
    assert all(not torch.equal(first[i], feats[i]) for i in range(4))
    assert torch.equal(augment.eval()(feats), feats)


def test_vtlp_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match=r"freq_warp must lie in \[0, 0.5\)"):
        SpecAugment(freq_warp=0.6)


def test_random_channel_is_a_smooth_bounded_equaliser_that_keeps_padding_and_lengths() -> None:
    torch.manual_seed(0)
    noise = torch.randn(4, 8000)
    aug = WaveAugment(SR, channel_prob=1.0, channel_db=10.0).train()
    assert aug.enabled
    out, lens = aug(noise, torch.full((4,), 8000))
    assert lens.tolist() == [8000] * 4
    gain_db = 20 * torch.log10(torch.fft.rfft(out).abs() / torch.fft.rfft(noise).abs())
    assert gain_db.abs().max() <= 10.0 + 1e-3  # never beyond channel_db
    assert (gain_db.amax(1) - gain_db.amin(1)).min() > 1.0  # each utterance coloured
    assert (gain_db.diff(dim=1).abs().max()) < 0.1  # smooth: no step between FFT bins
    assert not torch.allclose(gain_db[0], gain_db[1])  # each its own channel
    wavs, lens = _batch([8000, 4000])
    out, out_lens = aug(wavs, lens)
    assert torch.equal(out_lens, lens) and not out[1, 4000:].any()


def test_random_channel_share_and_range_checks() -> None:
    torch.manual_seed(0)
    noise = torch.randn(200, 800)
    aug = WaveAugment(SR, channel_prob=0.3, channel_db=6.0).train()
    out, _ = aug(noise, torch.full((200,), 800))
    changed = (out - noise).abs().amax(1) > 1e-4
    assert 40 <= int(changed.sum()) <= 80  # ~30 % of 200
    assert not WaveAugment(SR, channel_prob=0.5, channel_db=0.0).enabled
    for prob, db in ((1.5, 10.0), (0.5, -1.0)):
        with pytest.raises(ValueError, match="channel_prob .* channel_db"):
            WaveAugment(SR, channel_prob=prob, channel_db=db)


def test_time_masks_fall_inside_each_utterance_not_in_its_padding() -> None:
    """A 50-frame utterance padded to 400 frames (pad_to_buckets pads to bucket edges):
    drawn over the padded length, its masks mostly landed in the padding, and it was
    masked about 8x less than the same utterance alone."""
    torch.manual_seed(0)
    augment = SpecAugment(freq_mask=0, time_mask=20, n_freq_masks=0, n_time_masks=2).train()
    lengths = torch.tensor([50, 400, 5])
    shares, padding_masked = [], 0
    for _ in range(200):
        feats = torch.ones(3, 400, 4)
        feats[0, 50:] = 0.0  # padding is zeros, as the front end leaves it
        feats[2, 5:] = 0.0
        out = augment(feats, lengths)
        masked = (out == 0).all(dim=-1)  # [B, frames]
        shares.append(masked[0, :50].float().mean().item())
        padding_masked += int((out[0, 50:] != 0).any()) + int((out[2, 5:] != 0).any())
    assert padding_masked == 0
    # two masks of U[0, 20) frames: ~2 x 9.5 of 50 frames, less their overlaps
    assert 0.25 < sum(shares) / len(shares) < 0.4
    unmasked = augment(torch.ones(3, 400, 4), lengths)  # the 400-frame one is masked too
    assert (unmasked[1] == 0).all(dim=-1).any()
