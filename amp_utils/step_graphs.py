"""Whole training steps captured as CUDA graphs, one per batch shape, and replayed.

A small speech model's step is bound by the host: hundreds of small kernels, each
launched from Python, while the GPU idles between them (the 2026-11-26 H200 measured the
default recipe at 13-19 ms per step in every precision, at under 10 % model FLOPs
utilisation). Compiling the encoder blocks (``fast_path=cuda_graphs``) graphs only part
of the step. Here the *whole* step -- features, augmentation, forward, loss, backward,
unscaling, clipping, the skip decision and the fused optimizer update -- is recorded
once per batch shape with ``torch.cuda.graph`` and then replayed with one launch, as in
PyTorch's "whole-network capture" recipe. fp16 and bf16 then shorten the step itself
instead of hiding behind the launch overhead.

What a captured step needs, and what :class:`StepGraphs` does about it:

* **Fixed shapes.** Each distinct shape of the batch's tensors gets its own graph; batches
  padded to bucket edges (``data.pad_to_buckets``) keep them few. A batch is copied into
  its shape's static input tensors before the replay.
* **No host syncs or host values.** The body must compute from device tensors alone: the
  Brain runs it with ``graph_safe_step`` set, so that recipes use device-side code (the
  ASR recipe's CTC loss with device lengths, augmentation drawn on the device). A value
  read on the host would be frozen at the capture (a CPU tensor's) or break it (a GPU
  tensor's). The first warm-up step of each shape runs under
  :class:`~amp_utils.host_reads.HostReads`; if it read values on the host, the shape is
  not captured and :class:`CaptureFailed` names the lines. ``torch.compile``d code runs
  eagerly in that step (as in the first step of a bf16/fp16 run, where
  :class:`~amp_utils.weight_casts.WeightCasts` observes the weights), so with
  ``warmup_steps >= 2`` (the default) the compiled code has compiled for the shape before
  the capture: inductor cannot compile during a capture (2026-11-27 H200: "Cannot copy
  between CPU and CUDA tensors during CUDA graph capture"), and with one warm-up step a
  shape may fail to capture and train eagerly. A capture that fails for
  another reason is reported the same way; the Brain then logs why and trains eagerly.
* **Warm-up.** The first ``warmup_steps`` batches of the first shape run eagerly on a side
  stream (real training steps), so that lazily created state -- optimizer moments, the
  loss scale, cuBLAS handles, shape caches -- exists before the capture and never lives in
  graph memory. The step after them is captured, then replayed: it trains too. Once a
  graph exists that state does too, and each later shape needs only what is its own
  (cuDNN's algorithm choice, compiled code's compile for the shape): ``later_warmup_steps``
  eager steps (the Brain: one, or two with compiled modules). Eager 16-bit steps of the
  small recipe are ~5x a replay on the H200, and its ten shapes came two eager steps each.
* **Outputs that outlive the replay.** Every graph writes its outputs to the same memory
  on each replay, and the graphs share one memory pool; the outputs are copied before
  they are returned, so a value the caller reads later (the step ledger reads one step
  late) is never overwritten.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from amp_utils.host_reads import HostReads

logger = logging.getLogger(__name__)


class CaptureFailed(RuntimeError):
    """A step could not be captured as a CUDA graph; the message says why."""


def clone_tensors(value: Any) -> Any:
    """``value`` with every tensor inside (tuples, lists, dicts, dataclasses) cloned."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        return type(value)(*(clone_tensors(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(clone_tensors(v) for v in value)
    if isinstance(value, Mapping):
        return {k: clone_tensors(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,
            **{f.name: clone_tensors(getattr(value, f.name)) for f in dataclasses.fields(value)},
        )
    return value


#: Leaves that hold no tensor, answered before the container checks: a batch's lists of
#: utterance ids and transcripts made the walk cost ~2 us per string (the ``Mapping`` check
#: is an ABC's), ~0.3 ms a step for 100 utterances, spent while the GPU waited.
_ATOMS = (str, bytes, int, float, bool, type(None))


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors inside ``value`` (tuples, lists, dicts, dataclasses), in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, _ATOMS):
        return []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensor_leaves(v)]
    if isinstance(value, Mapping):
        return [t for k in sorted(value, key=str) for t in tensor_leaves(value[k])]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in tensor_leaves(getattr(value, f.name))]
    return []


