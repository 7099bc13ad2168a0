"""Training-time augmentation on the device: speed perturbation, noise and SpecAugment.

FSDD has six speakers; a model trained on them alone learns their voices. Two cheap
perturbations of the waveform, applied to each training batch where it already is (GPU or
CPU), teach it to ignore who is speaking and in what room:

* **speed perturbation** (Kaldi/ESPnet/SpeechBrain recipes' 0.9/1.0/1.1): the batch is
  resampled as if it had been played faster or slower, which shifts pitch and formants
  (a crude vocal-tract-length change) and tempo together; one factor per batch, as
  ``torchaudio.transforms.SpeedPerturbation`` does (the batch keeps one shape);
* **additive noise** at a random signal-to-noise ratio per utterance, white or pink
  (1/f) noise synthesised on the fly: no noise corpus to download;
* **end cuts**: the end of a share of the utterances is cut off, as an eager endpointer (or
  a recording trimmed too tightly) cuts a word's final consonant. FSDD has such recordings:
  some of nicolas's "eight"s (all of those in the test and validation sets) end before the
  "t" burst, and a model that only heard whole "eight"s takes them for "six" or "three";
* **random channels**: a share of the utterances goes through a random smooth equaliser
  (a gain curve over frequency, up to ``channel_db`` up or down), as a different microphone
  or room would colour it. FSDD's speakers were recorded on different equipment: their
  average spectra differ by 10-15 dB above 2 kHz. It matters with
  ``data.features.normalize=utterance``; per-bin normalisation already removes most of a
  fixed channel (and some of what tells the digits apart with it).

and on the log-mel features, **vocal-tract-length perturbation** (VTLP, Jaitly & Hinton
2013: each utterance's mel axis stretched or squeezed by its own factor, which moves the
formants as a longer or shorter vocal tract would, without touching pitch or tempo) and
**SpecAugment** (frequency and time masks).

Gain is not perturbed: the log-mel front end normalises every utterance to zero mean and
unit variance (per mel band or over all bands, ``data.features.normalize``), so a gain change
does not reach the model.

Random draws come from torch's global generators (the CPU one for choices, the device's
for noise), which the ``Brain`` saves with every checkpoint: a resumed run draws the same
perturbations as an uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torchaudio
from omegaconf import DictConfig, OmegaConf

from amp_utils.autocast import fwd_default_precision


def pink_noise(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``[B, T]`` pink (1/f power) noise with unit variance per row, made in the FFT domain."""
    white = torch.randn(shape, device=device)
    spectrum = torch.fft.rfft(white, dim=-1)
    freqs = torch.arange(spectrum.shape[-1], device=device, dtype=white.dtype)
    spectrum = spectrum / freqs.clamp(min=1.0).sqrt()  # power ~ 1/f
    noise = torch.fft.irfft(spectrum, n=shape[-1], dim=-1)
    return noise / noise.std(dim=-1, keepdim=True).clamp(min=1e-8)


