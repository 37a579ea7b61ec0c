"""Streaming weighted accumulation of flat updates.

Memory is O(model size): each update is added into one running sum on the
aggregation device as it arrives, then dropped.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ._errors import AggregationError

if TYPE_CHECKING:
    from .codecs import Codec, Parsed


class WeightedAccumulator:
    """Running weighted sum ``sum_i w_i * x_i`` and ``sum_i w_i`` over flat tensors.

    Parameters
    ----------
    numel : int
        Length of every update.
    device : torch.device
        Where the sum lives; updates are moved there (non-blocking from pinned memory).
    dtype : torch.dtype
        Accumulation dtype (float32 by default; float64 for reference checks).
    """

    def __init__(self, numel: int, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if numel <= 0:
            raise AggregationError(f"numel must be > 0. Found {numel}.")
        self.numel = int(numel)
        self._sum = torch.zeros(self.numel, device=device, dtype=dtype)
        self.total_weight = 0.0
        self.count = 0

    @property
    def device(self) -> torch.device:
        return self._sum.device

    def add(self, update: torch.Tensor, weight: float) -> None:
        """Add ``weight * update`` into the sum. ``update`` is not modified."""
        if update.dim() != 1 or update.numel() != self.numel:
            raise AggregationError(f"update must be 1-D of length {self.numel}. Found shape {tuple(update.shape)}.")
        self._check_weight(weight)
        src = update.to(self._sum.device, non_blocking=True)
        if src.dtype != self._sum.dtype:
            src = src.to(self._sum.dtype)
        self._sum.add_(src, alpha=weight)
        self.total_weight += float(weight)
        self.count += 1

    def add_parsed(self, codec: "Codec", parsed: "Parsed", weight: float) -> None:
        """Decode a validated encoding straight into the sum (``codec.add_into``): no dense copy."""
        if parsed.numel != self.numel:
            raise AggregationError(f"update must have {self.numel} elements. Found {parsed.numel}.")
        self._check_weight(weight)
        codec.add_into(parsed, self._sum, float(weight))
        self.total_weight += float(weight)
        self.count += 1

    @staticmethod
    def _check_weight(weight: float) -> None:
        if isinstance(weight, bool) or not (math.isfinite(weight) and weight > 0):
            raise AggregationError(f"weight must be finite and > 0. Found {weight}.")

    @property
    def total(self) -> torch.Tensor:
        """The running weighted sum itself (not a copy): read it, do not write to it."""
        return self._sum

    def mean(self) -> torch.Tensor:
        """The weighted mean (a new tensor); raises if nothing was added."""
        if self.count == 0:
            raise AggregationError("mean needs at least one accepted update. Found none.")
        return self._sum / self.total_weight

    def reset(self) -> None:
        self._sum.zero_()
        self.total_weight = 0.0
        self.count = 0
