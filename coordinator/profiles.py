"""The coordinator's registry of client device profiles, and selection policies that use it.

Clients report a profile in each train reply (see ``clients.profile``). It is
untrusted input: every value is checked (a number, finite, in a plausible range)
and a bad one is ignored, never raised on. The coordinator's own measurement,
the round-trip time it observed, is what the fast-fair policy ranks by.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ._errors import CoordinatorError

__all__ = ["SELECTION_POLICIES", "ProfileRegistry", "select_fast_fair", "select_uniform"]

SELECTION_POLICIES = ("fast-fair", "uniform")

# Accepted ranges for reported values; anything else is dropped.
PROFILE_RANGES: dict[str, tuple[float, float]] = {
    "profile-cpus": (1, 65_536),
    "profile-mem-gb": (0.0, 1.0e6),
    "profile-cuda": (0, 1),
    "profile-step-ms": (1.0e-6, 1.0e7),
    "profile-link-mbps": (1.0e-6, 1.0e7),
}
INTEGER_KEYS = ("profile-cpus", "profile-cuda")
MAX_TIME_S = 1.0e7  # an observed round trip above this is not a measurement


def _entries_of_nodes(nodes: Any) -> Iterable[tuple[int, Mapping[str, Any]]]:
    """(node, entry) from an older checkpoint's ``{"<node>": {"count": ..., "profile": {...}, ...}}``."""
    for key, entry in (nodes.items() if isinstance(nodes, Mapping) else ()):
        try:
            node = int(key)
        except (TypeError, ValueError):
            continue
        if isinstance(entry, Mapping):
            yield node, entry


def _entries_of_columns(cols: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """(node, entry) from :meth:`ProfileRegistry.state_dict`'s columns; none if a column is damaged (missing,
    not a 1-D tensor of its dtype, or of another length than ``node``)."""
    import numpy as np
    import torch

    ids = cols.get("node")
    if not (isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.dim() == 1):
        return []
    n = len(ids)
    floats = ("ema-time-s", "ema-epoch-s", "missed-epoch-s", *PROFILE_RANGES)
    for name, dtype in (("count", torch.int64), *((f, torch.float64) for f in floats)):
        t = cols.get(name)
        if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == (n,)):
            return []
    nodes = ids.numpy().view(np.uint64).tolist()
    counts = cols["count"].tolist()
    values = {f: cols[f].tolist() for f in floats}
    out = []
    for i, node in enumerate(nodes):
        entry: dict[str, Any] = {"count": counts[i], "profile": {k: values[k][i] for k in PROFILE_RANGES
                                                                  if not math.isnan(values[k][i])}}
        for f in ("ema-time-s", "ema-epoch-s", "missed-epoch-s"):
            if not math.isnan(values[f][i]):
                entry[f] = values[f][i]
        out.append((node, entry))
    return out


