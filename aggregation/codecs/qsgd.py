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
import sys
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array

from .. import kernels
from ..device import moved
from .._errors import AggregationError
from ..wire import array_to_tensor, tensor_to_array
from .base import (FLT_MAX, Codec, Encoded, Parsed, check_arrays, check_header, checked_add_two_pass, encode_input,
                   register_codec, require, restorer, settle_batch)

CODES, SCALES = "codes", "scales"
_ARRAYS = frozenset({CODES, SCALES})
_BITS = (2, 4, 8)
_CHUNK_MIN, _CHUNK_MAX = 64, 65536
BLOCK = 1 << 18  # codes per step: a 1 MB float32 buffer (in L2); 64K blocks measured 1.6x slower, 1M no faster


_INV_HALF = {bits: float(np.float32(2 / ((1 << bits) - 1))) for bits in _BITS}
# float32(M/2) * float32(2/M) rounds to exactly 1 for these widths: the extreme levels are exact.
assert all(np.float32(((1 << b) - 1) / 2) * np.float32(r) == np.float32(1) for b, r in _INV_HALF.items())


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
    if packed.device.type != "cpu":
        return unpack_levels_by_shifts(packed, bits, numel)
    table = _level_table(bits, packed.device)
    return table.index_select(0, packed.to(torch.int32)).view(-1)[:numel]


