"""Cryptographic core of SecAgg+ (Bell et al. 2020): Shamir sharing, key agreement, masking, graphs.

The protocol's state machines are in ``protocol`` (client and server, four stages),
the clipped/weighted/quantized input in ``inputs``; coordinator/secure.py and
clients/secure.py carry them over Flower messages.
"""

from .graph import Graph, check_threshold, choose_degree, complete_graph, harary_graph
from .keys import KeyPair, PairwiseKeys, agree, decrypt_share, derive_key, derive_pairwise, encrypt_share
from .masking import SEED_BYTES, dequantize, expand_seed, mask, quantization_step, quantize, ring_sum, unmask
from .shamir import PRIME, Share, combine, split

__all__ = [
    "Graph",
    "KeyPair",
    "PRIME",
    "PairwiseKeys",
    "SEED_BYTES",
    "Share",
    "agree",
    "check_threshold",
    "choose_degree",
    "combine",
    "complete_graph",
    "decrypt_share",
    "dequantize",
    "derive_key",
    "derive_pairwise",
    "encrypt_share",
    "expand_seed",
    "harary_graph",
    "mask",
    "quantization_step",
    "quantize",
    "ring_sum",
    "split",
    "unmask",
]
