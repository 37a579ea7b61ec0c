"""Federated evaluation: the global model evaluated by the clients, each with the task's own evaluate on
its held-out data; the coordinator takes the example-weighted mean of each metric the task's evaluate gives (over
the replies that give it; a name it does not give is not recorded): loss and accuracy in their own fields, the
task's others (a regression's rmse) in ``fed_eval_metrics``.

Every reply is validated before use (one metrics record of finite numbers within bounds, from the node
asked, within 64 KiB); a refused reply is counted and logged with its reason, and the others still count.
"""

from __future__ import annotations

import math
from collections import Counter
from logging import WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from aggregation import tensor_to_array
from aggregation._errors import shown
from clients.protocol import (ARRAYS, CONFIG, EVAL_PREFIX, MAX_EVAL_METRICS, MAX_METRIC, MAX_METRIC_NAME,
                              MESSAGE_TYPE_EVALUATE, METRICS, WEIGHTS, message_nbytes, metric_name_ok,
                              record_of)

from .validation import MAX_SIDE_BYTES, deadline_of, pull_bounded, pushed


class _Refused(Exception):
    def __init__(self, rule: str, detail: str) -> None:
        super().__init__(detail)
        self.rule = rule


def _check_reply(reply: Message, node: int, max_examples: int) -> tuple[int, dict[str, float]]:
    """(num-examples, {metric: value}) of a valid evaluate reply from ``node``; _Refused otherwise."""
    if reply.has_error():
        raise _Refused("client-error", shown(str(reply.error.reason), 200))  # (escaped: no forged log lines)
    if reply.metadata.src_node_id != node:
        raise _Refused("wrong-node", f"a reply from node {reply.metadata.src_node_id} to node {node}'s message")
    if message_nbytes(reply) > MAX_SIDE_BYTES:
        raise _Refused("too-large", f"an evaluate reply must be at most {MAX_SIDE_BYTES} bytes")
    metrics = record_of(reply.content, METRICS, MetricRecord)
    if metrics is None or set(reply.content.keys()) != {METRICS}:
        raise _Refused("malformed", f"an evaluate reply must carry one '{METRICS}' metric record")
    n = metrics.get("num-examples")
    if not (isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= max_examples):
        raise _Refused("bad-num-examples", f"num-examples must be an integer in [1, {max_examples}]")
    values = {k[len(EVAL_PREFIX):]: v for k, v in metrics.items() if k.startswith(EVAL_PREFIX)}
    if len(values) > MAX_EVAL_METRICS or len(values) != len(metrics) - 1:
        raise _Refused("malformed", f"at most {MAX_EVAL_METRICS} metrics, each named {EVAL_PREFIX}NAME")
    for key, v in values.items():
        if not metric_name_ok(key):  # (logged; as metric_values names them)
            raise _Refused("malformed", f"metric names must be 1 to {MAX_METRIC_NAME} printable characters; found "
                           f"{shown(key, 40)}")
        if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= MAX_METRIC):
            raise _Refused("non-finite", f"metric {key[:40]!r} must be a finite number with |value| <= {MAX_METRIC:g}")
    return n, {k: float(v) for k, v in values.items()}


def federated_evaluate(wf: Any, rnd: int, nodes: list[int]) -> dict[str, Any]:
    """Ask ``nodes`` to evaluate the workflow's global model; the row's ``fed_eval_*`` fields."""
    instr = wf.instruction(rnd).to_record()
    content = RecordDict({ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(wf.weights)}), CONFIG: ConfigRecord(dict(instr))})
    s = wf.cfg.server
    msgs = [Message(content, dst_node_id=n, message_type=MESSAGE_TYPE_EVALUATE, group_id=f"eval-{rnd}",
                    ttl=s.round_timeout + 60.0) for n in nodes]
    names = wf.eval_names  # what the task's evaluate gives: another name a client sends is not recorded (first:
    started = wf.clock.now()  # where no central evaluation told them yet, it evaluates, outside the clients' time)
    sent = {mid: m.metadata.dst_node_id for mid, m in pushed(wf.grid, msgs)}
    sums: dict[str, float] = {}
    weights: Counter[str] = Counter()  # each metric's examples: a reply that gives no such metric does not dilute it
    examples, accepted, rejected = 0, 0, Counter()
    replies, missing = _receive(wf, sent, deadline_of(wf.grid, started, wf.clock.now(), s.round_timeout))
    for reply in replies:
        node = sent.get(reply.metadata.reply_to_message_id, -1)
        try:
            n, values = _check_reply(reply, node, s.max_examples)
        except _Refused as exc:
            rejected[exc.rule] += 1
            log(WARNING, "[fedshield] round %d: evaluation from node %d refused (%s): %s", rnd, node, exc.rule, exc)
            continue
        examples, accepted = examples + n, accepted + 1
        for key, v in values.items():
            if key in names:
                sums[key] = sums.get(key, 0.0) + n * v
                weights[key] += n
    means = {k: v / weights[k] for k, v in sums.items()}
    out = {"fed_eval_nodes": accepted, "fed_eval_missing": missing, "fed_eval_examples": examples,
           "fed_eval_loss": means.pop("loss", None), "fed_eval_accuracy": means.pop("accuracy", None),
           "fed_eval_rejected": dict(rejected)}
    return {**out, "fed_eval_metrics": means} if means else out  # the task's own (a regression's rmse), by name


def _receive(wf: Any, sent: dict[str, int], deadline: float) -> tuple[list[Message], int]:
    """The replies to ``sent`` that arrive by ``deadline`` (polled on the workflow's clock), and how many of
    ``sent`` had none."""
    pending, out = dict(sent), []
    s = wf.cfg.server
    while pending:
        for reply in pull_bounded(wf.grid, list(pending), wf.clock, deadline):
            node = pending.get(mid := reply.metadata.reply_to_message_id)
            if node is not None:  # answered; one from another node (refused) leaves it open for its own
                if reply.has_error() or reply.metadata.src_node_id == node:
                    del pending[mid]
                out.append(reply)
        if not pending or wf.clock.now() >= deadline:
            break
        wf.clock.sleep(min(s.poll_interval, max(0.0, deadline - wf.clock.now())))
    return out, len(pending)


__all__ = ["federated_evaluate"]
