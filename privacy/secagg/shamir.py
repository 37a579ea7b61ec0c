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
_MAGIC_WORD = int.from_bytes(MAGIC, "little")
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
        x, secret_len = _check_layout(data)
        return cls._trusted(x, secret_len, np.frombuffer(data, dtype="<u4", offset=_HEADER.size).astype(np.int64))

    @classmethod
    def _trusted(cls, x: int, secret_len: int, values: np.ndarray) -> "Share":
        """A share whose fields are already checked (parsed by ``_check_layout`` or computed here)."""
        share = object.__new__(cls)
        values.setflags(write=False)
        object.__setattr__(share, "x", x)
        object.__setattr__(share, "secret_len", secret_len)
        object.__setattr__(share, "values", values)
        return share


def _check_layout(data: bytes) -> tuple[int, int]:
    """(x, secret length) of a share in :meth:`Share.to_bytes` form; any deviation raises PrivacyError."""
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
    if not 1 <= x < PRIME:
        raise PrivacyError(f"share x-coordinate must be in [1, {PRIME - 1}]. Found {x}.")
    if np.frombuffer(data, dtype="<u4", offset=_HEADER.size).max() >= PRIME:
        raise PrivacyError(f"share values must be field elements in [0, {PRIME}). Found one out of range.")
    return x, secret_len


def share_x(data: bytes, secret_len: int) -> int:
    """The x-coordinate of ``data``, checked to be a well-formed share of a ``secret_len``-byte secret."""
    x, found = _check_layout(data)
    if found != secret_len:
        raise PrivacyError(f"share must be of a {secret_len}-byte secret. Found one of {found} bytes.")
    return x


def parse_shares(blobs: list[bytes], secret_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Many shares of ``secret_len``-byte secrets at once: ``(ok, xs, values)``, ``ok[i]`` whether
    ``blobs[i]`` is a well-formed share (the same rules as :meth:`Share.from_bytes`; the other rows
    are meaningless), ``xs`` int64 (m,), ``values`` int64 (m, chunks). One numpy pass, no objects."""
    size = share_size(secret_len)
    fits = np.array([isinstance(b, bytes) and len(b) == size for b in blobs], dtype=bool)
    blank = bytes(size)
    rows = np.frombuffer(b"".join(b if f else blank for b, f in zip(blobs, fits)), dtype="<u4").reshape(len(blobs), -1)
    head = rows[:, :3].astype(np.int64)
    ok = (fits & (head[:, 0] == _MAGIC_WORD) & (head[:, 2] == secret_len) & (head[:, 1] >= 1)
          & (head[:, 1] < PRIME) & (rows[:, 3:] < PRIME).all(axis=1))
    return ok, head[:, 1], rows[:, 3:].astype(np.int64)


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


def _split_values(secret: bytes, t: int, n: int, rng: np.random.Generator | None) -> np.ndarray:
    """(n, chunks) int64: the shares' values at x = 1..n."""
    _check_t_n(t, n)
    if not 0 < len(secret) <= MAX_SECRET_BYTES:
        raise PrivacyError(f"secret must be 1..{MAX_SECRET_BYTES} bytes. Found {len(secret)}.")
    chunks = _to_chunks(bytes(secret))
    coeffs = _random_field((t - 1, chunks.size), rng)  # degree 1..t-1
    xs = np.arange(1, n + 1, dtype=np.int64)[:, None]
    acc = np.broadcast_to(coeffs[-1], (n, chunks.size)).copy()
    for c in coeffs[-2::-1]:
        acc = (acc * xs + c) % PRIME
    return (acc * xs + chunks) % PRIME


def split(secret: bytes, t: int, n: int, rng: np.random.Generator | None = None) -> list[Share]:
    """Split ``secret`` into ``n`` shares (x = 1..n); any ``t`` recover it, ``t - 1`` reveal nothing.

    ``rng`` defaults to ``os.urandom``; a numpy Generator is for reproducible tests only.
    """
    acc = _split_values(secret, t, n, rng)
    return [Share._trusted(x, len(secret), row) for x, row in enumerate(acc, start=1)]


def split_bytes(secret: bytes, t: int, n: int, rng: np.random.Generator | None = None) -> list[bytes]:
    """:func:`split` with each share in :meth:`Share.to_bytes` form, all serialised in one buffer."""
    acc = _split_values(secret, t, n, rng)
    rows = np.empty((n, 3 + acc.shape[1]), dtype="<u4")
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3:] = _MAGIC_WORD, np.arange(1, n + 1), len(secret), acc
    blob, step = rows.tobytes(), rows.shape[1] * 4
    return [blob[i:i + step] for i in range(0, len(blob), step)]


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
    lengths = {s.secret_len for s in shares}
    if len(lengths) > 1:
        raise PrivacyError(f"shares must come from one secret length. Found lengths {sorted(lengths)}.")
    return combine_values(np.array([s.x for s in shares], dtype=np.int64),
                          np.stack([s.values for s in shares]) if shares else np.empty((0, 0), np.int64),
                          t, lengths.pop() if lengths else 0)


