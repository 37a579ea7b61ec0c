"""Aggregation rules (mean, clipped mean, median, trimmed mean, Krum), chosen by name.

Every rule takes validated updates one at a time through ``add(codec, parsed,
weight)``, which decodes with ``codec.add_into`` straight into the rule's own
storage on its device, and returns the aggregated delta from ``result()``.

Memory. ``mean`` and ``norm-bounded-mean`` stream: one float32 sum of ``numel``.
``median``, ``trimmed-mean``, ``krum`` and ``multi-krum`` need every update at
once: they hold one preallocated ``(max_clients, numel)`` float32 buffer and
compute in column chunks, so what ``result()`` allocates besides its output is
bounded by the chunk (``work_bytes``, an estimate), not by the model.

Non-finite updates are refused by every rule (a NaN poisons a sum and has no
order): ``add`` raises and leaves the aggregator as it was. The streaming rules
decide from the update's norm, so they also refuse an update whose norm overflows
the codec's norm dtype (about 3.4e38 for float32).

``add_checked(codec, parsed, weight, max_norm)`` is the coordinator's path: the
norm check (non-finite, or L2 norm above ``max_norm``: UpdateRejected with that
rule) fused with the add, one pass over the update where the codec allows. The
buffered rules are bit-exact on rejection (the row is not committed); under
``mean`` a rejected update leaves nothing of itself in the sum either (the blocks
it was partly added to are rebuilt, see ``WeightedAccumulator``).

Example
-------
>>> import torch
>>> agg = create_aggregator("median", numel=3, device="cpu", max_clients=4)
>>> for x in ([1.0, 0.0, 5.0], [2.0, 0.0, 6.0], [9.0, 9.0, 9.0]):
...     agg.add_dense(torch.tensor(x), weight=1.0)
>>> agg.result()
tensor([2., 0., 6.])
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from numbers import Real
from typing import Any, ClassVar

import torch

from ._errors import AggregationError, UpdateRejected, each_checked, shown
from .accumulator import MAX_WEIGHT, MIN_WEIGHT, WEIGHT_RULE, WeightedAccumulator
from .device import memory_bytes
from .staging import DeviceStager
from ._registry import Registry

_REGISTRY = Registry("aggregator")
_WORK_ELEMENTS = 1 << 22  # default chunk: about this many buffer elements per column chunk
_SORT_BYTES = 1 << 20  # CPU median / trimmed mean: columns sorted per step (fits in L2)


def register_aggregator(name: str) -> Callable[[type], type]:
    """Class decorator: make an aggregation rule available under ``name``."""
    return _REGISTRY.decorator(name, set_name=True)


def available_aggregators() -> list[str]:
    return _REGISTRY.names()


def create_aggregator(name: str, numel: int, device: torch.device | str, max_clients: int, **params: Any) -> Aggregator:
    """Build the rule ``name`` for updates of ``numel`` floats, at most ``max_clients`` of them.

    Unknown names and unknown or bad parameters raise AggregationError (a silently
    dropped robustness parameter would weaken the rule without a word).
    """
    return _REGISTRY.build(name, numel, device, max_clients, **params)


def _check(ok: bool, what: str, rule: str, found: Any) -> None:
    if not ok:
        raise AggregationError(f"{what} must {rule}. Found {shown(found)}.")


def _check_weight(weight: Any) -> None:
    _check(_is_real(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT, "weight", f"be {WEIGHT_RULE}", weight)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


class _TensorSource:
    """A plain 1-D tensor behind the two codec methods the rules use (for ``add_dense``)."""

    def __init__(self, update: torch.Tensor) -> None:
        self.tensor = update
        self.numel = update.numel()

    @staticmethod
    def add_into(parsed: _TensorSource, out: torch.Tensor, weight: float) -> None:
        out.add_(parsed.tensor.to(out.device), alpha=weight)

    @staticmethod
    def norm(parsed: _TensorSource) -> float:
        return float(torch.linalg.vector_norm(parsed.tensor, dtype=torch.float64))


def _write_into(codec: Any, parsed: Any, out: torch.Tensor) -> None:
    """``out[:] = decode(parsed)``: the codec's ``write_into`` (dense: one copy), else zero and add."""
    write = getattr(codec, "write_into", None)
    if write is not None:
        write(parsed, out)
    else:
        out.zero_()
        codec.add_into(parsed, out, 1.0)


