"""Tasks: a model plus data with a fixed held-out split and seeded partitions."""

from __future__ import annotations

from functools import lru_cache

from ..config import TaskSpec
from .base import Dataset, Task
from .digits import DigitsTask
from .synthetic import SyntheticTask

_TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "synthetic": SyntheticTask}


@lru_cache(maxsize=8)
def get_task(spec: TaskSpec) -> Task:
    """The task for ``spec`` (cached per process: data is loaded once)."""
    return _TASKS[spec.task](spec)


__all__ = ["Dataset", "DigitsTask", "SyntheticTask", "Task", "get_task"]
