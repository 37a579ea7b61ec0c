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
from ._registry import Registry

_REGISTRY = Registry("server optimizer")


def register_server_optimizer(name: str) -> Callable[[type], type]:
    """Class decorator: make a server optimizer available under ``name``."""
    return _REGISTRY.decorator(name)


def available_server_optimizers() -> list[str]:
    return _REGISTRY.names()


def create_server_optimizer(name: str, **kwargs: Any) -> "ServerOptimizer":
    return _REGISTRY.build(name, **kwargs)


class ServerOptimizer(ABC):
    """Applies an aggregated delta to the global weights."""

    @abstractmethod
    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Return the new weights (may update ``weights`` in place)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], numel: int | None = None) -> None:  # noqa: B027 - optional hook
        """Restore ``state_dict``'s output; ``numel``, when given, is the model's size the state must fit."""


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


def _check_real(name: str, x: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """``x`` must be a finite real in ``[lo, hi)`` (``(lo, hi)`` with ``lo_open``)."""
    ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
    ok = ok and (x > lo if lo_open else x >= lo) and x < hi
    if not ok:
        interval = f"{'(' if lo_open else '['}{lo}, {hi})" if math.isfinite(hi) else f"{'>' if lo_open else '>='} {lo}"
        rule = f"be in {interval}" if math.isfinite(hi) else f"be finite and {interval}"
        raise AggregationError(f"server-{name} must {rule}. Found {x!r}.")
    return float(x)


def _describe(x: Any) -> str:
    return f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


class _Stateful(ServerOptimizer):
    """Per-coordinate state tensors (created on the first step, on the weights' device) and a step count."""

    _slots: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.t = 0
        self._state: dict[str, torch.Tensor] = {}

    def _init_state(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: torch.zeros_like(weights) for k in self._slots}

    def _prepare(self, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        if weights.dim() != 1 or not weights.is_floating_point():
            raise AggregationError(f"weights must be a 1-D floating tensor. Found shape {tuple(weights.shape)}.")
        if delta.shape != weights.shape:
            raise AggregationError(f"delta must have shape {tuple(weights.shape)}. Found {tuple(delta.shape)}.")
        if not self._state:
            self._state = self._init_state(weights)
        first = self._state[self._slots[0]]
        if first.shape != weights.shape:
            raise AggregationError(f"weights must have the optimizer state's shape {tuple(first.shape)}. "
                                   f"Found {tuple(weights.shape)}.")
        if first.device != weights.device or first.dtype != weights.dtype:
            self._state = {k: v.to(weights.device, weights.dtype) for k, v in self._state.items()}
        self.t += 1
        return delta.to(weights.device, weights.dtype)

    def state_dict(self) -> dict[str, Any]:
        """``{"t": steps}`` plus a copy of each state tensor once the first step made them."""
        return {"t": self.t, **{k: v.detach().clone() for k, v in self._state.items()}}

    def load_state_dict(self, state: dict[str, Any], numel: int | None = None) -> None:
        """As ``ServerOptimizer.load_state_dict``: a state of another model's size is refused here, not at the
        first step after a resumed round's training."""
        if not isinstance(state, dict):
            raise AggregationError(f"optimizer state must be a dict. Found {type(state).__name__}.")
        t = state.get("t")
        if not (isinstance(t, int) and not isinstance(t, bool) and t >= 0):
            raise AggregationError(f"optimizer state 't' must be an int >= 0. Found {t!r}.")
        names = set(state) - {"t"}
        if names not in (set(), set(self._slots)) or (t > 0) != bool(names):
            raise AggregationError(f"optimizer state must hold 't' and, after a step, exactly {sorted(self._slots)}. "
                                   f"Found t={t} and {sorted(names)}.")
        tensors = {k: state[k] for k in self._slots if k in state}
        shapes = {tuple(v.shape) if isinstance(v, torch.Tensor) and v.dim() == 1 and v.is_floating_point() else None
                  for v in tensors.values()}
        if len(shapes) > 1 or None in shapes:
            raise AggregationError(f"optimizer state {sorted(tensors)} must be 1-D floating tensors of one shape. "
                                   f"Found {[_describe(v) for v in tensors.values()]}.")
        if numel is not None and tensors and shapes != {(numel,)}:
            raise AggregationError(f"optimizer state {sorted(tensors)} must have the model's shape ({numel},). "
                                   f"Found {shapes.pop()}.")
        if self._state and tensors and shapes != {tuple(self._state[self._slots[0]].shape)}:
            raise AggregationError(f"optimizer state {sorted(tensors)} must have the current state's shape "
                                   f"{tuple(self._state[self._slots[0]].shape)}. Found {shapes.pop()}.")
        for k, v in tensors.items():  # a damaged checkpoint would turn the model into NaN at the next step
            if not bool(torch.isfinite(v).all()):
                raise AggregationError(f"optimizer state {k!r} must be finite. Found NaN or infinity.")
            if k == "v" and bool((v < 0).any()):  # second moments: the step divides by sqrt(v) + tau
                raise AggregationError(f"optimizer state 'v' must be >= 0. Found {float(v.min()):g}.")
        self.t = t
        self._state = {k: v.detach().clone() for k, v in tensors.items()}


@register_server_optimizer("fedavgm")
class FedAvgM(_Stateful):
    """Server momentum (Hsu et al. 2019): ``m <- beta * m + delta``; ``w <- w + lr * m``."""

    _slots = ("m",)

    def __init__(self, lr: float = 1.0, momentum: float = 0.9, **_: Any) -> None:
        super().__init__()
        self.lr = _check_lr(lr)
        self.momentum = _check_real("momentum", momentum, 0.0, 1.0)

    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        d = self._prepare(weights, delta)
        m = self._state["m"].mul_(self.momentum).add_(d)
        return weights.add_(m, alpha=self.lr)


# The smallest server-tau: tau**2 = 1e-36 is a normal float32 (>= 2**-126 = 1.18e-38; review helper-56, F1).
TAU_MIN = 1e-18


class _Adaptive(_Stateful):
    """Reddi et al. 2021, Algorithm 2, without bias correction: ``m <- b1 m + (1 - b1) delta``;
    ``v`` by the method, starting at ``tau**2``; ``w <- w + lr * m / (sqrt(v) + tau)``.

    ``lr`` has no default: adaptive steps are about ``lr`` per coordinate, so the caller chooses it.
    ``tau`` must be >= ``TAU_MIN`` (1e-18): ``tau**2`` then stays a normal float32 (see there).
    Flower's FedAdam/FedYogi/FedAdagrad differ: ``v`` starts at 0; FedAdam bias-corrects ``lr``; their
    FedAdagrad hard-codes ``beta_1 = 0`` (``m = delta``, no momentum) where this one keeps ``beta1``
    (default 0.9); and ``tau`` defaults to 1e-3 in Flower 1.42's ``flwr.serverapp.strategy`` classes and
    the legacy ``flwr.server.strategy.FedYogi``, to 1e-9 in the legacy ``flwr.server.strategy`` FedAdam
    and FedAdagrad. Results are not interchangeable with theirs.
    """

    _slots = ("m", "v")

    def __init__(self, lr: float | None = None, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 **_: Any) -> None:
        super().__init__()
        if lr is None:
            raise AggregationError(f"server-lr must be given for {type(self).__name__} (no default). Found None.")
        self.lr = _check_lr(lr)
        self.beta1 = _check_real("beta1", beta1, 0.0, 1.0)
        self.beta2 = _check_real("beta2", beta2, 0.0, 1.0)
        self.tau = _check_real("tau", tau, 0.0, math.inf, lo_open=True)
        if self.tau < TAU_MIN:
            raise AggregationError(f"server-tau must be >= {TAU_MIN:g} (tau**2, v's starting value, must stay a "
                                   "normal float32: below, a delta whose square rounds to 0 moves its weight by up to "
                                   "lr * delta / tau, and under 1e-45 tau itself is 0, so a coordinate whose delta is "
                                   f"0 becomes 0/0 = NaN). Found {tau!r}.")

    def _init_state(self, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"m": torch.zeros_like(weights), "v": torch.full_like(weights, self.tau**2)}

    @abstractmethod
    def _update_v(self, v: torch.Tensor, d2: torch.Tensor) -> None:
        """Update the second-moment estimate ``v`` in place from ``d2 = delta**2``."""

    def step(self, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        d = self._prepare(weights, delta)
        m, v = self._state["m"], self._state["v"]
        m.mul_(self.beta1).add_(d, alpha=1.0 - self.beta1)
        self._update_v(v, d * d)
        return weights.addcdiv_(m, v.sqrt().add_(self.tau), value=self.lr)


@register_server_optimizer("fedadagrad")
class FedAdagrad(_Adaptive):
    """``v <- v + delta**2`` (``beta2`` is not used; ``beta1`` is, where Flower's FedAdagrad has ``beta_1 = 0``)."""

    def _update_v(self, v: torch.Tensor, d2: torch.Tensor) -> None:
        v.add_(d2)


@register_server_optimizer("fedadam")
class FedAdam(_Adaptive):
    """``v <- b2 v + (1 - b2) delta**2``."""

    def _update_v(self, v: torch.Tensor, d2: torch.Tensor) -> None:
        v.mul_(self.beta2).add_(d2, alpha=1.0 - self.beta2)


@register_server_optimizer("fedyogi")
class FedYogi(_Adaptive):
    """``v <- v - (1 - b2) delta**2 sign(v - delta**2)`` (stays > 0 when it starts > 0)."""

    def _update_v(self, v: torch.Tensor, d2: torch.Tensor) -> None:
        v.addcmul_(d2, torch.sign(v - d2), value=-(1.0 - self.beta2))