def unpack_levels_by_shifts(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """``unpack_levels`` for bits < 8 by shifts and the table's own formula (on CPU bit-identical to
    the table; CUDA divides by a scalar as a multiply by its reciprocal, within one float32 ulp): on
    a GPU, where the table's gather ran at 76 us per 1M codes on an H200 (about 50 GB/s) and these
    elementwise kernels at memory speed."""
    m = (1 << bits) - 1
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = ((packed.unsqueeze(1) >> shifts) & m).view(-1)[:numel]
    return codes.to(torch.float32).mul_(2).sub_(m).div_(m)


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
        nbytes = check_arrays(arrays, _ARRAYS, max_bytes)
        try:
            codes = array_to_tensor(arrays[CODES], "uint8", -(-numel * bits // 8))
        except AggregationError as exc:
            raise AggregationError(f"codes ({numel} x {bits} bits): {exc}") from None
        try:
            scales = array_to_tensor(arrays[SCALES], "float32", -(-numel // chunk))
        except AggregationError as exc:
            raise AggregationError(f"scales (one per {chunk} coordinates): {exc}") from None
        s_np = scales.numpy()  # numpy on these ~10^3 scales: ~1 us a check where a torch op costs ~5
        if not np.isfinite(s_np).all():  # each rule tested first, its message formatted only on failure
            require(False, "scales", "be finite", "nan or inf")
        if not (s_np >= 0).all():
            require(False, "scales", "be >= 0", float(s_np.min()))
        if not padding_is_zero(codes, bits, numel):
            require(False, "codes", "have zero padding bits in the last byte", int(codes[-1]))
        return Parsed(self.name, numel, {CODES: codes, SCALES: scales}, {"bits": bits, "chunk": chunk}, nbytes,
                      host={SCALES: s_np})  # stays on the host when the tensors are staged to a GPU

    @staticmethod
    def _factors(parsed: Parsed, out: torch.Tensor, weight: float) -> torch.Tensor:
        """``weight * s`` per chunk (rounded once, in float64, to ``out``'s dtype), a column on its device."""
        scales = parsed.tensors[SCALES]
        if scales.device == out.device and out.device.type != "cpu":  # staged: made there, no host-to-device copy
            return (scales.double() * weight).to(out.dtype)[:, None]
        s64 = _host_scales(parsed).astype(np.float64)
        factors = torch.from_numpy(s64 * weight).to(out.dtype)
        return moved(factors, out.device)[:, None]

    def _blocks(self, parsed: Parsed, device: torch.device, unit: list[float] | None = None
                ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Per block of whole chunks (the last block may end in a short chunk): ``(start, rows,
        levels)`` with ``levels`` the block's ``(2q - M) / M`` as float32 (one reused cache-sized
        buffer, valid until the next block). With ``unit`` (a list to fill), the levels are left
        unscaled, exact multiples of ``unit[0]`` (one pass less; the caller scales)."""
        bits, chunk, numel = parsed.params["bits"], parsed.params["chunk"], parsed.numel
        codes = moved(parsed.tensors[CODES], device)
        # both powers of two: a whole number of chunks. On a GPU one step for the whole update: its
        # kernel launches bound it there, not a cache (transient buffers of 4 bytes per coordinate,
        # 6 at 4 bits, besides the rule's own storage).
        block = max(chunk, BLOCK) if device.type == "cpu" else max(chunk, -(-numel // chunk) * chunk)
        buf = torch.empty(block + 8, dtype=torch.float32, device=device)
        # the 4-bit int16 spread reads its bytes little-endian (x86, ARM, CUDA)
        fast4 = bits == 4 and sys.byteorder == "little"
        scratch = torch.empty(block + 8, dtype=torch.int16, device=device) if fast4 else None
        for start in range(0, numel, block):
            stop = min(start + block, numel)
            yield start, -(-(stop - start) // chunk), level_codes(codes, bits, start, stop, buf, scratch, unit)

    def add_into(self, parsed: Parsed, out: torch.Tensor, weight: float) -> None:
        # v = level * s: one addcmul per block with per-chunk factors s * weight.
        chunk = parsed.params["chunk"]
        factors = self._factors(parsed, out, weight)
        for start, rows, levels in self._blocks(parsed, out.device):
            r0 = start // chunk
            _add_rows(out, start, chunk, rows, levels, factors[r0 : r0 + rows])

    def norm(self, parsed: Parsed) -> float:
        return math.sqrt(self._sq_norm(parsed))

    def _sq_norm(self, parsed: Parsed) -> float:
        chunk = parsed.params["chunk"]
        row_norms = torch.empty(-(-parsed.numel // chunk), dtype=torch.float64)
        for start, rows, levels in self._blocks(parsed, torch.device("cpu")):
            _row_norms(levels, chunk, rows, row_norms[start // chunk : start // chunk + rows])
        return _sq_from_rows(row_norms, _host_scales(parsed))

    def add_into_checked(self, parsed: Parsed, out: torch.Tensor, weight: float, max_norm: float) -> float:
        """Scales are finite (parse), so every decoded value is bounded by its chunk's scale: if
        the bound ``sqrt(chunk * sum(s^2))`` is within ``max_norm``, nothing can be rejected or
        overflow and one pass decodes each block once for both its row norms and its add.
        Otherwise the norm is computed first (two passes, nothing written before deciding)."""
        chunk = parsed.params["chunk"]
        s64 = _host_scales(parsed).astype(np.float64)
        bound_sq = chunk * float(np.dot(s64, s64))
        if not (math.isfinite(bound_sq) and bound_sq <= FLT_MAX and math.sqrt(bound_sq) <= max_norm):
            return checked_add_two_pass(self, parsed, out, weight, max_norm)
        # Unscaled levels (exact half-integers, times ``unit``) with ``unit`` folded into the
        # per-chunk factors: one pass less per block; the result differs from ``add_into``'s by
        # float32 rounding only (each product rounded once either way, factors rounded once).
        unit = [_unit(parsed.params["bits"])]
        row_norms = torch.empty(s64.size, dtype=torch.float64, device=out.device)
        factors = self._factors(parsed, out, weight * unit[0])
        for start, rows, levels in self._blocks(parsed, out.device, unit):
            r0 = start // chunk
            _row_norms(levels, chunk, rows, row_norms[r0 : r0 + rows])
            _add_rows(out, start, chunk, rows, levels, factors[r0 : r0 + rows])
        return math.sqrt(_sq_from_rows(row_norms, _host_scales(parsed))) * unit[0]

    def add_batch_checked(self, batch, out, weights, max_norm, budget, zero=False):
        """The fused kernel (``aggregation.kernels``): codes decoded once per chunk for both the
        norm and the add, the sum kept in cache; as dense's, a chunk is kept ahead of the decision
        only within ``max_norm`` and this update's share of ``budget`` (its scale bounds it a
        priori, so most chunks are decoded once). Needs one (bits, chunk) for the whole batch."""
        if not batch or not kernels.applies(out):
            return None
        bits, chunk = batch[0].params["bits"], batch[0].params["chunk"]
        if any(p.params["bits"] != bits or p.params["chunk"] != chunk for p in batch):
            return None
        restore = restorer(out, zero)
        m, numel = (1 << bits) - 1, out.numel()
        block = max(kernels.BLOCK, chunk)
        ws = np.asarray(weights, dtype=np.float64)
        cap = np.clip(np.minimum(max_norm, max(budget, 0.0) / len(batch) / ws), 0.0, None)
        codes = [p.tensors[CODES].numpy() for p in batch]
        scales = [p.tensors[SCALES].numpy() for p in batch]
        sq, added = kernels.batch_arrays(len(batch), numel, block)
        impl = kernels.load()
        kernels.run_ranges(impl.qsgd_range, numel, block, kernels.typed_list(codes), kernels.typed_list(scales), bits,
                           chunk, ws, (cap * m) ** 2, out.numpy(), block, sq, added, bool(zero))

        def add_range(c: int, lo: int, hi: int) -> None:
            impl.qsgd_add(codes[c], scales[c], bits, chunk, float(ws[c]) / m, out.numpy(), lo, hi)

        return settle_batch(sq, added, float(m), max_norm, block, numel, add_range, restore, float32_norm=False)

    def write_into(self, parsed: Parsed, out: torch.Tensor) -> None:
        out.zero_()
        self.add_into(parsed, out, 1.0)


def _unit(bits: int) -> float:
    """What ``level_codes(..., unit=[...])`` leaves its values to be multiplied by."""
    return _INV_HALF[bits] / 16 if bits == 4 and sys.byteorder == "little" else _INV_HALF[bits]


def level_codes(codes: torch.Tensor, bits: int, start: int, stop: int, buf: torch.Tensor,
                scratch: torch.Tensor | None = None, unit: list[float] | None = None) -> torch.Tensor:
    """``(2q - M) / M`` (float32) for codes ``[start, stop)`` of packed ``codes``, written into
    ``buf`` (``start`` a multiple of 8; ``buf`` has ``stop - start + 8`` elements). Computed as
    ``(q - M/2) * r`` with ``r = float32(2 / M)``: the subtraction is exact, the extreme codes
    give exactly -1 and 1 (checked below for every width) and rounding is monotonic, so every
    level lies in [-1, 1] (``|v| <= s`` exactly), within 2 float32 ulps of ``(2q - M) / M``
    (a multiply: half the time of a divide).

    4 bits (``scratch``: int16, as many elements as ``buf``): each byte ``x = lo + 16 hi`` becomes
    the int16 ``16 x + 240 (x & 0xF0) = 16 lo + 256 (16 hi)`` (mod 2^16), whose two bytes are
    ``16 lo`` and ``16 hi`` in code order: one contiguous converting copy, no strided writes;
    then ``(16 q - 120) * (r / 16)``, the same products as ``(q - 7.5) * r`` (exact powers of two).

    ``unit`` (a one-element list): skip the final multiply and leave ``unit[0]`` (``r``, or ``r / 16``
    on the 4-bit int16 path) as the factor the exact half-integer values still need.
    """
    half, r = ((1 << bits) - 1) / 2, _INV_HALF[bits]
    if bits == 8:
        dst = buf[: stop - start]
        dst.copy_(codes[start:stop])
        dst.sub_(half)
        if unit is not None:
            unit[0] = r
            return dst
        return dst.mul_(r)
    per = 8 // bits
    b0, b1 = start // per, -(-stop // per)
    src = codes[b0:b1]
    if bits == 4 and scratch is not None:
        nb = b1 - b0
        wide, high = scratch[:nb], scratch[nb : 2 * nb]
        wide.copy_(src)
        torch.bitwise_and(wide, 0xF0, out=high)
        wide.mul_(16).add_(high, alpha=240)  # wraps (two's complement) past 2^15: only the two bytes count
        dst = buf[: 2 * nb]
        dst.copy_(wide.view(torch.uint8))
        dst.sub_(16 * half)
        if unit is not None:
            unit[0] = r / 16
            return dst[: stop - start]
        return dst.mul_(r / 16)[: stop - start]
    dst = buf[: (b1 - b0) * per]
    lanes = dst.view(-1, per)
    mask = (1 << bits) - 1
    for i in range(per):  # code i of each byte into lane i (uint8 ops, then one converting copy)
        lane = src & mask if i == 0 else (src >> (i * bits) if i == per - 1 else (src >> (i * bits)) & mask)
        lanes[:, i].copy_(lane)
    dst.sub_(half)
    if unit is not None:
        unit[0] = r
        return dst[: stop - start]
    return dst.mul_(r)[: stop - start]


def _host_scales(parsed: Parsed) -> np.ndarray:
    """The scales as a host array: parse's (kept when the tensors were staged to a GPU), else read back."""
    s = parsed.host.get(SCALES)
    return s if s is not None else parsed.tensors[SCALES].cpu().numpy()


def _sq_from_rows(row_norms: torch.Tensor, scales: np.ndarray) -> float:
    """``sum_r (s_r * |levels_r|)^2`` in float64."""
    per_row = row_norms.cpu().numpy() * scales
    return float(np.dot(per_row, per_row))


def _row_norms(levels: torch.Tensor, chunk: int, rows: int, out: torch.Tensor) -> None:
    """L2 norm of each chunk of ``levels`` (the last may be short) into ``out`` (float64, rows)."""
    full = levels.numel() // chunk
    if full:  # accumulated in float64: float32 over 2^16 unscaled levels was off by 6e-5 (the kernel's is not)
        torch.linalg.vector_norm(levels[: full * chunk].view(full, chunk), dim=1, dtype=torch.float64, out=out[:full])
    if rows > full:
        torch.linalg.vector_norm(levels[full * chunk :], dtype=torch.float64, out=out[full])


def _add_rows(out: torch.Tensor, start: int, chunk: int, rows: int, levels: torch.Tensor, factors: torch.Tensor) -> None:
    """``out[start:] += levels * factor`` of each chunk (the last may be short); ``factors`` a
    (rows, 1) column in ``out``'s dtype."""
    n = levels.numel()
    full = n // chunk
    if full:
        rows_view = levels[: full * chunk].view(full, chunk)
        out[start : start + full * chunk].view(full, chunk).addcmul_(rows_view, factors[:full])
    if rows > full:
        out[start + full * chunk : start + n].addcmul_(levels[full * chunk :], factors[full, 0])


def _check_params(bits: Any, chunk: Any, prefix: str) -> None:
    if not (type(bits) is int and bits in _BITS):
        require(False, f"{prefix}bits", f"be one of {list(_BITS)}", bits)
    if not (type(chunk) is int and _CHUNK_MIN <= chunk <= _CHUNK_MAX and chunk & (chunk - 1) == 0):
        require(False, f"{prefix}chunk", f"be a power of two in [{_CHUNK_MIN}, {_CHUNK_MAX}]", chunk)
