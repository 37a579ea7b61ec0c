"""Shamir secret sharing over GF(p), p = 2**31 - 1, vectorized with numpy int64.

Field choice: every field element is below 2**31, so the product of two of them
is below 2**62 and fits an int64 exactly; each multiply is followed by ``% p``.
No Python integers or object arrays are involved, and no loop runs per byte:
the secret is cut into 3-byte chunks (24-bit values, all valid field elements)
and one random polynomial of degree ``t - 1`` per chunk is evaluated at all
``n`` x-coordinates at once by Horner's rule (a loop over the ``t``
coefficients, each step a ``(n, chunks)`` array operation). Reconstruction is
Lagrange interpolation at 0, one ``(t, chunks)`` multiply-and-sum.

Security is information-theoretic whatever the field size: with independent
uniform coefficients, any ``t - 1`` shares of each chunk are uniform and
independent of that chunk. Coefficients come from ``os.urandom`` (rejection
sampling of 31-bit words) unless a ``numpy.random.Generator`` is passed for a
reproducible test; never pass one in production.

A reconstructed chunk must lie below 2**24; shares from different secrets or a
corrupted share give field elements that almost never do (2**-7 per chunk), and
shares beyond the first ``t`` are checked against the interpolated polynomial,
so mixed-up shares raise instead of returning garbage.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np

from .._errors import PrivacyError

PRIME = (1 << 31) - 1
CHUNK_BYTES = 3
MAGIC = b"FSS1"
_HEADER = struct.Struct("<4sII")  # magic, x, secret length in bytes
MAX_SECRET_BYTES = 1 << 20


@dataclass(frozen=True, eq=False, repr=False)
class Share:
    """One share: x-coordinate ``x`` (1..n) and one field element per 3-byte chunk."""

    x: int
    secret_len: int
    values: np.ndarray  # int64, shape (chunks,), each in [0, PRIME)

    def __post_init__(self) -> None:
        if not 1 <= self.x < PRIME:
            raise PrivacyError(f"share x-coordinate must be in [1, {PRIME - 1}]. Found {self.x}.")
        if not 0 < self.secret_len <= MAX_SECRET_BYTES:
            raise PrivacyError(f"share secret length must be in [1, {MAX_SECRET_BYTES}] bytes. "
                               f"Found {self.secret_len}.")
        values = np.asarray(self.values)
        if values.dtype != np.int64 or values.shape != (_n_chunks(self.secret_len),):
            raise PrivacyError(f"share values must be int64 of shape ({_n_chunks(self.secret_len)},) for a "
                               f"{self.secret_len}-byte secret. Found {values.dtype} {values.shape}.")
        if values.size and (values.min() < 0 or values.max() >= PRIME):
            raise PrivacyError(f"share values must be field elements in [0, {PRIME}). Found one out of range.")
        values = values.copy()
        values.setflags(write=False)
        object.__setattr__(self, "values", values)

    def __repr__(self) -> str:  # a share is secret material: never show its values
        return f"Share(x={self.x}, secret_len={self.secret_len})"

    def to_bytes(self) -> bytes:
        """Fixed layout: ``b"FSS1"``, x (uint32 LE), secret length (uint32 LE), values (uint32 LE each)."""
        return _HEADER.pack(MAGIC, self.x, self.secret_len) + self.values.astype("<u4").tobytes()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Share":
        """Parse :meth:`to_bytes` output; any deviation from the layout raises PrivacyError."""
        if len(data) < _HEADER.size:
            raise PrivacyError(f"share must be at least {_HEADER.size} bytes. Found {len(data)}.")
        magic, x, secret_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise PrivacyError(f"share must start with {MAGIC!r}. Found {magic!r}.")
        if not 0 < secret_len <= MAX_SECRET_BYTES:
            raise PrivacyError(f"share secret length must be in [1, {MAX_SECRET_BYTES}]. Found {secret_len}.")
        expected = _HEADER.size + 4 * _n_chunks(secret_len)
        if len(data) != expected:
            raise PrivacyError(f"share of a {secret_len}-byte secret must be {expected} bytes. Found {len(data)}.")
        values = np.frombuffer(data, dtype="<u4", offset=_HEADER.size).astype(np.int64)
        return cls(x=x, secret_len=secret_len, values=values)


def _n_chunks(secret_len: int) -> int:
    return -(-secret_len // CHUNK_BYTES)


def share_size(secret_len: int) -> int:
    """Bytes of :meth:`Share.to_bytes` for a ``secret_len``-byte secret."""
    return _HEADER.size + 4 * _n_chunks(secret_len)


def _to_chunks(secret: bytes) -> np.ndarray:
    padded = secret + bytes(-len(secret) % CHUNK_BYTES)
    b = np.frombuffer(padded, dtype=np.uint8).reshape(-1, CHUNK_BYTES).astype(np.int64)
    return (b[:, 0] << 16) | (b[:, 1] << 8) | b[:, 2]


def _from_chunks(values: np.ndarray, secret_len: int) -> bytes:
    if values.size and values.max() >= 1 << (8 * CHUNK_BYTES):
        raise PrivacyError("shares are inconsistent: they do not interpolate to a valid secret "
                           "(mixed secrets or a corrupted share).")
    b = np.stack([(values >> 16) & 0xFF, (values >> 8) & 0xFF, values & 0xFF], axis=1).astype(np.uint8)
    return b.tobytes()[:secret_len]


def _random_field(shape: tuple[int, ...], rng: np.random.Generator | None) -> np.ndarray:
    """Uniform elements of GF(p): 31-bit words, the single value p itself resampled."""
    size = int(np.prod(shape))
    out = np.empty(size, dtype=np.int64)
    filled = 0
    while filled < size:
        need = size - filled
        if rng is None:
            words = np.frombuffer(os.urandom(4 * need), dtype="<u4").astype(np.int64)
        else:
            words = rng.integers(0, 1 << 32, size=need, dtype=np.int64)
        words = words & PRIME
        words = words[words < PRIME]
        out[filled:filled + words.size] = words
        filled += words.size
    return out.reshape(shape)


def _check_t_n(t: int, n: int) -> None:
    if not 2 <= t <= n:
        raise PrivacyError(f"Shamir threshold t must satisfy 2 <= t <= n (t = 1 hands the secret to every "
                           f"holder). Found t={t}, n={n}.")
    if n >= PRIME:
        raise PrivacyError(f"Shamir n must be below {PRIME}. Found {n}.")


def split(secret: bytes, t: int, n: int, rng: np.random.Generator | None = None) -> list[Share]:
    """Split ``secret`` into ``n`` shares (x = 1..n); any ``t`` recover it, ``t - 1`` reveal nothing.

    ``rng`` defaults to ``os.urandom``; a numpy Generator is for reproducible tests only.
    """
    _check_t_n(t, n)
    if not 0 < len(secret) <= MAX_SECRET_BYTES:
        raise PrivacyError(f"secret must be 1..{MAX_SECRET_BYTES} bytes. Found {len(secret)}.")
    chunks = _to_chunks(bytes(secret))
    coeffs = _random_field((t - 1, chunks.size), rng)  # degree 1..t-1
    xs = np.arange(1, n + 1, dtype=np.int64)[:, None]
    acc = np.broadcast_to(coeffs[-1], (n, chunks.size)).copy()
    for c in coeffs[-2::-1]:
        acc = (acc * xs + c) % PRIME
    acc = (acc * xs + chunks) % PRIME
    return [Share(x=int(x), secret_len=len(secret), values=row) for x, row in zip(xs[:, 0], acc)]


def _powmod(a: np.ndarray, e: int) -> np.ndarray:
    result = np.ones_like(a)
    base = a % PRIME
    while e:
        if e & 1:
            result = (result * base) % PRIME
        base = (base * base) % PRIME
        e >>= 1
    return result


def _lagrange_at(xs: np.ndarray, ats: np.ndarray) -> np.ndarray:
    """Matrix ``l`` with f(ats[e]) = sum_i l[e, i] f(xs[i]) mod p, for distinct ``xs``."""
    t = xs.size
    diff = (ats[:, None] - xs[None, :]) % PRIME  # (at_e - x_j), shape (E, t)
    num = np.ones((ats.size, t), dtype=np.int64)
    den = np.ones(t, dtype=np.int64)
    for j in range(t):  # loop over shares, each step vectorized over all points and all i
        others = np.arange(t) != j
        num = np.where(others, (num * diff[:, j:j + 1]) % PRIME, num)
        den = np.where(others, (den * ((xs - xs[j]) % PRIME)) % PRIME, den)
    return (num * _powmod(den, PRIME - 2)) % PRIME


def _interpolate(xs: np.ndarray, ys: np.ndarray, ats: np.ndarray) -> np.ndarray:
    """Values at ``ats`` (shape (E, chunks)) of the polynomials through (xs, ys)."""
    coeffs = _lagrange_at(xs, ats)  # (E, t); each product < 2**62, each row sum of t terms < 2**63
    return ((coeffs[:, :, None] * ys[None, :, :]) % PRIME).sum(axis=1) % PRIME


def combine(shares: list[Share], t: int) -> bytes:
    """Recover the secret from at least ``t`` shares; extra shares are checked for consistency."""
    if t < 2:
        raise PrivacyError(f"Shamir threshold t must be >= 2. Found {t}.")
    if len(shares) < t:
        raise PrivacyError(f"need at least t={t} shares to recover the secret. Found {len(shares)}.")
    xs = np.array([s.x for s in shares], dtype=np.int64)
    if np.unique(xs).size != xs.size:
        raise PrivacyError(f"shares must have distinct x-coordinates. Found duplicates in {sorted(xs.tolist())}.")
    lengths = {s.secret_len for s in shares}
    if len(lengths) != 1:
        raise PrivacyError(f"shares must come from one secret length. Found lengths {sorted(lengths)}.")
    ys = np.stack([s.values for s in shares])
    secret_chunks = _interpolate(xs[:t], ys[:t], np.zeros(1, dtype=np.int64))[0]
    if len(shares) > t:
        bad = np.flatnonzero((_interpolate(xs[:t], ys[:t], xs[t:]) != ys[t:]).any(axis=1))
        if bad.size:
            raise PrivacyError(f"share x={int(xs[t + bad[0]])} is inconsistent with the first t={t} shares "
                               f"(mixed secrets or a corrupted share).")
    return _from_chunks(secret_chunks, lengths.pop())
