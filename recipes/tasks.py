"""The task registry: every task the recipes train, by name, and the model names each owns.

Training (``recipes/experiment.py``), data setup, inference and the benchmark look the
task up here (``task_for(cfg.model)``) instead of branching on its name. A new task is a
``Task`` in its own folder (``recipes/<task>/task.py``) added to ``TASKS``.
"""

from __future__ import annotations

from omegaconf import DictConfig

from recipes.asr.task import ASR
from recipes.speaker.task import SPEAKER
from recipes.task import Task

TASKS: dict[str, Task] = {task.name: task for task in (ASR, SPEAKER)}
#: ``model.name`` -> the name of the task it trains.
MODEL_TASKS: dict[str, str] = {
    model: task.name for task in TASKS.values() for model in task.model_names
}


class UnknownTaskError(ValueError):
    """A task or model name that no registered task has; the message lists the valid ones."""


def get_task(name: str) -> Task:
    """The task called ``name`` (``asr``, ``speaker``)."""
    try:
        return TASKS[str(name)]
    except KeyError:
        raise UnknownTaskError(
            f"model.task={name!r} is not a task; choose one of: {', '.join(TASKS)}."
        ) from None


def task_for(model_cfg: DictConfig) -> Task:
    """The task of a ``model`` config node: ``model.task``, which must own ``model.name``."""
    task = get_task(model_cfg.task)
    name = str(model_cfg.name)
    if name not in MODEL_TASKS:
        raise UnknownTaskError(
            f"model.name={name!r} is not a model; choose one of: {', '.join(MODEL_TASKS)}."
        )
    if name not in task.model_names:
        raise UnknownTaskError(
            f"model.task={task.name!r} does not fit model.name={name!r} "
            f"(which does {MODEL_TASKS[name]!r})."
        )
    return task
