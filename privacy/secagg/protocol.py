"""The SecAgg+ protocol (Bell et al. 2020) as two state machines: one client, one server.

Four stages, each one round trip of messages between the server and the clients
it picked (the transport is the caller's: fedshield drives them over Flower's
Grid; tests call the methods directly):

1. ``setup``        server -> client: the round's public parameters (nodes, graph
                    seed, k, t, ring bits, clip range, vector length).
                    client -> server: two X25519 public keys (``c`` for share
                    transport, ``s`` for pairwise masks) and SHA-256 of its
                    self-mask seed (lets the server check the seed it recovers).
2. ``share-keys``   server -> client: its neighbours' public keys.
                    client -> server: for each neighbour, AES-GCM ciphertext of
                    (Shamir share of the self-mask seed, Shamir share of ``s``'s
                    private key), bound to sender, receiver, round and stage.
3. ``masked-input`` server -> client: the ciphertexts addressed to it (which
                    also says which neighbours are still in).
                    client -> server: its quantized vector plus the self mask and
                    the pairwise masks with those neighbours, mod 2**bits.
4. ``unmask``       server -> client: which of its neighbours survived and which
                    dropped. client -> server: self-mask shares of survivors and
                    key shares of dropped neighbours, never both for one node.

The state machines do not care which message carries a stage: fedshield's
coordinator pipelines rounds (``secagg-pipeline``), sending round r+1's setup
with round r's masked-input and its share-keys with round r's unmask, each
round with its own fresh keys, session id and graph (coordinator/secure.py).

The server learns the ring sum of the survivors' vectors and nothing about one
vector, unless it holds ``t`` shares of both secrets of one client, which
``t > k / 2`` and the clients' refusal to reveal both prevent. Any client may
vanish at any stage; the round completes while every survivor's self seed and
every dropped client's key can still be rebuilt from ``t`` shares, and
otherwise :class:`SecAggAborted` says why. A malformed, replayed or
unauthenticated message to the server raises :class:`SecAggRejected` naming the
node and the rule; the caller counts it and treats that node as dropped.

Threat model and limits (stated, not hidden): the server is semi-honest. The
clients' public keys are not authenticated by a PKI, so a server that deviates
(swaps a victim's neighbours' keys for its own, adds Sybil nodes, or sends
different parameters to different clients) can learn an input; the server also
picks the graph seed. Clients colluding with the server are not modelled
(``choose_degree`` ignores a corrupted fraction), and under distributed DP they
could subtract their own noise shares. A client can add any ring element as its
input (SecAgg hides inputs, so no norm check is possible); the coordinator checks
what it can of the result (the summed weight, the mean's range). Share ciphertexts
of any size but an honest one's are refused by the server at share-keys. One that
a neighbour cannot decrypt or parse is left out by that neighbour, which still
masks with the sender, names it in its masked-input reply, and is not asked for
the sender's shares (the server counts the sender). Shares handed back for
unmasking are decoded around wrong ones (Berlekamp-Welch). What a client can
always do is make a round fail: shares of its own secrets that do not rebuild, or
out-of-range ring elements; SecAgg cannot tell who.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from .._errors import PrivacyError
from .graph import Graph, check_threshold, complete_graph, harary_graph, neighbours_of
from .keys import KEY_BYTES, NONCE_BYTES, TAG_BYTES, KeyPair, agree, decrypt_share, derive_key, encrypt_share
from .masking import SEED_BYTES, mask_words, quantization_step, unmask_words
from .shamir import combine_values, consistent, decode_values, parse_shares, share_size, share_x, split_bytes

STAGES = ("setup", "share-keys", "masked-input", "unmask")
MAX_DIM = 1 << 31
_PAYLOAD = struct.Struct("<QQII")  # sender, receiver, self-seed share length, key share length


class SecAggRejected(PrivacyError):
    """One message broke a protocol rule; ``rule`` is a short stable name for metrics."""

    def __init__(self, node_id: int, rule: str, detail: str) -> None:
        super().__init__(f"node {node_id}: {rule}: {detail}")
        self.node_id, self.rule, self.detail = node_id, rule, detail


class SecAggAborted(PrivacyError):
    """The round cannot complete securely (too few survivors, or shares that do not rebuild)."""


def ring_dtype(bits: int) -> np.dtype:
    """The smallest unsigned dtype that holds a ``bits``-bit ring element (the wire format)."""
    return np.dtype("<u1") if bits <= 8 else np.dtype("<u2") if bits <= 16 else np.dtype("<u4")


def seed_digest(seed: bytes) -> bytes:
    return hashlib.sha256(b"fedshield/secagg/v1/self-seed" + seed).digest()


@dataclass(frozen=True)
class SecAggParams:
    """The round's public parameters; both sides derive the same graph from them."""

    round: int
    session: int  # random per round: binds keys and ciphertexts to this one execution
    nodes: tuple[int, ...]  # the selected node ids, sorted
    degree: int  # neighbours per node (n - 1: the complete graph)
    threshold: int
    bits: int
    clip: float
    dim: int  # length of the masked vector
    graph_seed: bytes

    def __post_init__(self) -> None:
        nodes = tuple(int(v) for v in self.nodes)
        if list(nodes) != sorted(set(nodes)) or len(nodes) < 3:
            raise PrivacyError(f"secure aggregation needs >= 3 distinct sorted node ids. Found {len(nodes)} "
                               f"({'unsorted or repeated' if len(nodes) >= 3 else 'too few'}).")
        object.__setattr__(self, "nodes", nodes)
        n = len(nodes)
        if not isinstance(self.degree, int) or self.degree < 2:
            raise PrivacyError(f"secagg degree k must be an integer >= 2. Found {self.degree!r}.")
        k = min(self.degree, n - 1)
        if k < n - 1 and k % 2:
            raise PrivacyError(f"secagg degree k must be even below n - 1 = {n - 1} (a Harary graph). Found {k}.")
        object.__setattr__(self, "degree", k)
        check_threshold(self.threshold, k)
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 32 or n >= 1 << self.bits:
            raise PrivacyError(f"secagg bits must be an integer in [1, 32] with n = {n} < 2**bits. Found {self.bits!r}.")
        if not (isinstance(self.clip, int | float) and math.isfinite(self.clip) and self.clip > 0):
            raise PrivacyError(f"secagg clip range must be a finite number > 0. Found {self.clip!r}.")
        if not isinstance(self.dim, int) or not 1 <= self.dim <= MAX_DIM:
            raise PrivacyError(f"secagg vector length must be in [1, {MAX_DIM}]. Found {self.dim!r}.")
        if not isinstance(self.graph_seed, bytes) or len(self.graph_seed) != SEED_BYTES:
            raise PrivacyError(f"secagg graph seed must be {SEED_BYTES} bytes.")
        for name in ("round", "session"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < 1 << 63:
                raise PrivacyError(f"secagg {name} must be an integer in [0, 2**63). Found {value!r}.")

    @classmethod
    def create(cls, round: int, nodes: Iterable[int], *, degree: int, threshold: int, bits: int, clip: float,
               dim: int) -> "SecAggParams":
        """Fresh public randomness (session id, graph seed) from the OS."""
        return cls(round=round, session=int.from_bytes(os.urandom(8), "little") >> 1, nodes=tuple(sorted(nodes)),
                   degree=degree, threshold=threshold, bits=bits, clip=float(clip), dim=dim,
                   graph_seed=os.urandom(SEED_BYTES))

    def graph(self) -> Graph:
        """The neighbour graph (shared between calls with equal parameters: read it, do not change it)."""
        return _graph(self.nodes, self.degree, self.graph_seed)

    @property
    def step(self) -> float:
        """Quantization step: ``n`` inputs in [-clip, clip] sum below 2**bits."""
        return quantization_step(self.clip, len(self.nodes), self.bits)

    @property
    def levels(self) -> int:
        return ((1 << self.bits) - 1) // len(self.nodes)

    def to_fields(self) -> dict:
        return {"round": self.round, "session": self.session, "nodes": list(self.nodes), "degree": self.degree,
                "threshold": self.threshold, "bits": self.bits, "clip": float(self.clip), "dim": self.dim,
                "graph-seed": self.graph_seed}

    @classmethod
    def from_fields(cls, fields: Mapping) -> "SecAggParams":
        want = {"round": int, "session": int, "nodes": list, "degree": int, "threshold": int, "bits": int,
                "clip": float, "dim": int, "graph-seed": bytes}
        for key, typ in want.items():
            if not isinstance(fields.get(key), typ) or isinstance(fields.get(key), bool):
                raise PrivacyError(f"secagg parameter {key} must be a {typ.__name__}. Found {type(fields.get(key)).__name__}.")
        if len(fields["nodes"]) > 1 << 20 or not all(isinstance(v, int) for v in fields["nodes"]):
            raise PrivacyError("secagg parameter nodes must be a list of at most 2**20 integers.")
        return cls(round=fields["round"], session=fields["session"], nodes=tuple(fields["nodes"]),
                   degree=fields["degree"], threshold=fields["threshold"], bits=fields["bits"], clip=fields["clip"],
                   dim=fields["dim"], graph_seed=fields["graph-seed"])


@functools.lru_cache(maxsize=256)
def _neighbours(nodes: tuple[int, ...], degree: int, seed: bytes, me: int) -> frozenset[int]:
    """A client's own neighbours (``graph.neighbours_of``), once per round and node."""
    return neighbours_of(nodes, degree, seed, me)


@functools.lru_cache(maxsize=4)
def _graph(nodes: tuple[int, ...], degree: int, seed: bytes) -> Graph:
    """One computation per round (the in-process engine's clients share it): ~1 ms at n = 100."""
    return complete_graph(nodes) if degree >= len(nodes) - 1 else harary_graph(nodes, degree, seed)


@dataclass(frozen=True)
class PublicKeys:
    """What a client advertises: ``c`` (share transport), ``s`` (pairwise masks), SHA-256 of its self seed."""

    c: bytes
    s: bytes
    seed_hash: bytes

    def to_bytes(self) -> bytes:
        return self.c + self.s + self.seed_hash

    @classmethod
    def from_bytes(cls, node: int, data: bytes) -> "PublicKeys":
        if not isinstance(data, bytes) or len(data) != 3 * KEY_BYTES:
            raise SecAggRejected(node, "bad-keys", f"public keys must be {3 * KEY_BYTES} bytes; found "
                                                   f"{len(data) if isinstance(data, bytes) else type(data).__name__}")
        return cls(data[:KEY_BYTES], data[KEY_BYTES:2 * KEY_BYTES], data[2 * KEY_BYTES:])


# A sealed pair of shares, encrypted: nonce, header, a seed share and a key share, tag.
CIPHERTEXT_BYTES = NONCE_BYTES + _PAYLOAD.size + share_size(SEED_BYTES) + share_size(KEY_BYTES) + TAG_BYTES


def _share_index(neighbours: Iterable[int], node: int) -> int:
    """x-coordinate (1-based) of ``node`` among a sorted neighbourhood."""
    return sorted(neighbours).index(node) + 1


def _seal(payload_sender: int, receiver: int, self_share: bytes, key_share: bytes) -> bytes:
    return _PAYLOAD.pack(payload_sender, receiver, len(self_share), len(key_share)) + self_share + key_share


def _open(data: bytes, sender: int, receiver: int, holders: int) -> tuple[bytes, bytes]:
    """Check a neighbour's sealed shares: its self-seed share and its key share, both for 32-byte
    secrets at one x-coordinate in 1..``holders`` (the sender's neighbour count); returns them
    as sent. A share of another shape is refused here, naming the sender, so it never reaches this
    node's unmask reply (where the server would have to refuse the honest holder's whole answer)."""
    if len(data) < _PAYLOAD.size:
        raise SecAggRejected(sender, "bad-share", "share payload is shorter than its header")
    src, dst, n1, n2 = _PAYLOAD.unpack_from(data)
    if (src, dst) != (sender, receiver) or len(data) != _PAYLOAD.size + n1 + n2:
        raise SecAggRejected(sender, "bad-share", "share payload names other nodes or has a wrong length")
    if (n1, n2) != (share_size(SEED_BYTES), share_size(KEY_BYTES)):
        raise SecAggRejected(sender, "bad-share", f"shares must be of a {SEED_BYTES}-byte seed and a {KEY_BYTES}-byte "
                                                  f"key ({share_size(SEED_BYTES)} bytes each); found {n1} and {n2} bytes")
    seed, key = data[_PAYLOAD.size:_PAYLOAD.size + n1], data[_PAYLOAD.size + n1:]
    try:
        xs = share_x(seed, SEED_BYTES), share_x(key, KEY_BYTES)
    except PrivacyError as exc:
        raise SecAggRejected(sender, "bad-share", str(exc)) from None
    if xs[0] != xs[1] or not 1 <= xs[0] <= holders:
        raise SecAggRejected(sender, "bad-share", f"both shares must sit at one x-coordinate in 1..{holders}; "
                                                  f"found {xs[0]} and {xs[1]}")
    return seed, key


# ---------------------------------------------------------------------------------------------- client
@dataclass(repr=False)
class SecAggClient:
    """One client's side of one round. Holds secrets: never log it (its repr shows none)."""

    node_id: int
    params: SecAggParams
    stage: str = "setup"
    c: KeyPair | None = None
    s: KeyPair | None = None
    self_seed: bytes = b""
    peers: dict[int, PublicKeys] = field(default_factory=dict)  # neighbours' keys (from share-keys)
    held: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # shares others gave me (serialised)
    maskers: tuple[int, ...] = ()  # neighbours I masked with
    transport: dict[int, bytes] = field(default_factory=dict)  # AES-GCM share keys per neighbour (from share-keys)

    def __repr__(self) -> str:
        return f"SecAggClient(node={self.node_id}, round={self.params.round}, stage={self.stage!r})"

    def _expect(self, stage: str) -> None:
        if self.stage != stage:
            raise SecAggRejected(self.node_id, "wrong-stage", f"expected a {self.stage!r} message; got {stage!r} "
                                                              "(replayed or out of order)")

    def _pair_key(self, mine: KeyPair, theirs: bytes, peer: int, purpose: str) -> bytes:
        return derive_key(agree(mine, theirs), purpose, run_id=self.params.session, round=self.params.round,
                          node_a=self.node_id, node_b=peer)

    @property
    def neighbours(self) -> frozenset[int]:
        p = self.params
        return _neighbours(p.nodes, p.degree, p.graph_seed, self.node_id)

    @classmethod
    def setup(cls, node_id: int, params: SecAggParams) -> tuple["SecAggClient", PublicKeys]:
        """Stage 1: fresh keys and self seed for this round; returns what to advertise."""
        if node_id not in params.nodes:
            raise SecAggRejected(node_id, "not-selected", "this node is not among the round's nodes")
        me = cls(node_id=node_id, params=params, c=KeyPair.generate(), s=KeyPair.generate(),
                 self_seed=os.urandom(SEED_BYTES), stage="share-keys")
        return me, PublicKeys(me.c.public_bytes, me.s.public_bytes, seed_digest(me.self_seed))

    def share_keys(self, keys: Mapping[int, PublicKeys]) -> dict[int, bytes]:
        """Stage 2: check the neighbours' keys; return one ciphertext of my shares per neighbour."""
        self._expect("share-keys")
        p, me = self.params, self.node_id
        mine = keys.get(me)
        if mine is None or (mine.c, mine.s) != (self.c.public_bytes, self.s.public_bytes):
            raise SecAggRejected(me, "bad-keys", "the server must echo this node's own public keys unchanged")
        others = {v: k for v, k in keys.items() if v != me}
        if not set(others) <= self.neighbours:
            raise SecAggRejected(me, "bad-keys", "keys were sent for nodes that are not this node's neighbours")
        if len(others) < p.threshold:
            raise SecAggRejected(me, "too-few-neighbours", f"{len(others)} neighbours are left; t={p.threshold} needed")
        pubs = [k.c for k in keys.values()] + [k.s for k in keys.values()]
        if len(set(pubs)) != len(pubs):
            raise SecAggRejected(me, "bad-keys", "two public keys are equal (a replayed or forged key)")
        holders = sorted(others)
        self_shares = split_bytes(self.self_seed, p.threshold, len(holders))
        key_shares = split_bytes(self.s.private_bytes(), p.threshold, len(holders))
        out, transport = {}, {}
        for v, bs, ss in zip(holders, self_shares, key_shares, strict=True):
            transport[v] = self._pair_key(self.c, others[v].c, v, "share-key")
            out[v] = encrypt_share(transport[v], _seal(me, v, bs, ss),
                                   sender=me, receiver=v, round=p.round, stage="share-keys")
        self.peers, self.transport = others, transport  # the keys are kept: the shares coming back use them
        self.stage = "masked-input"
        return out

    def receive_shares(self, ciphertexts: Mapping[int, bytes]) -> dict[int, str]:
        """Stage 3, first half: decrypt and keep the shares neighbours sent me. A neighbour's that
        fails authentication or is misshapen is not kept and is returned (sender -> why), for the
        reply to name: this node still masks with that neighbour (the server expects it to), holds
        none of its shares, and is then never asked for one. Refusing the stage instead would let one
        faulty neighbour take every honest node it shares with out of the round."""
        self._expect("masked-input")
        p, me = self.params, self.node_id
        if not set(ciphertexts) <= set(self.peers):
            raise SecAggRejected(me, "bad-share", "shares came from nodes that were not this node's neighbours")
        if len(ciphertexts) < p.threshold:
            raise SecAggRejected(me, "too-few-neighbours", f"{len(ciphertexts)} neighbours shared keys; "
                                                           f"t={p.threshold} needed")
        held, unopened = {}, {}
        for u, ct in ciphertexts.items():
            try:
                plain = decrypt_share(self.transport[u], ct, sender=u, receiver=me, round=p.round, stage="share-keys")
                held[u] = _open(plain, u, me, p.degree)  # the graph is p.degree-regular
            except (PrivacyError, SecAggRejected) as exc:
                unopened[u] = str(exc)
        self.held = held
        self.maskers = tuple(sorted(ciphertexts))
        return unopened

    def mask(self, q: torch.Tensor) -> np.ndarray:
        """Stage 3, second half: ``q`` (ring elements, length dim) plus self and pairwise masks, mod 2**bits.

        Returns the wire form: the ring's unsigned dtype (see :func:`ring_dtype`).
        """
        self._expect("masked-input")
        p, me = self.params, self.node_id
        if q.dtype != torch.int64 or q.numel() != p.dim:
            raise PrivacyError(f"masked input must be int64 of length {p.dim}. Found {q.dtype} {q.numel()}.")
        pairwise = {v: self._pair_key(self.s, self.peers[v].s, v, "mask-seed") for v in self.maskers}
        words = mask_words(q.detach().reshape(-1).cpu().numpy().astype(np.uint32), self.self_seed, pairwise, me, p.bits)
        self.stage = "unmask"
        return words.astype(ring_dtype(p.bits))

    def unmask(self, survivors: Iterable[int], dropped: Iterable[int]) -> dict[str, bytes]:
        """Stage 4: self-seed shares of surviving neighbours, key shares of dropped ones; never both."""
        self._expect("unmask")
        me, p = self.node_id, self.params
        surv, drop = set(survivors), set(dropped)
        if surv & drop:
            raise SecAggRejected(me, "bad-unmask", "a node cannot be both a survivor and dropped "
                                                   "(answering would reveal both of its secrets)")
        if me in drop:
            raise SecAggRejected(me, "bad-unmask", "this node cannot be named dropped in a request sent to it")
        if not (surv | drop) <= set(self.held) | {me}:
            raise SecAggRejected(me, "bad-unmask", "the request names nodes whose shares this node does not hold")
        if (set(self.maskers) & set(self.held)) - surv - drop - {me}:
            raise SecAggRejected(me, "bad-unmask", "every neighbour I masked with and hold shares of must be named "
                                                   "survivor or dropped")
        if len((surv - {me}) & set(self.held)) + (me in surv) < p.threshold:
            raise SecAggRejected(me, "too-few-neighbours", f"fewer than t={p.threshold} neighbours survived")
        self.stage = "done"
        out = {f"self:{u}": self.held[u][0] for u in surv if u != me}
        out.update({f"key:{v}": self.held[v][1] for v in drop})
        return out

    # -- persistence between messages (Flower keeps it in the node's Context.state) --------------
    def to_fields(self) -> dict:
        """The state as a flat record of a few byte strings (one per kind, not one entry per
        neighbour: Flower's records cost microseconds per entry, on every stage of every client)."""
        f = {"node": self.node_id, "stage": self.stage, **{f"p.{k}": v for k, v in self.params.to_fields().items()},
             "c-sk": self.c.private_bytes(), "s-sk": self.s.private_bytes(), "self-seed": self.self_seed,
             "maskers": list(self.maskers),
             "peers": b"".join(_ID.pack(v) + k.to_bytes() for v, k in sorted(self.peers.items())),
             "transport": b"".join(_ID.pack(v) + k for v, k in sorted(self.transport.items())),
             "held": b"".join(_HELD.pack(u, len(bs), len(ss)) + bs + ss for u, (bs, ss) in sorted(self.held.items()))}
        return f

    @classmethod
    def from_fields(cls, f: Mapping) -> "SecAggClient":
        params = SecAggParams.from_fields({k[2:]: v for k, v in f.items() if k.startswith("p.")})
        node = int(f["node"])
        peers = {v: PublicKeys.from_bytes(v, b) for v, b in _fixed_entries(node, f.get("peers", b""), 3 * KEY_BYTES)}
        transport = dict(_fixed_entries(node, f.get("transport", b""), KEY_BYTES))
        if set(transport) != set(peers):
            raise SecAggRejected(node, "bad-state", "the saved share keys must cover exactly the saved neighbours")
        held, data, at = {}, f.get("held", b""), 0
        while at < len(data):
            if at + _HELD.size > len(data):
                raise SecAggRejected(node, "bad-state", "the saved shares are truncated")
            u, nb, ns = _HELD.unpack_from(data, at)
            at += _HELD.size
            if at + nb + ns > len(data):
                raise SecAggRejected(node, "bad-state", "the saved shares are truncated")
            held[u] = (bytes(data[at:at + nb]), bytes(data[at + nb:at + nb + ns]))
            at += nb + ns
        return cls(node_id=node, params=params, stage=str(f["stage"]),
                   c=KeyPair.from_private_bytes(f["c-sk"]), s=KeyPair.from_private_bytes(f["s-sk"]),
                   self_seed=f["self-seed"], peers=peers, held=held, maskers=tuple(f.get("maskers", [])),
                   transport=transport)


_ID = struct.Struct(">Q")
_HELD = struct.Struct(">QII")  # neighbour, length of its self-seed share, length of its key share


def _fixed_entries(node: int, data: bytes, size: int) -> list[tuple[int, bytes]]:
    """(id, value) pairs from a blob of ``_ID`` + ``size``-byte entries (a saved state's)."""
    step = _ID.size + size
    if not isinstance(data, bytes) or len(data) % step:
        raise SecAggRejected(node, "bad-state", f"a saved table must hold whole {step}-byte entries")
    return [(_ID.unpack_from(data, at)[0], data[at + _ID.size:at + step]) for at in range(0, len(data), step)]


# ---------------------------------------------------------------------------------------------- server
@dataclass
class SecAggResult:
    total: torch.Tensor  # ring sum of the survivors' unmasked inputs, int64 in [0, 2**bits)
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]  # shared keys, then sent no masked input
    params: SecAggParams

    def dequantized(self) -> torch.Tensor:
        """Float64 sum of the survivors' real inputs (each quantized in [-clip, clip])."""
        p = self.params
        return self.total.to(torch.float64) * p.step - len(self.survivors) * float(p.clip)


