"""CUDA paths of the data package (run with ``pytest -m gpu``; skipped without CUDA)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.dataset import AudioBatch, collate_audio
from data.text import ctc_greedy_decode
from recipes.frontend import LogMelFeatures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _synthetic_batch() -> AudioBatch:
    items = [
        {
            "id": f"u{n}",
            "wav": torch.rand(800 * n),
            "tokens": torch.arange(1, n + 1),
            "speaker": n,
            "transcript": "x" * n,
            "duration": 0.1 * n,
        }
        for n in (1, 2)
    ]
    return collate_audio(items)


def _tensors(batch: AudioBatch) -> list[torch.Tensor]:
    values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return [v for v in values if isinstance(v, torch.Tensor)]


def test_pin_memory_and_to_cuda() -> None:
    batch = _synthetic_batch()
    pinned = batch.pin_memory()
    assert all(t.is_pinned() for t in _tensors(pinned))
    moved = pinned.to("cuda", non_blocking=True)
    assert all(t.is_cuda for t in _tensors(moved)) and moved.ids == batch.ids
    assert torch.equal(moved.wavs.cpu(), batch.wavs)


def test_dataloader_pin_memory() -> None:
    items = [_synthetic_batch()]  # a dataset whose items already are batches
    loader = torch.utils.data.DataLoader(
        items, batch_size=None, collate_fn=lambda batch: batch, pin_memory=True
    )
    (batch,) = list(loader)
    assert isinstance(batch, AudioBatch) and batch.wavs.is_pinned()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_features_fp32_under_cuda_autocast(dtype: torch.dtype) -> None:
    wavs = torch.randn(2, 8000, device="cuda") * 0.1
    lens = torch.tensor([8000, 4000], device="cuda")
    module = LogMelFeatures().cuda()
    reference, _ = module(wavs, lens)
    with torch.autocast("cuda", dtype=dtype):
        feats, frame_lens = module(wavs.to(dtype), lens)
    assert feats.dtype == torch.float32 and frame_lens.tolist() == [101, 51]
    cpu_feats, _ = LogMelFeatures()(wavs.cpu(), lens.cpu())
    torch.testing.assert_close(reference.cpu(), cpu_feats, atol=1e-3, rtol=1e-3)


def test_ctc_greedy_decode_on_cuda_matches_cpu() -> None:
    log_probs = torch.randn(4, 50, 29).log_softmax(-1)
    lens = torch.tensor([50, 10, 0, 33])
    assert ctc_greedy_decode(log_probs.cuda(), lens.cuda()) == ctc_greedy_decode(log_probs, lens)
