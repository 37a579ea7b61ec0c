"""fedshield's virtual-time engine: a Grid whose replies arrive at simulated times.

See docs/architecture.md, "One round logic, three backends" and "Heterogeneous clients and
stragglers". The round logic (``SyncWorkflow``, ``BufferedAsyncWorkflow``) runs on
it unchanged; only the Grid and the Clock differ from a real deployment.

- :class:`VirtualClock` implements the workflows' ``Clock`` protocol in simulated
  seconds. ``sleep(s)`` jumps to ``min(now + s, next pending completion)``, so
  waiting costs no wall time and a poll loop wakes exactly when a reply lands.
- :class:`VirtualGrid` executes each pushed message at once, in process (the
  ClientApp sees the model that was sent), but keeps the reply hidden from
  ``pull_messages`` until the clock reaches its completion time::

      start      = max(push time, node free, node's next online window)
      completion = start + latency + bytes_down / downlink
                         + compute_s_per_example * num_examples * local_epochs * LogNormal(0, sigma)
                         + latency + bytes_up / uplink

  Bytes are the messages' actual sizes (sum of the Array data lengths). A node
  runs one message at a time (a second push queues behind the first). With
  probability ``dropout`` the reply never arrives; a message with a TTL whose
  reply would come after ``push + ttl`` (or never) yields an error reply
  (``ErrorCode.MESSAGE_UNAVAILABLE``) at ``push + ttl``, as the SuperLink does. Once the clock is past
  ``push + ttl``, a reply nobody pulled is deleted, as the SuperLink deletes an expired message's reply
  (a synchronous round that closed early never pulls its late replies); pulling it then gives the
  SuperLink's ``MESSAGE_UNAVAILABLE`` error instead.
  ``get_node_ids()`` lists the nodes online now: each node is online in each
  window of ``availability_window_s`` seconds with probability ``availability``.

Every random draw is keyed by ``(seed, node, k-th message to that node)`` or
``(seed, node, window)``, never by call order across nodes, so a run replays
exactly with the same seed. The workflows save :meth:`VirtualGrid.state_dict`
(the clock, the per-node message counts, when each node is next free) with every
round's checkpoint and restore it on resume, so a resumed synchronous run
replays the uninterrupted one too (tested). A resumed FedBuff run does not: the
replies in flight at its last release are not kept (README, "Results"), so the
releases after the resume take other updates.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import random
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from clients.protocol import CONFIG, METRICS, WORK_METRICS, message_nbytes

from .inprocess import ClientFn, InProcessGrid, call_client

__all__ = [
    "DEFAULT_TIERS",
    "DeviceProfile",
    "MessageRecord",
    "VirtualClock",
    "VirtualGrid",
    "tiered_profiles",
]


# -- clock -------------------------------------------------------------------
class VirtualClock:
    """Simulated seconds. Sources (grids) tell it when their next event is due."""

    def __init__(self, start: float = 0.0) -> None:
        if not (isinstance(start, int | float) and math.isfinite(start)):
            raise ValueError(f"start must be a finite number of seconds. Found {start!r}.")
        self._now = float(start)
        self._sources: list[Callable[[float], float | None]] = []

    def now(self) -> float:
        return self._now

    def add_source(self, next_event_after: Callable[[float], float | None]) -> None:
        """Register ``next_event_after(t)``: the earliest pending event time > t, or None."""
        self._sources.append(next_event_after)

    def next_event(self) -> float | None:
        times = [t for t in (src(self._now) for src in self._sources) if t is not None and t > self._now]
        return min(times) if times else None

    def sleep(self, seconds: float) -> None:
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"sleep must be given a finite number of seconds >= 0. Found {seconds!r}.")
        target = self._now + seconds
        nxt = self.next_event()
        self._now = nxt if nxt is not None and nxt < target else target

    def advance_to(self, t: float) -> None:
        """Jump to time ``t`` (>= now), past any events in between (they become visible)."""
        if not (isinstance(t, int | float) and math.isfinite(t) and t >= self._now):
            raise ValueError(f"advance_to needs a finite time >= now ({self._now}). Found {t!r}.")
        self._now = float(t)


# -- device profiles ------------------------------------------------------------
# Each number of a DeviceProfile: (lower bound, open?, upper bound, open?, the rule in words). The
# scenario loader checks [[tiers]] tables against the same rules, naming the keys as the file writes them.
PROFILE_RULES: dict[str, tuple[float, bool, float, bool, str]] = {
    "compute_s_per_example": (0.0, False, math.inf, False, "a finite number >= 0 (seconds per example per epoch)"),
    "uplink_mbps": (0.0, True, math.inf, False, "a finite number > 0 (Mbit/s)"),
    "downlink_mbps": (0.0, True, math.inf, False, "a finite number > 0 (Mbit/s)"),
    "latency_s": (0.0, False, math.inf, False, "a finite number >= 0 (seconds)"),
    "sigma": (0.0, False, 10.0, False, "a number in [0, 10] (LogNormal(0, 10) already spans e^+-30)"),
    "availability": (0.0, True, 1.0, False, "a number in (0, 1]"),
    "dropout": (0.0, False, 1.0, True, "a number in [0, 1)"),
}


def rule_holds(x: Any, rule: tuple[float, bool, float, bool, str]) -> bool:
    """Whether ``x`` is a finite real (not a bool) within one of PROFILE_RULES' bounds."""
    lo, lo_open, hi, hi_open, _ = rule
    return (isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
            and (x > lo if lo_open else x >= lo) and (x < hi if hi_open else x <= hi))


