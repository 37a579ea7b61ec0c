"""Tasks: a model plus data with a fixed held-out split and seeded partitions."""

from __future__ import annotations

from functools import lru_cache

from .._errors import ClientError
from ..config import TaskSpec
from .base import Dataset, Task
from .digits import DigitsTask
from .synthetic import SyntheticTask

_TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "synthetic": SyntheticTask}


@lru_cache(maxsize=8)
def get_task(spec: TaskSpec) -> Task:
    """The task for ``spec`` (cached per process: data is loaded once)."""
    return _TASKS[spec.task](spec)


def check_any_task(data: Dataset, source: str) -> None:
    """That ``data`` fits at least one task (the agent does not know which one the coordinator runs);
    else one ClientError naming what each task needs."""
    errors = []
    for cls in _TASKS.values():
        try:
            cls.check_data(data, cls.name)
            return
        except ClientError as exc:
            errors.append(str(exc).rstrip("."))
    raise ClientError(f"{source} must fit a fedshield task. Found it fits none: {'; '.join(errors)}")


def max_partitions() -> int:
    """The most partitions any task's training data splits into (one example each; the agent does not
    know which task, nor which partitioning, the coordinator will run)."""
    return max(len(get_task(TaskSpec(task=name)).train_set) for name in _TASKS)


__all__ = ["Dataset", "DigitsTask", "SyntheticTask", "Task", "check_any_task", "get_task", "max_partitions"]
