"""The codec interface: how one flat update travels and is added into an aggregate.

Client side, ``encode`` turns a flat float32 delta (plus an optional error-feedback
residual) into Flower ``Array`` objects and a small header of scalars. Server
side, ``parse`` validates every field of a received encoding *before* anything
is written anywhere and returns zero-copy tensor views; ``add_into`` then adds
``weight * decoded`` straight into an aggregate tensor on its device, fused
(no dense intermediate for sparse or quantized codecs). ``add_into_checked`` is the
coordinator's hot path: the norm check and the add in as few passes over the update as
the codec can manage (one, for dense float32 and QSGD).

Records on the wire::

    reply.content["arrays"]  ArrayRecord  {<codec's array names>: Array}
    reply.content["codec"]   ConfigRecord {"codec": name, "numel": n, <codec's header fields>}
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import math

import numpy as np
import torch
from flwr.app import Array

from .._errors import AggregationError, UpdateRejected, shown
from .._registry import Registry

Header = dict[str, int | float | str | bool]


@dataclass(frozen=True)
class Encoded:
    """An encoded update: arrays for an ArrayRecord, scalars for a ConfigRecord."""

    arrays: dict[str, Array]
    header: Header

    @property
    def nbytes(self) -> int:
        return sum(len(a.data) for a in self.arrays.values())


@dataclass(frozen=True)
class Parsed:
    """A validated encoding: zero-copy tensor views plus the header's numbers. ``host``: where a
    codec's CPU kernels take numpy arrays, those it made while parsing (same memory as ``tensors``,
    or a float32 widening of it), so the batch path does not make them again."""

    codec: str
    numel: int
    tensors: dict[str, torch.Tensor]
    params: dict[str, Any] = field(default_factory=dict)
    nbytes: int = 0
    host: dict[str, np.ndarray] = field(default_factory=dict)


class Codec(ABC):
    """One way of putting a flat update on the wire. Subclasses register by name."""

    name: ClassVar[str]

    @abstractmethod
    def encode(self, delta: torch.Tensor, residual: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> tuple[Encoded, torch.Tensor | None]:
        """Encode ``delta`` (1-D float32). Returns the encoding and the new residual
        (what was not sent, for error feedback), or None if the codec keeps none."""

    @abstractmethod
    def parse(self, arrays: Mapping[str, Array], header: Mapping[str, Any], numel: int, max_bytes: int) -> Parsed:
        """Validate an encoding for a model of ``numel`` parameters; raise
        AggregationError naming the field and the rule. Never writes anywhere."""

    @abstractmethod
    def add_into(self, parsed: Parsed, out: torch.Tensor, weight: float) -> None:
        """``out += weight * decode(parsed)`` on ``out``'s device, without densifying on the host."""

    @abstractmethod
    def norm(self, parsed: Parsed) -> float:
        """L2 norm of the decoded update (inf or nan when it is not finite)."""

    def add_into_checked(self, parsed: Parsed, out: torch.Tensor, weight: float, max_norm: float) -> float:
        """``out += weight * decode(parsed)`` if the update passes the norm check; return its L2 norm.

        The check (``check_norm``): raise UpdateRejected ``"non-finite"`` if the update holds a NaN
        or infinity or its sum of squares overflows float32, ``"norm-too-large"`` if its norm
        exceeds ``max_norm``. A rejected update leaves ``out`` bit-identical: a codec writes only
        what it has decided to add (this default reads the update twice, norm then add; a codec
        may decide first from an a-priori bound, as qsgd's does).
        """
        return checked_add_two_pass(self, parsed, out, weight, max_norm)

    def add_batch_checked(self, batch: list[Parsed], out: torch.Tensor, weights: list[float], max_norm: float,
                          budget: float, zero: bool = False) -> list[float | UpdateRejected] | None:
        """``add_into_checked`` for every update of ``batch`` in one pass over ``out``, or None
        where this codec has no batch path for ``out`` (the caller then adds one at a time).

        Returns, per update, its norm (added) or the UpdateRejected it raised (not added: a block
        it had parts added ahead to is rebuilt from its values before the batch, see ``settle_batch``).
        ``budget``: how much the magnitude of any element of ``out`` may grow through parts
        added ahead of their decision, all updates together (see WeightedAccumulator).
        ``zero``: ``out`` holds garbage (a fresh sum, not yet zeroed) and is set to zero within
        the same pass, before anything is added; where this returns None, ``out`` is untouched.
        """
        return None

    def write_into(self, parsed: Parsed, out: torch.Tensor) -> None:
        """``out[:] = decode(parsed)`` (every element overwritten)."""
        out.zero_()
        self.add_into(parsed, out, 1.0)

    def write_into_checked(self, parsed: Parsed, out: torch.Tensor, max_norm: float) -> float:
        """``write_into`` with ``add_into_checked``'s norm check; on rejection ``out`` holds
        unspecified values (callers write into scratch storage they only commit on success)."""
        norm = check_norm(self.norm(parsed), max_norm)
        self.write_into(parsed, out)
        return norm

    def decode(self, parsed: Parsed, device: torch.device | str = "cpu") -> torch.Tensor:
        out = torch.zeros(parsed.numel, dtype=torch.float32, device=device)
        self.add_into(parsed, out, 1.0)
        return out

    def config(self) -> Header:
        """The codec's parameters as a flat header (sent to clients in the train message)."""
        return {"codec": self.name}


