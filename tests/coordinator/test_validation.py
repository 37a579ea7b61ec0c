"""Every reply rule, each rejected with its name and nothing else accepted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict

from aggregation import tensor_to_array
from aggregation.codecs import create_codec
from clients.protocol import ARRAYS, CODEC, DELTA, METRICS
from coordinator import RejectedReply, RoundExpectation, validate_reply
from coordinator.validation import check_envelope

N = 50


def _instruction(node: int, mid: str, rnd: int = 3) -> Message:
    msg = Message(RecordDict({"config": ConfigRecord({"round": rnd})}), dst_node_id=node, message_type="train",
                  group_id=str(rnd))
    msg.metadata.__dict__["_message_id"] = mid
    return msg


def _reply(ins: Message, delta=None, metrics=None, arrays=None, src=None, group=None) -> Message:
    d = torch.zeros(N) if delta is None else delta
    m = {"num-examples": 10, "base-version": 7, "train-loss": 0.5} if metrics is None else metrics
    content = RecordDict({ARRAYS: ArrayRecord(arrays if arrays is not None else {DELTA: tensor_to_array(d)}),
                          METRICS: MetricRecord(m)})
    rep = Message(content, reply_to=ins)
    if src is not None:
        rep.metadata.__dict__["_src_node_id"] = src
    if group is not None:
        rep.metadata.__dict__["_group_id"] = group
    return rep


def _exp(**kw) -> RoundExpectation:
    base = dict(round=3, version=7, numel=N, max_examples=1000, max_bytes=N * 4 + 4096, max_norm=100.0,
                codec=create_codec("dense"), codec_header={"codec": "dense", "numel": N, "dtype": "float32"},
                sent={"m1": 11, "m2": 12})
    base.update(kw)
    return RoundExpectation(**base)


def _rule(reply: Message, exp: RoundExpectation | None = None) -> str:
    with pytest.raises(RejectedReply) as info:
        validate_reply(reply, exp or _exp())
    assert str(info.value.node_id) in str(info.value)
    return info.value.rule


def test_valid_reply_accepted():
    ok = validate_reply(_reply(_instruction(11, "m1"), delta=torch.ones(N)), _exp())
    assert ok.node_id == 11 and ok.num_examples == 10 and ok.norm == pytest.approx(N**0.5)
    assert ok.parsed.tensors["values"].sum() == N


def _coded_reply(ins: Message, codec, delta: torch.Tensor) -> Message:
    enc, _ = codec.encode(delta)
    content = RecordDict({ARRAYS: ArrayRecord(enc.arrays), CODEC: ConfigRecord(enc.header),
                          METRICS: MetricRecord({"num-examples": 10, "base-version": 7})})
    return Message(content, reply_to=ins)


def test_codec_reply_accepted_and_other_codec_rejected():
    topk = create_codec("topk", ratio=0.1)
    x = torch.arange(N, dtype=torch.float32) / N
    want = topk.encode(torch.zeros(N))[0].header
    ok = validate_reply(_coded_reply(_instruction(11, "m1"), topk, x), _exp(codec=topk, codec_header=want))
    assert torch.equal(topk.decode(ok.parsed)[-5:], x[-5:])
    assert _rule(_coded_reply(_instruction(11, "m1"), create_codec("dense"), x), _exp(codec=topk, codec_header=want)) == "wrong-codec"
    # A legal encoding with other settings than the coordinator's (20% instead of 10%) is refused too.
    other = _coded_reply(_instruction(11, "m1"), create_codec("topk", ratio=0.2), x)
    assert _rule(other, _exp(codec=topk, codec_header=want, max_bytes=10**6)) == "wrong-codec"


def test_codec_reply_without_arrays_of_its_kind_rejected():
    topk = create_codec("topk", ratio=0.1)
    rep = _coded_reply(_instruction(11, "m1"), topk, torch.ones(N))
    rep.content.config_records[CODEC]["value_dtype"] = "int8"
    assert _rule(rep, _exp(codec=topk, codec_header={"codec": "topk"})) == "bad-array"


def test_unknown_message():
    assert _rule(_reply(_instruction(11, "zzz"))) == "unknown-message"


def test_duplicate():
    exp = _exp()
    validate_reply(_reply(_instruction(11, "m1")), exp)
    assert _rule(_reply(_instruction(11, "m1")), exp) == "duplicate"


def test_impersonation_rejected():
    # Node 12 answers the message that was sent to node 11.
    assert _rule(_reply(_instruction(11, "m1"), src=12)) == "unknown-sender"


def test_wrong_round():
    assert _rule(_reply(_instruction(11, "m1"), group="2")) == "wrong-round"


@pytest.mark.parametrize("reply", [
    lambda ins: _reply(ins, group="9" * 100_000),
    lambda ins: _reply(ins, metrics={"num-examples": list(range(100_000)), "base-version": 7}),
    lambda ins: _reply(ins, metrics={"num-examples": 10, "base-version": [7] * 100_000}),
    lambda ins: Message(RecordDict({ARRAYS: ArrayRecord({DELTA: tensor_to_array(torch.zeros(N))}),
                                    "m" * 100_000: MetricRecord({"num-examples": 10})}), reply_to=ins),
])
def test_a_huge_value_from_a_client_is_cut_short_in_the_logged_reason(reply):
    """A rejection's reason is logged: a client must not be able to write 100 kB into the log per reply."""
    with pytest.raises(RejectedReply) as info:
        validate_reply(reply(_instruction(11, "m1")), _exp())
    # cut short, or (a huge metric) refused for its size before its value is shown
    assert len(str(info.value)) < 400 and ("characters)" in str(info.value) or info.value.rule == "oversized")


