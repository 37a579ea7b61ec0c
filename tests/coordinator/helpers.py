"""Clients that misbehave, for tests of the coordinator's defences."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from clients.client_app import run_train
from clients.protocol import ARRAYS, DELTA, METRICS
from simulations.inprocess import InProcessGrid


def reply_with(msg: Message, delta: Array, metrics: dict | None = None) -> Message:
    m = {"num-examples": 10, "base-version": int(msg.content.config_records["config"]["version"]), "train-loss": 1.0}
    m.update(metrics or {})
    return Message(RecordDict({ARRAYS: ArrayRecord({DELTA: delta}), METRICS: MetricRecord(m)}), reply_to=msg)


def stock_flower_bad(kind: str) -> Callable[[Message, Context], Message]:
    """A Flower-style client that replies with a broken update of the given kind."""

    def client(msg: Message, ctx: Context) -> Message:
        numel = msg.content.array_records[ARRAYS]["weights"].shape[0]
        if kind == "wrong-length":
            return reply_with(msg, Array(np.zeros(numel - 1, np.float32)))
        if kind == "nan":
            d = np.zeros(numel, np.float32)
            d[3] = np.nan
            return reply_with(msg, Array(d))
        if kind == "inf":
            d = np.zeros(numel, np.float32)
            d[-1] = np.inf
            return reply_with(msg, Array(d))
        if kind == "float64":
            return reply_with(msg, Array(np.zeros(numel, np.float64)))
        if kind == "zero-examples":
            return reply_with(msg, Array(np.zeros(numel, np.float32)), {"num-examples": 0})
        if kind == "huge-examples":
            return reply_with(msg, Array(np.zeros(numel, np.float32)), {"num-examples": 10**12})
        if kind == "stale":
            return reply_with(msg, Array(np.zeros(numel, np.float32)), {"base-version": 10**6})
        if kind == "huge-values":
            return reply_with(msg, Array(np.full(numel, 1e38, np.float32)))
        if kind == "large-norm":
            return reply_with(msg, Array(np.full(numel, 1e6, np.float32)))
        raise ValueError(kind)

    return client


def mixed(bad_nodes: set[int], bad: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    """Honest fedshield clients except on ``bad_nodes`` (node ids)."""

    def client(msg: Message, ctx: Context) -> Message:
        return bad(msg, ctx) if ctx.node_id in bad_nodes else run_train(msg, ctx)

    return client


class FakeClock:
    """A clock that moves only when waited on (or when a test's grid moves it)."""

    t = 0.0

    def now(self):
        return self.t

    def sleep(self, s):
        self.t += s


class SlowRemoteGrid(InProcessGrid):
    """A grid as slow as a busy SuperLink, on a fake clock: a push takes ``push_s``, each pull ``pull_s``
    (the replies are made at once; only the clock says how long the transport took)."""

    computes_replies_at_push = False  # as Flower's grid: the replies arrive after the push

    def __init__(self, client, num_nodes, clock, push_s, pull_s):
        super().__init__(client, num_nodes)
        self.clock, self.push_s, self.pull_s, self.asks = clock, push_s, pull_s, []
        self.events: list[tuple[str, int]] = []  # ("push" | "pull", messages pushed | ids asked), in order

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        self.clock.t += self.push_s
        self.events.append(("push", len(ids)))
        return ids

    def pull_messages(self, message_ids):
        ids = list(message_ids)
        self.asks.append(len(ids))
        self.events.append(("pull", len(ids)))
        self.clock.t += self.pull_s
        return super().pull_messages(ids)


class ForgingGrid(InProcessGrid):
    """Each reply of ``victim`` comes after a copy claiming to be from ``forger``, in the same pull. The guard and the
    ServerApp's grid refuse such a reply; behind them, the workflows must refuse it and still take the victim's own (a review:
    FedBuff, federated evaluation and SecAgg+ let the forged copy close the victim's message)."""

    def __init__(self, client, num_nodes: int, victim: int, forger: int) -> None:
        super().__init__(client, num_nodes)
        self.victim, self.forger, self.forged = victim, forger, 0

    def pull_messages(self, message_ids):
        import copy

        out = []
        for reply in super().pull_messages(message_ids):
            if reply.metadata.src_node_id == self.victim and not reply.has_error():
                forged = copy.deepcopy(reply)
                forged.metadata.__dict__["_src_node_id"] = self.forger
                out.append(forged)
                self.forged += 1
            out.append(reply)
        return out