_REGISTRY = Registry("codec")


def register_codec(cls: type[Codec]) -> type[Codec]:
    return _REGISTRY.add(cls.name, cls)


def available_codecs() -> list[str]:
    return _REGISTRY.names()


def create_codec(name: str, **params: Any) -> Codec:
    """Build a codec by name; unknown parameters and bad values raise AggregationError."""
    return _REGISTRY.build(name, **params)


def require(ok: bool, fld: str, rule: str, found: Any) -> None:
    """Raise ``AggregationError("<fld> must <rule>. Found <found>.")`` unless ``ok``."""
    if not ok:
        raise AggregationError(f"{fld} must {rule}. Found {shown(found)}.")


def encode_input(delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``delta + residual`` as a flat contiguous float32 tensor; rejects bad shapes and non-finite
    input (every codec's encode starts here)."""
    require(delta.dim() == 1 and delta.is_floating_point(), "delta", "be a 1-D floating tensor", tuple(delta.shape))
    require(delta.numel() > 0, "delta", "have at least one element", 0)
    x = delta.to(torch.float32).contiguous()  # may be ``delta`` itself: callers never write into it
    if residual is not None:
        require(residual.shape == delta.shape, "residual", f"have shape {tuple(delta.shape)}", tuple(residual.shape))
        x = x + residual.to(x.device, torch.float32)
    require(bool(torch.isfinite(x).all()), "delta + residual", "be finite to be encoded", "nan or inf")
    return x


def check_header(header: Mapping[str, Any], name: str, numel: int) -> None:
    # every check of the parse path tests first and formats its message only on failure
    if header.get("codec") != name:
        require(False, "codec", f"be {name!r}", header.get("codec"))
    if header.get("numel") != numel:
        require(False, "numel", f"be {numel}", header.get("numel"))


def check_arrays(arrays: Mapping[str, Array], names: set[str] | frozenset[str], max_bytes: int) -> int:
    if arrays.keys() != names:
        require(False, "arrays", f"be exactly {sorted(names)}", sorted(arrays.keys())[:8])
    total = sum(len(a.data) for a in arrays.values())
    if total > max_bytes:
        require(False, "arrays", f"total at most {max_bytes} bytes", total)
    return total


FLT_MAX = float(torch.finfo(torch.float32).max)


def norm_rule(sq: float, max_norm: float) -> str | None:
    """The rule a sum of squares ``sq`` breaks (None if none): ``"non-finite"`` when it is not
    finite or overflows float32 (the dense norm is a float32 reduction), else ``"norm-too-large"``
    when ``sqrt(sq) > max_norm``."""
    if not (math.isfinite(sq) and sq <= FLT_MAX):
        return "non-finite"
    return "norm-too-large" if math.sqrt(sq) > max_norm else None


def check_norm(norm: float, max_norm: float) -> float:
    """Return ``norm`` if it is finite and <= ``max_norm``, else raise UpdateRejected."""
    if not math.isfinite(norm):
        raise UpdateRejected("non-finite", norm, max_norm)
    if norm > max_norm:
        raise UpdateRejected("norm-too-large", norm, max_norm)
    return norm


def checked_add_two_pass(codec: Codec, parsed: Parsed, out: torch.Tensor, weight: float, max_norm: float) -> float:
    """``add_into_checked`` without writing before deciding: ``codec.norm``, then ``codec.add_into``."""
    norm = check_norm(float(codec.norm(parsed)), max_norm)
    codec.add_into(parsed, out, weight)
    return norm


def restorer(out: torch.Tensor, zero: bool) -> Callable[[int, int], None]:
    """``settle_batch``'s ``restore`` for a batch about to be added into ``out``: ``out[lo:hi]`` back
    to its values before the batch (zero for a fresh sum, ``zero``; else from a copy taken now)."""
    if zero:
        return lambda lo, hi: out[lo:hi].zero_()
    before = out.clone()
    return lambda lo, hi: out[lo:hi].copy_(before[lo:hi])


def settle_batch(sq: np.ndarray, added: np.ndarray, scale: float, max_norm: float, block: int, numel: int,
                 add_range: Callable[[int, int, int], None], restore: Callable[[int, int], None],
                 float32_norm: bool = True) -> list[float | UpdateRejected]:
    """Decide a batch after a kernel pass (``aggregation.kernels``): ``sq[c, b]`` is update ``c``'s
    sum of squares over block ``b`` (of ``block`` elements) times ``scale**2``, ``added[c, b]`` how
    many of that block's first elements were added ahead. A block that a rejected update had parts
    added to is rebuilt: ``restore(lo, hi)`` puts back its values from before the batch, then every
    accepted update is added to it again (``add_range(c, lo, hi)``). Nothing of a rejected
    update stays in the sum, whatever its weight: subtracting it again instead would leave float32
    rounding of its own size, which a large weight makes larger than everyone else's sum. An
    accepted update gets the rest of each other block (``add_range``: only where a step was too
    large to add ahead, so decided first).
    ``float32_norm``: the rules of ``norm_rule`` (a sum of squares past float32's range is
    non-finite), else those of ``check_norm`` on the float64 norm. Returns each update's norm or
    UpdateRejected."""
    totals = sq.astype(np.float64).sum(axis=1) / (scale * scale)
    if float32_norm:
        rules = [norm_rule(t, max_norm) for t in totals.tolist()]
    else:
        rules = [("non-finite" if not math.isfinite(t) else None if t <= max_norm * max_norm else "norm-too-large")
                 for t in totals.tolist()]  # inf <= inf: an infinite norm passed an unbounded max_norm
    lengths = np.minimum(block, numel - np.arange(added.shape[1], dtype=np.int64) * block)
    accepted = np.array([r is None for r in rules], dtype=bool)
    dirty = ((~accepted)[:, None] & (added != 0)).any(axis=0)  # blocks holding part of a rejected update
    keep = np.nonzero(accepted)[0].tolist()
    for b in np.nonzero(dirty)[0].tolist():
        lo, hi = b * block, b * block + int(lengths[b])
        restore(lo, hi)
        for c in keep:
            add_range(c, lo, hi)
    # The other blocks, for the whole batch at once: an accepted update's that were not added in full.
    todo = accepted[:, None] & (added != lengths) & ~dirty[None, :]
    for c, b in zip(*(i.tolist() for i in np.nonzero(todo)), strict=True):
        lo, done = b * block, int(added[c, b])
        add_range(c, lo + done, lo + int(lengths[b]))
    return [math.sqrt(t) if r is None else UpdateRejected(r, math.sqrt(t) if r == "norm-too-large" else math.inf, max_norm)
            for t, r in zip(totals.tolist(), rules, strict=True)]
