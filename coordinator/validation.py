"""Validation of every client reply before any of it is used.

A reply that breaks a rule raises :class:`RejectedReply` naming the node and
the rule; the caller logs it, counts it, and the round goes on.

The hot path reads each update once: ``validate_reply(reply, exp, check_norm=False)``
checks everything but the norm, and ``add_replies(agg, [(ok, weight, exp), ...])`` does the
norm checks fused with the adds into the aggregator (``Aggregator.add_checked_many``: a whole
batch in one pass over the sum where the rule allows), rejecting with the same
``"non-finite"`` / ``"norm-too-large"`` rules and leaving the aggregator as it was. ``validate_reply(reply, exp)`` alone still checks the norm too (two reads).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from aggregation import AggregationError, UpdateRejected
from aggregation._errors import shown
from aggregation.staleness import MIN_USEFUL_FACTOR
from aggregation.codecs import Codec, Parsed
from clients.protocol import ARRAYS, CODEC, DELTA, METRICS, message_nbytes, update_nbytes


class RejectedReply(Exception):
    """A reply broke a rule. ``rule`` is a short stable name used in metrics."""

    def __init__(self, node_id: int, rule: str, detail: str) -> None:
        super().__init__(f"node {node_id}: {rule}: {detail}")
        self.node_id, self.rule, self.detail = node_id, rule, detail


@dataclass
class RoundExpectation:
    """What a valid reply in this round must look like."""

    round: int
    version: int
    numel: int
    max_examples: int
    max_bytes: int
    max_norm: float
    codec: Codec
    codec_header: dict  # the header this codec writes for this model (fields a reply must match)
    sent: dict[str, int]  # message id -> node id it was sent to
    replied: set[str] = field(default_factory=set)
    sent_at: float = 0.0  # when the round's messages went out (a carried reply is timed from it)


@dataclass(frozen=True)
class ValidReply:
    node_id: int
    parsed: Parsed  # validated views that share memory with the reply's bytes: read only
    num_examples: int
    train_loss: float
    nbytes: int
    norm: float  # nan until add_reply when validated with check_norm=False
    local_epsilon: float | None = None


def _norm_rejection(node: int, rule: str, norm: float, max_norm: float) -> RejectedReply:
    if rule == "non-finite":
        return RejectedReply(node, "non-finite", "update must hold only finite values (and not overflow float32)")
    return RejectedReply(node, "norm-too-large", f"update L2 norm must be <= max-update-norm={max_norm:g}; found {norm:.4g}")


def check_envelope(reply: Message, asked: int, rnd: int) -> None:
    """A reply must not be an error, must come from the node asked, and must belong to round ``rnd``."""
    node = reply.metadata.src_node_id
    if reply.has_error():  # from the client, or from the SuperLink (node gone, message expired)
        # the reason as repr: a client's text with newlines or terminal escapes would forge log lines
        reason = shown(str(reply.error.reason), 200) if reply.error.reason else "(no reason given)"
        raise RejectedReply(asked, "error-reply", f"code {reply.error.code}: {reason}")
    if asked != node:
        raise RejectedReply(node, "unknown-sender", f"reply must come from node {asked}, the node asked")
    if reply.metadata.group_id != str(rnd):
        raise RejectedReply(node, "wrong-round", f"group id must be {rnd}; found {shown(reply.metadata.group_id, 40)}")


def check_num_examples(node: int, metrics: Any, max_examples: int) -> int:
    """The reply's ``num-examples``: an integer in [1, max_examples], else RejectedReply."""
    num = metrics.get("num-examples")
    if not isinstance(num, int) or isinstance(num, bool) or not 0 < num <= max_examples:
        raise RejectedReply(node, "bad-num-examples", f"num-examples must be an integer in [1, {max_examples}]; found {shown(num, 40)}")
    return num


def check_base_version(node: int, metrics: Any, version: int) -> None:
    """The reply must have trained from the model version it was sent."""
    base = metrics.get("base-version")
    if base is None:  # not stale: absent (a plain Flower client that sends only num-examples)
        raise RejectedReply(node, "missing-base-version", f"metrics must give base-version, the 'version' of the "
                                                          f"train message's config ({version})")
    if base != version:
        raise RejectedReply(node, "stale-version", f"base-version must be {version}; found {shown(base, 40)}")


