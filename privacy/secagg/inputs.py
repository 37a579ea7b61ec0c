"""What a client feeds into SecAgg+: a clipped, weighted, quantized vector, optionally sparsified.

Layout of the masked vector (length ``dim``): the ``m`` kept coordinates of
``weight * clamp(update, -clip, clip)`` followed by ``weight * clip``. The
server dequantizes the ring sum and divides by the summed weight, which gives
a weighted mean without ever seeing one client's weight and update together.

Values beyond the clip range are clipped and counted (the count travels in the
client's metrics: a stated clipping, never a silent one). Quantization is
unbiased stochastic rounding driven by a generator seeded from the OS.

Shared-seed sparsification: every client keeps the same coordinate subset,
drawn from a public per-round seed (AES-CTR words below ``ratio * 2**32``), so
the masked sums line up; what is not sent stays in the client's residual
(error feedback), as with top-k.
"""

from __future__ import annotations

import os

import torch

from .._errors import PrivacyError
from .masking import SEED_BYTES, expand_seed, round_levels
from .protocol import SecAggParams, SecAggResult


def shared_subset(seed: bytes, numel: int, ratio: float) -> torch.Tensor | None:
    """Coordinates every client sends this round (sorted int64), or None when ``ratio >= 1`` (all)."""
    if not 0 < ratio <= 1:
        raise PrivacyError(f"secagg sparse ratio must be in (0, 1]. Found {ratio!r}.")
    if ratio >= 1:
        return None
    if len(seed) != SEED_BYTES:
        raise PrivacyError(f"subset seed must be {SEED_BYTES} bytes.")
    idx = torch.nonzero(expand_seed(seed, numel) < int(ratio * 2**32)).flatten()
    return idx if idx.numel() else torch.zeros(1, dtype=torch.int64)


def input_length(numel: int, subset: torch.Tensor | None) -> int:
    return (numel if subset is None else subset.numel()) + 1


def secagg_weight(num_examples: int, max_weight: int) -> float:
    """A client's weight in (0, 1] under ``num-examples`` weighting: its example count, capped, over the cap."""
    return min(num_examples, max_weight) / max_weight


def encode_input(values: torch.Tensor, weight: float, params: SecAggParams) -> tuple[torch.Tensor, int]:
    """Ring elements for ``values`` (the kept coordinates) with ``weight`` in (0, 1]; and how many were clipped."""
    if not 0 < weight <= 1:
        raise PrivacyError(f"secagg weight must be in (0, 1]. Found {weight!r}.")
    if values.numel() + 1 != params.dim:
        raise PrivacyError(f"secagg input must have {params.dim - 1} values. Found {values.numel()}.")
    c = float(params.clip)
    v = values.detach().reshape(-1).to(torch.float64)
    if not torch.isfinite(v).all():
        raise PrivacyError("update contains NaN or infinity; it cannot enter secure aggregation.")
    clipped = int(torch.count_nonzero(v.abs() > c))
    y = torch.empty(params.dim, dtype=torch.float64)
    torch.mul(v.clamp_(-c, c), weight, out=y[:-1])
    y[-1] = weight * c
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))
    return round_levels(y, c, len(params.nodes), params.bits, generator=gen), clipped  # y is in range


def decode_sum(result: SecAggResult) -> tuple[torch.Tensor, float]:
    """The survivors' weighted sum of kept coordinates (float64) and their summed weight."""
    s = result.dequantized()
    return s[:-1], float(s[-1]) / float(result.params.clip)
