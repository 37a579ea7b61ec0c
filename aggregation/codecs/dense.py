"""``dense``: every coordinate, in float32, float16 or bfloat16 on the wire; fp32 accumulation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array

from ..wire import array_to_tensor, tensor_to_array
from .base import Codec, Encoded, Parsed, check_arrays, check_header, register_codec, require

# bfloat16 has no numpy dtype: it travels as its raw 16 bits in an int16 array.
_WIRE = {"float32": ("float32", torch.float32), "float16": ("float16", torch.float16), "bfloat16": ("int16", torch.bfloat16)}
VALUES = "values"


@register_codec
class DenseCodec(Codec):
    name = "dense"

    def __init__(self, dtype: str = "float32") -> None:
        require(dtype in _WIRE, "dense dtype", f"be one of {sorted(_WIRE)}", dtype)
        self.dtype = dtype

    def config(self) -> dict[str, Any]:
        return {"codec": self.name, "dtype": self.dtype}

    def encode(self, delta, residual=None, generator=None):
        x = delta if residual is None else delta + residual
        low = x.to(_WIRE[self.dtype][1])
        payload = low.view(torch.int16) if self.dtype == "bfloat16" else low
        return Encoded({VALUES: tensor_to_array(payload)}, {"codec": self.name, "numel": x.numel(), "dtype": self.dtype}), None

    def parse(self, arrays: Mapping[str, Array], header: Mapping[str, Any], numel: int, max_bytes: int) -> Parsed:
        check_header(header, self.name, numel)
        dtype = header.get("dtype")
        require(isinstance(dtype, str) and dtype in _WIRE, "dtype", f"be one of {sorted(_WIRE)}", dtype)
        nbytes = check_arrays(arrays, {VALUES}, max_bytes)
        wire, tdtype = _WIRE[dtype]
        values = array_to_tensor(arrays[VALUES], wire, numel)
        if dtype == "bfloat16":
            values = values.view(torch.bfloat16)
        return Parsed(self.name, numel, {VALUES: values}, {"dtype": dtype}, nbytes)

    def add_into(self, parsed: Parsed, out: torch.Tensor, weight: float) -> None:
        out.add_(parsed.tensors[VALUES].to(out.device, non_blocking=True), alpha=weight)

    def norm(self, parsed: Parsed) -> float:
        values = parsed.tensors[VALUES]
        if values.dtype == torch.float32:  # BLAS dot: half the time of vector_norm; NaN/inf/overflow -> non-finite
            return math.sqrt(float(torch.dot(values, values))) if values.numel() else 0.0
        return float(torch.linalg.vector_norm(values, dtype=torch.float32))
