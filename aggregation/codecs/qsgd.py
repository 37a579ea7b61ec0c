"""``qsgd``: unbiased stochastic uniform quantization, one float32 scale per chunk.

Each chunk of ``chunk`` coordinates (the last may be short) has scale
``s = max |x|``. A coordinate becomes an offset-binary code ``q`` in
``[0, M]``, ``M = 2**bits - 1``, standing for ``v(q) = s * (2q - M) / M``: the
2**bits levels evenly spaced on ``[-s, s]`` with step ``2s / M``. With
``t = (x / s + 1) * M / 2`` in ``[0, M]`` the code is ``floor(t)`` plus one with
probability ``t - floor(t)``, so ``E[q] = t`` and ``E[v(q)] = x`` exactly: the
codec is unbiased (up to float32 rounding of ``t``, about 1e-7 of a step) and
keeps no residual. Every decoded coordinate is within one step ``2s / M`` of
``x`` (variance at most ``step**2 / 4``), and ``|v| <= s`` so decoding never overflows.

Codes are packed little-end first: 8 // bits codes per byte, code ``i`` of a
byte in bits ``[i * bits, (i + 1) * bits)``; unused bits of the last byte are zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import Array

from .._errors import AggregationError
from ..wire import array_to_tensor, tensor_to_array
from .base import Codec, Encoded, Parsed, check_arrays, check_header, register_codec, require

CODES, SCALES = "codes", "scales"
_BITS = (2, 4, 8)
_CHUNK_MIN, _CHUNK_MAX = 64, 65536


def encode_input(delta: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """``delta + residual`` as a flat contiguous float32 tensor; rejects bad shapes and non-finite
    input (shared by the non-dense codecs)."""
    require(delta.dim() == 1 and delta.is_floating_point(), "delta", "be a 1-D floating tensor", tuple(delta.shape))
    require(delta.numel() > 0, "delta", "have at least one element", 0)
    x = delta.to(torch.float32).contiguous()  # may be ``delta`` itself: callers never write into it
    if residual is not None:
        require(residual.shape == delta.shape, "residual", f"have shape {tuple(delta.shape)}", tuple(residual.shape))
        x = x + residual.to(x.device, torch.float32)
    require(bool(torch.isfinite(x).all()), "delta + residual", "be finite to be encoded", "nan or inf")
    return x


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (each < 2**bits, bits in 1/2/4/8) into bytes, first code in the low bits."""
    if bits == 8:
        return codes
    per = 8 // bits
    padded = F.pad(codes, (0, -codes.numel() % per))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, per) << shifts).sum(1, dtype=torch.uint8)  # disjoint bits: sum == or


@lru_cache(maxsize=32)
def _level_table(bits: int, device: torch.device) -> torch.Tensor:
    """(256, 8 // bits) float32: for each byte value, ``(2q - M) / M`` of each code it packs."""
    m = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, device=device)
    codes = (torch.arange(256, device=device).unsqueeze(1) >> shifts) & m
    return codes.to(torch.float32).mul_(2).sub_(m).div_(m)  # exact integers, one rounding: in [-1, 1]