class Aggregator(ABC):
    """One aggregation rule over flat float32 updates of a fixed length.

    Attributes
    ----------
    count : int
        Updates accepted so far.
    total_weight : float
        Sum of their weights (rules that ignore weights still record it).
    peak_bytes : int
        Bytes of the rule's preallocated storage on its device.
    work_bytes : int
        Estimated upper bound on what ``result()`` allocates besides that storage
        (its output included).
    """

    name: ClassVar[str] = ""

    def __init__(self, numel: int, device: torch.device | str, max_clients: int) -> None:
        _check(_is_int(numel) and numel > 0, "numel", "be an int > 0", numel)
        _check(_is_int(max_clients) and max_clients > 0, "max-clients", "be an int > 0", max_clients)
        self.numel, self.max_clients, self.device = numel, max_clients, torch.device(device)
        self.count, self.total_weight = 0, 0.0
        # On CUDA, a batch's updates reach the device through pinned slots, each copied while the
        # previous one is checked and added (aggregation.staging); on CPU the kernels read the records.
        self.staging: DeviceStager | None = DeviceStager(self.device) if self.device.type == "cuda" else None

    def add(self, codec: Any, parsed: Any, weight: float, norm: float | None = None) -> None:
        """Decode one validated update into the rule's storage with weight ``weight`` (> 0).

        ``norm``: the update's L2 norm when the caller has already computed it (the
        coordinator's validation has), so the hot path does not read the update twice.
        """
        _check_weight(weight)
        _check(parsed.numel == self.numel, "update numel", f"be {self.numel}", parsed.numel)
        _check(self.count < self.max_clients, f"{self.name} updates", f"number at most max-clients={self.max_clients}",
               self.count + 1)
        if norm is not None:
            _check(_is_real(norm) and norm >= 0, "update norm", "be finite and >= 0", norm)
        self._add(codec, parsed, float(weight), norm)
        self.count += 1
        self.total_weight += float(weight)

    def add_checked(self, codec: Any, parsed: Any, weight: float, max_norm: float = math.inf) -> float:
        """``add`` after the norm check, fused with it where the rule and codec allow; return the norm.

        Raises UpdateRejected (an AggregationError; ``rule`` "non-finite" or "norm-too-large")
        and leaves the aggregator as it was (nothing of the update in it, see the module docstring).
        """
        _check_weight(weight)
        _check(parsed.numel == self.numel, "update numel", f"be {self.numel}", parsed.numel)
        _check(self.count < self.max_clients, f"{self.name} updates", f"number at most max-clients={self.max_clients}",
               self.count + 1)
        _check(isinstance(max_norm, Real) and not isinstance(max_norm, bool) and max_norm > 0, "max norm", "be > 0",
               max_norm)
        norm = self._add_checked(codec, parsed, float(weight), float(max_norm))
        self.count += 1
        self.total_weight += float(weight)
        return norm

    def add_checked_many(self, codec: Any, batch: list[Any], weights: list[float],
                         max_norm: float = math.inf) -> list[float | UpdateRejected]:
        """``add_checked`` for each update of ``batch`` (all in ``codec``); returns, per update,
        its norm or the UpdateRejected it raised. Rules that can take the batch in one pass
        (``mean``, with the fused CPU kernels) do; the others add one at a time."""
        _check(len(batch) == len(weights), "weights", f"number as many as the updates ({len(batch)})", len(weights))
        _check(self.count + len(batch) <= self.max_clients, f"{self.name} updates",
               f"number at most max-clients={self.max_clients}", self.count + len(batch))
        _check(isinstance(max_norm, Real) and not isinstance(max_norm, bool) and max_norm > 0, "max norm", "be > 0",
               max_norm)
        for parsed, weight in zip(batch, weights, strict=True):
            _check_weight(weight)
            _check(parsed.numel == self.numel, "update numel", f"be {self.numel}", parsed.numel)
        if self.staging is not None:  # one update at a time, the next one's copy in flight meanwhile
            return each_checked(lambda p, w: self.add_checked(codec, p, w, max_norm), self.staging.pipeline(batch),
                                [float(w) for w in weights])
        return self._add_checked_many(codec, batch, [float(w) for w in weights], float(max_norm))

    def _add_checked_many(self, codec: Any, batch: list[Any], weights: list[float],
                          max_norm: float) -> list[float | UpdateRejected]:
        """Default: ``add_checked`` one update at a time."""
        return each_checked(lambda p, w: self.add_checked(codec, p, w, max_norm), batch, weights)

    def _add_checked(self, codec: Any, parsed: Any, weight: float, max_norm: float) -> float:
        """Default: the norm (``codec.norm``), its check, then ``_add`` (two reads of the update)."""
        norm = float(codec.norm(parsed))
        if not math.isfinite(norm):
            raise UpdateRejected("non-finite", norm, max_norm)
        if norm > max_norm:
            raise UpdateRejected("norm-too-large", norm, max_norm)
        self._add(codec, parsed, weight, norm)
        return norm

    def add_dense(self, update: torch.Tensor, weight: float) -> None:
        """``add`` for a plain 1-D floating tensor of length ``numel``."""
        _check(isinstance(update, torch.Tensor) and update.dim() == 1 and update.is_floating_point(),
               "update", "be a 1-D floating tensor", getattr(update, "shape", type(update)))
        self.add(_TensorSource, _TensorSource(update), weight)

    @property
    def min_updates(self) -> int:
        """The fewest accepted updates ``result`` can combine (Krum's rules need more than one)."""
        return 1

    def result(self) -> torch.Tensor:
        """The aggregated delta: a new float32 tensor of ``numel`` on the rule's device."""
        if self.count == 0:
            raise AggregationError(f"{self.name} needs at least one accepted update. Found none.")
        if self.count < self.min_updates:
            raise AggregationError(f"{self.name} needs at least {self.min_updates} accepted updates. Found {self.count}.")
        return self._result()

    def reset(self) -> None:
        """Forget every update (storage is kept for the next round)."""
        self.count, self.total_weight = 0, 0.0

    @property
    @abstractmethod
    def peak_bytes(self) -> int: ...

    @property
    @abstractmethod
    def work_bytes(self) -> int: ...

    @abstractmethod
    def _add(self, codec: Any, parsed: Any, weight: float, norm: float | None) -> None:
        """Store one update; raise AggregationError without changing state if it is not finite
        (``norm``, when given, is the update's finite L2 norm, already checked)."""

    @abstractmethod
    def _result(self) -> torch.Tensor: ...