class SecAggServer:
    """The server's side of one round: which nodes are in at each stage, the masked sum, the unmasking."""

    def __init__(self, params: SecAggParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.graph = params.graph()
        self.device = torch.device(device)
        self.keys: dict[int, PublicKeys] = {}  # U1: advertised
        self.sharers: set[int] = set()  # U2 candidates asked to share
        self.ciphertexts: dict[int, dict[int, bytes]] = {}  # U2: sender -> receiver -> ciphertext
        self.masked_from: set[int] = set()  # nodes asked for a masked input
        self.maskers_of: dict[int, frozenset[int]] = {}
        self.total = np.zeros(params.dim, dtype=np.uint32)  # ring sum, wrapping mod 2**32
        self.survivors: set[int] = set()  # U3
        self.unmask_asked: dict[int, tuple[frozenset[int], frozenset[int]]] = {}
        self.self_shares: dict[int, dict[int, bytes]] = {}  # survivor -> holder -> share bytes
        self.key_shares: dict[int, dict[int, bytes]] = {}  # dropped -> holder -> share bytes
        self.responders: set[int] = set()  # U4
        # Shares left out, as (the node that sent it, what it was): an unmask share misshapen, at another x
        # or off the owner's polynomial, or a share ciphertext its receiver reported it could not open. A
        # dispute, not proof against the sender: the owner may have dealt a wrong share to an honest
        # holder, a receiver may report falsely. Reported by the caller (logged and counted per round).
        self.left_out: list[tuple[int, str]] = []
        self.bad_share_holders: set[int] = set()  # holders of a share left out: the fast path does without them
        self.unheld: dict[int, frozenset[int]] = {}  # survivor -> maskers whose shares it could not open

    # stage 1 --------------------------------------------------------------------------------
    def on_keys(self, node: int, keys: PublicKeys) -> None:
        if node not in self.graph:
            raise SecAggRejected(node, "unknown-sender", "node was not selected for this round")
        if node in self.keys:
            raise SecAggRejected(node, "duplicate", "keys already advertised")
        seen = {k for pk in self.keys.values() for k in (pk.c, pk.s)}
        if keys.c == keys.s or keys.c in seen or keys.s in seen:
            raise SecAggRejected(node, "bad-keys", "public keys must be fresh (one equals another node's or its own)")
        probe = KeyPair.generate()
        for pub in (keys.c, keys.s):  # a low-order point would make every neighbour's key agreement fail
            try:
                agree(probe, pub)
            except PrivacyError:
                raise SecAggRejected(node, "bad-keys", "a public key is not a usable X25519 point") from None
        self.keys[node] = keys

    def _stable(self, candidates: set[int], did: str) -> set[int]:
        """Largest subset where each node keeps >= t neighbours inside it; too small a one aborts the round."""
        t, live = self.params.threshold, set(candidates)
        while weak := {u for u in live if len(self.graph[u] & live) < t}:
            live -= weak
        if len(live) < max(3, t):
            raise SecAggAborted(f"only {len(live)} of {len(self.params.nodes)} nodes {did} with at least t={t} live "
                                f"neighbours; the round needs >= {max(3, t)}")
        return live

    def share_keys_requests(self) -> dict[int, dict[int, PublicKeys]]:
        """Stage 2 messages: each advertiser gets its live neighbours' keys (and its own, to check)."""
        live = self._stable(set(self.keys), "advertised keys")
        self.sharers = live
        return {u: {v: self.keys[v] for v in (self.graph[u] & live) | {u}} for u in sorted(live)}

    # stage 2 --------------------------------------------------------------------------------
    def on_shares(self, node: int, cts: Mapping[int, bytes]) -> None:
        """One node's share ciphertexts, checked before anything is kept: each must be exactly the size
        an honest node's is (a malformed one is refused here, the sender's fault, instead of reaching the
        receiver, whose decryption would fail)."""
        if node not in self.sharers:
            raise SecAggRejected(node, "unknown-sender", "node was not asked to share keys")
        if node in self.ciphertexts:
            raise SecAggRejected(node, "duplicate", "shares already received")
        want = self.graph[node] & self.sharers
        if set(cts) != want:
            raise SecAggRejected(node, "wrong-share-count", f"one ciphertext per live neighbour ({len(want)}) is "
                                                            f"required; found {len(cts)} for other nodes")
        if any(not isinstance(ct, bytes) or len(ct) != CIPHERTEXT_BYTES for ct in cts.values()):
            raise SecAggRejected(node, "bad-share", f"each ciphertext must be bytes of exactly {CIPHERTEXT_BYTES}")
        self.ciphertexts[node] = dict(cts)

    def sharers_ready(self) -> int:
        """How many nodes a masked-input stage would ask now; SecAggAborted if too few shared keys (nothing changes)."""
        return len(self._stable(set(self.ciphertexts), "shared keys"))

    def masked_input_requests(self) -> dict[int, dict[int, bytes]]:
        """Stage 3 messages: each node gets the ciphertexts its live neighbours addressed to it."""
        live = self._stable(set(self.ciphertexts), "shared keys")
        self.masked_from = live
        out = {}
        for v in sorted(live):
            out[v] = {u: self.ciphertexts[u][v] for u in self.graph[v] & live}
            self.maskers_of[v] = frozenset(out[v])
        return out

    # stage 3 --------------------------------------------------------------------------------
    def check_masked(self, node: int, vector: np.ndarray) -> None:
        """Validate one masked input (nothing is added yet)."""
        p = self.params
        if node not in self.masked_from:
            raise SecAggRejected(node, "unknown-sender", "node was not asked for a masked input")
        if node in self.survivors:
            raise SecAggRejected(node, "duplicate", "masked input already received")
        want = ring_dtype(p.bits)
        if not isinstance(vector, np.ndarray) or vector.dtype != want or vector.shape != (p.dim,):
            raise SecAggRejected(node, "bad-array", f"masked input must be {want} of shape ({p.dim},); found "
                                                    f"{getattr(vector, 'dtype', None)} {getattr(vector, 'shape', None)}")
        if want.itemsize * 8 > p.bits and int(vector.max()) >> p.bits:
            raise SecAggRejected(node, "bad-array", f"masked input values must be below 2**{p.bits}")

    def add_masked(self, node: int, vector: np.ndarray, unopened: Iterable[int] = ()) -> None:
        """Add one masked input. ``unopened``: the maskers whose share ciphertexts ``node`` reports it
        could not open (it is not asked for their shares; each is recorded in ``left_out``; a node it
        did not mask with is ignored)."""
        self.check_masked(node, vector)
        np.add(self.total, vector, out=self.total, casting="unsafe")
        self.survivors.add(node)
        self.unheld[node] = frozenset(unopened) & self.maskers_of[node]
        self.left_out += [(u, f"its share ciphertext to node {node}, which reports it could not open it")
                          for u in sorted(self.unheld[node])]

    def unmask_requests(self) -> dict[int, tuple[list[int], list[int]]]:
        """Stage 4 messages: for each survivor, its surviving and its dropped neighbours."""
        p = self.params
        if len(self.survivors) < max(3, p.threshold):
            raise SecAggAborted(f"only {len(self.survivors)} masked inputs arrived; the round needs "
                                f">= {max(3, p.threshold)}")
        dropped = self.masked_from - self.survivors
        out = {}
        for v in sorted(self.survivors):
            nb = (self.graph[v] & self.masked_from) - self.unheld.get(v, frozenset())
            surv, drop = (nb & self.survivors) | {v}, nb & dropped
            self.unmask_asked[v] = (frozenset(surv), frozenset(drop))
            out[v] = (sorted(surv), sorted(drop))
        return out

    # stage 4 --------------------------------------------------------------------------------
    def on_unmask(self, node: int, shares: Mapping[str, bytes]) -> None:
        if node not in self.unmask_asked:
            raise SecAggRejected(node, "unknown-sender", "node was not asked to unmask")
        if node in self.responders:
            raise SecAggRejected(node, "duplicate", "unmask shares already received")
        surv, drop = self.unmask_asked[node]
        want = {f"self:{u}" for u in surv - {node}} | {f"key:{v}" for v in drop}
        if set(shares) != want:
            raise SecAggRejected(node, "wrong-share-count", f"exactly the {len(want)} shares asked for are required; "
                                                            f"found {len(shares)} under other names")
        size = share_size(SEED_BYTES)  # == share_size(KEY_BYTES)
        if not all(isinstance(b, bytes) for b in shares.values()):
            raise SecAggRejected(node, "bad-share", "each share must be bytes")
        for name, b in shares.items():
            if len(b) != size:  # one bad share is left out, not the holder's other answers: _rebuild
                self._leave_out(node, f"its unmask share {name} of {len(b)} bytes")
                continue        # needs only t of each owner's shares (honest clients never send one)
            kind, who = name.split(":")
            (self.self_shares if kind == "self" else self.key_shares).setdefault(int(who), {})[node] = b
        self.responders.add(node)

    def _leave_out(self, holder: int, why: str) -> None:
        self.left_out.append((holder, why))
        self.bad_share_holders.add(holder)

    def _rebuild(self, owner: int, shares: Mapping[int, bytes], what: str, check) -> bytes:
        """Combine ``shares`` (holder -> bytes) and ``check`` the secret. Fast path: the first t shares
        of holders none of whose shares was left out so far. Else every share, decoded with
        Berlekamp-Welch (up to (m - t) / 2 wrong ones corrected, whichever they are), and where m - t
        is odd each share left out in turn (one more corrected: m = t + 1 with one wrong share
        included). The wrong shares are recorded in ``left_out``, and their holders' other shares
        skip the fast path, so one faulty holder costs a decode per round, not one per owner."""
        t = self.params.threshold
        if len(shares) < t:
            raise SecAggAborted(f"{what} of node {owner} needs t={t} shares; only {len(shares)} of its neighbours answered")
        xs = {h: i + 1 for i, h in enumerate(sorted(self.graph[owner] & self.sharers))}
        holders = sorted(shares)
        ok, got_x, values = parse_shares([shares[h] for h in holders], SEED_BYTES)  # == KEY_BYTES
        at_x = ok & (got_x == np.array([xs.get(h, -1) for h in holders], dtype=np.int64))
        for i in np.flatnonzero(~at_x):  # (a share must sit at its holder's x-coordinate)
            self._leave_out(holders[i], f"a malformed share of {what} of node {owner}")
        keep = np.flatnonzero(at_x)
        trusted = keep[[holders[i] not in self.bad_share_holders for i in keep]]
        if len(trusted) >= t:
            try:
                secret = combine_values(got_x[trusted[:t]], values[trusted[:t]], t, SEED_BYTES)
            except PrivacyError:
                secret = None
            if secret is not None and check(secret):
                return secret

        def decoded(subset: np.ndarray) -> tuple[bytes, np.ndarray] | None:
            if len(subset) < t:
                return None
            try:
                secret, right = decode_values(got_x[subset], values[subset], t, SEED_BYTES)
            except PrivacyError:
                return None
            return (secret, subset[right]) if check(secret) else None

        found = decoded(keep)
        for i in range(len(keep) if found is None and (len(keep) - t) % 2 else 0):
            found = decoded(np.delete(keep, i))
            if found is not None:
                break
        if found is None:
            raise SecAggAborted(f"{what} of node {owner} could not be rebuilt: too many of its m={len(keep)} shares "
                                f"are wrong (t={t}; (m - t) / 2 + 1 can be told apart at most)")
        secret, right = found
        right = right[:t]  # the polynomial through t right shares: every share off it is wrong
        on_it = consistent(got_x[right], values[right], got_x[keep], values[keep])
        for i in keep[~on_it]:
            self._leave_out(holders[i], f"a wrong share of {what} of node {owner}")
        return secret

    def finish(self) -> SecAggResult:
        """Remove the masks: survivors' self masks and the pairwise masks dropped nodes left behind."""
        try:
            return self._finish()
        except SecAggAborted:
            raise
        except PrivacyError as exc:  # e.g. a rebuilt key that cannot agree: the round fails, the run goes on
            raise SecAggAborted(f"unmasking failed: {exc}") from None

    def _finish(self) -> SecAggResult:
        p = self.params
        self_seeds = [self._rebuild(u, self.self_shares.get(u, {}), "the self-mask seed",
                                    lambda b, u=u: seed_digest(b) == self.keys[u].seed_hash)
                      for u in sorted(self.survivors)]
        dropped = self.masked_from - self.survivors
        dropped_pairwise: dict[int, dict[int, bytes]] = {}
        for v in sorted(dropped):
            maskers = self.maskers_of[v] & self.survivors  # survivors that masked with v
            if not maskers:
                continue
            raw = self._rebuild(v, self.key_shares.get(v, {}), "the mask key",
                                lambda b, v=v: len(b) == KEY_BYTES and KeyPair.from_private_bytes(b).public_bytes == self.keys[v].s)
            s_v = KeyPair.from_private_bytes(raw)
            dropped_pairwise[v] = {u: derive_key(agree(s_v, self.keys[u].s), "mask-seed", run_id=p.session,
                                                 round=p.round, node_a=u, node_b=v) for u in sorted(maskers)}
        words = unmask_words(self.total.copy(), self_seeds, dropped_pairwise, p.bits)
        total = torch.from_numpy(words.astype(np.int64)).to(self.device)
        return SecAggResult(total=total, survivors=tuple(sorted(self.survivors)), dropped=tuple(sorted(dropped)),
                            params=p)
