"""Peer loops (SpeechBrain's Brain, Lightning's Trainer) on a tiny model, on the CPU.

The peers are an optional extra (``pip install -e ".[bench]"``): tests that run one skip
when it is not installed; the "skipped" path is tested either way.
"""

import subprocess
import sys

import pytest
import torch

from data.dataset import AudioBatch
from recipes import peers
from recipes.peers import OptimizerSettings, run_peer

# Lightning 2.6.6 with torch 2.11 (its own pytree helper), not something we can fix.
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning")

CPU = torch.device("cpu")
STATS_KEYS = {
    "steps",
    "seconds",
    "steps_per_s",
    "utterances",
    "audio_seconds",
    "p50_step_ms",
    "p90_step_ms",
    "peak_memory_mb",
}


def tiny_modules() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(80, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return torch.nn.ModuleDict({"model": model})


def forward_loss(modules: torch.nn.ModuleDict, batch: AudioBatch) -> torch.Tensor:
    """Frames of 80 samples, averaged, classified into 4 'speakers'."""
    frames = batch.wavs.view(len(batch), -1, 80).mean(dim=1)
    return torch.nn.functional.cross_entropy(modules.model(frames), batch.speakers)


def fixed_batch(size: int = 8, samples: int = 800) -> AudioBatch:
    gen = torch.Generator().manual_seed(0)
    return AudioBatch(
        ids=[str(i) for i in range(size)],
        wavs=torch.randn(size, samples, generator=gen),
        wav_lens=torch.full((size,), samples),
        tokens=torch.ones(size, 2, dtype=torch.int64),
        token_lens=torch.full((size,), 2),
        speakers=torch.randint(0, 4, (size,), generator=gen),
        transcripts=["x"] * size,
        durations=torch.full((size,), samples / 8000),
    )


def repeat(batch: AudioBatch):
    while True:
        yield batch


SETTINGS = OptimizerSettings(lr=1e-2, weight_decay=0.01, max_grad_norm=5.0)


def check_trains(modules: torch.nn.ModuleDict, before: list[torch.Tensor], loss0: float) -> None:
    after = [p.detach() for p in modules.parameters()]
    assert all(a.device == CPU for a in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    with torch.no_grad():
        assert float(forward_loss(modules, fixed_batch())) < loss0


def snapshot(modules: torch.nn.ModuleDict) -> tuple[list[torch.Tensor], float]:
    with torch.no_grad():
        loss = float(forward_loss(modules, fixed_batch()))
    return [p.detach().clone() for p in modules.parameters()], loss


@pytest.mark.parametrize(
    ("precision", "max_grad_norm"), [("fp32", 5.0), ("bf16", 5.0), ("fp32", 0.0)]
)
def test_speechbrain_peer_trains_our_modules(precision, max_grad_norm):
    pytest.importorskip("speechbrain")
    modules = tiny_modules()
    before, loss0 = snapshot(modules)
    settings = OptimizerSettings(lr=1e-2, max_grad_norm=max_grad_norm)
    peer = peers.speechbrain_peer(modules, forward_loss, precision, CPU, settings)
    assert peer.brain.precision == precision and peer.brain.optimizer.defaults["fused"]
    for _ in range(5):
        peer.step(fixed_batch())
    assert peer.brain.optimizer_step == 5
    check_trains(modules, before, loss0)
    if max_grad_norm <= 0:  # a negative value would flip the gradients in SpeechBrain 1.1.2
        assert peer.brain.max_grad_norm == float("inf") and "inf" in peer.notes[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lightning_peer_trains_our_modules(precision):
    pytest.importorskip("lightning")
    modules = tiny_modules()
    before, loss0 = snapshot(modules)
    peer = peers.lightning_peer(modules, forward_loss, precision, CPU, SETTINGS)
    assert peer.trainer_kwargs["gradient_clip_val"] == 5.0
    stats = peer.run(repeat(fixed_batch()), warmup=2, steps=4)
    assert stats["steps"] == 4
    check_trains(modules, before, loss0)
    # fp32 keeps the fused optimizer; mixed precision with clipping cannot
    assert any("fused" in note for note in peer.notes) == (precision != "fp32")


def test_lightning_refuses_clipping_with_a_fused_optimizer():
    """Why the Lightning peer falls back to foreach AdamW under mixed precision."""
    pytest.importorskip("lightning")
    peer = peers.lightning_peer(tiny_modules(), forward_loss, "bf16", CPU, SETTINGS)
    module = peer.module
    module.configure_optimizers = lambda: torch.optim.AdamW(module.parameters(), fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        peer.run(repeat(fixed_batch()), warmup=0, steps=1)


@pytest.mark.parametrize("name", peers.PEERS)
def test_run_peer_returns_time_steps_statistics(name):
    pytest.importorskip(name)
    result = run_peer(
        name,
        tiny_modules(),
        forward_loss,
        repeat(fixed_batch()),
        precision="bf16",
        device=CPU,
        settings=SETTINGS,
        warmup=1,
        steps=3,
    )
    assert result.status == "ran" and result.reason == "" and result.version
    stats = result.stats
    assert set(stats) == STATS_KEYS
    assert stats["steps"] == 3 and stats["utterances"] == 3 * 8
    assert stats["audio_seconds"] == pytest.approx(3 * 8 * 0.1)
    assert 0 < stats["p50_step_ms"] <= stats["p90_step_ms"] <= 1e3 * stats["seconds"]
    assert stats["steps_per_s"] == pytest.approx(3 / stats["seconds"])
    assert stats["peak_memory_mb"] > 0


@pytest.mark.parametrize("name", peers.PEERS)
def test_fp16_on_the_cpu_is_reported_unsupported(name):
    pytest.importorskip(name)
    result = run_peer(
        name,
        tiny_modules(),
        forward_loss,
        repeat(fixed_batch()),
        precision="fp16",
        device=CPU,
        settings=SETTINGS,
        warmup=1,
        steps=1,
    )
    assert result.status == "unsupported" and result.stats is None
    assert "CPU" in result.reason


@pytest.mark.parametrize("name", peers.PEERS)
def test_missing_peer_is_skipped_with_the_install_hint(name, monkeypatch):
    """What CI (which installs .[dev] only) sees: no error, a 'skipped' result."""
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda _: None)
    result = run_peer(
        name,
        tiny_modules(),
        forward_loss,
        repeat(fixed_batch()),
        precision="bf16",
        device=CPU,
        settings=SETTINGS,
        warmup=1,
        steps=1,
    )
    assert result.status == "skipped" and result.stats is None
    assert peers.INSTALL_HINT in result.reason


def test_unknown_peer_or_precision_raises():
    with pytest.raises(ValueError, match="Unknown peer"):
        peers.peer_version("keras")
    with pytest.raises(ValueError, match="precision"):
        peers.unsupported_reason("lightning", "fp8", CPU)


def test_importing_speechbrain_keeps_our_tf32_setting():
    """SpeechBrain's import turns TF32 on process-wide; import_speechbrain undoes that."""
    pytest.importorskip("speechbrain")
    code = (
        "import torch\n"
        "from recipes.peers import import_speechbrain\n"
        "torch.backends.cudnn.allow_tf32 = False\n"
        "import_speechbrain()\n"
        "print(torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["highest", "False"]


def reference_weights(steps: int) -> list[torch.Tensor]:
    """Our loop's semantics in fp32: forward + loss, backward, clip, fused AdamW, zero grads."""
    modules = tiny_modules()
    opt = SETTINGS.adamw(modules.parameters())
    for _ in range(steps):
        forward_loss(modules, fixed_batch()).backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), SETTINGS.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach() for p in modules.parameters()]


@pytest.mark.parametrize("name", peers.PEERS)
def test_peer_steps_match_our_loop_in_fp32(name):
    """Same model, batch and settings: a peer's fp32 steps give our loop's weights."""
    pytest.importorskip(name)
    modules = tiny_modules()
    result = run_peer(
        name,
        modules,
        forward_loss,
        repeat(fixed_batch()),
        precision="fp32",
        device=CPU,
        settings=SETTINGS,
        warmup=1,
        steps=3,
    )
    assert result.status == "ran"
    for ours, peer in zip(reference_weights(4), modules.parameters(), strict=True):
        torch.testing.assert_close(peer.detach(), ours, rtol=1e-5, atol=1e-6)