def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class ProfileRegistry:
    """Per node: the last valid profile, an EMA of observed round-trip seconds, a participation count.

    ``alpha`` is the EMA weight of the newest observation (in (0, 1]).
    """

    def __init__(self, alpha: float = 0.3) -> None:
        if _number(alpha) is None or not 0 < alpha <= 1:
            raise CoordinatorError(f"alpha must be in (0, 1]. Found {alpha!r}.")
        self.alpha = float(alpha)
        self.profiles: dict[int, dict[str, int | float]] = {}
        self.ema_time: dict[int, float] = {}
        self.ema_epoch: dict[int, float] = {}  # observed seconds per local epoch (round trip / epochs asked)
        self.missed_epoch: dict[int, float] = {}  # a lower bound from missed rounds, until the next reply in time
        self.counts: dict[int, int] = {}
        self._interned: dict[tuple, dict[str, int | float]] = {}

    # -- updates -------------------------------------------------------------
    def update(self, node_id: int, metrics: Mapping[str, Any] | None = None, elapsed_s: float | None = None) -> None:
        """Record one reply from ``node_id``: its reported profile and the observed round trip.

        Invalid profile values (not numbers, NaN/inf, out of range) are ignored.
        """
        node = int(node_id)
        clean = self.clean_profile(metrics or {})
        if clean:
            self.profiles[node] = self._shared({**self.profiles.get(node, {}), **clean})
        if elapsed_s is not None:
            self.observe_time(node, elapsed_s)

    def observe_time(self, node_id: int, elapsed_s: float) -> None:
        """Fold one observed round trip (seconds) into the node's EMA; invalid times are ignored."""
        t = _number(elapsed_s)
        if t is None or t < 0:
            return
        t = min(t, MAX_TIME_S)
        node = int(node_id)
        old = self.ema_time.get(node)
        self.ema_time[node] = t if old is None else (1 - self.alpha) * old + self.alpha * t

    def observe_epochs(self, node_id: int, elapsed_s: float, epochs: int, work_s: Any = None) -> None:
        """Fold one reply that ran ``epochs`` local epochs into the node's seconds-per-epoch EMA.

        ``work_s``: the node's own report of its local work (``client-time-s``), used where it is a
        number in (0, ``elapsed_s``]: a node cannot claim more than the round trip the coordinator
        saw, and a false report only changes its own amount of work. Else the round trip, which
        includes the transfers (a node on a slow link then seems slower than it computes).
        """
        t = _number(elapsed_s)
        if t is None or t < 0 or not isinstance(epochs, int) or epochs < 1:
            return
        w = _number(work_s)
        if w is not None and 0 < w <= t:
            t = w
        node, per = int(node_id), min(t, MAX_TIME_S) / epochs
        old = self.ema_epoch.get(node)
        self.ema_epoch[node] = per if old is None else (1 - self.alpha) * old + self.alpha * per
        self.missed_epoch.pop(node, None)  # measured: the bound from missed rounds has served

    def observe_missed(self, node_id: int, elapsed_s: float, epochs: int) -> None:
        """A node asked for ``epochs`` epochs has not replied after ``elapsed_s`` (the round's deadline):
        it needs at least ``elapsed_s / epochs`` per epoch, until a reply in time measures it. Only
        replies in time measured, so a node too slow for the round ran ``local-epochs`` and missed
        forever; with the bound it is given fewer epochs until it finishes in time. A node that only
        dropped out once is measured again at its next reply, and gets its work back at once."""
        t = _number(elapsed_s)
        if t is None or t <= 0 or not isinstance(epochs, int) or epochs < 1:
            return
        node, bound = int(node_id), min(t, MAX_TIME_S) / epochs
        if bound > max(self.ema_epoch.get(node, 0.0), self.missed_epoch.get(node, 0.0)):
            self.missed_epoch[node] = bound

    def seconds_per_epoch(self, node_id: int) -> float | None:
        """The measured seconds per local epoch, raised to the bound from rounds missed since (None: unknown)."""
        node = int(node_id)
        known = [v for v in (self.ema_epoch.get(node), self.missed_epoch.get(node)) if v is not None]
        return max(known) if known else None

    def local_epochs(self, node_id: int, full: int, deadline_s: float) -> int:
        """How many local epochs fit in ``deadline_s`` for this node (1 .. ``full``; ``full`` if unmeasured)."""
        per = self.seconds_per_epoch(node_id)
        if deadline_s <= 0 or per is None or per <= 0:
            return full
        return max(1, min(full, int(deadline_s // per)))

    def participated(self, node_id: int) -> None:
        """Count one accepted update from ``node_id``."""
        node = int(node_id)
        self.counts[node] = self.counts.get(node, 0) + 1

    @staticmethod
    def clean_profile(metrics: Mapping[str, Any]) -> dict[str, int | float]:
        """The valid profile values in ``metrics`` (others are dropped silently)."""
        out: dict[str, int | float] = {}
        for key, (lo, hi) in PROFILE_RANGES.items():
            x = _number(metrics.get(key))
            if x is None or not lo <= x <= hi:
                continue
            out[key] = int(x) if key in INTEGER_KEYS else x
        return out

    # -- queries -------------------------------------------------------------
    def count(self, node_id: int) -> int:
        return self.counts.get(int(node_id), 0)

    def link_mbps(self, node_id: int) -> float | None:
        """The uplink the node last reported (validated), if any."""
        return self.profiles.get(int(node_id), {}).get("profile-link-mbps")

    def speed_key(self, node_id: int) -> tuple[int, float]:
        """Sort key, lower is preferred: unmeasured nodes first (to measure them), then by EMA time.

        Among unmeasured nodes a reported step time orders them.
        """
        node = int(node_id)
        if node in self.ema_time:
            return (1, self.ema_time[node])
        return (0, float(self.profiles.get(node, {}).get("profile-step-ms", 0.0)))

    # -- state ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Columns, one entry per node seen (loads with ``torch.load(weights_only=True)``): ``node`` (the ids'
        64 bits as int64), ``count``, and float64 columns for the EMAs and each profile value, NaN where a
        node has none. A million nodes' nested dicts took seconds to pickle each round."""
        import numpy as np
        import torch

        nodes = list(set(self.profiles) | set(self.ema_time) | set(self.counts) | set(self.ema_epoch)
                     | set(self.missed_epoch))
        nan = math.nan

        def column(values: Iterable[float]) -> torch.Tensor:
            return torch.tensor(list(values), dtype=torch.float64)

        cols: dict[str, torch.Tensor] = {
            "node": torch.from_numpy(np.array(nodes, dtype=np.uint64).view(np.int64)),
            "count": torch.tensor([self.counts.get(n, 0) for n in nodes], dtype=torch.int64),
            "ema-time-s": column(self.ema_time.get(n, nan) for n in nodes),
            "ema-epoch-s": column(self.ema_epoch.get(n, nan) for n in nodes),
            "missed-epoch-s": column(self.missed_epoch.get(n, nan) for n in nodes),
        }
        empty: dict[str, int | float] = {}
        for key in PROFILE_RANGES:
            cols[key] = column(self.profiles.get(n, empty).get(key, nan) for n in nodes)
        return {"alpha": self.alpha, "columns": cols}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`, or from the per-node dicts of older checkpoints (values are
        re-validated; a damaged part restores nothing)."""
        alpha = _number(state.get("alpha"))
        if alpha is not None and 0 < alpha <= 1:
            self.alpha = alpha
        self.profiles, self.ema_time, self.counts, self.ema_epoch, self.missed_epoch = {}, {}, {}, {}, {}
        cols = state.get("columns")
        entries = _entries_of_columns(cols) if isinstance(cols, Mapping) else _entries_of_nodes(state.get("nodes"))
        for node, entry in entries:
            count = entry.get("count", 0)
            if isinstance(count, int) and not isinstance(count, bool) and count > 0:
                self.counts[node] = count
            clean = self.clean_profile(entry.get("profile") or {})
            if clean:
                self.profiles[node] = self._shared(clean)
            if "ema-time-s" in entry:
                self.observe_time(node, entry["ema-time-s"])
            if "ema-epoch-s" in entry:
                self.observe_epochs(node, entry["ema-epoch-s"], 1)
            if "missed-epoch-s" in entry:
                self.observe_missed(node, entry["missed-epoch-s"], 1)

    def _shared(self, profile: dict[str, int | float]) -> dict[str, int | float]:
        """One dict for every node reporting the same profile (a simulated population's nodes all do: a million
        dicts were ~1 GB). Profiles are replaced, never changed in place."""
        key = tuple(sorted(profile.items()))
        return self._interned.setdefault(key, profile) if len(self._interned) < 100_000 else profile


def ascending(ids: Iterable[int]) -> Sequence[int]:
    """``ids`` sorted; an ascending ``range`` (an in-process grid's million nodes) as it is, not listed."""
    return ids if isinstance(ids, range) and ids.step > 0 else sorted(ids)


def select_uniform(nodes: Sequence[int], k: int, seed: int, rnd: int) -> list[int]:
    """A seeded uniform sample of ``k`` of ``nodes`` (sorted)."""
    return sorted(random.Random(f"{seed}:{rnd}").sample(ascending(nodes), k))


def select_fast_fair(nodes: Sequence[int], k: int, registry: ProfileRegistry, fairness: float, seed: int,
                     rnd: int) -> list[int]:
    """Pick ``k`` of ``nodes``, fast ones first, starving none (sorted).

    A node whose participation count is below ``fair / fairness`` has priority,
    where ``fair = (participations so far among the online nodes + k) / len(nodes)``
    is each node's fair share after this round (``rounds * k / n`` when every
    selected node's update is accepted). Starved nodes go first (fewest
    participations first); the remaining slots go to the fastest nodes by
    :meth:`ProfileRegistry.speed_key`. Ties break by a draw seeded with
    ``(seed, rnd)``, so the choice is deterministic. So long as the starved nodes
    fit in ``k`` slots each round, every node's count stays at or above
    ``fair / fairness``; and a node that would pass ``ceil(fair * fairness)`` is
    taken only when no other node is left, so none runs far ahead either.
    """
    if _number(fairness) is None or fairness < 1:
        raise CoordinatorError(f"fairness must be >= 1. Found {fairness!r}.")
    pool = sorted(int(n) for n in nodes)
    k = max(0, min(int(k), len(pool)))
    if k == 0:
        return []
    rng = random.Random(f"{seed}:{rnd}:fast-fair")
    tiebreak = {n: rng.random() for n in pool}
    fair = (sum(registry.count(n) for n in pool) + k) / len(pool)
    floor = fair / fairness
    starved = sorted((n for n in pool if registry.count(n) < floor), key=lambda n: (registry.count(n), tiebreak[n]))
    chosen = starved[:k]
    taken = set(chosen)
    cap = math.ceil(fair * fairness)  # nor may a fast node run far ahead: at most fair * fairness
    rest = sorted((n for n in pool if n not in taken),
                  key=lambda n: (registry.count(n) + 1 > cap, *registry.speed_key(n), tiebreak[n]))
    chosen += rest[: k - len(chosen)]
    return sorted(chosen)