def shape_key(batch: Any) -> tuple[tuple[tuple[int, ...], torch.dtype, str], ...]:
    """What makes two batches need different graphs: each tensor's shape, dtype and device."""
    return tuple((tuple(t.shape), t.dtype, str(t.device)) for t in tensor_leaves(batch))


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static_batch: Any  # the graph's input tensors (a copy of the batch's structure)
    outputs: Any  # the graph's output tensors (overwritten by each replay)


@dataclass
class PreparedStep:
    """A batch made ready by :meth:`StepGraphs.prepare` for :meth:`StepGraphs.run`."""

    batch: Any
    key: Hashable  # its shape
    captured: _Captured | None  # its shape's graph, the batch already in its inputs


class StepGraphs:
    """Run ``body(batch)`` as a CUDA graph per batch shape: warm up, capture, replay.

    Args:
        body: the training step; reads only the batch's tensors and persistent state
            (parameters, optimizer, loss scale), returns tensors (any nesting).
        static_copy: a copy of a batch with its own device tensors (the static inputs).
        copy_into: ``copy_into(static, batch)`` copies a batch's tensors into ``static``.
        warmup_steps: eager steps of each new shape before it is captured (>= 1), until a
            first graph is captured.
        later_warmup_steps: eager steps of each new shape once a graph has been captured
            (>= 1; None: ``warmup_steps``).
        max_shapes: shapes captured at most; later new shapes run eagerly (one warning).
        capture: False runs every step eagerly (CPUs; tests of the bookkeeping), with the
            same warm-up check for host reads.
        key: what tells shapes apart (default :func:`shape_key`).
    """

    def __init__(
        self,
        body: Callable[[Any], Any],
        static_copy: Callable[[Any], Any],
        copy_into: Callable[[Any, Any], None],
        warmup_steps: int = 2,
        max_shapes: int = 64,
        capture: bool = True,
        key: Callable[[Any], Hashable] = shape_key,
        later_warmup_steps: int | None = None,
    ) -> None:
        later_warmup_steps = warmup_steps if later_warmup_steps is None else later_warmup_steps
        if warmup_steps < 1 or later_warmup_steps < 1:
            raise ValueError(
                "warmup_steps and later_warmup_steps must be >= 1 (eager steps first), got "
                f"{warmup_steps} and {later_warmup_steps}."
            )
        self.body = body
        self.static_copy = static_copy
        self.copy_into = copy_into
        self.warmup_steps = warmup_steps
        self.later_warmup_steps = later_warmup_steps
        self.max_shapes = max_shapes
        self.capture = capture
        self.key = key
        self.graphs: dict[Hashable, _Captured] = {}
        self.host_reads: dict[Hashable, str] = {}  # shapes whose warm-up read host values
        self.seen: Counter[Hashable] = Counter()
        self.replays = 0
        self.eager_steps = 0
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self._stream: torch.cuda.Stream | None = None
        self._warned_full = False

    def __call__(self, batch: Any) -> Any:
        """One training step on ``batch``; returns the body's outputs (copies: keep them)."""
        return self.run(self.prepare(batch))

    def prepare(self, batch: Any) -> PreparedStep:
        """Work on ``batch`` that may come before the previous step has finished: its shape
        key and, for a captured shape, the copies into the graph's static inputs.

        The copies queue on the stream behind the step in flight (they never overtake its
        reads of the same inputs). A caller that waits for that step before :meth:`run`
        (the Brain reads its loss and sets the next learning rate) prepares first, so this
        host work overlaps the GPU's instead of following it: the GPU then idles only for
        the launch.
        """
        key = self.key(batch)
        captured = self.graphs.get(key)
        if captured is not None:
            self.copy_into(captured.static_batch, batch)
        return PreparedStep(batch, key, captured)

    def run(self, prepared: PreparedStep) -> Any:
        """The training step on a batch from :meth:`prepare`: a replay of its shape's graph,
        or a warm-up, capture or eager step; returns the body's outputs (copies: keep them)."""
        batch, key, captured = prepared.batch, prepared.key, prepared.captured
        if captured is not None:
            captured.graph.replay()
            self.replays += 1
            return clone_tensors(captured.outputs)
        self.seen[key] += 1
        if self.seen[key] <= (self.later_warmup_steps if self.graphs else self.warmup_steps):
            return self._warm_up(key, batch, check=self.seen[key] == 1)
        if key in self.host_reads:
            raise CaptureFailed(
                "the step reads values on the host, which a CUDA graph would freeze at the "
                "capture; compute them on the device while Brain.graph_safe_step is set, or "
                "block graph_step for this case in step_graph_blocker():\n" + self.host_reads[key]
            )
        if not self.capture:
            return self._eager(batch)
        if len(self.graphs) >= self.max_shapes:
            if not self._warned_full:
                logger.warning(
                    "%d batch shapes captured as CUDA graphs, the most that "
                    "trainer.graph_step_max_shapes allows: steps of new shapes run eagerly. Pad "
                    "batches to bucket edges "
                    "(data.pad_to_buckets=true) to keep the shapes few.",
                    self.max_shapes,
                )
                self._warned_full = True
            return self._eager(batch)
        return self._capture(key, batch)

    def _eager(self, batch: Any) -> Any:
        self.eager_steps += 1
        return self.body(batch)

    def _warm_up(self, key: Hashable, batch: Any, check: bool) -> Any:
        """An eager step on a side stream (PyTorch's warm-up before a capture); with
        ``check``, its host reads are recorded against the shape ``key``."""
        if check:
            with HostReads() as reads:
                outputs = self._warm_up(key, batch, check=False)
            if reads.found:
                self.host_reads[key] = reads.report()
            return outputs
        if not self.capture:
            return self._eager(batch)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            outputs = self._eager(batch)
        main.wait_stream(self._stream)
        return clone_tensors(outputs)  # on the main stream: the originals belong to the side one

    def _capture(self, key: Hashable, batch: Any) -> Any:
        static = self.static_copy(batch)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the DataLoader's pin-memory thread may allocate meanwhile.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = self.body(static)
        except Exception as err:  # noqa: BLE001 -- any failure means: train without graphs
            raise CaptureFailed(f"{type(err).__name__}: {err}") from err
        self.graphs[key] = _Captured(graph, static, outputs)
        logger.info(
            "Captured the training step of batch shape %s as CUDA graph %d.",
            [s for s, _, _ in key] if isinstance(key, tuple) else key,
            len(self.graphs),
        )
        graph.replay()  # capturing records the step; this runs it
        self.replays += 1
        return clone_tensors(outputs)

    def stats(self) -> dict[str, int]:
        """Graphs captured, replays and eager steps so far (for logs and tests)."""
        return {
            "graphs": len(self.graphs),
            "replays": self.replays,
            "eager_steps": self.eager_steps,
        }