class WaveAugment(torch.nn.Module):
    """Speed perturbation, end cuts, random channels and noise for ``[B, T]`` padded waveforms.

    Identity in eval mode. Padding stays zero and the valid lengths follow the speed
    change, so the features and the CTC lengths of the perturbed batch stay right.

    Args:
        sample_rate: sample rate of the waveforms (Hz).
        speeds: speed factors to draw from, one per batch (``[1.0]``: off).
        noise_prob: probability that an utterance gets noise (0: off).
        snr_db: ``(low, high)`` range of the signal-to-noise ratio, drawn uniformly in dB.
        pink_share: share of noisy utterances that get pink instead of white noise.
        cut_end_prob: probability that an utterance's end is cut off (0: off).
        cut_end_max: largest share of an utterance's length that a cut removes; each cut
            removes a share drawn uniformly from ``[0, cut_end_max]``.
        channel_prob: probability that an utterance goes through a random channel (0: off).
        channel_db: widest gain of the random channel's equaliser, in dB up or down.
    """

    def __init__(
        self,
        sample_rate: int,
        speeds: Sequence[float] = (1.0,),
        noise_prob: float = 0.0,
        snr_db: Sequence[float] = (10.0, 30.0),
        pink_share: float = 0.5,
        cut_end_prob: float = 0.0,
        cut_end_max: float = 0.3,
        channel_prob: float = 0.0,
        channel_db: float = 10.0,
    ) -> None:
        super().__init__()
        speeds = [float(s) for s in speeds]
        if not speeds or any(not 0 < s < math.inf for s in speeds):
            raise ValueError(
                f"speeds must be positive factors such as [0.9, 1.0, 1.1]; got {speeds}."
            )
        if not 0.0 <= noise_prob <= 1.0 or not 0.0 <= pink_share <= 1.0:
            raise ValueError(
                f"noise_prob and pink_share must lie in [0, 1]; got {noise_prob} and {pink_share}."
            )
        if not 0.0 <= cut_end_prob <= 1.0 or not 0.0 <= cut_end_max < 1.0:
            raise ValueError(
                "cut_end_prob must lie in [0, 1] and cut_end_max in [0, 1); got "
                f"{cut_end_prob} and {cut_end_max}."
            )
        if not 0.0 <= channel_prob <= 1.0 or not 0 <= channel_db < math.inf:
            raise ValueError(
                "channel_prob must lie in [0, 1] and channel_db be >= 0; got "
                f"{channel_prob} and {channel_db}."
            )
        if len(snr_db) != 2 or not -math.inf < snr_db[0] <= snr_db[1] < math.inf:
            raise ValueError(
                f"snr_db must be [low, high] in dB with low <= high (finite); got {list(snr_db)}."
            )
        self.sample_rate = int(sample_rate)
        self.speeds = speeds
        self.noise_prob = float(noise_prob)
        self.snr_db = (float(snr_db[0]), float(snr_db[1]))
        self.pink_share = float(pink_share)
        self.cut_end_prob = float(cut_end_prob)
        self.cut_end_max = float(cut_end_max)
        self.channel_prob = float(channel_prob)
        self.channel_db = float(channel_db)
        self._source_rate = self.sample_rate  # of the last batch (speed 1: the same)
        self._kept_permille: torch.Tensor | None = None  # of the last batch's end cuts

    @property
    def enabled(self) -> bool:
        """Whether any perturbation is on."""
        return (
            self.speeds != [1.0]
            or self.noise_prob > 0
            or self.cut_end_prob > 0
            or (self.channel_prob > 0 and self.channel_db > 0)
        )

    @fwd_default_precision
    def forward(
        self, wavs: torch.Tensor, wav_lens: torch.Tensor, host_draws: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Perturbed ``(wavs, wav_lens)`` in training mode; the inputs in eval mode.

        In fp32 under autocast (``fwd_default_precision``), as the features are: the
        resampling convolution and the channel curve's matmul ran in bf16/fp16, so those runs
        trained on rounded audio (~52 dB SNR after a bf16 speed change) and compared with fp32
        on other data.

        ``host_draws=False`` draws the end cuts on the device: a step captured as a CUDA
        graph must not depend on host values (they would be frozen at the capture).
        """
        if not self.training or not self.enabled:
            return wavs, wav_lens
        wavs, wav_lens = self.perturb_speed(wavs, wav_lens)
        wavs, wav_lens = self.cut_ends(wavs, wav_lens, host_draws)
        if self.channel_prob > 0 and self.channel_db > 0:
            wavs = self.random_channel(wavs, wav_lens)
        if self.noise_prob > 0:
            wavs = self.add_noise(wavs, wav_lens)
        return wavs, wav_lens

    def perturb_speed(
        self, wavs: torch.Tensor, wav_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Resample the batch by one speed factor drawn from ``speeds``.

        With one factor nothing is drawn: a step captured as a CUDA graph reads no host
        values (a draw would be frozen at the capture), and warm-up steps and replays then
        leave the host's random stream alike.
        """
        if len(self.speeds) == 1:
            factor = self.speeds[0]
        else:
            factor = self.speeds[int(torch.randint(len(self.speeds), ()))]
        # Played ``factor`` times faster: the audio is read as sampled at sr * factor.
        self._source_rate = round(self.sample_rate * factor)
        if self._source_rate == self.sample_rate:
            return wavs, wav_lens
        out = torchaudio.functional.resample(wavs, self._source_rate, self.sample_rate)
        lens = self._speed_lengths(wav_lens).clamp(max=out.shape[-1])
        valid = torch.arange(out.shape[-1], device=out.device) < lens.to(out.device).unsqueeze(1)
        return out * valid, lens

    def cut_ends(
        self, wavs: torch.Tensor, wav_lens: torch.Tensor, host_draws: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cut off the end of a random share ``cut_end_prob`` of the utterances.

        The shares kept are drawn on the host (in permille, so that the device and a host
        copy of the lengths compute the same new lengths in integer arithmetic, and no step
        waits for the device), or with ``host_draws=False`` on the device (a captured step;
        it has no host copy of the lengths); the cut samples become padding.
        """
        self._kept_permille = None
        if self.cut_end_prob <= 0:
            return wavs, wav_lens
        batch = wavs.shape[0]
        draw_on = torch.device("cpu") if host_draws else wavs.device
        cut = torch.rand(batch, device=draw_on) < self.cut_end_prob
        share = torch.rand(batch, device=draw_on) * self.cut_end_max * 1000
        share = torch.floor(share).to(torch.int64)
        self._kept_permille = torch.where(cut, 1000 - share, torch.full_like(share, 1000))
        kept = self._kept_permille
        if host_draws and wavs.device.type == "cuda":
            kept = kept.pin_memory()
        lens = self._cut_lengths(wav_lens, kept.to(wavs.device, non_blocking=True))
        valid = torch.arange(wavs.shape[-1], device=wavs.device) < lens.unsqueeze(1)
        return wavs * valid, lens

    @staticmethod
    def _cut_lengths(wav_lens: torch.Tensor, kept_permille: torch.Tensor) -> torch.Tensor:
        """``wav_lens`` after end cuts keeping ``kept_permille`` of each (at least 1 sample)."""
        return (wav_lens * kept_permille // 1000).clamp(min=1).to(wav_lens.dtype)

    def _speed_lengths(self, wav_lens: torch.Tensor) -> torch.Tensor:
        """``wav_lens`` after the last batch's speed change alone (not its end cuts)."""
        if self._source_rate == self.sample_rate:
            return wav_lens
        lens = torch.ceil(wav_lens.to(torch.float64) * self.sample_rate / self._source_rate)
        return lens.to(wav_lens.dtype)

    def lengths_after(self, wav_lens: torch.Tensor) -> torch.Tensor:
        """Lengths of waveforms of ``wav_lens`` samples after the last batch's speed change
        and end cuts.

        For copies of the lengths kept elsewhere (e.g. on the host, to compute CTC lengths
        without waiting for the device).
        """
        wav_lens = self._speed_lengths(wav_lens)
        if self._kept_permille is not None:
            wav_lens = self._cut_lengths(wav_lens, self._kept_permille.to(wav_lens.device))
        return wav_lens

    def random_channel(self, wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        """Filter a random share ``channel_prob`` of the utterances through random channels.

        Each channel is a smooth gain curve over frequency, in dB: three cosines of the
        frequency axis (0 to Nyquist) with random signs and sizes, the slower ones larger
        (a tilt, then broad bumps), never beyond ``channel_db`` up or down. It is applied
        in the FFT domain of the whole padded utterance; padding stays zero.
        """
        batch, length = wavs.shape
        device = wavs.device
        orders = torch.arange(1, 4, device=device, dtype=torch.float32)  # [3]
        weights = (1.0 / orders) / (1.0 / orders).sum()  # |curve| <= channel_db
        coef = (2.0 * torch.rand(batch, 3, device=device) - 1.0) * weights * self.channel_db
        coef = coef * (torch.rand(batch, 1, device=device) < self.channel_prob)
        spectrum = torch.fft.rfft(wavs.float(), dim=-1)  # [B, length // 2 + 1]
        freqs = torch.linspace(0.0, 1.0, spectrum.shape[-1], device=device)
        curve_db = coef @ torch.cos(torch.pi * orders.unsqueeze(1) * freqs.unsqueeze(0))
        filtered = torch.fft.irfft(spectrum * 10.0 ** (curve_db / 20.0), n=length, dim=-1)
        valid = torch.arange(length, device=device) < wav_lens.to(device).unsqueeze(1)
        return (filtered * valid).to(wavs.dtype)

    def add_noise(self, wavs: torch.Tensor, wav_lens: torch.Tensor) -> torch.Tensor:
        """Add white or pink noise at a random SNR to a random share of the utterances."""
        batch, length = wavs.shape
        device = wavs.device
        valid = torch.arange(length, device=device) < wav_lens.to(device).unsqueeze(1)
        count = valid.sum(dim=1, keepdim=True).clamp(min=1)
        signal_power = (wavs.float().pow(2) * valid).sum(dim=1, keepdim=True) / count
        low, high = self.snr_db
        snr = low + (high - low) * torch.rand(batch, 1, device=device)
        noisy = torch.rand(batch, 1, device=device) < self.noise_prob
        pink = torch.rand(batch, 1, device=device) < self.pink_share
        noise = torch.where(
            pink, pink_noise((batch, length), device), torch.randn(batch, length, device=device)
        )
        noise_power = (noise.pow(2) * valid).sum(dim=1, keepdim=True) / count
        scale = torch.sqrt(signal_power / (10.0 ** (snr / 10.0) * noise_power.clamp(min=1e-12)))
        scale = scale * noisy
        return (wavs.float() + noise * scale * valid).to(wavs.dtype)


def vtlp_source_bins(num_bins: int, factors: torch.Tensor, boundary: float = 0.8) -> torch.Tensor:
    """``[B, num_bins]`` positions on the input mel axis that each output bin reads.

    VTLP's piecewise-linear warp of the frequency axis: ``f -> factor * f`` up to a boundary
    frequency, then a straight line that maps the top bin to itself, so that no band leaves
    the axis. This is its inverse, for reading the warped features from the input ones.

    Args:
        num_bins: mel bins.
        factors: ``[B]`` warp factors (> 1 moves formants up, as a shorter vocal tract).
        boundary: share of the axis up to which the warp is a plain scaling.
    """
    top = float(num_bins - 1)
    factors = factors.unsqueeze(1)
    knee = boundary * top * torch.clamp(1.0 / factors, max=1.0)  # input position of the knee
    out = torch.arange(num_bins, device=factors.device, dtype=factors.dtype).unsqueeze(0)
    below = out / factors
    above = knee + (out - factors * knee) * (top - knee) / (top - factors * knee)
    return torch.where(out <= factors * knee, below, above).clamp(0.0, top)


def vtlp(feats: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """``[B, frames, n_mels]`` features with each utterance's mel axis warped by its factor
    (linear interpolation between neighbouring bins)."""
    source = vtlp_source_bins(feats.shape[-1], factors.to(torch.float32))
    low = source.floor().long()
    high = (low + 1).clamp(max=feats.shape[-1] - 1)
    weight = (source - low).unsqueeze(1).to(feats.dtype)  # [B, 1, n_mels]
    index = lambda bins: bins.unsqueeze(1).expand(-1, feats.shape[1], -1)  # noqa: E731
    gathered_low = feats.gather(2, index(low))
    return gathered_low + weight * (feats.gather(2, index(high)) - gathered_low)


class SpecAugment(torch.nn.Module):
    """Frequency and time masking of ``[B, frames, n_mels]`` features, in training only.

    Masks are drawn independently per utterance. Masked values are set to 0, the mean of
    normalised features. Given the utterances' lengths in frames, time masks fall inside
    each utterance, as torchaudio's ``TimeMasking`` draws them over a whole spectrogram:
    drawn over the padded batch, a short utterance's masks would land in its padding (more
    so with ``data.pad_to_buckets``, the CUDA default), and it would be masked less.

    Args:
        freq_mask: widest frequency mask, in mel bins.
        time_mask: widest time mask, in frames.
        n_freq_masks: number of frequency masks.
        n_time_masks: number of time masks.
        freq_warp: VTLP's widest warp: factors drawn uniformly from
            ``[1 - freq_warp, 1 + freq_warp]`` per utterance (0: off), before the masks.
    """

    def __init__(
        self,
        freq_mask: int = 8,
        time_mask: int = 20,
        n_freq_masks: int = 2,
        n_time_masks: int = 2,
        freq_warp: float = 0.0,
    ) -> None:
        super().__init__()
        if min(freq_mask, time_mask, n_freq_masks, n_time_masks) < 0:
            raise ValueError(  # torchaudio draws no mask of a negative width: silently off
                "freq_mask, time_mask, n_freq_masks and n_time_masks must be >= 0 (0: no "
                f"masks); got {freq_mask}, {time_mask}, {n_freq_masks} and {n_time_masks}."
            )
        if not 0.0 <= freq_warp < 0.5:
            raise ValueError(
                f"freq_warp must lie in [0, 0.5) (e.g. 0.1; 0 turns it off); got {freq_warp}."
            )
        self.freq_warp = float(freq_warp)
        self.n_freq_masks = n_freq_masks
        self.n_time_masks = n_time_masks
        self.time_mask = int(time_mask)
        self.freq_masking = torchaudio.transforms.FrequencyMasking(freq_mask, iid_masks=True)
        self.time_masking = torchaudio.transforms.TimeMasking(time_mask, iid_masks=True)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Masked copy of ``feats`` in training mode; ``feats`` itself in eval mode.

        ``feat_lens``: each utterance's valid frames (``[B]``); None: the whole padded
        length is the utterance's.
        """
        if not self.training:
            return feats
        if self.freq_warp > 0:
            draws = torch.rand(feats.shape[0], device=feats.device)
            feats = vtlp(feats, 1.0 + self.freq_warp * (2.0 * draws - 1.0))
        spec = feats.transpose(1, 2).unsqueeze(1)  # [B, 1, n_mels, frames]
        for _ in range(self.n_freq_masks):
            spec = self.freq_masking(spec)
        if feat_lens is None:
            for _ in range(self.n_time_masks):
                spec = self.time_masking(spec)
            return spec.squeeze(1).transpose(1, 2)
        feats = spec.squeeze(1).transpose(1, 2)
        for _ in range(self.n_time_masks):
            feats = self.mask_time(feats, feat_lens)
        return feats

    def mask_time(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> torch.Tensor:
        """One time mask per utterance inside its ``feat_lens`` frames: torchaudio's draw
        (width ``U[0, time_mask)``, start uniform over where it fits), over the utterance's
        own length instead of the padded one."""
        batch, frames = feats.shape[:2]
        lengths = feat_lens.to(device=feats.device, dtype=torch.float32)
        width = torch.rand(batch, device=feats.device) * self.time_mask
        start = (torch.rand(batch, device=feats.device) * (lengths - width).clamp(min=0)).long()
        end = start + width.long()
        index = torch.arange(frames, device=feats.device).unsqueeze(0)
        masked = (index >= start.unsqueeze(1)) & (index < end.unsqueeze(1))  # [B, frames]
        return feats.masked_fill(masked.unsqueeze(-1), 0.0)


def build_augment(data_cfg: DictConfig) -> SpecAugment | None:
    """SpecAugment as configured in ``data.spec_augment``, or None when it is off."""
    aug = data_cfg.spec_augment
    if not aug.enabled:
        return None
    return SpecAugment(
        aug.freq_mask,
        aug.time_mask,
        aug.n_freq_masks,
        aug.n_time_masks,
        freq_warp=OmegaConf.select(aug, "freq_warp", default=0.0),
    )


def build_wave_augment(data_cfg: DictConfig) -> WaveAugment | None:
    """Waveform augmentation as configured in ``data.wave_augment``, or None when it is off."""
    aug = data_cfg.wave_augment
    module = WaveAugment(
        data_cfg.sample_rate,
        speeds=list(aug.speeds),
        noise_prob=aug.noise_prob,
        snr_db=list(aug.snr_db),
        pink_share=aug.pink_share,
        cut_end_prob=OmegaConf.select(aug, "cut_end_prob", default=0.0),
        cut_end_max=OmegaConf.select(aug, "cut_end_max", default=0.3),
        channel_prob=OmegaConf.select(aug, "channel_prob", default=0.0),
        channel_db=OmegaConf.select(aug, "channel_db", default=10.0),
    )
    return module if module.enabled else None
