"""X25519 key agreement, HKDF-SHA256 key derivation and AES-GCM share transport.

Each client holds two X25519 key pairs per round (Bell et al. 2020): ``c`` for
encrypting shares to its neighbours and ``s`` for pairwise masks. The raw
Diffie-Hellman output goes only into :func:`derive_key`; HKDF binds every
derived key to the run id, the round and the two node ids (in increasing order,
so both ends derive the same bytes), with a distinct label per purpose.
Key material is never logged or put into exception messages.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .._errors import PrivacyError

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16  # AES-GCM's
_DOMAIN = b"fedshield/secagg/v1"
_U64 = 1 << 64


@dataclass(frozen=True, repr=False)
class KeyPair:
    """An X25519 key pair; ``public_bytes`` is the 32-byte raw public key to publish."""

    private: X25519PrivateKey
    public_bytes: bytes

    @classmethod
    def generate(cls) -> "KeyPair":
        return cls.from_private_bytes(X25519PrivateKey.generate().private_bytes_raw())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> "KeyPair":
        """Rebuild a pair from 32 raw private bytes (e.g. a dropped client's key recovered by Shamir)."""
        if len(raw) != KEY_BYTES:
            raise PrivacyError(f"X25519 private key must be {KEY_BYTES} bytes. Found {len(raw)}.")
        private = X25519PrivateKey.from_private_bytes(raw)
        public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        return cls(private=private, public_bytes=public)

    def private_bytes(self) -> bytes:
        """Raw private key, for Shamir sharing only; never log or persist it."""
        return self.private.private_bytes_raw()

    def __repr__(self) -> str:  # never show private material
        return f"KeyPair(public={self.public_bytes.hex()[:16]}...)"


@dataclass(frozen=True, repr=False)
class PairwiseKeys:
    """Keys one pair of nodes shares: a mask seed and an AES-256-GCM key (32 bytes each)."""

    mask_seed: bytes
    share_key: bytes

    def __repr__(self) -> str:
        return "PairwiseKeys(<secret>)"


def _u64(name: str, value: int) -> int:
    if not isinstance(value, int) or not 0 <= value < _U64:
        raise PrivacyError(f"{name} must be an integer in [0, 2**64). Found {value!r}.")
    return value


def agree(private: X25519PrivateKey | KeyPair, peer_public_bytes: bytes) -> bytes:
    """Raw X25519 shared secret with the peer's 32-byte public key."""
    if isinstance(private, KeyPair):
        private = private.private
    if len(peer_public_bytes) != KEY_BYTES:
        raise PrivacyError(f"peer X25519 public key must be {KEY_BYTES} bytes. Found {len(peer_public_bytes)}.")
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public_bytes)))
    except ValueError:  # low-order point: all-zero shared secret
        raise PrivacyError("X25519 key agreement failed: the peer public key is a low-order point, "
                           "which would give a predictable shared secret.") from None


def _info(label: bytes, run_id: int, round_: int, node_a: int, node_b: int) -> bytes:
    _u64("run_id", run_id), _u64("round", round_), _u64("node id", node_a), _u64("node id", node_b)
    if node_a == node_b:
        raise PrivacyError(f"pairwise keys need two different node ids. Found {node_a} twice.")
    lo, hi = sorted((node_a, node_b))
    return _DOMAIN + b"/" + label + struct.pack(">QQQQ", run_id, round_, lo, hi)


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=info).derive(secret)


_PURPOSES = (b"mask-seed", b"share-key")


def derive_key(shared_secret: bytes, purpose: str, *, run_id: int, round: int, node_a: int, node_b: int) -> bytes:
    """One HKDF-SHA256 key (32 bytes) from an X25519 output, for ``purpose`` ("mask-seed" or
    "share-key"), bound to the run, round and (sorted) pair of nodes: both ends derive the same."""
    label = purpose.encode() if isinstance(purpose, str) else b""
    if label not in _PURPOSES:
        raise PrivacyError(f"key purpose must be one of {[p.decode() for p in _PURPOSES]}. Found {purpose!r}.")
    if len(shared_secret) != KEY_BYTES:
        raise PrivacyError(f"shared secret must be {KEY_BYTES} bytes. Found {len(shared_secret)}.")
    return _hkdf(shared_secret, _info(label, run_id, round, node_a, node_b))


def derive_pairwise(shared_secret: bytes, *, run_id: int, round: int, node_a: int, node_b: int) -> PairwiseKeys:
    """Both of :func:`derive_key`'s keys (a mask seed and a share key) from one X25519 output."""
    ctx = {"run_id": run_id, "round": round, "node_a": node_a, "node_b": node_b}
    return PairwiseKeys(mask_seed=derive_key(shared_secret, "mask-seed", **ctx),
                        share_key=derive_key(shared_secret, "share-key", **ctx))


def _associated_data(sender: int, receiver: int, round_: int, stage: str) -> bytes:
    _u64("sender", sender), _u64("receiver", receiver), _u64("round", round_)
    stage_bytes = stage.encode()
    return _DOMAIN + b"/share" + struct.pack(">QQQH", sender, receiver, round_, len(stage_bytes)) + stage_bytes


def encrypt_share(key: bytes, plaintext: bytes, *, sender: int, receiver: int, round: int, stage: str) -> bytes:
    """AES-256-GCM: a random 12-byte nonce followed by ciphertext and tag; AD binds who, when and which stage."""
    if len(key) != KEY_BYTES:
        raise PrivacyError(f"share key must be {KEY_BYTES} bytes. Found {len(key)}.")
    nonce = os.urandom(NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, _associated_data(sender, receiver, round, stage))


def decrypt_share(key: bytes, ciphertext: bytes, *, sender: int, receiver: int, round: int, stage: str) -> bytes:
    """Inverse of :func:`encrypt_share`; a wrong key, context or any changed byte raises PrivacyError."""
    if len(key) != KEY_BYTES:
        raise PrivacyError(f"share key must be {KEY_BYTES} bytes. Found {len(key)}.")
    ad = _associated_data(sender, receiver, round, stage)
    if len(ciphertext) < NONCE_BYTES + TAG_BYTES:
        raise PrivacyError(f"share ciphertext from node {sender} to {receiver} failed authentication: "
                           f"{len(ciphertext)} bytes is shorter than nonce and tag.")
    try:
        return AESGCM(key).decrypt(ciphertext[:NONCE_BYTES], ciphertext[NONCE_BYTES:], ad)
    except InvalidTag:
        raise PrivacyError(f"share ciphertext from node {sender} to {receiver} (round {round}, stage {stage!r}) "
                           f"failed authentication: wrong key, wrong context or tampered bytes.") from None
