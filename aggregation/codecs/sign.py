"""``sign``: scaled sign compression with error feedback (EF-signSGD).

Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019: with ``x = delta + residual`` and ``scale = ||x||_1 / n``,
send one bit per coordinate (1 means ``x >= 0``) and ``scale``; the decoded
update is ``scale * sign(x)`` with sign(0) = +1. With error feedback the new
residual is ``x - decoded``, so nothing is lost over rounds: the sum of decoded
updates plus the final residual equals the sum of the deltas.

Bits are packed 8 per byte, coordinate ``8j + i`` in bit ``i`` of byte ``j``;
the unused bits of the last byte must be zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from flwr.app import Array

from ..device import moved
from .._errors import AggregationError
from ..wire import array_to_tensor, tensor_to_array
from .base import Codec, Encoded, Parsed, check_arrays, check_header, encode_input, register_codec, require
from .qsgd import pack_codes, padding_is_zero, unpack_levels

BITS, SCALE = "bits", "scale"


@register_codec
class SignCodec(Codec):
    """EF-signSGD.

    Parameters
    ----------
    error_feedback : bool
        Return ``x - scale * sign(x)`` as the residual to add to the next delta.
    """

    name = "sign"

    def __init__(self, *, error_feedback: bool = True) -> None:
        require(isinstance(error_feedback, bool), "sign error_feedback", "be a bool", error_feedback)
        self.error_feedback = error_feedback

    def config(self) -> dict[str, Any]:
        return {"codec": self.name, "error_feedback": self.error_feedback}

    def encode(self, delta, residual=None, generator=None):
        x = encode_input(delta, residual)
        n = x.numel()
        scale = (x.abs().sum(dtype=torch.float64) / n).to(torch.float32).view(1)
        positive = x >= 0
        header = {"codec": self.name, "numel": n}
        arrays = {BITS: tensor_to_array(pack_codes(positive.to(torch.uint8), 1)), SCALE: tensor_to_array(scale)}
        new_residual = None
        if self.error_feedback:
            decoded = torch.where(positive, scale, -scale)
            new_residual = x - decoded
        return Encoded(arrays, header), new_residual

    def parse(self, arrays: Mapping[str, Array], header: Mapping[str, Any], numel: int, max_bytes: int) -> Parsed:
        check_header(header, self.name, numel)
        nbytes = check_arrays(arrays, {BITS, SCALE}, max_bytes)
        try:
            bits = array_to_tensor(arrays[BITS], "uint8", -(-numel // 8))
        except AggregationError as exc:
            raise AggregationError(f"bits (one per coordinate): {exc}") from None
        try:
            scale = array_to_tensor(arrays[SCALE], "float32", 1)
        except AggregationError as exc:
            raise AggregationError(f"scale: {exc}") from None
        value = float(scale.numpy()[0])
        if not (math.isfinite(value) and value >= 0):
            require(False, "scale", "be finite and >= 0", value)
        if not padding_is_zero(bits, 1, numel):
            require(False, "bits", "have zero padding bits in the last byte", int(bits[-1]))
        return Parsed(self.name, numel, {BITS: bits, SCALE: scale}, {"scale": value}, nbytes)

    def add_into(self, parsed: Parsed, out: torch.Tensor, weight: float) -> None:
        # Temporaries on out's device: the packed bytes, their int32 indices (4 bytes per
        # packed byte) and the +-1 signs (float32, numel) from a byte lookup.
        signs = unpack_levels(moved(parsed.tensors[BITS], out.device), 1, parsed.numel)
        out.add_(signs, alpha=weight * parsed.params["scale"])

    def norm(self, parsed: Parsed) -> float:
        return parsed.params["scale"] * math.sqrt(parsed.numel)
