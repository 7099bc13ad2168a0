"""The device-side front end of every model: log-mel features.

``LogMelFeatures`` is an ``nn.Module`` that runs on the device, inside the training step and
under its autocast, so it lives with the models rather than with the data loading
(``data/`` yields waveforms); training-time augmentation is in ``recipes/augment.py``.
Features are computed in float32 even under autocast (``fwd_default_precision``): the
power spectrum and its log overflow or lose all precision in fp16, and they are cheap next
to the model.
"""

from __future__ import annotations

import torch
import torchaudio
from omegaconf import DictConfig

from amp_utils.autocast import fwd_default_precision

#: How ``LogMelFeatures`` normalises each utterance (``data.features.normalize``).
NORMALIZATIONS: tuple[str, ...] = ("per_bin", "utterance")
#: How the centred STFT pads the batch's ends (``data.features.pad_mode``).
PAD_MODES: tuple[str, ...] = ("constant", "reflect")
#: What runs from before the option used (torchaudio's default).
LEGACY_PAD_MODE = "reflect"


class LogMelFeatures(torch.nn.Module):
    """``[B, T]`` waveforms to normalised log-mel frames ``[B, frames, n_mels]``.

    Each utterance is normalised over its valid frames only (padding would bias the
    statistics of short utterances); padded frames are set to zero. Two ways:

    * ``per_bin``: zero mean and unit variance per mel bin (cepstral mean and variance
      normalisation). It removes a fixed channel (microphone) response, but on a single word
      the mean over time of a bin is mostly the word's own average spectrum, so it also
      removes much of what tells one vowel from another.
    * ``utterance``: one mean and one variance over all bins and frames. It removes the
      level only and keeps the spectral shape (vowel identity and the channel with it).

    Args:
        sample_rate: audio sample rate in Hz.
        n_fft: FFT size.
        win_length: window length in samples (25 ms at 8 kHz).
        hop_length: hop in samples (10 ms at 8 kHz).
        n_mels: number of mel bins.
        normalize: ``per_bin`` or ``utterance`` (above).
        pad_mode: how the centred STFT pads the ends of the padded batch. ``constant``
            (zeros) gives an utterance the same features alone and in any batch: with
            ``reflect`` (torchaudio's default) the batch's longest utterance ends on
            mirrored samples and the others on their zero padding, so one frame (and the
            normalisation statistics with it) depended on the batch.
    """

    def __init__(
        self,
        sample_rate: int = 8000,
        n_fft: int = 256,
        win_length: int = 200,
        hop_length: int = 80,
        n_mels: int = 40,
        normalize: str = "per_bin",
        pad_mode: str = "constant",
    ) -> None:
        super().__init__()
        if normalize not in NORMALIZATIONS:
            raise ValueError(
                f"Unknown feature normalisation {normalize!r}: choose one of "
                f"{', '.join(NORMALIZATIONS)} (data.features.normalize)."
            )
        self.normalize = normalize
        self.hop_length = hop_length
        self.n_mels = n_mels
        self.mel = torchaudio.transforms.MelSpectrogram(
            sample_rate=sample_rate,
            n_fft=n_fft,
            win_length=win_length,
            hop_length=hop_length,
            n_mels=n_mels,
            center=True,
            pad_mode=pad_mode,
        )

    def frame_lengths(self, wav_lens: torch.Tensor) -> torch.Tensor:
        """Number of valid frames for waveforms of ``wav_lens`` samples (centred STFT)."""
        return torch.div(wav_lens, self.hop_length, rounding_mode="floor") + 1

    @fwd_default_precision
    def forward(
        self, wavs: torch.Tensor, wav_lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute features.

        Args:
            wavs: ``[B, T]`` float waveforms, zero-padded.
            wav_lens: ``[B]`` valid samples per waveform.

        Returns:
            ``(features [B, frames, n_mels] float32, frame_lens [B] int64)``.
        """
        feats = torch.log(self.mel(wavs) + 1e-6).transpose(1, 2)  # [B, frames, n_mels]
        frame_lens = self.frame_lengths(wav_lens.to(feats.device)).clamp(max=feats.shape[1])
        frames = torch.arange(feats.shape[1], device=feats.device)
        mask = (frames.unsqueeze(0) < frame_lens.unsqueeze(1)).unsqueeze(-1)  # [B, F, 1]
        # Statistics over the valid frames (dim 1), and over the bins too for "utterance".
        dims, bins = ((1,), 1) if self.normalize == "per_bin" else ((1, 2), feats.shape[2])
        count = frame_lens.view(-1, 1, 1).to(feats.dtype) * bins
        mean = (feats * mask).sum(dim=dims, keepdim=True) / count
        var = (((feats - mean) * mask) ** 2).sum(dim=dims, keepdim=True) / count
        feats = (feats - mean) / torch.sqrt(var + 1e-5)
        return feats * mask, frame_lens.to(torch.int64)


def build_features(data_cfg: DictConfig) -> LogMelFeatures:
    """Log-mel front end of the configured data set (``data.sample_rate``, ``data.features``)."""
    f = data_cfg.features
    return LogMelFeatures(
        sample_rate=data_cfg.sample_rate,
        n_fft=f.n_fft,
        win_length=f.win_length,
        hop_length=f.hop_length,
        n_mels=f.n_mels,
        normalize=f.get("normalize", "per_bin"),
        pad_mode=f.get("pad_mode", LEGACY_PAD_MODE),  # older runs: as they were trained
    )
