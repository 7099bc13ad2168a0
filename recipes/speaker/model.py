"""A small x-vector speaker classifier (TDNN + masked statistics pooling).

The TDNN layers use "same" padding and padded frames are zeroed after every layer, so a
padded frame looks exactly like the convolution's own zero padding; statistics pooling
averages over valid frames only. A padded batch therefore gives the same embeddings as each
utterance on its own (in eval mode, where BatchNorm uses running statistics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from amp_utils import fast_kernels
from amp_utils.autocast import fwd_default_precision

#: (kernel size, dilation) of the five frame-level TDNN layers of the x-vector recipe.
TDNN_LAYERS: tuple[tuple[int, int], ...] = ((5, 1), (3, 2), (3, 3), (1, 1), (1, 1))


@fwd_default_precision
def masked_mean_std(x: Tensor, frame_mask: Tensor, eps: float = 1e-5) -> tuple[Tensor, Tensor]:
    """Mean and standard deviation over valid frames, computed in fp32.

    The variance subtracts two nearly equal quantities; in fp16/bf16 it can come out
    negative or zero and its square root's gradient explodes, hence fp32 and the clamp.

    Args:
        x: ``[B, C, T]`` frame-level features.
        frame_mask: ``[B, T]`` boolean, True on valid frames.
        eps: lower bound of the variance.

    Returns:
        ``([B, C] mean, [B, C] std)`` in fp32.
    """
    x = x.float()
    weights = frame_mask.unsqueeze(1).to(x.dtype)  # [B, 1, T]
    counts = weights.sum(dim=-1).clamp(min=1.0)  # [B, 1]
    mean = (x * weights).sum(dim=-1) / counts
    variance = (((x - mean.unsqueeze(-1)) * weights) ** 2).sum(dim=-1) / counts
    return mean, variance.clamp(min=eps).sqrt()


class EmbeddingBatchNorm(nn.BatchNorm1d):
    """BatchNorm1d over embeddings that also accepts a one-utterance training batch.

    Duration batching can yield a batch holding a single long utterance, whose batch
    statistics are undefined; such a batch is normalised with the running statistics.
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.training and x.shape[0] == 1:
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        return super().forward(x)


class XVector(nn.Module):
    """X-vector network: TDNN, masked statistics pooling, embedding, speaker classifier.

    Args:
        n_mels: mel bins of the input features.
        num_speakers: number of output classes.
        channels: width of the TDNN layers (the last one is 3x wider, as 512 -> 1500 in
            the original recipe).
        embedding_dim: size of the speaker embedding.
        dropout: dropout before the classifier's output layer.
    """

    def __init__(
        self,
        n_mels: int = 40,
        num_speakers: int = 6,
        channels: int = 256,
        embedding_dim: int = 128,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        self.tdnn = nn.ModuleList()
        in_channels = n_mels
        for index, (kernel_size, dilation) in enumerate(TDNN_LAYERS):
            out_channels = 3 * channels if index == len(TDNN_LAYERS) - 1 else channels
            self.tdnn.append(
                nn.Sequential(
                    fast_kernels.Conv1d(  # fp32 on a CPU under fp16 (86x slower in fp16)
                        in_channels,
                        out_channels,
                        kernel_size,
                        dilation=dilation,
                        padding=dilation * (kernel_size - 1) // 2,
                    ),
                    nn.ReLU(),
                    nn.BatchNorm1d(out_channels),
                )
            )
            in_channels = out_channels
        self.embedding = nn.Linear(2 * in_channels, embedding_dim)
        self.classifier = nn.Sequential(
            nn.ReLU(),
            EmbeddingBatchNorm(embedding_dim),
            nn.Dropout(dropout),
            nn.Linear(embedding_dim, num_speakers),
        )

    def embed(self, feats: Tensor, feat_lens: Tensor) -> Tensor:
        """Speaker embeddings.

        Args:
            feats: ``[B, T, n_mels]`` features, padded at the end.
            feat_lens: ``[B]`` valid frames per utterance.

        Returns:
            ``[B, embedding_dim]`` embeddings.
        """
        frame_mask = torch.arange(feats.shape[1], device=feats.device) < feat_lens.unsqueeze(1)
        keep = frame_mask.unsqueeze(1)  # [B, 1, T]
        x = feats.transpose(1, 2)
        for layer in self.tdnn:
            x = layer(x.masked_fill(~keep, 0.0))
        mean, std = masked_mean_std(x, frame_mask)
        stats = torch.cat((mean, std), dim=-1)
        return self.embedding(stats)

    def forward(self, feats: Tensor, feat_lens: Tensor) -> Tensor:
        """Speaker logits ``[B, num_speakers]`` for ``[B, T, n_mels]`` features."""
        return self.classifier(self.embed(feats, feat_lens))