def test_error_reply():
    ins = _instruction(11, "m1")
    err = Message(Error(code=3, reason="message expired"), reply_to=ins)
    assert _rule(err) == "error-reply"


def test_an_error_replys_reason_cannot_forge_log_lines():
    """The reason is a client's text: a newline and terminal escapes in it wrote a second, forged log
    line (a review's demonstration: a fake "accepted" record in green)."""
    forged = "oops\n\x1b[92mINFO \x1b[0m:      [fedshield] round 1: node 1002 accepted"
    err = Message(Error(code=0, reason=forged), reply_to=_instruction(11, "m1"))
    with pytest.raises(RejectedReply) as exc:
        check_envelope(err, 11, 1)
    text = str(exc.value)
    assert "\n" not in text and "\x1b" not in text and "\\x1b[92m" in text


@pytest.mark.parametrize("reason", [None, ""])
def test_an_error_reply_without_a_reason_is_rejected_not_a_crash(reason):
    """Flower's Error.reason defaults to None, and its wire decoding turns "" into None: a client
    sending either used to raise TypeError in the coordinator (``None[:200]``) and end the run."""
    from flwr.common.serde import error_from_proto, error_to_proto

    err = Error(code=0, reason=reason)
    err = error_from_proto(error_to_proto(err))  # as it arrives over the network
    with pytest.raises(RejectedReply, match="error-reply|code 0") as exc:
        check_envelope(Message(err, reply_to=_instruction(11, "m1")), 11, 1)
    assert exc.value.rule == "error-reply" and "no reason given" in exc.value.detail


def test_a_record_the_coordinator_does_not_read_is_rejected():
    """A reply could carry extra records of any size past the size limit, uncounted in bytes_up."""
    ins = _instruction(11, "m1")
    reply = _reply(ins, delta=torch.ones(N))
    reply.content["padding"] = ArrayRecord({"x": Array(np.zeros(1 << 20, np.float32))})
    with pytest.raises(RejectedReply, match="reply must hold only 'arrays', 'metrics', 'codec'; found 'padding'") as exc:
        validate_reply(reply, _exp())
    assert exc.value.rule == "unexpected-record"


def test_missing_records_and_arrays():
    ins = _instruction(11, "m1")
    assert _rule(Message(RecordDict({METRICS: MetricRecord({"num-examples": 1})}), reply_to=ins)) == "missing-record"
    # Without a codec record only the plain {"delta": float32} form is accepted.
    assert _rule(_reply(_instruction(11, "m1"), arrays={"other": tensor_to_array(torch.zeros(N))})) == "missing-record"
    assert _rule(_reply(_instruction(11, "m1"), arrays={DELTA: tensor_to_array(torch.zeros(N)),
                                                         "extra": tensor_to_array(torch.zeros(1))})) == "missing-record"


@pytest.mark.parametrize("delta,rule", [
    (torch.zeros(N + 1), "oversized"),
    (torch.zeros(N - 1), "bad-array"),
    (torch.zeros(N, dtype=torch.float16), "bad-array"),
    (torch.full((N,), float("nan")), "non-finite"),
    (torch.full((N,), 3e38), "non-finite"),
    (torch.full((N,), 50.0), "norm-too-large"),
])
def test_update_rules(delta, rule):
    exp = _exp(max_bytes=len(tensor_to_array(torch.zeros(N)).data))
    assert _rule(_reply(_instruction(11, "m1"), delta=delta), exp) == rule


def test_stock_numpy_array_accepted():
    rep = _reply(_instruction(11, "m1"), arrays={DELTA: Array(np.zeros(N, np.float32))})
    assert validate_reply(rep, _exp()).parsed.tensors["values"].shape == (N,)