_KINDS = {ARRAYS: ArrayRecord, METRICS: MetricRecord, CODEC: ConfigRecord}
MAX_SIDE_BYTES = 1 << 16  # a reply's records besides its update (metrics, codec header): 64 KiB is ~100x what clients send


def check_records(node: int, content: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """The reply holds the ``required`` records, perhaps the ``optional`` ones, nothing else, each of its kind
    (``_KINDS``); else RejectedReply ("missing-record", "unexpected-record", "wrong-record-kind")."""
    missing = [name for name in required if name not in content]
    if missing:
        raise RejectedReply(node, "missing-record", f"reply must hold {' and '.join(repr(n) for n in required)}; "
                            f"found {shown(list(content.keys()))}")
    extra = sorted(set(content.keys()) - {*required, *optional})
    if extra:  # nothing else is read: unchecked, a record of any size would ride along uncounted
        allowed = ", ".join(repr(n) for n in (*required, *optional))
        raise RejectedReply(node, "unexpected-record", f"reply must hold only {allowed}; "
                            f"found {', '.join(repr(k[:40]) for k in extra[:3])}")
    for name in (*required, *optional):
        rec = content.get(name)
        if rec is not None and not isinstance(rec, _KINDS[name]):
            raise RejectedReply(node, "wrong-record-kind", f"'{name}' must be of kind {_KINDS[name].__name__}; "
                                f"found {type(rec).__name__}")


def check_side_bytes(node: int, reply: Message, nbytes: int | None = None) -> None:
    """Everything in the reply but its update's array data (its metrics, codec header, keys, names) must stay
    within ``MAX_SIDE_BYTES``: the update's own size is checked against the round's limit, and extra keys
    in a record that is read (a codec header's, a metric record's) would otherwise ride along uncounted.
    ``nbytes``: the reply's ``message_nbytes``, where the caller counted it already."""
    side = (message_nbytes(reply) if nbytes is None else nbytes) - update_nbytes(reply)
    if side > MAX_SIDE_BYTES:
        raise RejectedReply(node, "oversized", f"records besides the update must be <= {MAX_SIDE_BYTES} bytes; "
                            f"found {side}")


def validate_reply(reply: Message, exp: RoundExpectation, *, check_norm: bool = True,
                   nbytes: int | None = None) -> ValidReply:
    """Check one reply against every rule; return its parts or raise RejectedReply.

    ``check_norm=False`` leaves the norm rules ("non-finite", "norm-too-large") to ``add_reply``,
    which checks them while adding (the returned ``norm`` is then nan). A reply breaking a norm
    rule and a later rule (num-examples, base-version) is then rejected by the later rule.
    ``nbytes``: the reply's ``message_nbytes`` where the caller counted it (its traffic), not counted again.
    """
    meta = reply.metadata
    node = meta.src_node_id
    msg_id = meta.reply_to_message_id
    if msg_id not in exp.sent:
        raise RejectedReply(node, "unknown-message", f"reply must answer a message sent this round; found {msg_id[:16]!r}")
    if msg_id in exp.replied:
        raise RejectedReply(node, "duplicate", "a reply to this message was already received")
    # Before the message counts as answered: a reply from another node (refused here) must not use up the
    # slot of the node asked, whose own reply would then be refused as a duplicate.
    check_envelope(reply, exp.sent[msg_id], exp.round)
    exp.replied.add(msg_id)
    content = reply.content
    check_records(node, content, required=(ARRAYS, METRICS), optional=(CODEC,))
    array_rec, metrics, codec_rec = content[ARRAYS], content[METRICS], content.get(CODEC)
    check_side_bytes(node, reply, nbytes)
    arrays: dict[str, Array] = dict(array_rec.items())
    if codec_rec is not None:
        header = dict(codec_rec)
    elif list(arrays) == [DELTA]:  # the plain format: dense float32 under "delta"
        header = {"codec": "dense", "numel": exp.numel, "dtype": "float32"}
        arrays = {"values": arrays[DELTA]}
    else:
        raise RejectedReply(node, "missing-record", f"reply must hold a '{CODEC}' record, or exactly the array '{DELTA}'")
    for key, want in exp.codec_header.items():  # the codec and its settings are the coordinator's, not the client's
        if header.get(key, want) != want:
            raise RejectedReply(node, "wrong-codec", f"codec header {key} must be {want!r}; found {str(header.get(key))[:40]!r}")
    nbytes = sum(len(a.data) for a in arrays.values())
    if nbytes > exp.max_bytes:
        raise RejectedReply(node, "oversized", f"update must be <= {exp.max_bytes} bytes; found {nbytes}")
    try:
        parsed = exp.codec.parse(arrays, header, exp.numel, exp.max_bytes)
    except AggregationError as exc:
        raise RejectedReply(node, "bad-array", str(exc)) from None
    norm = math.nan
    if check_norm:
        # One reduction: a NaN/inf anywhere, or an overflowing magnitude, makes the norm non-finite.
        norm = exp.codec.norm(parsed)
        if not math.isfinite(norm):
            raise _norm_rejection(node, "non-finite", norm, exp.max_norm)
        if norm > exp.max_norm:
            raise _norm_rejection(node, "norm-too-large", norm, exp.max_norm)
    num = check_num_examples(node, metrics, exp.max_examples)
    check_base_version(node, metrics, exp.version)
    loss = metrics.get("train-loss", float("nan"))
    loss = float(loss) if isinstance(loss, int | float) and abs(loss) <= MAX_TRAIN_LOSS else float("nan")
    eps = metrics.get("local-epsilon")  # a negative or non-finite claim is no claim
    eps = float(eps) if isinstance(eps, int | float) and not isinstance(eps, bool) and 0 <= eps < math.inf else None
    return ValidReply(node_id=node, parsed=parsed, num_examples=num, train_loss=loss, nbytes=nbytes, norm=norm,
                      local_epsilon=eps)


MAX_TRAIN_LOSS = 1e30  # a reported train-loss past this (or not finite, or missing) is unknown: nan, left out of means


class LossMean:
    """A round's training loss: the accepted replies' reported ``train-loss``, averaged over their
    examples (``num-examples``), whatever weight their update got in the sum (1 under central DP, a
    staleness factor for a late reply). A reply whose loss is unknown (nan, see ``validate_reply``)
    is left out of the mean instead of making it nan; a loss within ``MAX_TRAIN_LOSS`` cannot make
    it overflow."""

    def __init__(self) -> None:
        self.total, self.examples = 0.0, 0

    def add(self, ok: "ValidReply") -> None:
        if not math.isnan(ok.train_loss):
            self.total += ok.train_loss * ok.num_examples
            self.examples += ok.num_examples

    @property
    def value(self) -> float:
        return self.total / self.examples if self.examples else float("nan")


def add_replies(agg: Any, items: list[tuple[ValidReply, float, RoundExpectation]]) -> list[ValidReply | RejectedReply]:
    """Add replies validated with ``check_norm=False`` into ``agg`` (an Aggregator), each
    ``(reply, weight, expectation)``, checking every norm while adding (``add_checked_many``: for
    the mean on CPU, one fused pass over the sum for the whole batch).

    Returns, in order, each reply with its ``norm`` filled in, or the RejectedReply
    ("non-finite" or "norm-too-large") of a reply that broke a norm rule and was left out
    (the aggregator's count, weights and sum hold nothing of it, see ``aggregation.accumulator``). Other
    AggregationErrors (a full aggregator, a bad weight) pass through.
    """
    out: list[ValidReply | RejectedReply | None] = [None] * len(items)
    groups: dict[tuple[int, float], list[int]] = {}
    for i, (_, _, exp) in enumerate(items):  # one batch per codec (a slow link's may differ)
        groups.setdefault((id(exp.codec), exp.max_norm), []).append(i)
    for idx in groups.values():
        exp = items[idx[0]][2]
        results = agg.add_checked_many(exp.codec, [items[i][0].parsed for i in idx], [items[i][1] for i in idx],
                                       exp.max_norm)
        for i, res in zip(idx, results, strict=True):
            ok = items[i][0]
            out[i] = (_norm_rejection(ok.node_id, res.rule, res.norm, exp.max_norm) if isinstance(res, UpdateRejected)
                      else dataclasses.replace(ok, norm=res))
    return out  # type: ignore[return-value]


def add_reply(agg: Any, codec: Codec, ok: ValidReply, weight: float, exp: RoundExpectation) -> ValidReply:
    """``add_replies`` for one reply (with ``codec``): returns it with its norm, or raises its RejectedReply."""
    res = add_replies(agg, [(ok, weight, dataclasses.replace(exp, codec=codec))])[0]
    if isinstance(res, RejectedReply):
        raise res
    return res


def pushed(grid: Any, msgs: list[Message]) -> list[tuple[str, Message]]:
    """Push ``msgs`` and return ``(message id, message)`` for each one the grid took, in order.

    A grid may take fewer than it was given (Flower's in-memory grid and ours leave out a message to a
    node that has gone; its HTTP grid answers None or "" for one it could not push): each id is read
    from its own message's metadata, never matched to the messages by position, so one left out
    cannot shift the others' ids onto other nodes.
    """
    taken = {i for i in grid.push_messages(msgs) if isinstance(i, str) and i}
    return [(m.metadata.message_id, m) for m in msgs if m.metadata.message_id in taken]


# A remote grid is asked for this many replies at a time, the deadline checked between asks: one pull of a
# hundred replies through a busy SuperLink took tens of seconds, past a 60 s round-timeout.
PULL_CHUNK = 32


def deadline_of(grid: Any, push_started: float, push_ended: float, timeout: float) -> float:
    """When replies to a push stop counting: ``timeout`` from before the push to a remote grid (a push through a
    busy SuperLink takes its time too), from after it on an in-process grid (which trains while it pushes)."""
    return (push_ended if getattr(grid, "computes_replies_at_push", False) else push_started) + timeout


def pull_chunks(grid: Any, ids: list[str]) -> Iterator[list[Message]]:
    """The replies to ``ids`` that are in, one ask at a time: ``PULL_CHUNK`` ids an ask from a remote grid (one pull of
    many replies through a busy SuperLink takes tens of seconds), all in one ask from an in-process grid. The caller
    may stop between asks; the ids not asked stay pending."""
    if getattr(grid, "computes_replies_at_push", False):
        yield list(grid.pull_messages(ids))
        return
    for i in range(0, len(ids), PULL_CHUNK):
        yield list(grid.pull_messages(ids[i:i + PULL_CHUNK]))


def pull_bounded(grid: Any, ids: list[str], clock: Any, deadline: float) -> list[Message]:
    """The replies to ``ids`` that are in (:func:`pull_chunks`), stopping between asks once ``deadline`` has passed
    on ``clock``."""
    out: list[Message] = []
    for got in pull_chunks(grid, ids):
        out.extend(got)
        if clock.now() >= deadline:
            break
    return out


def staleness_factor(fn: Any, staleness: int, max_staleness: int, node: int) -> float:
    """``fn(staleness)`` for a reply from ``node``; RejectedReply ``too-stale`` past ``max_staleness``
    or when the factor is below MIN_USEFUL_FACTOR (its weight would vanish in float32, and a release
    of only such updates would divide by a sum of weights of 0)."""
    if staleness > max_staleness:
        raise RejectedReply(node, "too-stale", f"staleness must be <= max_staleness={max_staleness}; found {staleness}")
    factor = fn(staleness)
    if factor < MIN_USEFUL_FACTOR:
        raise RejectedReply(node, "too-stale", f"staleness factor must be >= {MIN_USEFUL_FACTOR:g} (smaller adds "
                                               f"nothing); found {factor:.3g} at staleness {staleness}")
    return factor

