"""Quantization into the ring Z_(2**bits) and SecAgg+ masking with a cryptographic keystream.

Ring representation: torch int64 tensors holding values in ``[0, 2**bits)``;
sums are reduced with ``& (2**bits - 1)``, which is exact modular arithmetic
for a power-of-two modulus, negative intermediates included.

Masks: a 32-byte seed is the full AES-256 key of an AES-CTR keystream (zero
IV) over zero bytes, read as little-endian uint32 words and added with numpy's
uint32 wrap-around arithmetic (single-threaded, no temporaries, no int64 copies). All 256 seed bits
count (Flower's ``pseudo_rand_gen`` folds its seed into 32 bits for
``numpy.random.RandomState``). Each seed must expand one stream only: seeds
come from HKDF with a per-purpose label (pairwise) or ``os.urandom`` (self).

Quantization: with ``L = (2**bits - 1) // n_clients`` levels, a value in
``[-clip, clip]`` maps to ``[0, L]`` with step ``2 * clip / L``, so the sum of
``n_clients`` quantized values is at most ``n_clients * L < 2**bits`` and never
wraps: the modular sum equals the integer sum. Stochastic rounding makes each
quantized value unbiased; the dequantized sum is within ``n_clients * step``
of the float sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from .._errors import PrivacyError

SEED_BYTES = 32
_ZERO_IV = bytes(16)


def _modulus_mask(bits: int) -> int:
    if not isinstance(bits, int) or not 1 <= bits <= 32:
        raise PrivacyError(f"ring bits must be an integer in [1, 32]. Found {bits!r}.")
    return (1 << bits) - 1


def _check_seed(seed: bytes, n: int) -> None:
    if len(seed) != SEED_BYTES:
        raise PrivacyError(f"mask seed must be {SEED_BYTES} bytes (all of them are used). Found {len(seed)}.")
    if n < 0:
        raise PrivacyError(f"mask length must be >= 0. Found {n}.")


def _encrypt_zeros(seed: bytes, zeros: bytes, buf: bytearray) -> None:
    """AES-256-CTR (zero IV) keyed by ``seed`` over ``zeros`` into ``buf`` (len(zeros) + 15 bytes)."""
    Cipher(algorithms.AES(bytes(seed)), modes.CTR(_ZERO_IV)).encryptor().update_into(zeros, buf)


def keystream(seed: bytes, n: int) -> np.ndarray:
    """``n`` uniform uint32 words from an AES-256-CTR keystream keyed by the 32-byte seed (no copy made)."""
    _check_seed(seed, n)
    buf = bytearray(4 * n + 15)  # update_into needs len(data) + block_size - 1 bytes
    _encrypt_zeros(seed, bytes(4 * n), buf)
    return np.frombuffer(buf, dtype="<u4", count=n)


def expand_seed(seed: bytes, n: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`keystream` as an int64 tensor."""
    out = torch.from_numpy(keystream(seed, n).astype(np.int64))
    return out if device is None else out.to(device)


def apply_masks_(words: np.ndarray, seeds: Iterable[tuple[bytes, int]]) -> np.ndarray:
    """Add (sign +1) or subtract (sign -1) each seed's keystream into ``words`` (uint32, in place).

    uint32 arithmetic wraps mod 2**32, which every ring Z_(2**bits), bits <= 32, divides:
    reduce with ``& (2**bits - 1)`` once at the end. One pass per seed, no temporaries
    beyond the keystream itself.
    """
    if words.dtype != np.uint32:
        raise PrivacyError(f"mask words must be uint32. Found {words.dtype}.")
    n = words.size
    zeros, buf = bytes(4 * n), bytearray(4 * n + 15)  # one source and one keystream buffer for every seed
    stream = np.frombuffer(buf, dtype="<u4", count=n)
    for seed, sign in seeds:
        _check_seed(seed, n)
        _encrypt_zeros(seed, zeros, buf)
        (np.add if sign > 0 else np.subtract)(words, stream, out=words)
    return words


def pairwise_signs(my_id: int, pairwise: Mapping[int, bytes]) -> list[tuple[bytes, int]]:
    """Bell et al.: node ``u`` adds ``PRG(s_uv)`` for ``v > u`` and subtracts it for ``v < u``."""
    if my_id in pairwise:
        raise PrivacyError(f"node {my_id} lists itself as a masking peer.")
    return [(seed, 1 if my_id < peer else -1) for peer, seed in pairwise.items()]


def quantization_step(clip: float, n_clients: int, bits: int = 32) -> float:
    """Width of one quantization level so that ``n_clients`` values in [-clip, clip] sum below 2**bits."""
    if not (isinstance(clip, int | float) and np.isfinite(clip) and clip > 0):
        raise PrivacyError(f"clip must be a finite float > 0. Found {clip!r}.")
    levels = _levels(n_clients, bits)
    return 2.0 * float(clip) / levels


def _levels(n_clients: int, bits: int) -> int:
    if not isinstance(n_clients, int) or n_clients < 1:
        raise PrivacyError(f"n_clients must be an integer >= 1. Found {n_clients!r}.")
    levels = _modulus_mask(bits) // n_clients
    if levels < 1:
        raise PrivacyError(f"{n_clients} clients cannot share a 2**{bits} ring without overflow; "
                           f"need n_clients < 2**bits.")
    return levels