@pytest.mark.parametrize("metrics,rule", [
    ({"base-version": 7}, "bad-num-examples"),
    ({"num-examples": 0, "base-version": 7}, "bad-num-examples"),
    ({"num-examples": 1001, "base-version": 7}, "bad-num-examples"),
    ({"num-examples": 2.5, "base-version": 7}, "bad-num-examples"),
    ({"num-examples": 5, "base-version": 6}, "stale-version"),
    ({"num-examples": 5}, "missing-base-version"),
])
def test_metric_rules(metrics, rule):
    assert _rule(_reply(_instruction(11, "m1"), metrics=metrics)) == rule


# ------------------------------------------------------------------ norm check fused with the add


@pytest.mark.parametrize("delta,rule", [
    (torch.full((N,), float("nan")), "non-finite"),
    (torch.full((N,), 3e38), "non-finite"),
    (torch.full((N,), 50.0), "norm-too-large"),
])
def test_add_reply_rejects_by_the_norm_rules_and_leaves_the_aggregator(delta, rule):
    from aggregation import create_aggregator
    from coordinator.validation import add_reply

    exp = _exp()
    agg = create_aggregator("mean", N, "cpu", 2)
    first = validate_reply(_reply(_instruction(11, "m1"), delta=torch.ones(N)), exp, check_norm=False)
    assert first.norm != first.norm  # nan: not checked yet
    first = add_reply(agg, exp.codec, first, 10.0, exp)
    assert first.norm == pytest.approx(N**0.5) and agg.count == 1
    before = agg.result().clone()
    ok = validate_reply(_reply(_instruction(12, "m2"), delta=delta), exp, check_norm=False)  # passes: norm deferred
    with pytest.raises(RejectedReply) as info:
        add_reply(agg, exp.codec, ok, 10.0, exp)
    assert info.value.rule == rule and info.value.node_id == 12
    assert agg.count == 1 and torch.equal(agg.result(), before)
    # the same reply through validate_reply alone is refused by the same rule
    assert _rule(_reply(_instruction(12, "m2"), delta=delta), _exp()) == rule


def test_add_reply_equals_validate_then_add():
    from aggregation import create_aggregator
    from coordinator.validation import add_reply

    x = torch.linspace(-1, 1, N)
    exp_a, exp_b = _exp(), _exp()
    fused, plain = create_aggregator("mean", N, "cpu", 1), create_aggregator("mean", N, "cpu", 1)
    ok = add_reply(fused, exp_a.codec, validate_reply(_reply(_instruction(11, "m1"), delta=x), exp_a, check_norm=False),
                   3.0, exp_a)
    ref = validate_reply(_reply(_instruction(11, "m1"), delta=x), exp_b)
    plain.add(exp_b.codec, ref.parsed, 3.0, norm=ref.norm)
    assert ok.norm == pytest.approx(ref.norm, rel=1e-6)
    assert torch.equal(fused.result(), plain.result())


def _padded(ins: Message, where: str) -> Message:
    """A valid reply with ~1 MB hidden where the size limit used to miss it (a review found each)."""
    reply = _reply(ins)
    if where == "codec as an ArrayRecord":  # read as "no codec record": the plain form, the record never sized
        reply.content[CODEC] = ArrayRecord({"x": Array(np.zeros(1 << 18, np.float32))})
    elif where == "extra codec header keys":
        reply.content[CODEC] = ConfigRecord({"codec": "dense", "numel": N, "dtype": "float32", "pad": "x" * (1 << 20)})
        reply.content[ARRAYS] = ArrayRecord({"values": tensor_to_array(torch.zeros(N))})
    elif where == "extra metrics":
        reply.content[METRICS]["pad"] = [0.0] * (1 << 17)
    else:
        reply.content[METRICS]["pad"] = list(range(10))  # small: fine
    return reply


@pytest.mark.parametrize(("where", "rule"), [("codec as an ArrayRecord", "wrong-record-kind"),
                                             ("extra codec header keys", "oversized"), ("extra metrics", "oversized")])
def test_bytes_hidden_beside_the_update_are_refused(where, rule):
    assert _rule(_padded(_instruction(11, "m1"), where)) == rule
    assert validate_reply(_padded(_instruction(11, "m1"), "a few extra metrics"), _exp()).num_examples == 10


def test_message_nbytes_counts_every_key_and_value():
    from clients.protocol import message_nbytes

    content = RecordDict({"c": ConfigRecord({"s": "é" * 10, "b": b"12", "l": ["ab", "c"], "f": 1.5, "t": True}),
                          "m": MetricRecord({"x": [1, 2, 3]})})
    msg = Message(content, dst_node_id=1, message_type="train")
    assert message_nbytes(msg) == 1 + (1 + 20) + (1 + 2) + (1 + 3) + (1 + 8) + (1 + 1) + 1 + (1 + 24)


