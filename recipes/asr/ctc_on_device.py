"""A CTC loss whose lengths stay on the device: no host sync, capturable in a CUDA graph.

``torch.nn.functional.ctc_loss`` copies the input and target lengths to the CPU, and its
CUDA kernel copies its target offsets back to the GPU from pageable memory; both wait for
everything queued before them, and neither can be recorded in a CUDA graph. A training
step captured whole (``trainer.graph_step``, ``amp_utils.step_graphs``) therefore needs a
loss computed from device tensors alone. This is the CTC forward (alpha) recursion in log
space, batched over utterances and vectorised over the extended label sequence, one
iteration per output frame; autograd gives the backward. Lengths enter only as masks, so
the same code serves every batch of one padded shape.

Values match ``F.ctc_loss(..., reduction="mean", zero_infinity=True)`` and so do the
gradients with respect to the logits (``tests/test_ctc_on_device.py``). Impossible
alignments (targets longer than the output allows) give zero loss and zero gradient, as
``zero_infinity`` does. On CUDA, each frame's update is one ``torch.compile``-d function
(a few fused kernels instead of a dozen small ones); elsewhere it runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from amp_utils.autocast import fwd_default_precision
from amp_utils.compile import RECOMPILES

logger = logging.getLogger(__name__)

#: Log-probability of an impossible path. Finite, unlike ``-inf``, so that the log-sum-exp
#: of impossible paths and its gradient stay finite (no NaN to mask later); a real path's
#: log-probability is never anywhere near it.
IMPOSSIBLE = -1.0e30

AlphaStep = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def alpha_step(alpha: Tensor, emit: Tensor, skip_penalty: Tensor, active: Tensor) -> Tensor:
    """One frame of the CTC forward recursion over ``[B, S]`` extended-label states.

    Each state is reached from itself, from the state before it, and from two before when
    that skips a blank between different labels (``skip_penalty`` 0, else
    :data:`IMPOSSIBLE`); then the frame's emission log-probability is added. Utterances
    whose output has ended (``active`` False) keep their alphas.
    """
    pad = torch.full_like(alpha[:, :2], IMPOSSIBLE)
    shifted = torch.cat([pad, alpha], dim=1)
    paths = torch.stack([alpha, shifted[:, 1:-1], shifted[:, :-2] + skip_penalty])
    return torch.where(active.unsqueeze(1), torch.logsumexp(paths, dim=0) + emit, alpha)


_compiled_steps: dict[str, AlphaStep] = {}


def alpha_step_for(device: torch.device) -> AlphaStep:
    """:func:`alpha_step`, compiled once per process on CUDA (fused kernels), else eager.

    The compile and its trial wait for a call outside any dispatch mode and CUDA-graph
    capture; until then the eager function serves. Under a mode (a whole-step graph's
    host-read check, the step where WeightCasts observes the weights) compiled code runs
    eagerly, so the trial would compile nothing and pass, and the first real compile, a
    step later, could fail outside the fallback; inside a capture inductor cannot compile.
    """
    if device.type != "cuda":
        return alpha_step
    if "cuda" not in _compiled_steps:
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if _get_current_dispatch_mode() is not None or capturing:
            return alpha_step
        _compiled_steps["cuda"] = compiled_or_eager(device)
    return _compiled_steps["cuda"]


def compiled_or_eager(device: torch.device) -> AlphaStep:
    """:func:`alpha_step` compiled (dynamic shapes), tried forward and backward on a tiny
    batch first; if compiling fails, the eager function, with a warning.

    Compiling here, before any step, keeps a compiler failure out of a training step
    (whose backward would otherwise compile lazily) and out of a CUDA-graph capture. The
    trial is the loss itself (:func:`ctc_loss_on_device`), so that the update meets the
    arguments of a real step: distinct tensors, and per-frame views at growing offsets,
    which the first frames' duck-sized guards tie to the batch size. A trial on plain
    tensors (before 2026-11-28: one tensor passed twice) left two recompiles to the first
    real step; this one leaves none for any batch shape
    (``tests/test_ctc_on_device.py``), so a new shape can be captured after a single eager
    warm-up step, whose compiled code runs eagerly. The trial runs without gradients too:
    grad mode is one of dynamo's guards, and validation's captured loss
    (``trainer.graph_eval``) would otherwise compile inside its first capture and fail it.
    """
    RECOMPILES.install()
    compiled = torch.compile(alpha_step, dynamic=True)
    try:
        # batch 3, 2 targets (5 states), 8 frames: past frame 1 (views at offsets 3 and 5,
        # tied to the batch and state counts) no offset equals a size, so the trial's last
        # compile is the general one
        logits = torch.zeros(3, 8, 11, device=device, requires_grad=True)
        tokens = torch.tensor([[1, 2], [4, 4], [5, 0]], device=device)
        token_lens = torch.tensor([2, 2, 1], device=device)
        out_lens = torch.tensor([8, 6, 5], device=device)
        log_probs = logits.log_softmax(-1)
        ctc_loss_on_device(log_probs, out_lens, tokens, token_lens, step=compiled).backward()
        with torch.no_grad():  # validation's captured loss: grad mode is one of the guards
            ctc_loss_on_device(log_probs, out_lens, tokens, token_lens, step=compiled)
    except Exception as err:  # noqa: BLE001 -- any compiler failure: run eagerly
        logger.warning(
            "The CTC loss's per-frame update could not be compiled (%s: %s); it runs "
            "eagerly (a dozen small kernels a frame instead of a few fused ones).",
            type(err).__name__,
            err,
        )
        return alpha_step
    return compiled


@fwd_default_precision
def ctc_loss_on_device(
    log_probs: Tensor,
    out_lens: Tensor,
    tokens: Tensor,
    token_lens: Tensor,
    blank: int = 0,
    step: AlphaStep | None = None,
) -> Tensor:
    """Mean CTC loss in fp32 from device-side lengths (no host sync; CUDA-graph safe).

    Args:
        log_probs: ``[B, T, vocab]`` log-probabilities (e.g. ``ctc_log_probs``).
        out_lens: ``[B]`` valid frames per utterance, on the same device.
        tokens: ``[B, L]`` padded target token ids (no blanks).
        token_lens: ``[B]`` valid tokens per target, on the same device.
        blank: id of the CTC blank.
        step: the per-frame update (default: :func:`alpha_step_for` the device).

    Returns:
        Scalar fp32 loss: per-target negative log-likelihoods divided by the target
        lengths (at least 1), averaged over the batch; impossible targets count 0.
    """
    log_probs = log_probs.float()
    batch, frames, _ = log_probs.shape
    device = log_probs.device
    step = step or alpha_step_for(device)
    out_lens = out_lens.to(device=device, dtype=torch.long)
    token_lens = token_lens.to(device=device, dtype=torch.long)
    num_states = 2 * tokens.shape[1] + 1
    # Extended labels: blank, y1, blank, y2, ..., blank (padding tokens lie beyond the
    # last state any valid path ends in, and states only feed later states).
    extended = torch.full((batch, num_states), blank, dtype=torch.long, device=device)
    extended[:, 1::2] = tokens.to(device=device, dtype=torch.long)
    emit = log_probs.gather(2, extended.unsqueeze(1).expand(batch, frames, num_states))
    repeats = torch.ones_like(extended, dtype=torch.bool)  # blanks and repeated labels
    repeats[:, 2:] = extended[:, 2:] == extended[:, :-2]
    skip_penalty = torch.where(repeats, IMPOSSIBLE, 0.0)
    # One view per frame from unbind: backward stacks the frames' gradients once, where
    # indexing emit[:, t] would cost each frame a zero-filled [B, T, S] gradient and an add
    # (~3 kernels a frame, a few hundred in a captured step; the same values).
    emits = emit.unbind(1)
    states = torch.arange(num_states, device=device)
    alpha = torch.where(
        (states < 2).unsqueeze(0) & (out_lens > 0).unsqueeze(1), emits[0], IMPOSSIBLE
    )
    active = torch.arange(frames, device=device).unsqueeze(1) < out_lens.unsqueeze(0)
    for t in range(1, frames):
        alpha = step(alpha, emits[t], skip_penalty, active[t])
    last = (2 * token_lens).unsqueeze(1)
    end_blank = alpha.gather(1, last).squeeze(1)
    end_label = alpha.gather(1, (last - 1).clamp(min=0)).squeeze(1)
    end_label = torch.where(token_lens > 0, end_label, IMPOSSIBLE)
    nll = -torch.logaddexp(end_blank, end_label)
    nll = torch.where(nll > -0.5 * IMPOSSIBLE, 0.0, nll)  # zero_infinity
    return (nll / token_lens.clamp(min=1)).mean()
