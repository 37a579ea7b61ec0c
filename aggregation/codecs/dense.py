"""``dense``: every coordinate, in float32, float16 or bfloat16 on the wire; fp32 accumulation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flwr.app import Array

from .. import kernels
from ..wire import array_view, host_tensor, tensor_to_array
from ..device import moved
from .._errors import UpdateRejected
from .base import (FLT_MAX, Codec, Encoded, Parsed, check_arrays, check_header, encode_input, norm_rule, register_codec,
                   require, restorer, settle_batch)

# bfloat16 has no numpy dtype: it travels as its raw 16 bits in an int16 array.
_WIRE = {"float32": ("float32", torch.float32), "float16": ("float16", torch.float16), "bfloat16": ("int16", torch.bfloat16)}
VALUES = "values"
_ARRAYS = frozenset({VALUES})
# Block of the fused check-and-add (float32 elements): the dot leaves it in cache for the add.
# 256K floats (1 MB, half per thread on two) measured fastest on a 2-core Xeon with 2 MB L2 per
# core: 64K blocks pay ~5 us of torch op overhead too often, 1M blocks fall out of L2.
BLOCK = 1 << 18


@register_codec
class DenseCodec(Codec):
    name = "dense"

    def __init__(self, dtype: str = "float32") -> None:
        require(isinstance(dtype, str) and dtype in _WIRE, "dense dtype", f"be one of {sorted(_WIRE)}", dtype)
        self.dtype = dtype

    def config(self) -> dict[str, Any]:
        return {"codec": self.name, "dtype": self.dtype}

    def encode(self, delta, residual=None, generator=None):
        """Finite input only (as every codec); a value past the wire dtype's range saturates at its
        largest finite value (as topk's values do) instead of becoming inf, which the coordinator
        would reject as non-finite."""
        x = encode_input(delta, residual)
        wire = _WIRE[self.dtype][1]
        if wire != torch.float32:
            limit = torch.finfo(wire).max
            x = x.clamp(-limit, limit)
        low = x.to(wire)
        payload = low.view(torch.int16) if self.dtype == "bfloat16" else low
        return Encoded({VALUES: tensor_to_array(payload)}, {"codec": self.name, "numel": x.numel(), "dtype": self.dtype}), None

    def parse(self, arrays: Mapping[str, Array], header: Mapping[str, Any], numel: int, max_bytes: int) -> Parsed:
        check_header(header, self.name, numel)
        dtype = header.get("dtype")
        if not (isinstance(dtype, str) and dtype in _WIRE):  # tested first, the message formatted only on failure
            require(False, "dtype", f"be one of {sorted(_WIRE)}", dtype)
        nbytes = check_arrays(arrays, _ARRAYS, max_bytes)
        view = array_view(arrays[VALUES], _WIRE[dtype][0], numel)
        values = host_tensor(view)
        if dtype == "bfloat16":
            return Parsed(self.name, numel, {VALUES: values.view(torch.bfloat16)}, {"dtype": dtype}, nbytes)
        return Parsed(self.name, numel, {VALUES: values}, {"dtype": dtype}, nbytes,
                      host={VALUES: view} if dtype == "float32" and view.flags.aligned else {})

    def add_into(self, parsed: Parsed, out: torch.Tensor, weight: float) -> None:
        out.add_(moved(parsed.tensors[VALUES], out.device), alpha=weight)

    def add_batch_checked(self, batch, out, weights, max_norm, budget, zero=False):
        """The fused kernel (``aggregation.kernels``): each update read once, the sum kept in cache.
        A step is kept ahead of the decision only if its own norm is within ``max_norm`` and
        within this update's share of ``budget`` (``budget / len(batch) / weight``), so nothing
        kept can overflow; a step that is not is restored exactly, and so is every block of an
        update rejected once all its blocks are read (``settle_batch``; a sum that is not fresh
        is copied first for that, one model's size)."""
        if not batch or not kernels.applies(out) or any(p.tensors[VALUES].dtype != torch.float32 for p in batch):
            return None
        restore = restorer(out, zero)
        ws = np.asarray(weights, dtype=np.float64)
        cap = np.clip(np.minimum(max_norm, max(budget, 0.0) / len(batch) / ws), 0.0, None)
        block = kernels.BLOCK
        sq, added = kernels.batch_arrays(len(batch), out.numel(), block)
        kernels.run_ranges(kernels.load().dense_range, out.numel(), block,
                           kernels.typed_list([p.host[VALUES] if p.host else p.tensors[VALUES].numpy() for p in batch]), ws, cap, out.numpy(),
                           block, kernels.SUB, sq, added, bool(zero))

        def add_range(c: int, lo: int, hi: int) -> None:
            out[lo:hi].add_(batch[c].tensors[VALUES][lo:hi], alpha=float(ws[c]))

        return settle_batch(sq, added, 1.0, max_norm, block, out.numel(), add_range, restore)

    def write_into(self, parsed: Parsed, out: torch.Tensor) -> None:
        out.copy_(parsed.tensors[VALUES])

    def write_into_checked(self, parsed: Parsed, out: torch.Tensor, max_norm: float) -> float:
        """Copy block by block, each block's sum of squares taken from the copy while it is in cache."""
        values = parsed.tensors[VALUES]
        if values.dtype != torch.float32 or out.dtype != torch.float32:
            return super().write_into_checked(parsed, out, max_norm)
        sq = 0.0
        for start in range(0, values.numel(), BLOCK):
            dst = out[start : start + BLOCK]
            dst.copy_(values[start : start + BLOCK])
            sq += float(torch.dot(dst, dst))
            if not math.isfinite(sq):
                break
        rule = norm_rule(sq, max_norm)
        if rule is not None:
            raise UpdateRejected(rule, math.sqrt(sq) if rule == "norm-too-large" else math.inf, max_norm)
        return math.sqrt(sq)

    def norm(self, parsed: Parsed) -> float:
        """On CPU, float32 within each block (the BLAS dot: half the time of vector_norm), float64
        across blocks: one float32 reduction over a whole update drifts with its length
        (CPU vector_norm: 1e-5 relative at 1M elements, 4e-4 at 10M; the dot 5e-5 at 10M). CUDA's
        tree reductions do not: one call there, one sync. NaN, inf or overflow -> non-finite."""
        values = parsed.tensors[VALUES]
        f32 = values.dtype == torch.float32
        if values.device.type != "cpu":
            return math.sqrt(float(torch.dot(values, values))) if f32 else float(
                torch.linalg.vector_norm(values, dtype=torch.float32))
        sq, wide = 0.0, None if f32 else torch.empty(min(BLOCK, values.numel()), dtype=torch.float32)
        for start in range(0, values.numel(), BLOCK):
            b = values[start : start + BLOCK]
            if wide is not None:  # float16 / bfloat16: widened into one cache-sized buffer, then the dot
                b = wide[: b.numel()].copy_(b)
            sq += float(torch.dot(b, b))
        return math.sqrt(sq) if sq <= FLT_MAX else math.inf  # past float32's range: non-finite, as one dot said
