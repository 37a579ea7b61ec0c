"""Codecs: how updates travel (dense, top-k sparse, stochastic quantization, sign)."""

from .base import Codec, Encoded, Parsed, available_codecs, create_codec, register_codec
from .dense import DenseCodec
from .qsgd import QSGDCodec
from .sign import SignCodec
from .topk import TopKCodec

__all__ = [
    "Codec",
    "DenseCodec",
    "Encoded",
    "Parsed",
    "QSGDCodec",
    "SignCodec",
    "TopKCodec",
    "available_codecs",
    "create_codec",
    "register_codec",
]
