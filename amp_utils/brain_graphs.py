"""The Brain's CUDA graphs: whole training steps and validation's forward passes.

A small speech model's step is bound by the host: each of its hundreds of small kernels is
launched from Python while the GPU waits. ``amp_utils.step_graphs.StepGraphs`` records a
step once per batch shape and replays it with one launch. This module is what the Brain
does with it, as :class:`GraphedSteps`, a base class of ``amp_utils.brain.Brain`` (its
methods are the Brain's, so recipes override them there):

* training (``trainer.graph_step``): whether the step can be captured
  (:meth:`GraphedSteps.step_graph_blocker`), the device-only step that is captured
  (forward, loss, backward, clipping, the fused optimizer, the loss scale), the static
  inputs, and the fallback to the eager step when a capture fails;
* validation (``trainer.graph_eval``): the forward pass and loss of each validation batch
  shape, replayed from the shape's second validation on, with the recipe's
  ``score_predictions`` scoring the outputs on the host.

It relies on the Brain for the rest: ``run_opts``, ``device``, ``optimizers_dict``,
``amp_step``, ``ledger``, ``_forward_backward``, ``_eval_forward``, ``flush_pending``,
``zero_grad``, ``on_fit_batch_end``, ``overrides_freeze_optimizers``,
``scores_predictions`` and ``score_predictions``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from amp_utils.stage import Stage
from amp_utils.step_graphs import (
    CapturableOptimizers,
    CaptureFailed,
    StepGraphs,
    clone_tensors,
    tensor_leaves,
)

logger = logging.getLogger("amp_utils.brain")  # the Brain's log, as before the split


class GraphedSteps:
    """The Brain's whole-step CUDA graphs (training) and validation graphs."""

    # ------------------------------------------------------- training steps
    def step_graph_blocker(self) -> str | None:
        """Why this run's training step cannot be captured whole (``graph_step``), or None.

        Subclasses add their own reasons (e.g. augmentation that changes the batch shape).
        """
        if self.device.type != "cuda":
            return f"whole-step CUDA graphs need a CUDA device (this run: {self.device.type})"
        if self.run_opts.grad_accumulation_factor != 1:
            return "gradient accumulation (trainer.grad_accumulation_factor > 1) is not captured"
        if self.distributed.world_size > 1:
            return "DDP's gradient all-reduce is not captured (one process only)"
        if self._cudagraphs:
            return "torch.compile already replays CUDA graphs (trainer.compile_mode)"
        if self.overrides_freeze_optimizers():
            return "freeze_optimizers is overridden: a captured step would freeze its choice"
        optimizers = list(self.optimizers_dict.values())
        if not optimizers:
            return "there is no optimizer"
        if not all(getattr(opt, "_step_supports_amp_scaling", False) for opt in optimizers):
            return (
                "the optimizer is not fused (trainer.fused_optimizer=true): others decide on "
                "the host whether to skip a step"
            )
        return None

    def _set_up_step_graphs(self) -> None:
        """With ``graph_step``, train through :class:`StepGraphs` unless something blocks it."""
        self._step_graphs = None
        if not self.run_opts.graph_step:
            return
        blocker = self.step_graph_blocker()
        if blocker is not None:
            logger.warning("trainer.graph_step: %s; the step runs as usual.", blocker)
            return
        if self._step_graphs_failed is not None:
            logger.warning(
                "trainer.graph_step: an earlier session of this run could not capture the "
                "training step (%s); this one trains without whole-step graphs too, as the "
                "uninterrupted run does.",
                self._step_graphs_failed,
            )
            return
        self._capturable = CapturableOptimizers(list(self.optimizers_dict.values()), self.device)
        self._step_graphs = StepGraphs(
            self._graph_safe_step,
            self.static_batch,
            self.copy_into_static,
            warmup_steps=self.run_opts.graph_step_warmup,
            max_shapes=self.run_opts.graph_step_max_shapes,
            capture=self.device.type == "cuda",  # elsewhere (tests) the body runs eagerly
            later_warmup_steps=self.graph_step_later_warmup(),
        )
        logger.info(
            "trainer.graph_step: each batch shape's whole training step is captured as a CUDA "
            "graph after %d eager steps (%d for the first shape), then replayed.",
            self._step_graphs.later_warmup_steps,
            self.run_opts.graph_step_warmup,
        )

    def graph_step_later_warmup(self) -> int:
        """Eager steps of each batch shape after the first capture: ``graph_step_later_warmup``,
        else one, or ``graph_step_warmup`` with compiled modules.

        The run-wide state exists once a graph has been captured; what a new shape needs is
        its own: cuDNN's algorithm search (one eager step) and, for compiled code, its
        compile, which happens in the shape's second step (the first, checked for host reads,
        runs compiled code eagerly; inductor cannot compile inside a capture). The device
        CTC loss's compiled update needs none: its trial compile serves every shape.
        """
        if self.run_opts.graph_step_later_warmup is not None:
            return self.run_opts.graph_step_later_warmup
        return self.run_opts.graph_step_warmup if self._compiled else 1

    def static_batch(self, batch: Any) -> Any:
        """A copy of ``batch`` with tensors of its own: a captured step's inputs."""
        return clone_tensors(batch)

    def copy_into_static(self, static: Any, batch: Any) -> None:
        """Copy ``batch``'s tensors into ``static`` (from :meth:`static_batch`)."""
        for dst, src in zip(tensor_leaves(static), tensor_leaves(batch), strict=True):
            dst.copy_(src, non_blocking=True)

    def graph_input(self, batch: Any) -> Any:
        """What a captured step reads of ``batch`` (subclasses drop host-side copies)."""
        return batch

    @contextmanager
    def _graph_safe(self) -> Iterator[None]:
        """``graph_safe_step`` set while a body that :class:`StepGraphs` may capture runs:
        recipes then compute from device tensors only."""
        self.graph_safe_step = True
        try:
            yield
        finally:
            self.graph_safe_step = False

    def _graph_safe_step(self, batch: Any) -> tuple[Any, ...]:
        """The whole training step from device tensors alone: what :class:`StepGraphs`
        warms up, captures and replays. Returns (outputs, loss, step info, loss scale)."""
        assert self._capturable is not None
        with self._graph_safe():
            # No autocast weight cache: its casts would be made once, at the capture.
            outputs, loss = self._forward_backward(batch, autocast_cache=False)
            loss = loss.detach()
            self.amp_step.observe_loss(loss)
            with self._capturable.during_step():
                step_info = self.amp_step.step(self._stepped_optimizers())
            return outputs, loss, step_info, self.amp_step.loss_scale()

    def _fit_batch_graphed(self, batch: Any) -> torch.Tensor | None:
        """``fit_batch`` through the step graphs; None when a capture failed (the caller
        then trains on this batch as usual, and so does every later step)."""
        assert self._step_graphs is not None and self._capturable is not None
        # The batch goes into its graph's inputs while the previous step still runs: the
        # flush then waits for that step, and the GPU idles only for the LR and the launch.
        prepared = self._step_graphs.prepare(self.graph_input(batch))
        self.flush_pending()  # the previous step's values (and the LR schedule) are read
        self._capturable.refresh()
        try:
            outputs, loss, step_info, scale = self._step_graphs.run(prepared)
        except CaptureFailed as err:
            logger.warning(
                "trainer.graph_step: the training step could not be captured as a CUDA graph "
                "(%s); training goes on without whole-step graphs.",
                err,
            )
            self._step_graphs, self._step_graphs_failed = None, str(err)
            self.amp_step.reset()
            self.zero_grad(set_to_none=True)
            return None
        self.ledger.record(self.step, loss, step_info, scale)
        self.on_fit_batch_end(batch, outputs, loss, True)
        return loss

    def step_graph_stats(self) -> dict[str, int] | None:
        """Graphs captured, replays and eager steps of ``graph_step`` (None: not in use)."""
        return self._step_graphs.stats() if self._step_graphs is not None else None

    # --------------------------------------------- validation as CUDA graphs
    def _set_up_eval_graphs(self) -> None:
        """With ``graph_eval`` and training's step graphs in use, replay validation too."""
        self._eval_graphs = None
        if self._step_graphs is None or not self.run_opts.graph_eval:
            return
        if not self.scores_predictions():
            logger.info(
                "trainer.graph_eval: validation runs eagerly: %s scores inside "
                "compute_objectives (override score_predictions to replay it as CUDA graphs).",
                type(self).__name__,
            )
            return
        self._eval_graphs = StepGraphs(
            self._graph_safe_eval,
            self.static_batch,
            self.copy_into_static,
            # the check for host reads and cuDNN's algorithm search; modules compiled for
            # evaluation compile for a shape in its second pass (the first runs them eagerly)
            warmup_steps=2 if self._compiled and self.run_opts.compile_eval else 1,
            max_shapes=self.run_opts.graph_step_max_shapes,
            capture=self.device.type == "cuda",
        )
        logger.info(
            "trainer.graph_eval: each validation batch shape's forward pass and loss is "
            "captured as a CUDA graph after %d eager passes, then replayed; the metrics are "
            "scored on the host from the graph's outputs.",
            self._eval_graphs.warmup_steps,
        )

    def _graph_safe_eval(self, batch: Any) -> tuple[Any, torch.Tensor]:
        """A validation batch's forward pass and loss from device tensors alone (no
        scoring): what the evaluation graphs warm up, capture and replay."""
        with self._graph_safe():
            # No autocast weight cache: its casts would be made once, at the capture.
            predictions, loss = self._eval_forward(batch, Stage.VALID, autocast_cache=False)
            return predictions, loss.detach()

    def _evaluate_batch_graphed(self, batch: Any) -> torch.Tensor | None:
        """A validation batch through the evaluation graphs, then scored on the host;
        None when its capture failed (the caller evaluates it eagerly, as every later
        validation batch of the run)."""
        assert self._eval_graphs is not None
        try:
            predictions, loss = self._eval_graphs(self.graph_input(batch))
        except CaptureFailed as err:
            logger.warning(
                "trainer.graph_eval: a validation batch could not be captured as a CUDA graph "
                "(%s); validation goes on eagerly.",
                err,
            )
            self._eval_graphs = None
            return None
        self.score_predictions(predictions, batch, Stage.VALID)
        return loss.cpu()

    def eval_graph_stats(self) -> dict[str, int] | None:
        """Graphs captured, replays and eager passes of ``graph_eval`` (None: not in use)."""
        return self._eval_graphs.stats() if self._eval_graphs is not None else None
