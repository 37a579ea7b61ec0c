"""What a train message and its reply carry (names shared by both sides).

Train message (coordinator -> client)::

    content["arrays"]  ArrayRecord {"weights": flat float32 global model}
    content["config"]  ConfigRecord {round, version, seed, <TaskSpec keys>, <TrainSettings keys>,
                                     frozen-check (only for a model with frozen parameters)}
    content["codec"]   ConfigRecord {"codec": name, <codec parameters>}   (how to encode the reply)
    content["local-dp"] ConfigRecord {noise-multiplier, max-grad-norm, delta, accountant}  (only when local DP is on)

Reply (client -> coordinator)::

    content["arrays"]  ArrayRecord {<the codec's arrays>}   (the encoded delta, new - old)
    content["codec"]   ConfigRecord {"codec": name, "numel": n, <the codec's header>}
    content["metrics"] MetricRecord {num-examples, base-version, train-loss, train-time-s, client-time-s,
                                     <the device profile>}
                                     (client-time-s: the node's whole local work for the round, in
                                     seconds; work-deadline reads it)

Evaluate message (federated evaluation): the train message's "arrays" and "config"; its reply carries only
content["metrics"] MetricRecord {num-examples, eval-loss, eval-<metric>...}: the task's evaluate on the
node's held-out data.

SecAgg+ rounds use message type "train.secagg"; each stage's message and reply
carry content["secagg"] ConfigRecord {stage, round, ...}, plus per stage:
"secagg-keys" {node: public keys} (share-keys), "secagg-shares" {node: ciphertext}
(share-keys reply, masked-input), the train records above (masked-input), and
in the masked-input reply content["arrays"] {"masked": uint ring vector} with
content["metrics"] (and "secagg-unopened" {node: b""} naming neighbours whose shares
it could not decrypt or parse). Pipelined rounds (``secagg-pipeline``) let the next round's first
two stages ride on this round's last two: a message may also carry
content["secagg-next"] {stage: setup|share-keys, round: next, ...} with
"secagg-next-keys" (share-keys), and its reply "secagg-next" {stage, round}
with "secagg-next-keys" (setup) or "secagg-next-shares" (share-keys).
See privacy/secagg/protocol.py and clients/secure.py.

A reply without a "codec" record whose arrays are exactly {"delta": float32} is
read as dense float32: the plain format any Flower ClientApp can send, with "num-examples" and
"base-version" (the config's "version") in its "metrics" record (tests/clients/test_flower_interop.py).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from aggregation import AggregationError
from aggregation._errors import shown
from aggregation.codecs import Codec, Encoded, create_codec

from ._errors import ClientError
from .config import TaskSpec, TrainSettings, build_config, check, split_mapping, to_mapping
from .tasks.layout import FROZEN_STATS

ARRAYS, CONFIG, METRICS, CODEC, LOCAL_DP = "arrays", "config", "metrics", "codec", "local-dp"
WEIGHTS, DELTA = "weights", "delta"
CLIENT_TIME = "client-time-s"  # a reply's local work, seconds (work-deadline's measure, bounded by the round trip)
WORK_METRICS = ("train-time-s", CLIENT_TIME)  # the reported times a simulated device replaces with its own
MESSAGE_TYPE_TRAIN = "train"
FROZEN_CHECK = "frozen-check"  # a train or evaluate instruction's summary of the model's frozen entries
MAX_FROZEN_CHECK = FROZEN_STATS * 65536  # its numbers at most (FROZEN_STATS per frozen tensor)
MESSAGE_TYPE_EVALUATE = "evaluate"  # the train message's arrays and config; the reply: metrics only
EVAL_PREFIX = "eval-"  # an evaluate reply's metrics: num-examples and eval-NAME (eval-loss, eval-accuracy, ...)
MAX_EVAL_METRICS, MAX_METRIC_NAME = 32, 64  # an evaluation's metrics besides num-examples, and a name's characters
MAX_METRIC = 1e30  # |value| of an evaluation metric past this is no loss or accuracy: refused in a reply
MESSAGE_TYPE_SECAGG = "train.secagg"
SECAGG, SECAGG_KEYS, SECAGG_SHARES, MASKED = "secagg", "secagg-keys", "secagg-shares", "masked"
SECAGG_UNOPENED = "secagg-unopened"  # masked-input reply: {node: b""} for shares it could not open
NEXT, NEXT_KEYS, NEXT_SHARES = "secagg-next", "secagg-next-keys", "secagg-next-shares"  # a piggybacked stage
# What reading a malformed message's content raises beyond our own errors (a type, a key or a value it lacks):
# the sender's fault, refused, never the receiver's end.
CONTENT_ERRORS = (ValueError, TypeError, KeyError, OverflowError)


@dataclass(frozen=True)
class TrainInstruction:
    """The validated contents of a train message's ConfigRecord."""

    round: int
    version: int
    seed: int
    task: TaskSpec
    train: TrainSettings
    frozen: tuple[float, ...] = ()  # the coordinator's Task.frozen_summary (() for a model without frozen entries)

    def to_record(self) -> ConfigRecord:
        fields: dict[str, Any] = {"round": self.round, "version": self.version, "seed": self.seed}
        fields.update(to_mapping(self.task))
        fields.update(to_mapping(self.train))
        if self.frozen:
            fields[FROZEN_CHECK] = list(self.frozen)
        return ConfigRecord(fields)

    @classmethod
    def from_record(cls, record: ConfigRecord) -> "TrainInstruction":
        data = dict(record)
        for key in ("round", "version", "seed"):
            check(isinstance(data.get(key), int) and not isinstance(data[key], bool) and data[key] >= 0, key, "be an integer >= 0", data.get(key))
        frozen = data.get(FROZEN_CHECK, [])
        check(isinstance(frozen, list) and len(frozen) <= MAX_FROZEN_CHECK and len(frozen) % FROZEN_STATS == 0
              and all(isinstance(v, float) and math.isfinite(v) for v in frozen), FROZEN_CHECK,
              f"be a list of finite floats, {FROZEN_STATS} per frozen tensor, at most {MAX_FROZEN_CHECK}", frozen)
        task_part, train_part = split_mapping(data, TaskSpec, TrainSettings)
        return cls(
            round=data["round"],
            version=data["version"],
            seed=data["seed"],
            task=build_config(TaskSpec, task_part, "config"),
            train=build_config(TrainSettings, train_part, "config"),
            frozen=tuple(frozen),
        )


