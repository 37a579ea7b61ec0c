"""Root error of the aggregation package."""

from collections.abc import Callable, Sequence
from typing import Any


SHOWN_CHARS = 80  # the most of a found value an error message repeats
_WHOLE_REPR = 1 << 16  # a longer string or bytes is cut before its repr (counted then by its own length)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters with the length it had:
    a value from the network or a config file (a 100 kB string, a 300-digit number) must not flood
    the log or the one-line message it lands in."""
    if isinstance(value, str | bytes) and len(value) > _WHOLE_REPR:  # (a 64 MB reason: cut before repr copies it)
        return f"{repr(value[:limit])[:limit]}... ({len(value)} characters)"
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown_key(key: str, limit: int = 40) -> str:
    """A config key or name for a message: as it is when short and printable, else ``shown`` (escaped, cut)."""
    return key if isinstance(key, str) and key.isprintable() and len(key) <= limit else shown(key, limit)


class AggregationError(ValueError):
    """An update, codec or aggregation setting broke a rule; the message says which."""


class UpdateRejected(AggregationError):
    """A checked add refused an update by its norm (``add_checked`` / ``add_into_checked``).

    ``rule`` is ``"non-finite"`` (a NaN or infinity, or a sum of squares that overflows float32)
    or ``"norm-too-large"`` (finite, but the L2 norm exceeds ``max_norm``); ``norm`` is the
    update's L2 norm as computed (inf or nan for ``"non-finite"``).
    """

    def __init__(self, rule: str, norm: float, max_norm: float) -> None:
        if rule == "non-finite":
            msg = "update must hold only finite values (and not overflow float32)"
        else:
            msg = f"update L2 norm must be <= max-update-norm={max_norm:g}; found {norm:.4g}"
        super().__init__(msg)
        self.rule, self.norm, self.max_norm = rule, norm, max_norm


def each_checked(add: Callable[[Any, float], float], batch: Sequence[Any],
                 weights: Sequence[float]) -> list[float | UpdateRejected]:
    """``add(update, weight)`` (a checked add) for each update in turn: its norm, or the
    UpdateRejected it raised (the others are still added)."""
    results: list[float | UpdateRejected] = []
    for update, weight in zip(batch, weights, strict=True):
        try:
            results.append(add(update, weight))
        except UpdateRejected as rej:
            results.append(rej)
    return results