def unpack_levels(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack_codes`` fused with dequantization: ``(2q - M) / M`` for the first ``numel``
    codes, as a new float32 tensor on packed's device (a byte lookup: one gather, no shifts).

    Temporaries besides the result (4 bytes per code, rounded up to whole bytes): for bits < 8,
    the bytes as int32 indices (4 bytes per packed byte).
    """
    if bits == 8:  # one code per byte: the same formula as the table, computed directly (faster)
        return packed[:numel].to(torch.float32).mul_(2).sub_(255).div_(255)
    table = _level_table(bits, packed.device)
    return table.index_select(0, packed.to(torch.int32)).view(-1)[:numel]


def split_chunks(values: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a flat contiguous tensor: the whole chunks as (rows, chunk), and the short tail."""
    full = values.numel() - values.numel() % chunk
    return values[:full].view(-1, chunk), values[full:]


def padding_is_zero(packed: torch.Tensor, bits: int, numel: int) -> bool:
    """Whether the unused high bits of the last byte are all zero (canonical encoding)."""
    used = numel * bits % 8
    return used == 0 or int(packed[-1]) >> used == 0


@register_codec
class QSGDCodec(Codec):
    """Stochastic uniform quantization (QSGD-style, offset-binary levels).

    Parameters
    ----------
    bits : {2, 4, 8}
        Bits per coordinate on the wire.
    chunk : int
        Coordinates per scale, a power of two in [64, 65536].
    """

    name = "qsgd"

    def __init__(self, *, bits: int = 8, chunk: int = 1024) -> None:
        _check_params(bits, chunk, "qsgd ")
        self.bits = bits
        self.chunk = chunk

    def config(self) -> dict[str, Any]:
        return {"codec": self.name, "bits": self.bits, "chunk": self.chunk}

    def encode(self, delta, residual=None, generator=None):
        x = encode_input(delta, residual)  # qsgd keeps no residual, but honours one it is given
        n, m = x.numel(), (1 << self.bits) - 1
        body, tail = split_chunks(x, self.chunk)
        scales = body.abs().amax(1)
        if tail.numel():
            scales = torch.cat([scales, tail.abs().amax().view(1)])
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # zero chunks divide by 1
        t = x.clone()
        t_body, t_tail = split_chunks(t, self.chunk)
        t_body.div_(safe[: t_body.shape[0], None])
        t_tail.div_(safe[-1])
        t.add_(1).mul_(m / 2).clamp_(0, m)  # in [0, m]: |x| <= s, so x / s cannot overflow
        low = t.floor()
        u = torch.rand(n, generator=generator, device=generator.device if generator else x.device).to(x.device)
        codes = low.add_(u < t.sub_(low)).clamp_(0, m).to(torch.uint8)  # floor(t) + Bernoulli(t - floor(t))
        header = {"codec": self.name, "numel": n, "bits": self.bits, "chunk": self.chunk}
        arrays = {CODES: tensor_to_array(pack_codes(codes, self.bits)), SCALES: tensor_to_array(scales)}
        return Encoded(arrays, header), None

    def parse(self, arrays: Mapping[str, Array], header: Mapping[str, Any], numel: int, max_bytes: int) -> Parsed:
        check_header(header, self.name, numel)
        bits, chunk = header.get("bits"), header.get("chunk")
        _check_params(bits, chunk, "")
        nbytes = check_arrays(arrays, {CODES, SCALES}, max_bytes)
        try:
            codes = array_to_tensor(arrays[CODES], "uint8", -(-numel * bits // 8))
        except AggregationError as exc:
            raise AggregationError(f"codes ({numel} x {bits} bits): {exc}") from None
        try:
            scales = array_to_tensor(arrays[SCALES], "float32", -(-numel // chunk))
        except AggregationError as exc:
            raise AggregationError(f"scales (one per {chunk} coordinates): {exc}") from None
        require(bool(torch.isfinite(scales).all()), "scales", "be finite", "nan or inf")
        require(bool((scales >= 0).all()), "scales", "be >= 0", float(scales.min()))
        require(padding_is_zero(codes, bits, numel), "codes", "have zero padding bits in the last byte",
                int(codes[-1]))
        return Parsed(self.name, numel, {CODES: codes, SCALES: scales}, {"bits": bits, "chunk": chunk}, nbytes)

    def _levels(self, parsed: Parsed, device: torch.device) -> torch.Tensor:
        """(2q - M) / M per coordinate, in [-1, 1]: a new float32 tensor of numel on ``device``
        (plus the packed bytes copied there), which the callers scale in place."""
        codes = parsed.tensors[CODES].to(device, non_blocking=True)
        return unpack_levels(codes, parsed.params["bits"], parsed.numel)

    def add_into(self, parsed: Parsed, out: torch.Tensor, weight: float) -> None:
        scales = parsed.tensors[SCALES].to(out.device, non_blocking=True)
        levels = self._levels(parsed, out.device)
        body, tail = split_chunks(levels, parsed.params["chunk"])
        body.mul_(scales[: body.shape[0], None])
        tail.mul_(scales[-1])
        out.add_(levels, alpha=weight)

    def norm(self, parsed: Parsed) -> float:
        scales = parsed.tensors[SCALES].to(torch.float64)
        levels = self._levels(parsed, torch.device("cpu")).square_()
        body, tail = split_chunks(levels, parsed.params["chunk"])
        sq = body.sum(1, dtype=torch.float64)
        if tail.numel():
            sq = torch.cat([sq, tail.sum(dtype=torch.float64).view(1)])
        return math.sqrt(float((scales.square() * sq).sum()))


def _check_params(bits: Any, chunk: Any, prefix: str) -> None:
    require(type(bits) is int and bits in _BITS, f"{prefix}bits", f"be one of {list(_BITS)}", bits)
    ok = type(chunk) is int and _CHUNK_MIN <= chunk <= _CHUNK_MAX and chunk & (chunk - 1) == 0
    require(ok, f"{prefix}chunk", f"be a power of two in [{_CHUNK_MIN}, {_CHUNK_MAX}]", chunk)
