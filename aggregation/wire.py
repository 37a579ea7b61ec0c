"""Flat tensors to and from Flower ``Array`` records without extra copies.

Flower's ``Array`` carries ``numpy.save`` bytes (an ``.npy`` header, then the raw
buffer). We write that format directly from the tensor's memory and read it back
with ``numpy.frombuffer`` at the header's offset (``torch.from_numpy`` on top), so a received update is never
copied before it is added into the accumulator.
"""

from __future__ import annotations

import ast
import warnings

import numpy as np
import torch
from flwr.app import Array

from ._errors import AggregationError, shown

_MAGIC = b"\x93NUMPY"
_DTYPES = {
    "float32": (torch.float32, "<f4"),
    "float16": (torch.float16, "<f2"),
    "bfloat16": (torch.bfloat16, None),
    "int8": (torch.int8, "|i1"),
    "int16": (torch.int16, "<i2"),
    "int32": (torch.int32, "<i4"),
    "int64": (torch.int64, "<i8"),
    "uint8": (torch.uint8, "|u1"),
}


def _npy_header(descr: str, numel: int) -> bytes:
    header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': ({numel},), }}"
    # npy v1.0: total header length (magic + 2 + 2 + text) padded to 64 bytes.
    pad = 64 - (len(_MAGIC) + 4 + len(header) + 1) % 64
    text = (header + " " * pad + "\n").encode("latin1")
    return _MAGIC + b"\x01\x00" + len(text).to_bytes(2, "little") + text


def tensor_to_array(tensor: torch.Tensor) -> Array:
    """Pack a 1-D tensor as a Flower ``Array`` (npy layout, one copy into bytes)."""
    flat = tensor.detach().reshape(-1)
    name = str(flat.dtype).removeprefix("torch.")
    if name not in _DTYPES or _DTYPES[name][1] is None:
        raise AggregationError(f"tensor dtype must be one of {sorted(k for k, v in _DTYPES.items() if v[1])}. Found {name}.")
    flat = flat.to("cpu").contiguous()
    body = flat.numpy().tobytes()
    data = _npy_header(_DTYPES[name][1], flat.numel()) + body
    return Array(dtype=name, shape=(flat.numel(),), stype="numpy.ndarray", data=data)


_HEADER_CACHE: dict[bytes, tuple[str, tuple[int, ...], int]] = {}
_NP_DTYPES = {name: np.dtype(descr) for name, (_, descr) in _DTYPES.items() if descr is not None}
# Received bytes are immutable and only ever read through these views: torch's warning that the
# array is not writable says nothing here. torch gives it once per process (TORCH_WARN_ONCE), so
# it is spent here, silenced, instead of surfacing at the first reply.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.from_numpy(np.frombuffer(b"\0", dtype=np.uint8))


def _parse_header(data: bytes) -> tuple[str, tuple[int, ...], int]:
    """(descr, shape, data offset) of npy bytes; headers seen before are not parsed again."""
    if len(data) >= 10 and data[:8] == _MAGIC + b"\x01\x00":
        end = 10 + int.from_bytes(data[8:10], "little")
        cached = _HEADER_CACHE.get(data[:end])
        if cached is not None:
            return cached
        parsed = _parse_header_uncached(data)
        if len(_HEADER_CACHE) < 4096:
            _HEADER_CACHE[data[:end]] = parsed
        return parsed
    return _parse_header_uncached(data)


def _parse_header_uncached(data: bytes) -> tuple[str, tuple[int, ...], int]:
    if len(data) < 10 or data[:6] != _MAGIC:
        raise AggregationError("array data must start with the npy magic bytes. Found something else.")
    major = data[6]
    if major == 1:
        hlen, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        if len(data) < 12:
            raise AggregationError("array data is truncated inside the npy header.")
        hlen, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise AggregationError(f"npy version must be 1, 2 or 3. Found {major}.")
    if hlen > 4096 or start + hlen > len(data):
        raise AggregationError(f"npy header length must be <= 4096 and inside the data. Found {hlen}.")
    try:
        meta = ast.literal_eval(data[start : start + hlen].decode("latin1"))
        descr, fortran, shape = meta["descr"], meta["fortran_order"], tuple(meta["shape"])
    except (ValueError, SyntaxError, KeyError, TypeError, RecursionError, MemoryError) as exc:
        raise AggregationError(f"npy header must be a dict with descr/fortran_order/shape. Found error: {exc}.") from None
    if fortran or not isinstance(descr, str) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise AggregationError("npy header must describe a C-ordered array of a plain dtype.")
    return descr, shape, start + hlen


def array_view(array: Array, expected_dtype: str, expected_numel: int | None = None) -> np.ndarray:
    """View an ``Array``'s bytes as a read-only 1-D numpy array, validating layout first.

    Checks the declared dtype, stype and shape, that the npy header agrees with
    them, and that the byte count is exact. Shares memory with the record (no copy).
    """
    want = _NP_DTYPES.get(expected_dtype)
    if want is None:
        raise AggregationError(f"expected dtype must be a supported wire dtype. Found {expected_dtype}.")
    if array.stype != "numpy.ndarray":
        raise AggregationError(f"stype must be 'numpy.ndarray'. Found {shown(array.stype, 40)}.")
    if array.dtype != expected_dtype:
        raise AggregationError(f"dtype must be {expected_dtype}. Found {shown(array.dtype, 40)}.")
    shape = tuple(array.shape)
    if len(shape) != 1:
        raise AggregationError(f"shape must be 1-D (one flat tensor). Found {shown(shape, 60)}.")
    if expected_numel is not None and shape[0] != expected_numel:
        raise AggregationError(f"length must be {expected_numel}. Found {shape[0]}.")
    data = array.data
    head_descr, head_shape, offset = _parse_header(data)
    if head_descr != want.str or head_shape != shape:  # the common spelling first: no dtype parsing
        try:
            head_dtype = np.dtype(head_descr)
        except (TypeError, ValueError):
            raise AggregationError(f"npy header dtype must be a valid numpy dtype. Found {head_descr!r}.") from None
        if head_dtype != want or head_shape != shape:
            raise AggregationError(
                f"npy header must match dtype {expected_dtype} and shape {shape}. Found {head_descr} {head_shape}.")
    if len(data) - offset != shape[0] * want.itemsize:
        raise AggregationError(
            f"data must hold exactly {shape[0] * want.itemsize} bytes after the header. Found {len(data) - offset}."
        )
    return np.frombuffer(data, dtype=want, count=shape[0], offset=offset)


def array_to_tensor(array: Array, expected_dtype: str, expected_numel: int | None = None) -> torch.Tensor:
    """``array_view`` as a tensor (same checks, same memory): callers must not write to it."""
    return host_tensor(array_view(array, expected_dtype, expected_numel))


def host_tensor(view: np.ndarray) -> torch.Tensor:
    """A tensor on a received (read-only) numpy view, sharing its memory; an unaligned view (only a
    foreign buffer: npy headers are padded to 64 bytes) is copied once."""
    return torch.from_numpy(view if view.flags.aligned else view.copy())