class _Streaming(Aggregator):
    """``sum_i w_i * s_i * x_i / sum_i w_i`` in one running sum (a WeightedAccumulator), ``s_i`` from ``_scale``."""

    def __init__(self, numel: int, device: torch.device | str, max_clients: int) -> None:
        super().__init__(numel, device, max_clients)
        self._acc = WeightedAccumulator(numel, device=self.device)

    peak_bytes = property(lambda self: 4 * self.numel)
    work_bytes = property(lambda self: 4 * self.numel)

    def _scale(self, norm: float) -> float:
        return 1.0

    def _add(self, codec: Any, parsed: Any, weight: float, norm: float | None) -> None:
        if norm is None:
            norm = float(codec.norm(parsed))
            _check(math.isfinite(norm), "update norm", "be finite", norm)
        self._acc.add_parsed(codec, parsed, weight, norm, scale=self._scale(norm))

    def _result(self) -> torch.Tensor:
        return self._acc.total / self.total_weight  # the unscaled weights: a clipped update counts fully

    def reset(self) -> None:
        super().reset()
        self._acc.reset()


@register_aggregator("mean")
class Mean(_Streaming):
    """Weighted mean ``sum_i w_i x_i / sum_i w_i`` (FedAvg's); no robustness."""

    def _add(self, codec: Any, parsed: Any, weight: float, norm: float | None) -> None:
        if norm is None:  # not validated upstream: the finiteness check, fused with the add
            try:
                self._acc.add_parsed_checked(codec, parsed, weight)
            except UpdateRejected as rej:
                raise AggregationError(f"update norm must be finite. Found {rej.norm!r}.") from None
        else:
            self._acc.add_parsed(codec, parsed, weight, norm)

    def _add_checked(self, codec: Any, parsed: Any, weight: float, max_norm: float) -> float:
        return self._acc.add_parsed_checked(codec, parsed, weight, max_norm)

    def _add_checked_many(self, codec: Any, batch: list[Any], weights: list[float],
                          max_norm: float) -> list[float | UpdateRejected]:
        results = self._acc.add_parsed_checked_many(codec, batch, weights, max_norm)
        for res, weight in zip(results, weights, strict=True):
            if not isinstance(res, UpdateRejected):
                self.count += 1
                self.total_weight += weight
        return results