@dataclass(frozen=True)
class DeviceProfile:
    """How fast, how well connected and how reliable one kind of device is.

    compute_s_per_example: seconds per training example per local epoch.
    uplink_mbps / downlink_mbps: link rates in megabit/s (10**6 bit/s).
    latency_s: one-way latency added to each transfer.
    sigma: heavy-tail noise; the compute time is multiplied by LogNormal(0, sigma).
    availability: probability in (0, 1] that the node is online in a time window.
    dropout: probability in [0, 1) that a reply never arrives.
    """

    tier: str
    compute_s_per_example: float
    uplink_mbps: float
    downlink_mbps: float
    latency_s: float = 0.0
    sigma: float = 0.0
    availability: float = 1.0
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name, rule in PROFILE_RULES.items():
            if not rule_holds(getattr(self, name), rule):
                raise ValueError(f"DeviceProfile {self.tier!r}: {name} must be {rule[-1]}. Found {getattr(self, name)!r}.")
        if not isinstance(self.tier, str) or not self.tier:
            raise ValueError(f"DeviceProfile tier must be a non-empty name. Found {self.tier!r}.")

    def transfer_s(self, nbytes: int, *, up: bool) -> float:
        return self.latency_s + 8.0 * nbytes / ((self.uplink_mbps if up else self.downlink_mbps) * 1e6)


# Plausible tiers for small models such as the digits task (~10k parameters,
# ~40 kB per message). Compute rates are per example per epoch for such a model:
#   edge-cpu   phone / Raspberry-Pi class, slow and bursty (sigma 0.6: the slowest
#              tenth takes ~2.2x the median), 1 Mbit/s up, 5 down, 150 ms latency,
#              offline 20% of the time, 5% of replies lost.
#   laptop     20x faster compute, Wi-Fi/DSL links (20 up / 100 down), 30 ms.
#   gpu-server datacenter node, 500 / 1000 Mbit/s, 5 ms, always on.
EDGE_CPU = DeviceProfile("edge-cpu", compute_s_per_example=0.02, uplink_mbps=1.0, downlink_mbps=5.0,
                         latency_s=0.15, sigma=0.6, availability=0.8, dropout=0.05)
LAPTOP = DeviceProfile("laptop", compute_s_per_example=0.001, uplink_mbps=20.0, downlink_mbps=100.0,
                       latency_s=0.03, sigma=0.3, availability=0.9, dropout=0.01)
GPU_SERVER = DeviceProfile("gpu-server", compute_s_per_example=0.0001, uplink_mbps=500.0, downlink_mbps=1000.0,
                           latency_s=0.005, sigma=0.1, availability=1.0, dropout=0.0)
DEFAULT_TIERS: list[tuple[float, DeviceProfile]] = [(0.70, EDGE_CPU), (0.25, LAPTOP), (0.05, GPU_SERVER)]