class CapturableOptimizers:
    """Optimizers made capturable for the duration of a captured step, and only then.

    A graph records each kernel's arguments: a learning rate passed as a Python number
    would be frozen at its value on the capture. Inside :meth:`during_step`, each
    parameter group's ``lr`` is a one-element device tensor (refreshed from the group's own
    float before every step by :meth:`refresh`) and, during a capture, ``capturable`` is on
    (PyTorch refuses to capture a step without it); outside, the
    groups are as the recipe built them, so the LR scheduler, logs and checkpoints see
    plain floats (a checkpoint resumes with or without graphs).
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
        self.groups = [group for opt in optimizers for group in opt.param_groups]
        self.lrs = [
            torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
            for group in self.groups
        ]

    def refresh(self) -> None:
        """Copy each group's current learning rate into its tensor (a fill, not a sync)."""
        for group, lr in zip(self.groups, self.lrs, strict=True):
            lr.fill_(float(group["lr"]))

    @contextmanager
    def during_step(self) -> Iterator[None]:
        """Context in which the groups hold the lr tensors (and, while a graph is being
        captured, are capturable); the groups' own values come back afterwards."""
        # capturable only while capturing: PyTorch warns about capturable steps run eagerly
        # (the warm-up steps), and fused kernels do not otherwise read the flag.
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        saved = [(group["lr"], group.get("capturable", False)) for group in self.groups]
        for group, lr in zip(self.groups, self.lrs, strict=True):
            group["lr"], group["capturable"] = lr, capturing or group.get("capturable", False)
        try:
            yield
        finally:
            for group, (lr, capturable) in zip(self.groups, saved, strict=True):
                group["lr"], group["capturable"] = lr, capturable
