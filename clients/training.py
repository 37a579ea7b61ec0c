"""Local training and evaluation of a task's torch model, and the flat-vector view of its state."""

from __future__ import annotations

import torch
from torch import nn

from .config import TaskSpec, TrainSettings
from .tasks import Dataset, DigitsTask, ModelLayout, Task, timed_train

_CLASSIFICATION = DigitsTask(TaskSpec())  # the default loss, metrics and loop, for a bare model (tests, tools)


def load_flat(model: nn.Module, flat: torch.Tensor, layout: ModelLayout | None = None) -> None:
    """Copy flat weights into the model's federated entries (``layout``; default: derived from ``model``).

    Copies (never aliases): ``flat`` may be backed by a received message's bytes.
    """
    (layout or ModelLayout.of(model)).load(model, flat)


def flat_params(model: nn.Module, layout: ModelLayout | None = None) -> torch.Tensor:
    """The model's federated entries as one flat float32 tensor."""
    return (layout or ModelLayout.of(model)).flatten(model)


def train_local(model: nn.Module, data: Dataset, settings: TrainSettings, generator: torch.Generator,
                task: Task | None = None) -> dict[str, float]:
    """The task's training (default: mini-batch SGD with cross-entropy); returns its metrics and timing."""
    return timed_train(task or _CLASSIFICATION, model, data, settings, generator)


def evaluate(model: nn.Module, data: Dataset, batch_size: int = 1024, task: Task | None = None) -> tuple[float, float]:
    """(accuracy, mean loss) on ``data`` (accuracy nan for a task that reports none)."""
    out = (task or _CLASSIFICATION).evaluate(model, data, batch_size)
    return float(out.get("accuracy", float("nan"))), float(out.get("loss", float("nan")))