def tiered_profiles(num_nodes: int, tiers: Sequence[tuple[float, DeviceProfile]] | None = None,
                    seed: int = 0) -> list[DeviceProfile]:
    """One profile per node: tier counts from the fractions (largest remainder), shuffled with ``seed``."""
    tiers = list(DEFAULT_TIERS if tiers is None else tiers)
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1. Found {num_nodes!r}.")
    if not tiers or any(not (isinstance(f, int | float) and f >= 0) for f, _ in tiers) or sum(f for f, _ in tiers) <= 0:
        raise ValueError("tiers must be a non-empty list of (fraction >= 0, DeviceProfile) with a positive sum.")
    total = sum(f for f, _ in tiers)
    exact = [f / total * num_nodes for f, _ in tiers]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(tiers)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: num_nodes - sum(counts)]:
        counts[i] += 1
    profiles = [p for (_, p), c in zip(tiers, counts, strict=True) for _ in range(c)]
    random.Random(f"tiers:{seed}").shuffle(profiles)
    return profiles


# -- grid --------------------------------------------------------------------
@dataclass
class MessageRecord:
    """The simulated life of one pushed message (for tests and analysis)."""

    message_id: str
    node_id: int
    pushed_at: float
    start: float  # when the node began (download)
    done: float  # when the reply reached the server (inf: never)
    visible_at: float  # when pull_messages can return it (done, or expiry, or inf)
    bytes_down: int
    bytes_up: int
    dropped: bool
    expired: bool
    outstanding_at_push: int  # unresolved messages this node already had when this one was pushed
    pulled_at: float | None = None
    deadline: float = math.inf  # push + ttl: once the clock is past it, a reply not pulled is deleted


def _expired(msg: Message) -> Message:
    """The error reply the SuperLink gives a message whose TTL ran out before its reply arrived."""
    return Message(error=Error(code=ErrorCode.MESSAGE_UNAVAILABLE,
                               reason=f"message expired (ttl {msg.metadata.ttl} s) before a reply arrived"), reply_to=msg)


def _deleted(message_id: str, run_id: int, now: float) -> Message:
    """What the SuperLink answers for a message it deleted when its TTL ran out, its reply unpulled: its own
    ``create_message_error_unavailable_ins_message``, dated at simulated time ``now``."""
    # imported here: the module brings Flower's link-state stack (~0.8 s at import), needed only on this rare path
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_ins_message

    msg = create_message_error_unavailable_ins_message(message_id, run_id)
    msg.metadata.created_at = now
    return msg


