"""Server optimizers on flat tensors, chosen by name from a registry.

Each takes the current global weights and the aggregated (weighted mean)
client delta ``new - old`` and returns the next global weights. Their state
is a dict of tensors and numbers that goes into the checkpoint.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from ._errors import AggregationError

_REGISTRY: dict[str, Callable[..., "ServerOptimizer"]] = {}


def register_server_optimizer(name: str) -> Callable[[type], type]:
    """Class decorator: make a server optimizer available under ``name``."""

    def deco(cls: type) -> type:
        if name in _REGISTRY:
            raise AggregationError(f"server optimizer name must be unique. Found {name!r} registered twice.")
        _REGISTRY[name] = cls
        return cls

    return deco


def available_server_optimizers() -> list[str]:
    return sorted(_REGISTRY)


def create_server_optimizer(name: str, **kwargs: Any) -> "ServerOptimizer":
    if name not in _REGISTRY:
        raise AggregationError(f"server optimizer must be one of {available_server_optimizers()}. Found {name!r}.")
    return _REGISTRY[name](**kwargs)


class ServerOptimizer(ABC):
    """Applies an aggregated delta to the global weights."""

    @abstractmethod
    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Return the new weights (may update ``weights`` in place)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        pass


def _check_lr(lr: float) -> float:
    if not (isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0):
        raise AggregationError(f"server-lr must be > 0. Found {lr!r}.")
    return float(lr)


@register_server_optimizer("fedavg")
class FedAvg(ServerOptimizer):
    """``w <- w + lr * delta`` (FedAvg with a server learning rate; lr=1 is plain FedAvg)."""

    def __init__(self, lr: float = 1.0, **_: Any) -> None:
        self.lr = _check_lr(lr)

    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return weights.add_(delta.to(weights.device, weights.dtype), alpha=self.lr)