def quantize(x: torch.Tensor, clip: float, n_clients: int, bits: int = 32, *,
             generator: torch.Generator | None = None, clipping: str = "raise") -> torch.Tensor:
    """Map floats in [-clip, clip] to ring elements in [0, L] by unbiased stochastic rounding.

    Values outside the range raise PrivacyError unless ``clipping="clip"``; NaN always raises.
    ``generator`` drives the rounding; pass a CSPRNG-seeded one in secure mode.
    """
    if clipping not in ("raise", "clip"):
        raise PrivacyError(f"clipping must be 'raise' or 'clip'. Found {clipping!r}.")
    quantization_step(clip, n_clients, bits)  # clip, n_clients and bits checked before the values
    xf = x.detach().to(torch.float64)
    if torch.isnan(xf).any():
        raise PrivacyError("update contains NaN; it cannot be quantized for secure aggregation.")
    outside = xf.abs() > clip
    if outside.any():
        if clipping == "raise":
            raise PrivacyError(f"{int(outside.sum())} values lie outside [-{clip}, {clip}] (max |x| = "
                               f"{float(xf.abs().max()):.6g}); the overflow bound needs them clipped. "
                               f"Pass clipping='clip' to clip explicitly.")
        xf = xf.clamp(-clip, clip)
    shared = xf.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # round_levels writes into it
    return round_levels(xf.clone() if shared else xf, clip, n_clients, bits, generator=generator)


def round_levels(y: torch.Tensor, clip: float, n_clients: int, bits: int = 32, *,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """:func:`quantize`'s rounding for a float64 ``y`` already known finite and within [-clip, clip]
    (checked by the caller); ``y`` is used as scratch (overwritten), so the rounding allocates two buffers, not five."""
    step, levels = quantization_step(clip, n_clients, bits), _levels(n_clients, bits)
    y.add_(clip).div_(step)
    q = torch.floor(y)
    frac = y.sub_(q)
    u = torch.rand(y.shape, generator=generator, dtype=torch.float64, device=y.device)
    q.add_(torch.lt(u, frac, out=u.new_empty(y.shape, dtype=torch.bool)))  # 1 with probability frac
    return q.clamp_(0, levels).to(torch.int64)


def dequantize(total: torch.Tensor, n_clients: int, clip: float, bits: int = 32) -> torch.Tensor:
    """Float64 sum of ``n_clients`` dequantized values from their ring sum (in [0, 2**bits))."""
    step = quantization_step(clip, n_clients, bits)
    total = total.to(torch.int64) & _modulus_mask(bits)
    return total.to(torch.float64) * step - n_clients * float(clip)


def mask_words(words: np.ndarray, self_seed: bytes, pairwise: Mapping[int, bytes], my_id: int,
               bits: int = 32) -> np.ndarray:
    """``q + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)`` mod 2**bits (Bell et al. 2020).

    ``words`` are the uint32 ring elements, masked in place; returned reduced mod 2**bits.
    """
    mod = _modulus_mask(bits)
    apply_masks_(words, [(self_seed, 1), *pairwise_signs(my_id, pairwise)])
    return np.bitwise_and(words, mod, out=words)


def unmask_words(words: np.ndarray, survivor_self_seeds: Iterable[bytes],
                 dropped_pairwise: Mapping[int, Mapping[int, bytes]], bits: int = 32) -> np.ndarray:
    """Server side: remove survivors' self masks and the pairwise masks dropped clients left behind.

    ``words`` is the uint32 ring sum of the survivors' masked inputs (unmasked in place).
    ``survivor_self_seeds`` holds each survivor's self-mask seed (recovered from Shamir shares).
    ``dropped_pairwise[v][u]`` is the seed ``s_uv`` between dropped node ``v`` and surviving
    neighbour ``u`` (recomputed from v's recovered private key and u's public key). Survivor
    ``u`` added ``+PRG(s_uv)`` if ``u < v`` and ``-PRG(s_uv)`` otherwise; that is undone here.
    The result is the plain ring sum of the survivors' quantized inputs, mod 2**bits.
    """
    mod = _modulus_mask(bits)
    apply_masks_(words, unmask_signs(survivor_self_seeds, dropped_pairwise))
    return np.bitwise_and(words, mod, out=words)


def _words(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).cpu().numpy().astype(np.uint32)


def _ring_tensor(words: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.int64)).reshape(like.shape).to(like.device)


def mask(q: torch.Tensor, self_seed: bytes, pairwise: Mapping[int, bytes], my_id: int,
         bits: int = 32) -> torch.Tensor:
    """:func:`mask_words` on an int64 tensor of ring elements."""
    return _ring_tensor(mask_words(_words(q), self_seed, pairwise, my_id, bits), q)


def unmask(sum_masked: torch.Tensor, survivor_self_seeds: Iterable[bytes],
           dropped_pairwise: Mapping[int, Mapping[int, bytes]], bits: int = 32) -> torch.Tensor:
    """:func:`unmask_words` on an int64 tensor holding the ring sum."""
    return _ring_tensor(unmask_words(_words(sum_masked), survivor_self_seeds, dropped_pairwise, bits), sum_masked)


def unmask_signs(survivor_self_seeds: Iterable[bytes],
                 dropped_pairwise: Mapping[int, Mapping[int, bytes]]) -> list[tuple[bytes, int]]:
    """The keystreams the server subtracts (-1) or adds back (+1) to unmask a ring sum."""
    out = [(seed, -1) for seed in survivor_self_seeds]
    for dropped, survivors in dropped_pairwise.items():
        for survivor, seed in survivors.items():
            if survivor == dropped:
                raise PrivacyError(f"node {dropped} cannot be both dropped and its own surviving neighbour.")
            out.append((seed, -1 if survivor < dropped else 1))
    return out


def ring_sum(tensors: Iterable[torch.Tensor], bits: int = 32) -> torch.Tensor:
    """Sum of ring elements mod 2**bits (int64 accumulator, reduced once per addition)."""
    mod = _modulus_mask(bits)
    total = None
    for t in tensors:
        total = t.to(torch.int64) if total is None else (total + t) & mod
    if total is None:
        raise PrivacyError("ring_sum needs at least one tensor.")
    return total & mod
