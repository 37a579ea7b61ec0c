"""Buffered asynchronous rounds (FedBuff, Nguyen et al. 2022), on Flower's Grid and a Clock.

Like :class:`~coordinator.workflow.SyncWorkflow` (whose model, codec, server
optimizer, checkpoint, run directory and evaluation it reuses), nothing here
knows where clients run: push, pull, node ids, and a clock.

The loop keeps ``concurrency`` (C) nodes busy, at most one message in flight per
node. Every accepted reply goes into a buffer with weight
``num_examples * staleness(version_now - base_version)``; when the buffer holds
``buffer_size`` (K) updates its weighted mean goes through the server optimizer,
the version is bumped, and that is one "round" (one release, one metrics row).
Idle nodes get new work at once, on the newest model. A reply staler than
``max_staleness`` is refused (rule ``too-stale``). Error replies (an expired
message, a vanished node) resolve their message: only then is the node idle
again, so a node is never sent a second message while one is in flight (the
livelock of FLOWER_NOTES.md, "Grid", cannot happen).

Every message gets its own :class:`RoundExpectation`: its group id is its
dispatch number and its base version the model version it carried, so
``validate_reply`` checks each reply against exactly what was sent.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from aggregation import tensor_to_array
from aggregation.staleness import StalenessFunction, create_staleness
from clients.protocol import (ARRAYS, CODEC, CONFIG, LOCAL_DP, MESSAGE_TYPE_TRAIN, WEIGHTS, message_nbytes, update_nbytes)

from ._errors import CoordinatorError
from .config import RunConfig
from .live import recorded
from .progress import format_row
from .rundir import CONFIG as CONFIG_FILE
from .rundir import SUMMARY, RunDirectory
from .validation import (
    LossMean,
    RejectedReply,
    RoundExpectation,
    add_reply,
    pull_chunks,
    pushed,
    staleness_factor,
    validate_reply,
)
from .workflow import Clock, RoundCallback, SyncWorkflow

__all__ = ["BufferedAsyncWorkflow", "Flight", "LedgerEntry"]


@dataclass
class Flight:
    """One message in flight."""

    node_id: int
    seq: int  # dispatch number (group id and instruction round)
    base_version: int
    sent_at: float
    expectation: RoundExpectation


@dataclass(frozen=True)
class LedgerEntry:
    """What became of one resolved message."""

    message_id: str
    node_id: int
    base_version: int
    version_at_arrival: int
    outcome: str  # "accepted" or a rejection rule
    staleness: int | None = None
    weight: float | None = None
    released_in: int | None = None  # the release (round) the update went into


def _int_param(name: str, x: Any, lo: int) -> int:
    if not isinstance(x, int) or isinstance(x, bool) or x < lo:
        raise CoordinatorError(f"{name} must be an integer >= {lo}. Found {x!r}.")
    return x


class BufferedAsyncWorkflow(SyncWorkflow):
    """FedBuff: keep ``concurrency`` nodes busy, release every ``buffer_size`` accepted updates.

    ``num-rounds`` of the run config counts releases. ``staleness`` is a
    StalenessFunction or a name for ``create_staleness`` (default: polynomial,
    a=0.5, i.e. 1/sqrt(1+s)); ``staleness_params`` its parameters.
    ``message_ttl`` (default ``round-timeout``) is each message's TTL: a node whose
    reply has not come by then is answered by the Grid with an error reply.
    ``stall_timeout`` (default ``message_ttl + wait-nodes-timeout``): the run stops
    with CoordinatorError when no update has been accepted for that long (replies that
    are all rejected, or all expire, are no progress: such a run used to go on for ever).
    """

    def __init__(self, cfg: RunConfig, grid: Grid, run_dir: RunDirectory, clock: Clock | None = None,
                 on_round: RoundCallback | None = None, *, concurrency: int = 10, buffer_size: int = 5,
                 max_staleness: int = 20, staleness: str | StalenessFunction = "polynomial",
                 staleness_params: dict[str, Any] | None = None, message_ttl: float | None = None,
                 stall_timeout: float | None = None, sim_nodes: int | None = None) -> None:
        self.concurrency = _int_param("concurrency", concurrency, 1)
        self.buffer_size = _int_param("buffer_size", buffer_size, 1)
        self.max_staleness = _int_param("max_staleness", max_staleness, 0)
        if isinstance(staleness, StalenessFunction):
            if staleness_params:
                raise CoordinatorError("staleness_params must be empty when staleness is already a function.")
            self.staleness_fn = staleness
        elif isinstance(staleness, str):
            params = {"a": 0.5} if staleness == "polynomial" and staleness_params is None else dict(staleness_params or {})
            try:
                self.staleness_fn = create_staleness(staleness, **params)
            except Exception as exc:  # AggregationError: unknown name or parameter
                raise CoordinatorError(f"staleness must be a known function: {exc}") from None
        else:
            raise CoordinatorError(f"staleness must be a name or a StalenessFunction. Found {type(staleness).__name__}.")
        super().__init__(cfg, grid, run_dir, clock, on_round, sim_nodes)
        s = cfg.server
        self.message_ttl = float(message_ttl if message_ttl is not None else s.round_timeout)
        if not (math.isfinite(self.message_ttl) and self.message_ttl > 0):
            raise CoordinatorError(f"message_ttl must be > 0 seconds. Found {message_ttl!r}.")
        self.stall_timeout = float(stall_timeout if stall_timeout is not None else self.message_ttl + s.wait_nodes_timeout)
        if not (math.isfinite(self.stall_timeout) and self.stall_timeout > 0):
            raise CoordinatorError(f"stall_timeout must be > 0 seconds. Found {stall_timeout!r}.")
        self.inflight: dict[str, Flight] = {}
        self.ledger: list[LedgerEntry] = []
        # dispatches so far: keys each dispatch's sample and its messages' round; resumed, so a resumed run does
        # not draw the same samples and training seeds again
        def count(key: str) -> int:
            v = self.resumed_extra.get(key, 0)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0

        self._seq = count("dispatch-seq")
        # the counts of the sessions before a resume (the ledger itself is this session's)
        self.dispatched, self._accepted_before, self._rejected_before = count("dispatched"), count("accepted"), count("rejected")
        self._in_buffer: set[int] = set()  # nodes with an update in the buffer (not dispatched again: _one_per_node)

    def _extra_state(self) -> dict[str, Any]:
        return {"dispatch-seq": self._seq, "dispatched": self.dispatched, "accepted": self.accepted_total,
                "rejected": self.rejected_total}

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "workflow": "fedbuff"}

    # -- counts --------------------------------------------------------------
    @property
    def accepted_total(self) -> int:
        return self._accepted_before + sum(1 for e in self.ledger if e.outcome == "accepted")

    @property
    def rejected_total(self) -> int:
        return self._rejected_before + sum(1 for e in self.ledger if e.outcome != "accepted")

    # -- dispatch ------------------------------------------------------------
    @property
    def _one_per_node(self) -> str:
        """Why a node adds at most one update to a release ('' when it may add several): RunConfig.one_update_per_node."""
        return self.cfg.one_update_per_node()

    def _new_aggregator(self) -> Any:
        return self.cfg.aggregation.make_aggregator(self.numel, self.device, self.buffer_size)

    def _dispatch(self, nodes: list[int]) -> tuple[int, int]:
        """Send the current model to idle online nodes until C are busy; return (messages, bytes)."""
        busy = {f.node_id for f in self.inflight.values()}
        if self._one_per_node:  # one update per node per release
            busy |= self._in_buffer
        idle = [n for n in sorted(nodes) if n not in busy]
        room = self.concurrency - len(self.inflight)
        if room <= 0 or not idle:
            return 0, 0
        chosen = sorted(random.Random(f"{self.cfg.server.seed}:async:{self._seq}").sample(idle, min(room, len(idle))))
        array = tensor_to_array(self.weights)
        s = self.cfg.server
        msgs, seqs = [], []
        for node in chosen:
            self._seq += 1
            instr = self.instruction(self._seq)
            content = RecordDict({ARRAYS: ArrayRecord({WEIGHTS: array}), CONFIG: instr.to_record(),
                                  CODEC: ConfigRecord(self.codec.config())})
            if self.cfg.privacy.dp == "local":
                content[LOCAL_DP] = ConfigRecord(self.cfg.privacy.local_record())
            msgs.append(Message(content, dst_node_id=node, message_type=MESSAGE_TYPE_TRAIN, group_id=str(self._seq),
                                ttl=self.message_ttl))
            seqs.append(self._seq)
        seq_of = {id(m): q for m, q in zip(msgs, seqs, strict=True)}
        ids = pushed(self.grid, msgs)
        if len(ids) != len(msgs):
            log(WARNING, "[fedshield] async: %d of %d messages were not accepted by the grid", len(msgs) - len(ids), len(msgs))
        now = self.clock.now()
        for mid, msg in ids:
            node, seq = msg.metadata.dst_node_id, seq_of[id(msg)]
            exp = RoundExpectation(round=seq, version=self.version, numel=self.numel, max_examples=s.max_examples,
                                   max_bytes=self.max_update_bytes, max_norm=s.max_update_norm, codec=self.codec,
                                   codec_header=self.codec_header, sent={mid: node})
            self.inflight[mid] = Flight(node, seq, self.version, now, exp)
        self.dispatched += len(ids)
        return len(ids), len(array.data) * len(ids)

    # -- the loop --------------------------------------------------------------
    @recorded
    def run(self) -> dict[str, Any]:
        total = self.cfg.server.num_rounds
        self.run_dir.write_json(CONFIG_FILE, self.cfg.to_mapping())
        t0 = self.clock.now()
        last_release = t0
        last_progress = t0  # the last accepted update (or the start)
        acc = self._new_aggregator()
        window: dict[str, Any] = self._fresh_window()
        while self.round < total:
            nodes = list(self.grid.get_node_ids())
            n_sent, n_bytes = self._dispatch(nodes)
            window["selected"] += n_sent
            window["bytes_down"] += n_bytes
            pulled, releases = 0, self.round
            for replies in pull_chunks(self.grid, list(self.inflight)) if self.inflight else ():
                pulled += len(replies)
                for reply in replies:
                    if self.round >= total:
                        break  # the last release is out; the rest stay "in flight" (unresolved) at the end
                    mid = reply.metadata.reply_to_message_id
                    flight = self.inflight.get(mid)
                    # A reply that resolves no message (to one not ours or resolved, or from another node than the
                    # one asked, which leaves the message open for its own): a stray, counted apart from the
                    # ledger, whose entries are the dispatched messages' outcomes
                    stray = ("unknown-message" if flight is None else None if reply.has_error()
                             or reply.metadata.src_node_id == flight.node_id else "unknown-sender")
                    if stray is not None:
                        window["stray"][stray] += 1
                        window["bytes_up"] += message_nbytes(reply)
                        log(WARNING, "[fedshield] async: ignoring a reply from node %d (%s) to message %s",
                            reply.metadata.src_node_id, stray, str(mid)[:16])
                        continue
                    del self.inflight[mid]
                    window["replies"] += 1
                    if not self._take(reply, mid, flight, acc, window):
                        continue
                    last_progress = self.clock.now()
                    if acc.count >= self.buffer_size:
                        self._release(acc, window, last_release, nodes)
                        last_release = self.clock.now()
                        acc = self._new_aggregator()
                        window = self._fresh_window()
                        self._in_buffer.clear()
                if self.round > releases:
                    break  # the nodes that replied get the new model before the other replies are asked for
            if self.round >= total:
                break
            if self.clock.now() - last_progress >= self.stall_timeout:
                rejected = ", ".join(f"{rule} {n}" for rule, n in sorted(window["rejected"].items())) or "none"
                if self._one_per_node and len(set(nodes)) < self.buffer_size:
                    raise CoordinatorError(
                        f"a release {self._one_per_node} must take buffer-size = {self.buffer_size} updates from as many "
                        f"nodes (one each). Found {len(set(nodes))} nodes online for {self.stall_timeout:g} s; lower "
                        "buffer-size or start more nodes.")
                raise CoordinatorError(
                    f"the async run must make progress: no update was accepted for {self.stall_timeout:g} s "
                    f"(rejected since the last release: {rejected}; {len(self.inflight)} in flight, {len(nodes)} nodes "
                    "online). Raise round-timeout (each message's time to live) if the nodes need longer, or check them.")
            if not pulled:
                self.clock.sleep(self.cfg.server.poll_interval if self.inflight else min(1.0, self.cfg.server.poll_interval * 10))
        return self.finish()

    @staticmethod
    def _fresh_window() -> dict[str, Any]:
        return {"selected": 0, "bytes_down": 0, "replies": 0, "rejected": Counter(), "stray": Counter(), "bytes_up": 0,
                "update_bytes_up": 0,
                "loss": LossMean(),
                "staleness": [], "local_eps": [], "examples": 0}

    def _take(self, reply: Message, mid: str, flight: Flight, acc: Any, window: dict[str, Any]) -> bool:
        """Validate one reply and add it to the buffer; return whether it was accepted."""
        nbytes = message_nbytes(reply)
        window["bytes_up"] += nbytes  # what came up, refused or not (as the sync rows count)
        window["update_bytes_up"] += update_nbytes(reply)
        try:
            ok = validate_reply(reply, flight.expectation, check_norm=False, nbytes=nbytes)
            staleness = self.version - flight.base_version
            if self._one_per_node and flight.node_id in self._in_buffer:
                raise RejectedReply(ok.node_id, "duplicate-contributor", "a node adds at most one update to a release "
                                                                         f"{self._one_per_node}")
            # weight n s(staleness); the release divides by the examples, sum n (Nguyen et al.'s sum s(t) delta / K)
            factor = staleness_factor(self.staleness_fn, staleness, self.max_staleness, ok.node_id)
            weight = float(ok.num_examples) * factor
            ok = add_reply(acc, self.codec, ok, weight, flight.expectation)  # the norm rules, checked while adding
        except RejectedReply as rej:
            window["rejected"][rej.rule] += 1
            self.ledger.append(LedgerEntry(mid, flight.node_id, flight.base_version, self.version, rej.rule))
            log(WARNING, "[fedshield] async: rejected reply from node %d (%s): %s", rej.node_id, rej.rule, rej.detail)
            return False
        window["examples"] += ok.num_examples
        self._in_buffer.add(flight.node_id)
        self.ledger.append(LedgerEntry(mid, flight.node_id, flight.base_version, self.version, "accepted",
                                       staleness, weight, self.round + 1))
        window["staleness"].append(staleness)
        window["loss"].add(ok)
        if ok.local_epsilon is not None:
            window["local_eps"].append(ok.local_epsilon)
        return True

    def _release(self, acc: Any, window: dict[str, Any], last_release: float, nodes: list[int]) -> None:
        # The rule's result (for the mean: sum n s delta / sum n s) times sum n s / sum n: the staleness factors
        # discount the release (Nguyen et al. 2022, Alg. 1), not only weigh its updates against each other, which
        # cancelled them out whenever a release's updates were equally stale. Under the robust rules (which
        # choose by value, not weight) this scales their result by the release's mean staleness factor.
        extra: dict[str, Any] = {}
        self._step(self.round + 1, acc.result().mul(acc.total_weight / window["examples"]), extra)
        self.round += 1
        tested = self.evaluate_at(self.round)
        now = self.clock.now()
        rejected: Counter[str] = window["rejected"]
        row: dict[str, Any] = {
            **extra, "workflow": "fedbuff", "round": self.round, "nodes_online": len(nodes), "selected": window["selected"],
            "bytes_down": window["bytes_down"], "replies": window["replies"], "accepted": acc.count,
            "rejected": sum(rejected.values()), "rejected_by_rule": dict(rejected), "bytes_up": window["bytes_up"],
            "update_bytes_up": window["update_bytes_up"],
            "train_loss": window["loss"].value, **tested,
            "version": self.version, "round_time_s": now - last_release, **self._run_times(now - last_release),
            "mean_staleness": sum(window["staleness"]) / len(window["staleness"]),
        }
        if window["local_eps"]:
            row["local_epsilon_max"] = max(window["local_eps"])
        if window["stray"]:
            row["stray_replies"] = dict(window["stray"])
        self.record(self.round, row)
        log(INFO, "[fedshield] %s  staleness %.2f", format_row(row, self.cfg.server.num_rounds), row["mean_staleness"])
        if self.on_round:
            self.on_round(row)

    def finish(self) -> dict[str, Any]:
        summary = super().finish()
        summary.update({"workflow": "fedbuff", "dispatched": self.dispatched, "accepted_total": self.accepted_total,
                        "rejected_total_async": self.rejected_total, "in_flight_at_end": len(self.inflight)})
        if self.simulated:
            summary["sim_time_s"] = self._spent("sim_time_s")
        self.run_dir.write_json(SUMMARY, summary)
        return summary