def codec_from_record(record: ConfigRecord | None) -> Codec:
    """The codec the coordinator asked for (dense float32 when it named none)."""
    params = dict(record or {"codec": "dense"})
    name = params.pop("codec", None)
    if not isinstance(name, str):
        raise ClientError(f"codec record must name a codec. Found {shown(name, 40)}.")
    try:
        return create_codec(name, **params)
    except AggregationError as exc:
        raise ClientError(f"codec record must describe a known codec: {exc}") from None


def parse_train_message(msg: Message) -> tuple[TrainInstruction, ArrayRecord]:
    content = msg.content
    config, arrays = record_of(content, CONFIG, ConfigRecord), record_of(content, ARRAYS, ArrayRecord)
    if config is None or arrays is None:
        raise ClientError(f"train message must carry '{CONFIG}' and '{ARRAYS}' records. Found {shown(list(content.keys()))}.")
    if WEIGHTS not in arrays:
        raise ClientError(f"train message must carry array '{WEIGHTS}'. Found {shown(list(arrays.keys()))}.")
    return TrainInstruction.from_record(config), arrays


def train_reply_content(encoded: Encoded, metrics: dict[str, int | float]) -> RecordDict:
    return RecordDict({ARRAYS: ArrayRecord(encoded.arrays), CODEC: ConfigRecord(encoded.header),
                       METRICS: MetricRecord(metrics)})


R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)


def records_of(content: RecordDict, kind: type[R]) -> dict[str, R]:
    """The records of ``kind`` in ``content`` as a plain dict, to read: what ``content.config_records`` (or
    ``array_records``, ``metric_records``) gives, without Flower building and type-checking a new synced
    view of every such record on each access (microseconds a record; the SecAgg+ stages read them
    thousands of times a round). Write to ``content`` itself (``content[name] = record``)."""
    return {k: v for k, v in content.items() if isinstance(v, kind)}


def record_of(content: RecordDict, name: str, kind: type[R]) -> R | None:
    """``records_of(content, kind).get(name)`` for one record: a record of another kind under ``name`` is None."""
    rec = content.get(name)
    return rec if isinstance(rec, kind) else None


