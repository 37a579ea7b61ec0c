"""Staleness weighting for late updates in asynchronous aggregation, chosen by name.

A function maps an update's staleness ``s`` (rounds between the model it was
trained on and the current one, an int >= 0) to a factor in ``(0, 1]`` that
multiplies its aggregation weight; every one is 1 at ``s = 0`` and non-increasing
in ``s``. Forms from Xie et al. 2019, "Asynchronous Federated Optimization".

Example
-------
>>> create_staleness("polynomial", a=0.5)(3)
0.5
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from numbers import Integral, Real
from typing import Any, ClassVar

from ._errors import AggregationError
from ._registry import Registry

_REGISTRY = Registry("staleness function")
_TINY = sys.float_info.min  # the smallest factor returned, so that a factor is never 0
MIN_USEFUL_FACTOR = 1e-6  # a late update weighted less adds nothing a float32 sum keeps: workflows refuse it
# ("too-stale"), which also keeps a buffer of only such updates from a sum of weights that underflows to 0
_HUGE = 2**1000  # staleness beyond this does not fit a float comfortably


def register_staleness(name: str) -> Callable[[type], type]:
    """Class decorator: make a staleness function available under ``name``."""
    return _REGISTRY.decorator(name, set_name=True)


def available_staleness_functions() -> list[str]:
    return _REGISTRY.names()


def create_staleness(name: str, **params: Any) -> StalenessFunction:
    """Build the staleness function ``name``; unknown names or parameters raise AggregationError."""
    return _REGISTRY.build(name, **params)


def _param(name: str, x: Any, *, positive: bool) -> float:
    ok = isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x) and (x > 0 if positive else x >= 0)
    if not ok:
        raise AggregationError(f"staleness {name} must be finite and {'> 0' if positive else '>= 0'}. Found {x!r}.")
    return float(x)


class StalenessFunction(ABC):
    """``s -> factor in (0, 1]``, 1 at ``s = 0``, non-increasing."""

    name: ClassVar[str] = ""

    def __call__(self, staleness: int) -> float:
        if not (isinstance(staleness, Integral) and not isinstance(staleness, bool) and staleness >= 0):
            raise AggregationError(f"staleness must be an int >= 0. Found {staleness!r}.")
        return min(1.0, max(_TINY, self._factor(int(staleness))))

    @abstractmethod
    def _factor(self, s: int) -> float: ...


@register_staleness("constant")
class Constant(StalenessFunction):
    """1 for every staleness (late updates count fully)."""

    def _factor(self, s: int) -> float:
        return 1.0


@register_staleness("polynomial")
class Polynomial(StalenessFunction):
    """``(1 + s) ** -a``."""

    def __init__(self, a: float = 0.5) -> None:
        self.a = _param("a", a, positive=False)

    def _factor(self, s: int) -> float:
        if s < _HUGE:
            return float(s + 1) ** -self.a
        return math.exp(-self.a * math.log(s + 1))  # math.log takes ints of any size


@register_staleness("hinge")
class Hinge(StalenessFunction):
    """1 for ``s <= b``, then ``1 / (a (s - b) + 1)``."""

    def __init__(self, a: float = 10.0, b: float = 4.0) -> None:
        self.a = _param("a", a, positive=True)
        self.b = _param("b", b, positive=False)

    def _factor(self, s: int) -> float:
        if s <= self.b:
            return 1.0
        return 1.0 / (self.a * (s - self.b) + 1.0) if s < _HUGE else _TINY  # an overflow gives 0, then _TINY
