"""Clients that misbehave, for tests of the coordinator's defences."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict

from clients.client_app import run_train
from clients.protocol import ARRAYS, DELTA, METRICS


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