class VirtualGrid(InProcessGrid):
    """An in-process Grid on a virtual clock; node ``1001 + i`` has profile ``profile_fn(i)``."""

    ENGINE = "virtual"

    def __init__(self, client: ClientFn, num_nodes: int, clock: VirtualClock,
                 profile_fn: Callable[[int], DeviceProfile] | Sequence[DeviceProfile],
                 node_config: Callable[[int], dict[str, Any]] | None = None, seed: int = 0,
                 availability_window_s: float = 60.0, run_id: int = 1) -> None:
        super().__init__(client, num_nodes, node_config, run_id)
        if not (isinstance(availability_window_s, int | float) and math.isfinite(availability_window_s)
                and availability_window_s > 0):
            raise ValueError(f"availability_window_s must be > 0. Found {availability_window_s!r}.")
        get = profile_fn if callable(profile_fn) else profile_fn.__getitem__
        self.profiles: dict[int, DeviceProfile] = {}
        for i in range(num_nodes):
            p = get(i)
            if not isinstance(p, DeviceProfile):
                raise ValueError(f"profile_fn({i}) must return a DeviceProfile. Found {type(p).__name__}.")
            self.profiles[1001 + i] = p
            self.contexts[1001 + i].node_config["link-mbps"] = p.uplink_mbps  # what an agent reports (--link-mbps)
        self.clock, self.seed, self.window_s = clock, int(seed), float(availability_window_s)
        self.records: dict[str, MessageRecord] = {}
        self._pending: dict[str, Message] = {}  # message id -> reply (or error), not yet pulled
        self._pending_of: Counter[int] = Counter()  # node -> its messages in _pending (_outstanding, in O(1))
        self._heap: list[tuple[float, str]] = []  # (visible_at, message id) of coming replies, lazily cleaned
        self._expiry: list[tuple[float, str]] = []  # (deadline, message id) of _pending's entries, lazily cleaned
        self._node_free: dict[int, float] = dict.fromkeys(self.profiles, clock.now())
        self._node_count: dict[int, int] = dict.fromkeys(self.profiles, 0)
        self._counter = 0
        self._wakeups: list[float] = []  # from a checkpoint: arrivals of replies the resumed run does not await
        clock.add_source(self.next_event_after)

    # -- availability ----------------------------------------------------------
    def is_online(self, node: int, t: float | None = None) -> bool:
        t = self.clock.now() if t is None else t
        p = self.profiles[node]
        if p.availability >= 1.0:
            return True
        window = math.floor(t / self.window_s)
        return random.Random(f"{self.seed}:avail:{node}:{window}").random() < p.availability

    def _next_online(self, node: int, t: float, limit: float) -> float:
        """The first time >= t the node is online (inf if not before ``limit``)."""
        if self.is_online(node, t):
            return t
        w = math.floor(t / self.window_s) + 1
        while w * self.window_s <= limit:
            if self.is_online(node, w * self.window_s):
                return w * self.window_s
            w += 1
        return math.inf

    def get_node_ids(self) -> Iterable[int]:
        now = self.clock.now()
        return [n for n in self.contexts if self.is_online(n, now)]

    def too_few_online_hint(self) -> str:
        """What the coordinator's "too few nodes online" error adds on this engine: where the shortfall
        comes from (the tiers' availability) and what to change."""
        expected = sum(p.availability for p in self.profiles.values())  # each in (0, 1], checked by DeviceProfile
        return (f"On the virtual engine a node is online in each {self.window_s:g} s window with its tier's "
                f"availability: {expected:.1f} of {len(self.profiles)} nodes on average here; lower run.min-nodes "
                "(--set run.min-nodes=N), or raise run.wait-nodes-timeout (each window draws afresh) or the tiers' "
                "availability.")

    # -- resume ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as the uninterrupted one would: the clock (availability
        windows are keyed by time), each node's message count (its draws are keyed by it), when each node
        is next free (one may still be working on a reply the run no longer waits for) and the message count
        (message ids). Replies still pending are not kept (a resumed workflow does not wait for them), only
        when they would have arrived: the clock wakes up then as it did in the uninterrupted run, and the
        workflow's polls land at the same times."""
        now = self.clock.now()
        wakeups = sorted({when for when, mid in self._heap if mid in self._pending and when > now}
                         | {w for w in self._wakeups if w > now})
        return {**super().state_dict(), "clock": now, "node_count": dict(self._node_count),
                "node_free": dict(self._node_free), "messages": self._counter, "wakeups": wakeups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (of :meth:`state_dict`); nodes this grid does not have are ignored."""
        super().load_state_dict(state)  # the nodes' error-feedback residuals
        self.clock.advance_to(float(state["clock"]))
        for node in self.profiles.keys() & state["node_count"].keys():
            self._node_count[node] = int(state["node_count"][node])
            self._node_free[node] = float(state["node_free"][node])
        self._counter = int(state["messages"])
        self._wakeups = sorted(float(w) for w in state.get("wakeups", ()))  # (absent from earlier checkpoints)

    # -- events ----------------------------------------------------------------
    def _delete_expired(self, now: float) -> None:
        """Delete the replies not pulled by their message's deadline, as the SuperLink deletes an expired
        message's reply: a round that closed early (or dropped its late replies) never pulls them, and each
        holds a whole update. Past the deadline, strictly: the error reply of an expired message is due at it."""
        while self._expiry and self._expiry[0][0] < now:
            _, mid = heapq.heappop(self._expiry)
            if self._pending.pop(mid, None) is not None:
                self._pending_of[self.records[mid].node_id] -= 1

    def next_event_after(self, t: float) -> float | None:
        now = self.clock.now()
        self._delete_expired(now)
        # Entries pulled, deleted or already due (at or before both t and now; the clock never goes back) are no
        # longer events: popped, so heap[0] is the next one and a poll costs O(log n), not a sort of every reply.
        while self._heap and (self._heap[0][1] not in self._pending or self._heap[0][0] <= min(t, now)):
            heapq.heappop(self._heap)
        if self._heap and self._heap[0][0] > t:
            when: float | None = self._heap[0][0]
        else:  # t ahead of the clock (no caller does this): the entries up to t are still in the heap
            when = min((w for w, mid in self._heap if w > t and mid in self._pending), default=None)
        i = bisect_right(self._wakeups, t)  # a resumed run's replies nobody awaits
        wake = self._wakeups[i] if i < len(self._wakeups) else None
        return wake if when is None else when if wake is None else min(when, wake)

    def _message_id(self) -> str:
        self._counter += 1
        return hashlib.sha256(f"fedshield-virtual:{self.seed}:{self._counter}".encode()).hexdigest()[:32]

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        now = self.clock.now()
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                continue
            msg.metadata.__dict__["_message_id"] = mid = self._message_id()
            ids.append(mid)
            k = self._node_count[node]
            self._node_count[node] = k + 1
            rng = random.Random(f"{self.seed}:msg:{node}:{k}")
            p = self.profiles[node]
            noise = rng.lognormvariate(0.0, p.sigma) if p.sigma > 0 else 1.0
            dropped = rng.random() < p.dropout
            ttl = msg.metadata.ttl
            deadline = now + ttl if ttl else math.inf
            start = self._next_online(node, max(now, self._node_free[node]), min(deadline, now + 1e7))
            if start > deadline:
                # Still queued behind the node's earlier work (or the node offline) when its TTL ran out:
                # Flower's SuperLink deletes it instead of delivering it, so the node never runs it (no
                # work, no state change, no bytes) and is free for the next one.
                self.records[mid] = MessageRecord(mid, node, now, math.inf, math.inf, deadline, 0, 0, False,
                                                  math.isfinite(deadline), self._outstanding(node), deadline=deadline)
                if math.isfinite(deadline):
                    self._hold(mid, node, _expired(msg), deadline, deadline)
                continue
            reply = call_client(self._client, msg, self.contexts[node])
            down, up = message_nbytes(msg), message_nbytes(reply)
            epochs, examples = 1, 1
            if not msg.has_error() and CONFIG in msg.content.config_records:
                epochs = int(msg.content.config_records[CONFIG].get("local-epochs", 1))
            metrics = None if reply.has_error() else reply.content.metric_records.get(METRICS)
            if metrics is not None:
                n = metrics.get("num-examples", 1)
                examples = n if isinstance(n, int) and n > 0 else 1
            compute = p.compute_s_per_example * examples * epochs * noise
            if metrics is not None and math.isfinite(compute):
                # the client reports its local work in seconds (work-deadline reads it): here that is the
                # simulated device's, not this process's
                for key in WORK_METRICS:
                    if key in metrics:
                        metrics[key] = float(compute)
            done = start + p.transfer_s(down, up=False) + compute + p.transfer_s(up, up=True)
            if math.isfinite(done):
                self._node_free[node] = done  # a message it started, it finishes, even past the TTL
            outstanding = self._outstanding(node)
            expired = dropped or done > deadline
            if expired:
                done = math.inf if dropped else done
                reply = _expired(msg) if math.isfinite(deadline) else None
                visible = deadline
            else:
                visible = done
            self.records[mid] = MessageRecord(mid, node, now, start, done, visible, down, up if not dropped else 0,
                                              dropped, expired and math.isfinite(deadline), outstanding,
                                              deadline=deadline)
            if reply is not None:
                self._hold(mid, node, reply, visible, deadline)
        return ids

    def _hold(self, mid: str, node: int, reply: Message, visible: float, deadline: float) -> None:
        """Keep ``reply`` for pull_messages from ``visible`` until the clock is past ``deadline``."""
        self._pending[mid] = reply
        self._pending_of[node] += 1
        heapq.heappush(self._heap, (visible, mid))
        if math.isfinite(deadline):
            heapq.heappush(self._expiry, (deadline, mid))

    def _outstanding(self, node: int) -> int:
        """The node's messages whose reply is not pulled yet (a scan of every record made each round slower)."""
        return self._pending_of[node]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        now = self.clock.now()
        self._delete_expired(now)
        out = []
        for mid in list(message_ids):
            rec = self.records.get(mid)
            if mid in self._pending and rec.visible_at <= now:
                out.append(self._pending.pop(mid))
                self._pending_of[rec.node_id] -= 1
                rec.pulled_at = now
            elif rec is not None and rec.pulled_at is None and rec.deadline < now:
                # deleted unpulled when its TTL ran out: the SuperLink's error instead (once), so a workflow
                # still waiting for it is not left waiting for ever
                out.append(_deleted(mid, self.run.run_id, now))
                rec.pulled_at = now
        return out

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        ids = list(self.push_messages(messages))
        end = self.clock.now() + (timeout if timeout is not None else math.inf)
        replies: list[Message] = []
        waiting = set(ids)
        while waiting:
            got = list(self.pull_messages([m for m in ids if m in waiting]))
            for r in got:
                waiting.discard(r.metadata.reply_to_message_id)
            replies += got
            nxt = self.next_event_after(self.clock.now())
            if not waiting or nxt is None or nxt > end:
                break
            self.clock.advance_to(nxt)
        return replies
