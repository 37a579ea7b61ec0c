"""Neighbour graphs for SecAgg+: a random Harary graph from a public seed, or the complete graph.

Bell et al. (2020) place the nodes on a ring in a random order and connect each
to its ``k / 2`` nearest nodes on either side (a k-regular, symmetric graph).
The permutation comes from a public seed, so every party can recompute the
graph; the seed must not be chosen by a party that could bias it (protocol
layer's job). ``k`` is picked so that, at a stated dropout rate, every node
keeps at least ``t = k // 2 + 1`` surviving neighbours except with a small
probability (a union bound over nodes on the binomial tail). The security side
of Bell et al.'s parameter choice (a corrupted fraction of clients) is not
modelled here yet.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

import numpy as np

from .._errors import PrivacyError

Graph = dict[int, frozenset[int]]


def check_threshold(t: int, k: int) -> None:
    """Shamir threshold ``t`` among ``k`` neighbours must satisfy ``k / 2 < t <= k``.

    With ``t <= k / 2`` a server could collect both the self-mask share and the
    key share of one client from two disjoint halves of its neighbours, and unmask it alone.
    """
    if not isinstance(k, int) or k < 2:
        raise PrivacyError(f"neighbour count k must be an integer >= 2. Found {k!r}.")
    if not isinstance(t, int) or not k / 2 < t <= k:
        raise PrivacyError(f"Shamir threshold must satisfy k/2 < t <= k so that no client's self mask "
                           f"and pairwise key can both be recovered. Found t={t!r}, k={k}.")


def _check_nodes(node_ids: Sequence[int]) -> list[int]:
    ids = [int(i) for i in node_ids]
    if len(set(ids)) != len(ids):
        raise PrivacyError("node ids must be distinct.")
    if len(ids) < 3:
        raise PrivacyError(f"secure aggregation needs at least 3 nodes. Found {len(ids)}.")
    return sorted(ids)


def complete_graph(node_ids: Sequence[int]) -> Graph:
    """Every node neighbours every other node (SecAgg without the '+')."""
    ids = _check_nodes(node_ids)
    everyone = frozenset(ids)
    return {i: everyone - {i} for i in ids}


def harary_graph(node_ids: Sequence[int], k: int, seed: bytes) -> Graph:
    """Random k-regular graph: nodes on a ring in seeded order, each joined to k/2 on each side.

    ``k`` must be even and below ``len(node_ids)``; ``k >= n - 1`` gives the complete graph.
    """
    ids = _check_nodes(node_ids)
    n = len(ids)
    if k >= n - 1:
        return complete_graph(ids)
    if not isinstance(k, int) or k < 2 or k % 2:
        raise PrivacyError(f"Harary degree k must be an even integer >= 2. Found {k!r}.")
    rng = np.random.Generator(np.random.PCG64(np.frombuffer(hashlib.sha256(seed).digest(), dtype="<u4")))
    order = rng.permutation(n)  # ring positions -> indices into ids (node ids may exceed int64: Flower's are uint64)
    offsets = np.concatenate([np.arange(1, k // 2 + 1), -np.arange(1, k // 2 + 1)])
    neighbours = order[(np.arange(n)[:, None] + offsets[None, :]) % n]
    return {ids[order[i]]: frozenset(ids[j] for j in neighbours[i]) for i in range(n)}


def neighbours_of(node_ids: Sequence[int], k: int, seed: bytes, me: int) -> frozenset[int]:
    """``harary_graph(node_ids, k, seed)[me]`` (the complete graph's where ``k >= n - 1``) in O(n) time and
    memory: a client needs only its own neighbours, and the whole graph is O(n k) (a coordinator listing 10^4
    nodes of the complete graph had each device build 10^8 entries)."""
    ids = _check_nodes(node_ids)
    n = len(ids)
    where = bisect.bisect_left(ids, me)  # (ids are sorted; Flower's node ids may exceed int64)
    if where >= n or ids[where] != me:
        raise PrivacyError(f"node {me} is not among the round's {n} nodes.")
    if k >= n - 1:
        return frozenset(ids[:where] + ids[where + 1:])
    if not isinstance(k, int) or k < 2 or k % 2:
        raise PrivacyError(f"Harary degree k must be an even integer >= 2. Found {k!r}.")
    rng = np.random.Generator(np.random.PCG64(np.frombuffer(hashlib.sha256(seed).digest(), dtype="<u4")))
    order = rng.permutation(n)  # as harary_graph draws it
    pos = int(np.flatnonzero(order == where)[0])  # my place on the ring
    offsets = np.concatenate([np.arange(1, k // 2 + 1), -np.arange(1, k // 2 + 1)])
    return frozenset(ids[j] for j in order[(pos + offsets) % n])


def _binomial_cdf_below(t: int, k: int, p_survive: float) -> float:
    """P[Binomial(k, p_survive) < t]."""
    return sum(math.comb(k, j) * p_survive**j * (1 - p_survive) ** (k - j) for j in range(t))


def choose_degree(n: int, dropout_rate: float, failure_prob: float = 2.0**-20) -> tuple[int, int]:
    """Smallest even ``k`` and ``t = k // 2 + 1`` such that, with independent dropouts at
    ``dropout_rate``, ``n * P[fewer than t of k neighbours survive] <= failure_prob``.

    Grows like ``O(log(n / failure_prob))``; falls back to the complete graph
    (``k = n - 1``) when no smaller degree is enough. ``dropout_rate`` must be below 1/2
    since ``t > k / 2`` must survive.
    """
    if not isinstance(n, int) or n < 3:
        raise PrivacyError(f"n must be an integer >= 3. Found {n!r}.")
    if not 0 <= dropout_rate < 0.5:
        raise PrivacyError(f"dropout_rate must be in [0, 0.5) so that t > k/2 neighbours can survive. "
                           f"Found {dropout_rate!r}.")
    if not 0 < failure_prob < 1:
        raise PrivacyError(f"failure_prob must be in (0, 1). Found {failure_prob!r}.")
    for k in range(2, n - 1, 2):
        t = k // 2 + 1
        if n * _binomial_cdf_below(t, k, 1 - dropout_rate) <= failure_prob:
            return k, t
    return n - 1, (n - 1) // 2 + 1
