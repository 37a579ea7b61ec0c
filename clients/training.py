"""Local training and evaluation of a task's torch model on in-memory data."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from .config import TrainSettings
from .tasks import Dataset


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy flat weights into the model's parameters.

    Copies (never aliases): ``flat`` may be backed by a received message's bytes.
    """
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"flat weights must have {total} elements. Found {flat.numel()}.")
    for p, chunk in zip(params, flat.split([p.numel() for p in params]), strict=True):
        p.copy_(chunk.view_as(p))


def flat_params(model: nn.Module) -> torch.Tensor:
    return parameters_to_vector(model.parameters()).detach()


def train_local(
    model: nn.Module, data: Dataset, settings: TrainSettings, generator: torch.Generator
) -> dict[str, float]:
    """Mini-batch SGD for ``settings.local_epochs`` epochs; returns loss and timing."""
    device = next(model.parameters()).device
    x = torch.from_numpy(np.ascontiguousarray(data.x)).to(device)
    y = torch.from_numpy(np.ascontiguousarray(data.y)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=settings.lr, momentum=settings.momentum)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    start = time.perf_counter()
    total, seen = 0.0, 0
    for _ in range(settings.local_epochs):
        perm = torch.randperm(len(y), generator=generator).to(device)
        for batch in perm.split(settings.batch_size):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
            seen += len(batch)
    return {"train-loss": total / max(seen, 1), "train-time-s": time.perf_counter() - start}


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, batch_size: int = 1024) -> tuple[float, float]:
    """(accuracy, mean cross-entropy loss) on ``data``."""
    device = next(model.parameters()).device
    model.eval()
    x = torch.from_numpy(np.ascontiguousarray(data.x)).to(device)
    y = torch.from_numpy(np.ascontiguousarray(data.y)).to(device)
    correct, loss = 0, 0.0
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        out = model(xb)
        loss += nn.functional.cross_entropy(out, yb, reduction="sum").item()
        correct += (out.argmax(1) == yb).sum().item()
    return correct / len(y), loss / len(y)
