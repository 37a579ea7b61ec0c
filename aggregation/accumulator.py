"""Streaming weighted accumulation of flat updates.

Memory is O(model size): each update is added into one running sum on the
aggregation device as it arrives, then dropped.

``add_parsed_checked_many`` is the coordinator's hot path: a batch's norm checks and adds in one
pass over the sum where the codec has a fused kernel (``Codec.add_batch_checked``). A rejected
update leaves nothing of itself in the sum: the parts of it added ahead of the decision are not
subtracted again (float32 rounding of their size would stay, and a large weight makes that larger
than the others' sum) but their blocks rebuilt from the values before the batch
(``codecs.base.settle_batch``). Parts are added ahead only while that cannot overflow the sum
(``_bound``). ``add_parsed_checked`` (one update) decides before it writes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ._errors import AggregationError, UpdateRejected, each_checked
from .device import moved

if TYPE_CHECKING:
    from .codecs import Codec, Parsed


# Set by the test suite: a fresh or reset CPU sum then holds NaN instead of whatever the memory
# held (often zeros), so a path that adds into it without zeroing it first gives a wrong sum.
POISON_FRESH = False


# Weights are multiplied in float32: a smaller one vanishes from the sum (and a sum of only such weights
# divides by 0); a larger one becomes inf (1e39 is finite in float64) and its products NaN or inf.
MIN_WEIGHT, MAX_WEIGHT = 1e-30, 1e38  # float32 holds up to 3.4e38
WEIGHT_RULE = f"finite and in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}]"

class WeightedAccumulator:
    """Running weighted sum ``sum_i w_i * x_i`` and ``sum_i w_i`` over flat tensors.

    Parameters
    ----------
    numel : int
        Length of every update.
    device : torch.device
        Where the sum lives; updates are moved there (an aggregator's batches on CUDA arrive through
        pinned slots, one copy ahead of the adds: ``aggregation.staging``).
    dtype : torch.dtype
        Accumulation dtype (float32 by default; float64 for reference checks).
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if numel <= 0:
            raise AggregationError(f"numel must be > 0. Found {numel}.")
        self.numel = int(numel)
        self._sum = torch.empty(self.numel, device=device, dtype=dtype)
        self.reset()

    @property
    def device(self) -> torch.device:
        return self._sum.device

    def add(self, update: torch.Tensor, weight: float) -> None:
        """Add ``weight * update`` into the sum. ``update`` is not modified."""
        if update.dim() != 1 or update.numel() != self.numel:
            raise AggregationError(f"update must be 1-D of length {self.numel}. Found shape {tuple(update.shape)}.")
        self._check_weight(weight)
        src = moved(update, self._sum.device)
        if src.dtype != self._sum.dtype:
            src = src.to(self._sum.dtype)
        self._ready().add_(src, alpha=weight)
        self._bound = math.inf  # not measured (a checked add after this one reads its update twice)
        self.total_weight += float(weight)
        self.count += 1

    def add_parsed(self, codec: "Codec", parsed: "Parsed", weight: float, norm: float | None = None,
                   scale: float = 1.0) -> None:
        """Decode a validated encoding straight into the sum (``codec.add_into``): no dense copy.
        ``norm`` (the update's L2 norm, when known) keeps later checked adds on their one-pass path.
        ``scale`` in [0, 1] multiplies the weight after its check (a clip factor: the product may be far
        below the smallest weight accepted, for an update whose norm is far above the clip)."""
        if parsed.numel != self.numel:
            raise AggregationError(f"update must have {self.numel} elements. Found {parsed.numel}.")
        self._check_weight(weight)
        if not (isinstance(scale, int | float) and 0 <= scale <= 1):  # 0: a clip factor that underflowed
            raise AggregationError(f"scale must be in [0, 1]. Found {scale!r}.")
        w = float(weight) * float(scale)
        codec.add_into(parsed, self._ready(), w)
        self._bound += math.inf if norm is None else w * norm
        self.total_weight += w
        self.count += 1

    def add_parsed_checked(self, codec: "Codec", parsed: "Parsed", weight: float, max_norm: float = math.inf) -> float:
        """``add_parsed`` if the update's L2 norm is finite and <= ``max_norm``; return the norm.

        Otherwise raise UpdateRejected (``rule`` "non-finite" or "norm-too-large") and leave the
        sum bit-identical (``Codec.add_into_checked`` decides before it writes). Past a norm that
        could overflow the sum (``(_SAFE - _bound) / weight``) the update is checked first and
        added second whatever the codec.
        """
        if parsed.numel != self.numel:
            raise AggregationError(f"update must have {self.numel} elements. Found {parsed.numel}.")
        self._check_weight(weight)
        weight = float(weight)
        from .codecs.base import checked_add_two_pass  # lazy: the codecs are not needed to import this module

        safe = (_SAFE - self._bound) / weight
        self._ready()
        try:
            fused = getattr(codec, "add_into_checked", None)  # duck-typed sources may have only norm/add_into
            if fused is None or not safe > 0:
                raise UpdateRejected("norm-too-large", 0.0, safe)  # nothing may be added ahead: two passes
            norm = fused(parsed, self._sum, weight, min(max_norm, safe))
        except UpdateRejected as rej:
            if rej.rule != "norm-too-large" or not rej.norm <= max_norm:
                raise UpdateRejected(rej.rule, rej.norm, max_norm) from None
            # within max_norm but past what may be added ahead of the decision: decide, then add
            norm = checked_add_two_pass(codec, parsed, self._sum, weight, max_norm)
        self._bound += weight * norm
        self.total_weight += weight
        self.count += 1
        return norm

    def add_parsed_checked_many(self, codec: "Codec", batch: list["Parsed"], weights: list[float],
                                max_norm: float = math.inf) -> list[float | UpdateRejected]:
        """``add_parsed_checked`` for each update of ``batch``; returns, per update, its norm or the
        UpdateRejected it raised (the others are added whatever one of them breaks).

        Where the codec has a batch path (``Codec.add_batch_checked``: the fused CPU kernels), the
        whole batch is checked and added in one pass over the sum; the parts added ahead of their
        decision share what the sum may still grow by (``_SAFE - _bound``)."""
        if len(batch) != len(weights):
            raise AggregationError(f"weights must number as many as the updates ({len(batch)}). Found {len(weights)}.")
        for parsed, weight in zip(batch, weights, strict=True):
            if parsed.numel != self.numel:
                raise AggregationError(f"update must have {self.numel} elements. Found {parsed.numel}.")
            self._check_weight(weight)
        weights = [float(w) for w in weights]
        many = getattr(codec, "add_batch_checked", None)
        results = None
        if many is not None and batch:
            results = many(batch, self._sum, weights, max_norm, _SAFE - self._bound, zero=self._unzeroed)
            if results is not None:
                self._unzeroed = False
        if results is None:
            return each_checked(lambda p, w: self.add_parsed_checked(codec, p, w, max_norm), batch, weights)
        for res, weight in zip(results, weights, strict=True):
            if not isinstance(res, UpdateRejected):
                self._bound += weight * res
                self.total_weight += weight
                self.count += 1
        return results

    @staticmethod
    def _check_weight(weight: float) -> None:
        if isinstance(weight, bool) or not (math.isfinite(weight) and MIN_WEIGHT <= weight <= MAX_WEIGHT):
            raise AggregationError(f"weight must be {WEIGHT_RULE}. Found {weight}.")

    def _ready(self) -> torch.Tensor:
        """The sum, zeroed first if it is still fresh and unwritten."""
        if self._unzeroed:
            self._sum.zero_()
            self._unzeroed = False
        return self._sum

    @property
    def total(self) -> torch.Tensor:
        """The running weighted sum itself (not a copy): read it, do not write to it."""
        return self._ready()

    def mean(self) -> torch.Tensor:
        """The weighted mean (a new tensor); raises if nothing was added."""
        if self.count == 0:
            raise AggregationError("mean needs at least one accepted update. Found none.")
        return self._ready() / self.total_weight

    def reset(self) -> None:
        """Forget every update. On CPU in float32 (the fused kernels' case) the sum is left unwritten:
        the next batch's kernel zeroes each block in the thread that then adds into it, while it is
        in that core's cache, instead of a separate pass (and, when fresh, its page faults) on one
        thread. Every other path zeroes it first (``_ready``)."""
        self._unzeroed = self._sum.device.type == "cpu" and self._sum.dtype == torch.float32
        if not self._unzeroed:
            self._sum.zero_()
        elif POISON_FRESH:
            self._sum.fill_(math.nan)
        self.total_weight = 0.0
        self.count = 0
        self._bound = 0.0  # >= max_i |sum_i|: the sum of weight * L2 norm of what was added (inf: unknown)


# What a checked add may bring the sum's largest magnitude to before it has decided: far below
# float32's 3.4e38, so adding and subtracting again cannot overflow (and float64 sums never do).
_SAFE = 1e37
