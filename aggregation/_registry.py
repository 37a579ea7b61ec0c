"""One registry mechanism for everything chosen by name (codecs, rules, optimizers, staleness)."""

from __future__ import annotations

import functools
import inspect
from typing import Any

from ._errors import AggregationError, shown


class Registry(dict):
    """``name -> class``; a name registered twice is an error, an unknown name lists the known ones."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def __reduce__(self):  # copy.copy keeps the kind (tests swap in private copies)
        return (_rebuild, (self.kind, dict(self)))

    def add(self, name: str, cls: type) -> type:
        if name in self:
            raise AggregationError(f"{self.kind} name must be unique. Found {name!r} registered twice.")
        self[name] = cls
        return cls

    def decorator(self, name: str, set_name: bool = False):
        """A class decorator registering under ``name`` (and setting ``cls.name`` if asked)."""

        def deco(cls: type) -> type:
            if set_name:
                cls.name = name
            return self.add(name, cls)

        return deco

    def names(self) -> list[str]:
        return sorted(self)

    def build(self, name: str, *args: Any, **params: Any) -> Any:
        """Instantiate ``name``; unknown names and parameters raise AggregationError."""
        if name not in self:
            raise AggregationError(f"{self.kind} must be one of {self.names()}. Found {shown(name, 40)}.")
        cls = self[name]
        try:
            _signature(cls).bind(*args, **params)
        except TypeError as exc:
            raise AggregationError(f"{self.kind} {name!r} parameters must be known. Found error: "
                                   f"{shown(str(exc), 120)}.") from None
        return cls(*args, **params)


@functools.lru_cache(maxsize=256)
def _signature(cls: type) -> inspect.Signature:
    """A class's signature, computed once (inspect took ~0.2 ms per call: per client message in a simulation)."""
    return inspect.signature(cls)


def _rebuild(kind: str, items: dict) -> Registry:
    reg = Registry(kind)
    reg.update(items)
    return reg
