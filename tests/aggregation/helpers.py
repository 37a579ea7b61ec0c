"""What clients send, for tests of the receiving side."""

from __future__ import annotations

import torch

from aggregation import tensor_to_array
from aggregation.codecs import Encoded


def sent(codec, x: torch.Tensor, generator: torch.Generator | None = None) -> Encoded:
    """``codec.encode(x)``; for dense with non-finite values (which fedshield's encode refuses), the
    wire form a client that skips the check sends, such as a stock Flower client's NaN update: the
    coordinator must reject it, so the tests need it on the wire."""
    if codec.name == "dense" and not bool(torch.isfinite(x).all()):
        from aggregation.codecs.dense import _WIRE, VALUES

        low = x.to(_WIRE[codec.dtype][1])
        payload = low.view(torch.int16) if codec.dtype == "bfloat16" else low
        return Encoded({VALUES: tensor_to_array(payload)}, {"codec": "dense", "numel": x.numel(), "dtype": codec.dtype})
    return codec.encode(x, None, generator)[0]