@register_aggregator("norm-bounded-mean")
class NormBoundedMean(_Streaming):
    """Weighted mean of updates each scaled by ``min(1, clip / ||x_i||)``.

    One update moves the result by at most ``w_i * clip / sum_j w_j``.
    """

    def __init__(self, numel: int, device: torch.device | str, max_clients: int, *, clip: float) -> None:
        _check(_is_real(clip) and clip > 0, "clip", "be finite and > 0", clip)
        super().__init__(numel, device, max_clients)
        self.clip = float(clip)

    def _scale(self, norm: float) -> float:
        return 1.0 if norm <= self.clip else self.clip / norm


class _Buffered(Aggregator):
    """Rules that need all updates: row ``i`` of one ``(max_clients, numel)`` buffer holds update ``i``."""

    def __init__(self, numel: int, device: torch.device | str, max_clients: int, chunk_size: int | None) -> None:
        super().__init__(numel, device, max_clients)
        if chunk_size is None:
            chunk_size = max(1, _WORK_ELEMENTS // max_clients)
        _check(_is_int(chunk_size) and chunk_size > 0, "chunk-size", "be an int > 0", chunk_size)
        self.chunk_size = min(chunk_size, numel)
        need, have = max_clients * numel * 4, memory_bytes(self.device)
        _check(need <= have, "max-clients", f"let its ({max_clients} x {numel}) float32 buffer of {need / 2**30:.3g} GiB "
               f"fit in the {self.device.type} memory of {have / 2**30:.3g} GiB (fewer updates per round or buffer)",
               max_clients)
        try:
            self._rows = torch.empty(max_clients, numel, dtype=torch.float32, device=self.device)
        except (RuntimeError, MemoryError) as exc:  # the allocator refused (other allocations, a cgroup limit)
            raise AggregationError(f"{self.name} must allocate its ({max_clients} x {numel}) float32 buffer of "
                                   f"{need / 2**30:.3g} GiB. Found: {shown(str(exc).splitlines()[0])}") from None
        self._weights: list[float] = []

    peak_bytes = property(lambda self: self._rows.numel() * 4)

    def _add(self, codec: Any, parsed: Any, weight: float, norm: float | None) -> None:
        row = self._rows[self.count]
        _write_into(codec, parsed, row)
        if norm is None:  # not validated upstream: check here
            low, high = torch.aminmax(row)  # NaN propagates; one pass, no temporary
            _check(math.isfinite(float(low)) and math.isfinite(float(high)), "update values", "be finite",
                   "a NaN or infinity")
        self._weights.append(weight)

    def _add_checked(self, codec: Any, parsed: Any, weight: float, max_norm: float) -> float:
        # The row is scratch until count moves past it: a rejected update is never committed.
        write = getattr(codec, "write_into_checked", None)
        if write is None:
            return super()._add_checked(codec, parsed, weight, max_norm)
        norm = write(parsed, self._rows[self.count], max_norm)
        self._weights.append(weight)
        return norm

    def reset(self) -> None:
        super().reset()
        self._weights.clear()

    def _chunks(self) -> Iterator[slice]:
        for start in range(0, self.numel, self.chunk_size):
            yield slice(start, min(start + self.chunk_size, self.numel))

    def _transposed_chunks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """Per column chunk, a contiguous ``(columns, count)`` copy: selecting along short
        contiguous rows is faster than along the buffer's strided first dimension."""
        for cols in self._chunks():
            yield cols, self._rows[: self.count, cols].T.contiguous()

    def _sorted_chunks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """On CPU, per column chunk, a ``(columns, count)`` tensor whose rows are the columns'
        values sorted ascending: numpy's sort (AVX-512 sorting networks on these short rows where
        the CPU has them) in one reused buffer of about ``_SORT_BYTES``, cache-sized (~5x faster
        than ``torch.topk``). Exact: the values are only permuted."""
        n = self.count
        width = max(1, min(self.chunk_size, _SORT_BYTES // (4 * n)))
        buf = torch.empty(width, n, dtype=torch.float32)
        for start in range(0, self.numel, width):
            cols = slice(start, min(start + width, self.numel))
            x = buf[: cols.stop - cols.start]
            x.copy_(self._rows[:n, cols].T)
            x.numpy().sort(axis=1)
            yield cols, x

    def _order_work_bytes(self, per_column: int) -> int:
        # output + transposed copy + top-k values + int64 indices + what the rule adds per column
        return 4 * self.numel + (16 * self.max_clients + per_column) * self.chunk_size


@register_aggregator("median")
class Median(_Buffered):
    """Coordinate-wise median, unweighted. For an even count it is the average of the
    two middle values (numpy's and Flower's ``aggregate_median``), not torch's lower one."""

    def __init__(self, numel: int, device: torch.device | str, max_clients: int, *,
                 chunk_size: int | None = None) -> None:
        super().__init__(numel, device, max_clients, chunk_size)

    work_bytes = property(lambda self: self._order_work_bytes(40))  # top two (values, indices), float64 middles

    def _result(self) -> torch.Tensor:
        n, out = self.count, torch.empty(self.numel, dtype=torch.float32, device=self.device)
        if self.device.type == "cpu":
            for cols, x in self._sorted_chunks():
                if n % 2:
                    out[cols] = x[:, n // 2]
                else:
                    out[cols] = (x[:, n // 2 - 1].double() + x[:, n // 2].double()) * 0.5
            return out
        for cols, x in self._transposed_chunks():
            # the n // 2 + 1 smallest values: their largest is the upper middle, the next one the lower
            low = torch.topk(x, n // 2 + 1, dim=1, largest=False, sorted=False).values
            if n % 2:
                out[cols] = low.amax(dim=1)
            else:
                two = torch.topk(low, 2, dim=1).values
                out[cols] = (two[:, 0].double() + two[:, 1].double()) * 0.5
        return out


@register_aggregator("trimmed-mean")
class TrimmedMean(_Buffered):
    """Coordinate-wise trimmed mean, unweighted: drop the ``k = floor(beta * n)`` largest and
    ``k`` smallest values of each coordinate and average the rest (``scipy.stats.trim_mean``)."""

    def __init__(self, numel: int, device: torch.device | str, max_clients: int, *, beta: float,
                 chunk_size: int | None = None) -> None:
        _check(_is_real(beta) and 0 <= beta < 0.5, "beta", "be in [0, 0.5)", beta)
        super().__init__(numel, device, max_clients, chunk_size)
        self.beta = float(beta)

    work_bytes = property(lambda self: self._order_work_bytes(12 * self.max_clients + 4))  # a second top-k, the sum

    def _result(self) -> torch.Tensor:
        n, out = self.count, torch.empty(self.numel, dtype=torch.float32, device=self.device)
        k = int(self.beta * n)
        if self.device.type == "cpu":
            for cols, x in self._sorted_chunks():
                torch.sum(x[:, k : n - k], dim=1, out=out[cols]).div_(n - 2 * k)
            return out
        for cols, x in self._transposed_chunks():
            if k:  # the n - k smallest, then the n - 2k largest of those; order statistics, no subtraction
                x = torch.topk(x, n - k, dim=1, largest=False, sorted=False).values
                x = torch.topk(x, n - 2 * k, dim=1, sorted=False).values
            out[cols] = x.sum(dim=1).div_(n - 2 * k)  # float32: a float64 sum costs +10% on CPU
        return out


def trimmed_mean_min_updates(beta: float) -> int:
    """The fewest updates a trimmed mean of ``beta`` > 0 trims anything from (``floor(beta n) >= 1``; with fewer
    it is a plain mean, as scipy's and Flower's are); 1 at ``beta`` = 0, which trims nothing by design."""
    if beta <= 0:
        return 1
    n = math.ceil(1 / beta)
    while int(beta * n) < 1:  # 1 / beta rounded down in float
        n += 1
    return n


def krum_min_updates(f: int, m: int = 1) -> int:
    """The fewest updates Krum (``n > 2f + 2``) or Multi-Krum (also ``m <= n - f``) can combine."""
    return max(2 * f + 3, m + f)


@register_aggregator("krum")
class Krum(_Buffered):
    """Krum (Blanchard et al. 2017): the update whose summed squared distance to its
    ``n - f - 2`` nearest other updates is smallest; needs ``n > 2f + 2``. Unweighted.

    After ``result()``, ``selected`` lists the chosen updates' indices (order of ``add``).
    """

    def __init__(self, numel: int, device: torch.device | str, max_clients: int, *, f: int,
                 chunk_size: int | None = None) -> None:
        _check(_is_int(f) and f >= 0, "f", "be an int >= 0", f)
        _check(max_clients > 2 * f + 2, "max-clients", f"be > 2f + 2 = {2 * f + 2} for krum with f={f}", max_clients)
        super().__init__(numel, device, max_clients, chunk_size)
        self.f = f
        self.selected: list[int] = []

    # float64 copy of a chunk, a few n x n float64 matrices, the output
    work_bytes = property(lambda self: 4 * self.numel + 8 * self.max_clients * (self.chunk_size + 4 * self.max_clients))

    @property
    def min_updates(self) -> int:
        return krum_min_updates(self.f)

    def scores(self) -> torch.Tensor:
        """Krum score of each accepted update (float64, on the device).

        Squared distances come from a float64 Gram matrix, ``|a|^2 + |b|^2 - 2 a.b``: exact
        products of float32 inputs, so the relative error of a distance ``d`` between updates
        of norm ``r`` is about ``1e-16 * (r / d)^2``.
        """
        n = self.count
        _check(n > 2 * self.f + 2, f"{self.name} update count", f"be > 2f + 2 = {2 * self.f + 2} (f={self.f})", n)
        gram = torch.zeros(n, n, dtype=torch.float64, device=self.device)
        for cols in self._chunks():
            x = self._rows[:n, cols].double()
            gram.addmm_(x, x.T)
        sq = gram.diagonal()
        dist = (sq[:, None] + sq[None, :] - 2 * gram).clamp_(min=0).fill_diagonal_(math.inf)
        return dist.topk(n - self.f - 2, dim=1, largest=False).values.sum(dim=1)

    def reset(self) -> None:
        super().reset()
        self.selected = []

    def _result(self) -> torch.Tensor:
        best = int(torch.argmin(self.scores()))
        self.selected = [best]
        return self._rows[best].clone()


@register_aggregator("multi-krum")
class MultiKrum(Krum):
    """Multi-Krum: the weighted mean of the ``m`` updates with the best Krum scores
    (ties broken by arrival order); needs ``n > 2f + 2`` and ``m <= n - f``."""

    def __init__(self, numel: int, device: torch.device | str, max_clients: int, *, f: int, m: int,
                 chunk_size: int | None = None) -> None:
        super().__init__(numel, device, max_clients, f=f, chunk_size=chunk_size)
        _check(_is_int(m) and 1 <= m <= max_clients - f, "m", f"be an int in [1, max-clients - f = {max_clients - f}]",
               m)
        self.m = m

    @property
    def min_updates(self) -> int:
        return krum_min_updates(self.f, self.m)

    def _result(self) -> torch.Tensor:
        n = self.count  # >= m + f (min_updates, checked by result)
        chosen = torch.argsort(self.scores(), stable=True)[: self.m].cpu()
        self.selected = sorted(chosen.tolist())
        w = torch.zeros(n, dtype=torch.float64)
        w[chosen] = torch.tensor(self._weights, dtype=torch.float64)[chosen]
        w = (w / w.sum()).to(device=self.device, dtype=torch.float32)
        return w @ self._rows[:n]