def _solve_mod(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """One solution ``z`` of ``a z = b`` mod p (free unknowns 0), or None when there is none.
    Gauss-Jordan elimination, one vectorized row operation per column."""
    m, n = a.shape
    aug = np.concatenate([a, b[:, None]], axis=1) % PRIME
    row, pivots = 0, []
    for col in range(n):
        if row == m:
            break
        nz = np.flatnonzero(aug[row:, col])
        if nz.size == 0:
            continue
        r = row + int(nz[0])
        if r != row:
            aug[[row, r]] = aug[[r, row]]
        aug[row] = (aug[row] * pow(int(aug[row, col]), PRIME - 2, PRIME)) % PRIME
        factor = aug[:, col].copy()
        factor[row] = 0
        aug = (aug - (factor[:, None] * aug[row][None, :]) % PRIME) % PRIME
        pivots.append(col)
        row += 1
    if np.any(aug[row:, n]):
        return None
    z = np.zeros(n, dtype=np.int64)
    z[pivots] = aug[:len(pivots), n]
    return z


def consistent(xs_t: np.ndarray, ys_t: np.ndarray, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Which shares (``xs``, ``ys``) lie on the polynomials through the t shares (``xs_t``, ``ys_t``), in every chunk."""
    return (_interpolate(xs_t, ys_t, xs) == ys % PRIME).all(axis=1)


def decode_values(xs: np.ndarray, ys: np.ndarray, t: int, secret_len: int) -> tuple[bytes, np.ndarray]:
    """The secret shared by ``t``-of-n shares when some of the ``m`` given ones are wrong, and which
    ones are right (a bool mask). Berlekamp-Welch, chunk by chunk: corrects up to ``(m - t) // 2``
    wrong shares, whichever they are; the decoded polynomial is then the unique one through all the
    right shares. Raises PrivacyError when there are too many wrong shares to decode.

    For each chunk: find the error locator E (monic, degree e) and Q (degree < t + e) with
    Q(x_i) = y_i E(x_i) for every share (any solution has Q = P E, P the shared polynomial, when at
    most e shares are wrong), so every share with E(x_i) != 0 is right; P is then interpolated
    from t of those. With more wrong shares than that it raises, or may return another secret (when
    m - t is even the system always has a solution): callers check the secret against a commitment.
    """
    m = len(xs)
    if t < 2 or m < t or np.unique(xs).size != m:
        raise PrivacyError(f"decoding needs at least t={t} >= 2 shares at distinct x-coordinates. Found {m}.")
    e = (m - t) // 2
    powers = np.ones((m, t + e + 1), dtype=np.int64)
    for j in range(1, t + e + 1):
        powers[:, j] = (powers[:, j - 1] * (xs % PRIME)) % PRIME
    secret = np.empty(ys.shape[1], dtype=np.int64)
    right = np.ones(m, dtype=bool)
    at = np.concatenate([np.zeros(1, dtype=np.int64), xs])  # the secret's point, then every share's
    for c in range(ys.shape[1]):  # a loop over the secret's 3-byte chunks (11 for 32 bytes), each one solve
        y = ys[:, c] % PRIME
        if e:
            a = np.concatenate([powers[:, :t + e], (-(y[:, None] * powers[:, :e])) % PRIME], axis=1)
            z = _solve_mod(a, (y * powers[:, e]) % PRIME)
            if z is None:
                raise PrivacyError(f"more than {e} of the {m} shares are wrong: the secret cannot be decoded.")
            locator = (powers[:, e] + ((powers[:, :e] * z[t + e:][None, :]) % PRIME).sum(axis=1)) % PRIME
            good = np.flatnonzero(locator != 0)
        else:
            good = np.arange(m)
        if good.size < t:
            raise PrivacyError(f"more than {e} of the {m} shares are wrong: the secret cannot be decoded.")
        values = _interpolate(xs[good[:t]], y[good[:t], None], at)[:, 0]
        secret[c] = values[0]
        right &= values[1:] == y
    if right.sum() < t + e:
        raise PrivacyError(f"the {m} shares do not decode to one secret (more than {e} are wrong).")
    return _from_chunks(secret, secret_len), right


def combine_values(xs: np.ndarray, ys: np.ndarray, t: int, secret_len: int) -> bytes:
    """:func:`combine` on parsed shares: x-coordinates ``xs`` (m,) and values ``ys`` (m, chunks)
    of a ``secret_len``-byte secret (e.g. rows of :func:`parse_shares`)."""
    if t < 2:
        raise PrivacyError(f"Shamir threshold t must be >= 2. Found {t}.")
    if len(xs) < t:
        raise PrivacyError(f"need at least t={t} shares to recover the secret. Found {len(xs)}.")
    if np.unique(xs).size != xs.size:
        raise PrivacyError(f"shares must have distinct x-coordinates. Found duplicates in {sorted(xs.tolist())}.")
    secret_chunks = _interpolate(xs[:t], ys[:t], np.zeros(1, dtype=np.int64))[0]
    if len(xs) > t:
        bad = np.flatnonzero((_interpolate(xs[:t], ys[:t], xs[t:]) != ys[t:]).any(axis=1))
        if bad.size:
            raise PrivacyError(f"share x={int(xs[t + bad[0]])} is inconsistent with the first t={t} shares "
                               f"(mixed secrets or a corrupted share).")
    return _from_chunks(secret_chunks, secret_len)
