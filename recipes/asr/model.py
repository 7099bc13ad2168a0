"""A small Conformer-CTC acoustic model and its fp32 CTC helpers.

The encoder is written here rather than taken from ``torchaudio.models.Conformer`` because
that module's backward fails under ``torch.compile``. Everything in ``forward`` is plain
tensor arithmetic on shapes and lengths (no ``.item()``, no branches on tensor values), so
the model traces with ``torch.compile(dynamic=True)`` and runs under fp16/bf16 autocast.

Padding never leaks into valid frames: the front end's output lengths follow exactly from
the convolution arithmetic, attention masks padded keys, and the convolution module zeroes
padded frames before its depthwise convolution. A padded batch therefore gives the same
valid outputs as each utterance on its own (in eval mode).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_utils import fast_kernels
from amp_utils.autocast import fwd_default_precision
from amp_utils.fast_kernels import scaled_dot_product_attention


def _length_mask(lengths: Tensor, max_len: int) -> Tensor:
    """Boolean ``[B, max_len]`` mask, True on valid frames."""
    positions = torch.arange(max_len, device=lengths.device)
    return positions.unsqueeze(0) < lengths.unsqueeze(1)


class Conv2dSubsampling(nn.Module):
    """Stride-2 3x3 convolutions (no padding) over time and mel bins, then a linear layer.

    Each convolution maps ``n`` frames to ``(n - 1) // 2``; without padding, every valid
    output frame sees only valid input frames, so padding cannot change it.

    Args:
        n_mels: number of mel bins of the input features.
        d_model: output feature size.
        subsampling: total time reduction, a power of two (one convolution per factor 2).
    """

    def __init__(self, n_mels: int, d_model: int, subsampling: int = 4) -> None:
        super().__init__()
        num_convs = int(math.log2(subsampling)) if subsampling >= 2 else 0
        if 2**num_convs != subsampling or num_convs < 1:
            raise ValueError(f"subsampling must be a power of two >= 2, got {subsampling}")
        layers: list[nn.Module] = []
        freq = n_mels
        in_channels = 1
        for _ in range(num_convs):
            # fp32 on a CPU under fp16: oneDNN's fp16 convs crawl there (fast_kernels)
            conv = fast_kernels.Conv2d(in_channels, d_model, kernel_size=3, stride=2)
            layers += [conv, nn.ReLU()]
            in_channels = d_model
            freq = (freq - 1) // 2
        if freq < 1:
            raise ValueError(f"n_mels={n_mels} is too small for subsampling={subsampling}")
        self.num_convs = num_convs
        self.convs = nn.Sequential(*layers)
        self.out = ConvFeatureLinear(d_model, freq, d_model)

    def output_lengths(self, lengths: Tensor) -> Tensor:
        """Number of valid output frames for ``lengths`` valid input frames (>= 0)."""
        for _ in range(self.num_convs):
            lengths = torch.div(lengths - 1, 2, rounding_mode="floor")
        return lengths.clamp(min=0)

    def forward(self, feats: Tensor, feat_lens: Tensor) -> tuple[Tensor, Tensor]:
        """Subsample ``[B, T, n_mels]`` features to ``[B, T', d_model]`` and their lengths."""
        *layers, last_relu = self.convs
        # On a CPU (eager) the convolutions run channels-last, oneDNN's fast layout: their
        # input is [B, T, n_mels] viewed as [B, 1, T, n_mels] with unit channel stride, so
        # their outputs are stored as [B, T', F', C] and flattening each frame is a view.
        # Elsewhere (CUDA, torch.compile) the layout of torch's defaults, as measured there.
        channels_last = feats.device.type == "cpu" and not torch.compiler.is_compiling()
        frames = torch.arange(feats.shape[1], device=feats.device).view(-1, 1)
        if channels_last:
            valid = frames < feat_lens.view(-1, 1, 1)  # [B, T, 1]
            x = feats.masked_fill(~valid, 0.0).unsqueeze(-1).permute(0, 3, 1, 2)
        else:
            # Zero the padding (valid outputs never see it) in a computed tensor, not a view:
            # inductor (torch 2.11) once failed on a one-channel view's strides under dynamic
            # shapes. The computed tensor failed the same way on the CPU until
            # amp_utils.compile.compile_options turned inductor's layout optimisation off.
            valid = frames < feat_lens.view(-1, 1, 1, 1)  # [B, 1, T, 1]
            x = feats.unsqueeze(1).masked_fill(~valid, 0.0)
        for layer in layers:
            x = layer(x)  # [B, C, T', F'] after the last convolution
        batch, channels, out_frames, freq = x.shape
        if channels_last:  # features in [F', C] order; self.out permutes its weight to match
            x = x.permute(0, 2, 3, 1).reshape(batch, out_frames, freq * channels)
        else:
            x = x.transpose(1, 2).reshape(batch, out_frames, channels * freq)
        # The last ReLU after the reshape (elementwise, so the same values): its backward then
        # gets a contiguous gradient. Before it, the gradient arrived transposed, and the bf16
        # ReLU backward took 10 ms on a CPU instead of 1.5 ms (a slow strided kernel).
        x = self.out(last_relu(x), channels_last=channels_last)
        return x, self.output_lengths(feat_lens)


class ConvFeatureLinear(nn.Linear):
    """``nn.Linear`` over conv features ``[C, F]`` flattened per frame, which also accepts
    them flattened in ``[F, C]`` order, as channels-last convolutions store them.

    With ``channels_last=True`` the weight's input columns are permuted to ``[F, C]``
    (``out_features x C*F``, small) instead of the features (``[B, T', F', C]``, large, and
    again in the backward). Parameters and state-dict keys are those of ``nn.Linear`` with
    ``[C, F]`` columns, so checkpoints do not depend on the layout a run used.

    Args:
        channels: conv channels ``C``.
        freq: conv output bins ``F``.
        out_features: output size.
    """

    def __init__(self, channels: int, freq: int, out_features: int) -> None:
        super().__init__(channels * freq, out_features)
        self.channels = channels
        self.freq = freq

    def forward(self, input: Tensor, channels_last: bool = False) -> Tensor:  # noqa: A002
        """Project ``[..., C*F]`` features (``[..., F*C]`` with ``channels_last``)."""
        if not channels_last:
            return super().forward(input)
        weight = self.weight.view(-1, self.channels, self.freq).transpose(1, 2)
        return F.linear(input, weight.reshape(self.out_features, -1), self.bias)


class FeedForward(nn.Module):
    """Pre-LayerNorm feed-forward module with SiLU (Conformer's macaron half)."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(d_model),
            nn.Linear(d_model, ffn_dim),
            nn.SiLU(),
            fast_kernels.Dropout(dropout),
            nn.Linear(ffn_dim, d_model),
            fast_kernels.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the module to ``[B, T, d_model]``."""
        return self.net(x)


class SelfAttention(nn.Module):
    """Pre-LayerNorm multi-head self-attention over ``scaled_dot_product_attention``.

    Args:
        d_model: feature size.
        num_heads: number of heads; must divide ``d_model``.
        dropout: dropout on the attention output.

    There is no dropout on the attention weights: ``scaled_dot_product_attention`` with
    ``dropout_p > 0`` fails to compile under inductor with dynamic shapes on CUDA (torch
    2.11, ``CantSplit`` in the lowering), and output dropout regularizes enough here.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        self.num_heads = num_heads
        self.norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.out_dropout = fast_kernels.Dropout(dropout)

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        """Attend over ``[B, T, d_model]``; ``attn_mask`` is boolean ``[B, 1, 1, T]``."""
        batch, frames, d_model = x.shape
        qkv = self.qkv(self.norm(x)).view(batch, frames, 3, self.num_heads, -1)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, d_head]
        # On a CPU in bf16/fp16 the attention core runs in fp32: faster there (fast_kernels).
        out = scaled_dot_product_attention(query, key, value, attn_mask=attn_mask)
        out = out.transpose(1, 2).reshape(batch, frames, d_model)
        return self.out_dropout(self.proj(out))


class ConvModule(nn.Module):
    """Conformer convolution module: pointwise + GLU, depthwise conv, LayerNorm, SiLU, pointwise.

    LayerNorm over channels (per frame) replaces the original BatchNorm so that padded
    frames never enter any statistic; padded frames are zeroed before the depthwise
    convolution so that they look exactly like the convolution's own zero padding.
    """

    def __init__(self, d_model: int, kernel_size: int, dropout: float) -> None:
        super().__init__()
        if kernel_size % 2 == 0:
            raise ValueError(f"conv_kernel must be odd to keep the length, got {kernel_size}")
        self.norm = nn.LayerNorm(d_model)
        self.pointwise_in = nn.Linear(d_model, 2 * d_model)
        # On a CPU: fp32 channels-last in every precision (2x faster; oneDNN's bf16/fp16
        # depthwise kernels hang on some shapes; fast_kernels.depthwise_conv1d)
        self.depthwise = fast_kernels.Conv1d(
            d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model
        )
        self.conv_norm = nn.LayerNorm(d_model)
        self.pointwise_out = nn.Linear(d_model, d_model)
        self.dropout = fast_kernels.Dropout(dropout)

    def forward(self, x: Tensor, frame_mask: Tensor) -> Tensor:
        """Apply to ``[B, T, d_model]``; ``frame_mask`` is boolean ``[B, T]``, True = valid."""
        x = F.glu(self.pointwise_in(self.norm(x)), dim=-1)
        x = x.masked_fill(~frame_mask.unsqueeze(-1), 0.0)
        x = self.depthwise(x.transpose(1, 2)).transpose(1, 2)
        x = F.silu(self.conv_norm(x))
        return self.dropout(self.pointwise_out(x))


class ConformerBlock(nn.Module):
    """One Conformer block: half FFN, self-attention, convolution, half FFN, LayerNorm."""

    def __init__(
        self, d_model: int, num_heads: int, ffn_dim: int, conv_kernel: int, dropout: float
    ) -> None:
        super().__init__()
        self.ffn1 = FeedForward(d_model, ffn_dim, dropout)
        self.attention = SelfAttention(d_model, num_heads, dropout)
        self.conv = ConvModule(d_model, conv_kernel, dropout)
        self.ffn2 = FeedForward(d_model, ffn_dim, dropout)
        self.final_norm = nn.LayerNorm(d_model)

    def forward(self, x: Tensor, frame_mask: Tensor, attn_mask: Tensor) -> Tensor:
        """Apply to ``[B, T, d_model]`` with a ``[B, T]`` frame mask and ``[B,1,1,T]`` key mask."""
        x = x + 0.5 * self.ffn1(x)
        x = x + self.attention(x, attn_mask)
        x = x + self.conv(x, frame_mask)
        x = x + 0.5 * self.ffn2(x)
        return self.final_norm(x)


def sinusoidal_positions(num_frames: int, d_model: int, device: torch.device) -> Tensor:
    """Absolute sinusoidal position encodings ``[num_frames, d_model]`` in fp32.

    Computed per call rather than stored as a fixed-size buffer, so any length works
    (including symbolic lengths under ``torch.compile(dynamic=True)``).
    """
    positions = torch.arange(num_frames, device=device, dtype=torch.float32).unsqueeze(1)
    frequencies = torch.exp(
        torch.arange(0, d_model, 2, device=device, dtype=torch.float32)
        * (-math.log(10000.0) / d_model)
    )
    angles = positions * frequencies  # [T, ceil(d_model / 2)]
    encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)
    return encoding[:, :d_model]


class ConformerCTC(nn.Module):
    """Conformer encoder with a CTC output layer, sized for digit-level ASR.

    Args:
        n_mels: mel bins of the input features.
        vocab_size: output classes including the CTC blank.
        d_model: encoder width.
        num_layers: number of Conformer blocks.
        num_heads: attention heads.
        ffn_dim: hidden size of the feed-forward modules.
        conv_kernel: depthwise convolution kernel size (odd).
        dropout: dropout probability used throughout.
        subsampling: time reduction of the front end (power of two).
    """

    def __init__(
        self,
        n_mels: int = 40,
        vocab_size: int = 29,
        d_model: int = 144,
        num_layers: int = 4,
        num_heads: int = 4,
        ffn_dim: int = 576,
        conv_kernel: int = 15,
        dropout: float = 0.1,
        subsampling: int = 4,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.frontend = Conv2dSubsampling(n_mels, d_model, subsampling)
        self.input_dropout = fast_kernels.Dropout(dropout)
        self.blocks = nn.ModuleList(
            ConformerBlock(d_model, num_heads, ffn_dim, conv_kernel, dropout)
            for _ in range(num_layers)
        )
        self.output = nn.Linear(d_model, vocab_size)

    def output_lengths(self, feat_lens: Tensor) -> Tensor:
        """Valid output frames for ``feat_lens`` valid input frames (what ``forward`` returns).

        Lets the caller compute the lengths on the host, where the CTC loss reads them.
        """
        return self.frontend.output_lengths(feat_lens)

    def forward(self, feats: Tensor, feat_lens: Tensor) -> tuple[Tensor, Tensor]:
        """Compute CTC logits.

        Args:
            feats: ``[B, T, n_mels]`` features, padded at the end.
            feat_lens: ``[B]`` int64 valid frames per utterance.

        Returns:
            ``[B, T', vocab_size]`` logits (in the autocast dtype under autocast) and
            ``[B]`` int64 valid output frames per utterance.
        """
        x, out_lens = self.frontend(feats, feat_lens)
        num_frames = x.shape[1]
        positions = sinusoidal_positions(num_frames, self.d_model, x.device)
        x = self.input_dropout(x * math.sqrt(self.d_model) + positions.to(x.dtype))
        positions_index = torch.arange(num_frames, device=x.device)
        frame_mask = positions_index < out_lens.unsqueeze(1)  # [B, T']
        # [B, 1, 1, T'] key mask built by broadcasting, not by unsqueezing a [B, T'] mask:
        # inductor (torch 2.11) fails on size-1 views with symbolic strides under
        # dynamic shapes. At least one valid key per row, so an utterance too short to
        # survive subsampling gives finite (ignored) outputs instead of NaN.
        key_mask = positions_index < out_lens.clamp(min=1).view(-1, 1, 1, 1)
        for block in self.blocks:
            x = block(x, frame_mask, key_mask)
        return self.output(x), out_lens


@fwd_default_precision
def ctc_log_probs(logits: Tensor) -> Tensor:
    """Log-softmax over the vocabulary in fp32 (even under autocast).

    Reduced-precision log-softmax loses the small probabilities that CTC's alignment
    sum depends on, so this always computes in fp32.

    Args:
        logits: ``[B, T, vocab]`` logits of any floating dtype.

    Returns:
        ``[B, T, vocab]`` fp32 log-probabilities.
    """
    return logits.float().log_softmax(-1)


@fwd_default_precision
def ctc_loss(
    log_probs: Tensor, out_lens: Tensor, tokens: Tensor, token_lens: Tensor, blank: int = 0
) -> Tensor:
    """Mean CTC loss in fp32 (even under autocast).

    ``zero_infinity`` turns impossible alignments (targets longer than the output) into
    zero loss and zero gradient instead of ``inf`` that would poison the whole batch.

    Args:
        log_probs: ``[B, T, vocab]`` log-probabilities, e.g. from :func:`ctc_log_probs`.
        out_lens: ``[B]`` valid frames per utterance.
        tokens: ``[B, S]`` padded target token ids (no blanks).
        token_lens: ``[B]`` valid tokens per target.
        blank: id of the CTC blank.

    Returns:
        Scalar fp32 loss (per-target losses divided by target lengths, then averaged).
    """
    if out_lens.device != log_probs.device and _get_current_dispatch_mode() is not None:
        # Under a dispatch mode (the pass where WeightCasts observes the weights' uses)
        # torch's ctc_loss takes its tensor-subclass path, whose CUDA kernels want every
        # length on the GPU: host lengths failed every bf16/fp16 CUDA run's first step
        # (2026-11-27 H200). The copy waits for the GPU, once per run.
        out_lens = out_lens.to(log_probs.device)
        token_lens = token_lens.to(log_probs.device)
    return F.ctc_loss(
        log_probs.float().transpose(0, 1),
        tokens,
        out_lens,
        token_lens,
        blank=blank,
        reduction="mean",
        zero_infinity=True,
    )