def _value_nbytes(value: Any) -> int:
    """Bytes a config or metric record's value takes: bytes and str by length (str as UTF-8), a list by
    its elements, a number as 8 (a bool as 1)."""
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, str):
        return len(value) if value.isascii() else len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, list):
        return sum(map(_value_nbytes, value))
    return 1 if isinstance(value, bool) else 8


def _array_nbytes(a: Any) -> int:
    """An Array's data and what declares it (dtype, stype: strings a client may make megabytes long; 8 a dim)."""
    return len(a.data) + _value_nbytes(a.dtype) + _value_nbytes(a.stype) + 8 * len(a.shape)


def record_nbytes(rec: Any) -> int:
    """Bytes one record carries: every key, every Array's data and declared layout, every config or metric value."""
    if isinstance(rec, ArrayRecord):
        return sum(len(k) + _array_nbytes(a) for k, a in rec.items())
    return sum(len(k) + _value_nbytes(v) for k, v in rec.items())


def message_nbytes(msg: Message) -> int:
    """Payload bytes of a message: every record's keys and values (``record_nbytes``) and the names they
    go under (0 for an error message). Counts what a client can make the coordinator receive: an ignored
    record, a long str or a list of numbers in a metric record too."""
    if msg.has_error():
        return 0
    return sum(len(name) + record_nbytes(rec) for name, rec in msg.content.items())


def update_nbytes(msg: Message) -> int:
    """Bytes of the update a reply carries: its ``arrays`` record's data (0 without one): what a codec's
    compression is measured on, apart from the records every reply has (metrics, the codec header, names)."""
    rec = None if msg.has_error() else msg.content.get(ARRAYS)
    return sum(len(a.data) for a in rec.values()) if isinstance(rec, ArrayRecord) else 0


_NODE_ID = re.compile(r"[0-9]{1,20}")


def node_map(record: ConfigRecord | None, what: str) -> dict[int, bytes]:
    """A record mapping node ids (ASCII digits, as Flower's uint64 ids print) to bytes, as ints -> bytes.

    Anything else (a missing record, a key like "²" that ``isdigit()`` accepts, a non-bytes value)
    raises ClientError naming the record.
    """
    if record is None:
        raise ClientError(f"message must carry a '{what}' record.")
    out = {}
    for key, value in record.items():
        if not _NODE_ID.fullmatch(key) or not isinstance(value, bytes):
            raise ClientError(f"'{what}' must map node ids (ASCII digits) to bytes. Found key {key[:20]!r}.")
        out[int(key)] = value
    return out


def metric_values(out: Mapping[Any, Any]) -> dict[str, float]:
    """A task's ``evaluate`` result as fedshield records it, on the coordinator and on a client alike: each real
    number (an int or float, a numpy or torch value of one element; not a bool, not complex, not text) under its
    name, where the name is printable text of 1 to ``MAX_METRIC_NAME`` characters; ``loss`` and ``accuracy``
    first, then the others in order, ``MAX_EVAL_METRICS`` in all. Anything else is left out."""
    first = [k for k in ("loss", "accuracy") if k in out]
    values: dict[str, float] = {}
    for name in (*first, *(k for k in out if k not in first)):
        if len(values) == MAX_EVAL_METRICS:
            break
        if metric_name_ok(name):
            number = real_number(out[name])
            if number is not None:
                values[name] = number
    return values


def metric_name_ok(name: Any) -> bool:
    """An evaluation metric's name as recorded, logged and shown: printable text of 1 to ``MAX_METRIC_NAME``
    characters."""
    return isinstance(name, str) and name.isprintable() and 0 < len(name) <= MAX_METRIC_NAME


def real_number(value: Any) -> float | None:
    """``value`` as a float where it is one real number (see ``metric_values``), else None."""
    if isinstance(value, bool):
        return None
    try:
        if isinstance(value, numbers.Real):
            return float(value)
        if hasattr(value, "detach"):  # a torch tensor: off the graph and the device first (bfloat16 as float64:
            value = value.detach().cpu()  # numpy has no bfloat16)
            value = (value.double() if value.is_floating_point() else value).numpy()
        if not hasattr(value, "dtype"):
            return None
        arr = np.asarray(value)
        if arr.size != 1 or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.number) \
                or np.issubdtype(arr.dtype, np.complexfloating):
            return None
        return float(arr.reshape(()))
    except (TypeError, ValueError, OverflowError, RuntimeError):
        return None  # (an int past float's range, a tensor torch cannot hand to numpy)