@pytest.mark.parametrize("name, wrong", [(ARRAYS, ConfigRecord({})), (METRICS, ArrayRecord({})),
                                         (CODEC, MetricRecord({"numel": N}))])
def test_a_record_of_the_wrong_kind_is_named_as_such(name, wrong):
    """It was "missing-record: reply must hold 'arrays' and 'metrics'; found ['arrays', 'metrics']"."""
    reply = _reply(_instruction(11, "m1"))
    reply.content[name] = wrong
    with pytest.raises(RejectedReply) as info:
        validate_reply(reply, _exp())
    assert info.value.rule == "wrong-record-kind" and f"'{name}' must be of kind" in info.value.detail
    assert type(wrong).__name__ in info.value.detail


def test_a_reply_from_another_node_does_not_use_up_the_asked_node_s_slot():
    """Marked answered before the sender was checked, node 12's reply to node 11's message made node 11's own
    reply a "duplicate"."""
    exp = _exp()
    ins = _instruction(11, "m1")
    assert _rule(_reply(ins, src=12), exp) == "unknown-sender"
    assert validate_reply(_reply(ins), exp).node_id == 11
    assert _rule(_reply(ins), exp) == "duplicate"


@pytest.mark.parametrize("eps, kept", [(-1.0, None), (float("inf"), None), (0.0, 0.0), (3.5, 3.5)])
def test_a_negative_or_infinite_local_epsilon_is_no_claim(eps, kept):
    reply = _reply(_instruction(11, "m1"), metrics={"num-examples": 10, "base-version": 7, "local-epsilon": eps})
    assert validate_reply(reply, _exp()).local_epsilon == kept


# -- edges a mutation review found untested (helper-51) ------------------------------------------------------------
def test_the_side_bytes_limit_holds_at_its_edge():
    from clients.protocol import message_nbytes, update_nbytes
    from coordinator.validation import MAX_SIDE_BYTES

    def padded(extra: int) -> Message:
        reply = _reply(_instruction(11, "m1"))
        side = message_nbytes(reply) - update_nbytes(reply) + len("pad")  # the key's bytes, then the value's
        reply.content[METRICS]["pad"] = [0.0] * ((MAX_SIDE_BYTES - side) // 8 + extra)
        return reply

    ok = padded(0)
    assert MAX_SIDE_BYTES - 8 < message_nbytes(ok) - update_nbytes(ok) <= MAX_SIDE_BYTES
    assert validate_reply(ok, _exp()).num_examples == 10
    assert _rule(padded(1)) == "oversized"


@pytest.mark.parametrize("factor, rule", [(1.0, None), (1.01, "norm-too-large")])
def test_validate_reply_checks_the_norm_at_its_bound(factor, rule):
    delta = torch.ones(N) * (100.0 / N**0.5) * factor  # max_norm 100
    reply = _reply(_instruction(11, "m1"), delta=delta)
    if rule is None:
        assert validate_reply(reply, _exp()).norm == pytest.approx(100.0, rel=1e-5)
    else:
        assert _rule(reply) == rule


def test_replies_under_one_codec_with_different_norm_bounds_are_checked_against_their_own():
    """add_replies batches replies by codec: a batch must not take the first reply's max_norm for all."""
    from aggregation import create_aggregator
    from coordinator.validation import add_replies

    codec = create_codec("dense")
    big, small = _exp(codec=codec, max_norm=100.0), _exp(codec=codec, max_norm=1.0)
    agg = create_aggregator("mean", N, "cpu", 2)
    items = [(validate_reply(_reply(_instruction(11, "m1"), delta=torch.full((N,), 5.0 / N**0.5)), big,
                             check_norm=False), 1.0, big),
             (validate_reply(_reply(_instruction(12, "m2"), delta=torch.full((N,), 5.0 / N**0.5)), small,
                             check_norm=False), 1.0, small)]
    first, second = add_replies(agg, items)
    assert not isinstance(first, RejectedReply) and first.norm == pytest.approx(5.0, rel=1e-5)
    assert isinstance(second, RejectedReply) and second.rule == "norm-too-large" and agg.count == 1


@pytest.mark.parametrize("loss", [1e300, -1e31, float("inf")])
def test_a_train_loss_past_the_bound_is_unknown_not_averaged(loss):
    """(A boolean num-examples cannot arrive: Flower's MetricRecord refuses bools.)"""
    reply = _reply(_instruction(11, "m1"), metrics={"num-examples": 10, "base-version": 7, "train-loss": loss})
    assert math.isnan(validate_reply(reply, _exp()).train_loss)
