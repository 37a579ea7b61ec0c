"""SecAgg+ rounds in the synchronous workflow: exact results, dropouts at every stage, bad clients, no secrets in logs."""

from __future__ import annotations

import base64
import json
import logging
import math
import re

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from clients._errors import ConfigError
from clients.client_app import app
from clients.protocol import ARRAYS, MASKED, NEXT, NEXT_KEYS, SECAGG, SECAGG_KEYS, SECAGG_SHARES
from clients.secure import STATE, run_secagg_stage
from coordinator import RunConfig, RunDirectory, SyncWorkflow
from coordinator.rundir import METRICS, SUMMARY
from privacy.secagg.protocol import SecAggClient, SecAggParams
from simulations.inprocess import InProcessGrid, ensure_task_identity
from simulations.virtual import VirtualClock

N = 6


def cfg(**kw) -> RunConfig:
    base = {"num-rounds": 1, "min-nodes": 3, "task": "digits", "seed": 0, "local-epochs": 1, "poll-interval": 1.0,
            "secagg-stage-timeout": 30.0, "round-timeout": 60.0, "secagg-clip": 10.0}
    base.update(kw)
    return RunConfig.from_mapping(base)


def stage_of(msg: Message) -> str:
    return str(msg.content.config_records[SECAGG]["stage"]) if SECAGG in msg.content.config_records else "train"


class DroppingGrid(InProcessGrid):
    """Nodes in ``drop[stage]`` vanish at that stage: they get the message and never answer."""

    def __init__(self, client, num_nodes: int, drop: dict[str, set[int]] | None = None) -> None:
        super().__init__(client, num_nodes)
        self.drop = drop or {}
        self.gone: set[int] = set()

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages):
            node = msg.metadata.dst_node_id
            if node in self.drop.get(stage_of(msg), set()) or node in self.gone:
                self.gone.add(node)
                self._replies.pop(mid, None)
        return ids


def run(tmp_path, grid, name="a", **kw) -> SyncWorkflow:
    wf = SyncWorkflow(cfg(**kw), grid, RunDirectory(tmp_path / name), clock=VirtualClock())
    wf.run()
    return wf


def plain_reference(tmp_path, nodes: list[int], **kw) -> torch.Tensor:
    ref = SyncWorkflow(cfg(**kw), InProcessGrid(app, N), RunDirectory(tmp_path / "ref"))
    ref.select = lambda online, rnd: nodes
    ref.run()
    return ref.weights


def test_secagg_round_equals_the_plain_weighted_mean(tmp_path):
    wf = run(tmp_path, InProcessGrid(app, N), **{"secure-aggregation": "secagg+"})
    row = wf.history[0]
    assert row["secagg_survivors"] == N and row["accepted"] == N and row["rejected"] == 0
    stages = row["secagg_stage_s"]  # each stage's time on the workflow's clock, sending to last reply
    assert list(stages) == ["setup", "share-keys", "masked-input", "unmask"]
    assert all(v >= 0 for v in stages.values()) and sum(stages.values()) <= row["round_time_s"] + 1e-6
    ref = plain_reference(tmp_path, list(range(1001, 1001 + N)))
    torch.testing.assert_close(wf.weights, ref, rtol=0, atol=1e-6)  # 32-bit ring: quantization error ~1e-8
    assert wf.version == 1


@pytest.mark.parametrize("stage", ["setup", "share-keys", "masked-input", "unmask"])
def test_a_node_vanishing_at_any_stage_leaves_the_survivors_mean(tmp_path, stage):
    victim = 1003
    wf = run(tmp_path, DroppingGrid(app, N, {stage: {victim}}), **{"secure-aggregation": "secagg+"})
    row = wf.history[0]
    survivors = [n for n in range(1001, 1001 + N) if n != victim or stage == "unmask"]
    assert row["secagg_survivors"] == len(survivors), row
    assert row["secagg_dropped"] == (1 if stage == "masked-input" else 0)
    ref = plain_reference(tmp_path, survivors)
    torch.testing.assert_close(wf.weights, ref, rtol=0, atol=1e-6)


def test_too_many_dropouts_fail_clearly_and_leave_the_model_unchanged(tmp_path):
    grid = DroppingGrid(app, N, {"masked-input": {1001, 1002, 1003, 1004}})
    wf = SyncWorkflow(cfg(**{"secure-aggregation": "secagg+"}), grid, RunDirectory(tmp_path / "a"), clock=VirtualClock())
    before = wf.weights.clone()
    wf.run()
    row = wf.history[0]
    assert "secagg_failure" in row and "masked inputs arrived" in row["secagg_failure"]
    assert row["accepted"] == 0 and wf.version == 0
    assert torch.equal(wf.weights, before)


def misbehave(node: int, stage: str, mutate):
    """The real client app, except that ``node``'s reply at ``stage`` is passed through ``mutate``."""
    replies: dict[tuple[int, str], Message] = {}

    def client(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        s = stage_of(msg)
        replies[(ctx.node_id, s)] = reply
        if ctx.node_id == node and s == stage:
            return mutate(reply, replies, msg)
        return reply

    return client


def _replayed_setup(reply, replies, msg):
    return Message(replies[(1001, "setup")].content, reply_to=msg)


def _other_nodes_keys(reply, replies, msg):
    other = replies[(1001, "setup")].content.config_records[SECAGG_KEYS]
    reply.content.config_records[SECAGG_KEYS] = ConfigRecord({"1002": other["1001"]})
    return reply


def _claims_other_node(reply, replies, msg):
    reply.content.config_records[SECAGG_KEYS] = ConfigRecord({"1001": reply.content.config_records[SECAGG_KEYS]["1002"]})
    return reply


def _drops_one_share(reply, replies, msg):
    shares = dict(reply.content.config_records[SECAGG_SHARES])
    shares.pop(next(iter(shares)))
    reply.content.config_records[SECAGG_SHARES] = ConfigRecord(shares)
    return reply


def _tampered_share(reply, replies, msg):
    shares = dict(reply.content.config_records[SECAGG_SHARES])
    k = next(iter(shares))
    shares[k] = shares[k][:-1] + bytes([shares[k][-1] ^ 1])
    reply.content.config_records[SECAGG_SHARES] = ConfigRecord(shares)
    return reply


def _float_vector(reply, replies, msg):
    n = reply.content.array_records[ARRAYS][MASKED].shape[0]
    reply.content.array_records[ARRAYS] = ArrayRecord({MASKED: Array(np.zeros(n, np.float32))})
    return reply


def _huge_vector(reply, replies, msg):
    reply.content.array_records[ARRAYS] = ArrayRecord({MASKED: Array(np.zeros(10**6, np.uint32))})
    return reply


def _zero_examples(reply, replies, msg):
    reply.content.metric_records["metrics"]["num-examples"] = 0
    return reply


def _bogus_unmask(reply, replies, msg):
    reply.content.config_records[SECAGG_SHARES] = ConfigRecord({"self:1": b"x"})
    return reply


def _wrong_unmask_shares(reply, replies, msg):
    shares = {k: v[:-1] + bytes([v[-1] ^ 1]) for k, v in reply.content.config_records[SECAGG_SHARES].items()}
    reply.content.config_records[SECAGG_SHARES] = ConfigRecord(shares)
    return reply


def _extra_record(reply, replies, msg):
    reply.content["padding"] = ArrayRecord({"x": Array(np.zeros(1 << 18, np.float32))})
    return reply


def _huge_header_field(reply, replies, msg):
    reply.content[SECAGG]["pad"] = b"x" * (1 << 20)  # a field no stage reads
    return reply


def _huge_metric(reply, replies, msg):
    reply.content.metric_records["metrics"]["pad"] = [0.0] * (1 << 17)
    return reply


def _extra_array(reply, replies, msg):
    reply.content.array_records[ARRAYS]["junk"] = Array(np.zeros(1, np.uint8))  # an array nothing would read
    return reply


def _huge_declared_dtype(reply, replies, msg):
    reply.content.array_records[ARRAYS][MASKED].__dict__["dtype"] = "u" * (1 << 20)  # read by nothing, was counted by nothing
    return reply


def _lying_dtype(reply, replies, msg):
    reply.content.array_records[ARRAYS][MASKED].__dict__["dtype"] = "float32"  # its bytes are the ring's
    return reply


BAD = {  # (stage, mutate, rule, counted as survivor?)
    "replayed reply of another node": ("setup", _replayed_setup, "unknown-sender", False),
    "keys claimed for another node": ("setup", _claims_other_node, "unknown-sender", False),
    "another node's keys re-sent": ("setup", _other_nodes_keys, "bad-keys", False),
    "wrong share count": ("share-keys", _drops_one_share, "wrong-share-count", False),
    "float masked vector": ("masked-input", _float_vector, "bad-array", False),
    "oversized masked vector": ("masked-input", _huge_vector, "oversized", False),
    "zero examples claimed": ("masked-input", _zero_examples, "bad-num-examples", False),
    "unmask names unknown shares": ("unmask", _bogus_unmask, "wrong-share-count", True),
    # a review: nothing bounded a SecAgg+ reply's other records, so a client could send megabytes past the limit
    "extra record with the masked input": ("masked-input", _extra_record, "unexpected-record", False),
    "a megabyte in the keys' header record": ("setup", _huge_header_field, "oversized", False),
    "a megabyte of metrics with the masked input": ("masked-input", _huge_metric, "oversized", False),
    "a megabyte in the unmask header record": ("unmask", _huge_header_field, "oversized", True),
    # a review: the masked input's record could carry other arrays, and its declared dtype any string, uncounted
    "a second array beside the masked input": ("masked-input", _extra_array, "unexpected-record", False),
    "a megabyte of declared dtype on the masked input": ("masked-input", _huge_declared_dtype, "oversized", False),
    "a masked input declared of another dtype": ("masked-input", _lying_dtype, "bad-array", False),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_messages_are_rejected_with_a_reason_and_the_round_completes(tmp_path, case):
    stage, mutate, rule, survives = BAD[case]
    wf = run(tmp_path, InProcessGrid(misbehave(1002, stage, mutate), N), **{"secure-aggregation": "secagg+"})
    row = wf.history[0]
    assert row["rejected_by_rule"] == {rule: 1}, row
    assert "secagg_failure" not in row and wf.version == 1
    survivors = [n for n in range(1001, 1001 + N) if n != 1002 or survives]
    assert row["secagg_survivors"] == len(survivors)
    torch.testing.assert_close(wf.weights, plain_reference(tmp_path, survivors), rtol=0, atol=1e-6)
    if mutate in (_huge_vector, _extra_record, _huge_header_field, _huge_metric, _huge_declared_dtype):  # counted
        assert row["bytes_up"] > 1 << 20, row


def test_a_reply_forged_from_another_node_costs_nothing_but_itself(tmp_path):
    """Node 1001 also answers node 1002's messages at every stage: each copy refused, and 1002 still a survivor."""
    from .helpers import ForgingGrid

    grid = ForgingGrid(app, N, victim=1002, forger=1001)
    wf = run(tmp_path, grid, **{"secure-aggregation": "secagg+"})
    row = wf.history[0]
    assert grid.forged == 4 and row["rejected_by_rule"] == {"unknown-sender": 4}, row
    assert row["secagg_survivors"] == N and "secagg_failure" not in row
    torch.testing.assert_close(wf.weights, plain_reference(tmp_path, list(range(1001, 1001 + N))), rtol=0, atol=1e-6)


@pytest.mark.parametrize("stage, mutate", [("share-keys", _tampered_share), ("unmask", _wrong_unmask_shares)])
def test_a_wrong_share_costs_only_itself_and_is_logged_with_its_sender(tmp_path, caplog, stage, mutate):
    """One of 1002's share ciphertexts fails authentication at its receiver (the receiver used to refuse
    its whole masked-input stage, and was counted and dropped for it), or 1002 hands back only wrong
    shares for unmasking: the shares are left out and logged with their sender, every node's update is
    in the sum. A share is a dispute (its dealer may have made it wrong), so no node counts as rejected."""
    with caplog.at_level(logging.WARNING):
        wf = run(tmp_path, InProcessGrid(misbehave(1002, stage, mutate), N),
                 **{"secure-aggregation": "secagg+", "secagg-degree": 5, "secagg-threshold": 3, "min-nodes": N})
    row = wf.history[0]
    assert row["rejected_by_rule"] == {} and row["secagg_survivors"] == N and wf.version == 1
    assert row["secagg_shares_left_out"] >= 1 and "left out a share from node 1002" in caplog.text
    torch.testing.assert_close(wf.weights, plain_reference(tmp_path, list(range(1001, 1001 + N))), rtol=0, atol=1e-6)


def test_compressed_variants_learn_and_send_fewer_bytes(tmp_path):
    rows = {}
    for name, kw in {"dense": {}, "16-bit": {"secagg-bits": 16}, "sparse": {"secagg-sparse-ratio": 0.25}}.items():
        wf = run(tmp_path, InProcessGrid(app, N), name, **{"secure-aggregation": "secagg+", "num-rounds": 3,
                                                           "secagg-clip": 1.0, "local-epochs": 2, **kw})
        rows[name] = (wf.history[-1]["test_accuracy"], sum(r["bytes_up"] for r in wf.history))
    assert rows["16-bit"][1] < 0.6 * rows["dense"][1] and rows["sparse"][1] < 0.35 * rows["dense"][1]
    for acc, _ in rows.values():
        assert 0.5 <= acc <= 0.99


def test_no_key_material_or_masks_reach_the_logs_or_run_dir(tmp_path, caplog, capsys):
    secrets: list[bytes] = []

    def recording(msg: Message, ctx: Context) -> Message:
        reply = app(msg, ctx)
        for name, state in ctx.state.config_records.items():  # this round's and a pipelined next round's
            if not name.startswith(STATE + ":"):
                continue
            secrets.extend(state[k] for k in ("c-sk", "s-sk", "self-seed"))
            saved = SecAggClient.from_fields(dict(state))
            secrets.extend(b for pair in saved.held.values() for b in pair)
            secrets.extend(saved.transport.values())
        if ARRAYS in reply.content.array_records and MASKED in reply.content.array_records[ARRAYS]:
            secrets.append(reply.content.array_records[ARRAYS][MASKED].numpy()[:8].tobytes())
        return reply

    with caplog.at_level(logging.DEBUG):
        flwr_logger = logging.getLogger("flwr")
        flwr_logger.addHandler(caplog.handler)
        try:
            wf = run(tmp_path, DroppingGrid(recording, N, {"masked-input": {1004}}),
                     **{"secure-aggregation": "secagg+", "num-rounds": 2})
        finally:
            flwr_logger.removeHandler(caplog.handler)
    out = capsys.readouterr()
    text = caplog.text + out.out + out.err
    text += "".join(p.read_text(errors="replace") for p in (tmp_path / "a").iterdir() if p.suffix in (".csv", ".json"))
    assert "secagg masked-input" in text and wf.history[0]["secagg_dropped"] == 1
    assert len(secrets) > 50
    for s in secrets:
        for form in (s.hex(), base64.b64encode(s).decode(), repr(s)[2:-1], str(list(s[:8]))[1:-1]):
            assert form not in text
    summary = json.loads((tmp_path / "a" / SUMMARY).read_text())
    assert summary["secure_aggregation"] == "secagg+"
    header, first = (tmp_path / "a" / METRICS).read_text().splitlines()[:2]
    assert "secagg_survivors" in header and "secagg_stage_s" in header
    assert '""setup"": ' in first, "the stage times are a JSON object in the CSV"


def test_secagg_settings_are_checked():
    with pytest.raises(ConfigError, match="aggregator must be 'mean'"):
        cfg(**{"secure-aggregation": "secagg+", "aggregator": "median"})
    with pytest.raises(ConfigError, match="k/2 < t <= k"):
        cfg(**{"secure-aggregation": "secagg+", "secagg-degree": 6, "secagg-threshold": 3})
    with pytest.raises(ConfigError, match="codec must be 'dense'"):
        cfg(**{"secure-aggregation": "secagg+", "codec": "topk"})
    # accepted and silently ignored before: a SecAgg+ round profiles no node and waits for its stages' quorums
    for key, value in (("selection", "fast-fair"), ("work-deadline", 1.0), ("close-after-replies", 3)):
        with pytest.raises(ConfigError, match=f"{key} must be .* under secure-aggregation = 'secagg\\+'"):
            cfg(**{"secure-aggregation": "secagg+", key: value})
    with pytest.raises(ConfigError, match="secure-aggregation must be one of"):
        cfg(**{"secure-aggregation": "secagg"})
    with pytest.raises(ConfigError, match="dp must not be 'central'"):
        cfg(**{"secure-aggregation": "secagg+", "dp": "central", "dp-noise-multiplier": 1.0})
    k, t = cfg(**{"secure-aggregation": "secagg+"}).secure.graph(100)
    assert k % 2 == 0 and k < 40 and t == k // 2 + 1  # log-degree graph at 10% dropout
    assert cfg(**{"secure-aggregation": "secagg+", "secagg-degree": 1000}).secure.graph(10) == (9, 5)
    with pytest.raises(ConfigError, match="min-nodes must be >= 3 under secure aggregation.*Found 2"):
        cfg(**{"secure-aggregation": "secagg+", "min-nodes": 2})
    with pytest.raises(ConfigError, match="with 3 nodes k = 2. Found t = 3. \\(a round of min-nodes = 3 nodes could never run"):
        cfg(**{"secure-aggregation": "secagg+", "secagg-threshold": 3})
    assert cfg(**{"secure-aggregation": "secagg+", "secagg-threshold": 3, "min-nodes": 4}).secure.graph(4) == (3, 3)


# -- distributed DP: clients add Skellam noise shares under SecAgg+ --------------------------------
DDP = {"secure-aggregation": "secagg+", "dp": "distributed", "dp-clip": 0.5, "dp-noise-multiplier": 0.8,
       "secagg-weighting": "uniform", "secagg-clip": 2.0, "secagg-dropout-rate": 0.2}


def test_distributed_dp_noise_has_the_stated_std_and_is_accounted(tmp_path):
    a = run(tmp_path, InProcessGrid(app, N), "a", **DDP)
    b = run(tmp_path, InProcessGrid(app, N), "b", **DDP)
    diff = (a.weights - b.weights).double()
    assert not torch.equal(a.weights, b.weights)  # noise from the OS: two runs differ
    # Each run's mean update carries N(0, (z C)^2 * n / (n (1 - r))) / n; the difference of two has sqrt(2) that.
    z, c, r = 0.8, 0.5, 0.2
    want = math.sqrt(2) * z * c * math.sqrt(N / (N * (1 - r))) / N
    assert abs(float(diff.std()) / want - 1) < 0.05 and abs(float(diff.mean())) < 4 * want / math.sqrt(diff.numel())
    events = a.dp.accountant.events
    assert len(events) == 1 and events[0].noise_multiplier == pytest.approx(z * math.sqrt(1 / (1 - r)))
    assert a.history[0]["epsilon"] == pytest.approx(a.dp.epsilon) and a.dp.epsilon > 0
    summary = json.loads((tmp_path / "a" / SUMMARY).read_text())
    assert "Skellam" in summary["privacy_guarantee"] and summary["epsilon"] == pytest.approx(a.dp.epsilon)


def test_distributed_dp_without_enough_survivors_releases_nothing_and_spends_nothing(tmp_path):
    wf = SyncWorkflow(cfg(**DDP), DroppingGrid(app, N, {"masked-input": {1001, 1002}}), RunDirectory(tmp_path / "a"),
                      clock=VirtualClock())
    before = wf.weights.clone()
    wf.run()
    row = wf.history[0]
    assert "distributed DP needs >= 5 survivors" in row["secagg_failure"]
    assert torch.equal(wf.weights, before) and wf.dp.accountant.events == [] and wf.dp.epsilon == 0


def test_distributed_dp_budget_stops_the_run(tmp_path):
    wf = run(tmp_path, InProcessGrid(app, N), **{**DDP, "num-rounds": 10, "target-epsilon": 12.0})
    assert wf.status == "budget-exhausted" and 1 <= wf.round < 10 and wf.dp.epsilon <= 12.0


def test_distributed_dp_settings_are_checked():
    with pytest.raises(ConfigError, match="secure-aggregation must be 'secagg\\+' under dp = 'distributed'"):
        cfg(**{"dp": "distributed", "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match="secagg-weighting must be 'uniform'"):
        cfg(**{**DDP, "secagg-weighting": "num-examples"})
    with pytest.raises(ConfigError, match="adaptive-clipping must be false"):
        cfg(**{**DDP, "adaptive-clipping": True})
    # min-nodes = 3, 20% dropout: s = ceil(2.4) = 3 survivors; dp-clip 0.5 (1 + 8 * 0.8 / 3) = 1.567, before any run
    with pytest.raises(ConfigError, match=r"secagg-clip must be >= dp-clip \* \(1 \+ 8 z / s\) = 1.567 .* s = 3 "):
        cfg(**{**DDP, "secagg-clip": 1.56})
    cfg(**{**DDP, "secagg-clip": 1.57})
    with pytest.raises(ConfigError, match=r"= 1.14 .* s = 5 "):  # min-nodes = 6: s = ceil(4.8); more nodes, less room
        cfg(**{**DDP, "secagg-clip": 1.1, "min-nodes": 6})


def test_a_client_refuses_a_second_instance_of_a_round_it_already_sent_input_for(tmp_path):
    ensure_task_identity()
    grid = InProcessGrid(app, N)
    run(tmp_path, grid, **{"secure-aggregation": "secagg+"})
    ctx = grid.contexts[1001]
    params = SecAggParams.create(1, list(grid.contexts), degree=5, threshold=3, bits=32, clip=1.0, dim=10)
    setup = ConfigRecord({"stage": "setup", **params.to_fields(), "numel": 9, "sparse-ratio": 1.0,
                          "subset-seed": bytes(32), "weighting": "uniform", "max-weight": 1})
    msg = Message(RecordDict({SECAGG: setup}), dst_node_id=1001, message_type="train.secagg", group_id="1")
    with pytest.raises(Exception, match="already sent its masked input for round 1"):
        run_secagg_stage(msg, ctx)


@pytest.mark.parametrize(("numel", "ratio", "why"), [
    (2**31 - 1, 1.0, "secagg vector length 10 does not match numel = 2147483647"),  # drew 2^31 words first: GBs
    (2**40, 0.5, "numel must be in [1, 2147483648]"),
    (10**9, 1e-3, "secagg vector length 10 does not match numel = 1000000000"),
    (9, None, "sparse-ratio must be a number in (0, 1]"),  # float(None): a bare TypeError
    (9, "all", "sparse-ratio must be a number in (0, 1]"),
])
def test_a_setup_whose_sizes_disagree_is_refused_before_anything_is_drawn(numel, ratio, why):
    from clients import ClientError
    from flwr.app import Context, RecordDict as RD

    params = SecAggParams.create(1, [1001, 1002, 1003], degree=2, threshold=2, bits=32, clip=1.0, dim=10)
    fields = {"stage": "setup", **params.to_fields(), "numel": numel, "subset-seed": bytes(32), "weighting": "uniform",
              "max-weight": 1}
    if ratio is not None:
        fields["sparse-ratio"] = ratio
    msg = Message(RecordDict({SECAGG: ConfigRecord(fields)}), dst_node_id=1001, message_type="train.secagg", group_id="1")
    ctx = Context(run_id=1, node_id=1001, node_config={}, state=RD(), run_config={})
    with pytest.raises(ClientError, match=re.escape(why)):
        run_secagg_stage(msg, ctx)


def _odd_key_name(reply, replies, msg):
    reply.content.config_records[SECAGG_KEYS] = ConfigRecord({"\u00b2": b"x" * 96})  # isdigit() but not int()
    return reply


def _low_order_key(reply, replies, msg):
    keys = reply.content.config_records[SECAGG_KEYS]["1002"]
    reply.content.config_records[SECAGG_KEYS] = ConfigRecord({"1002": bytes(32) + keys[32:]})
    return reply


@pytest.mark.parametrize("mutate,rule", [(_odd_key_name, "bad-share"), (_low_order_key, "bad-keys")])
def test_keys_that_would_break_others_are_rejected_and_the_round_completes(tmp_path, mutate, rule):
    wf = run(tmp_path, InProcessGrid(misbehave(1002, "setup", mutate), N), **{"secure-aggregation": "secagg+"})
    row = wf.history[0]
    assert row["rejected_by_rule"] == {rule: 1} and row["secagg_survivors"] == N - 1 and wf.version == 1


def _shift(index: int, amount: int):
    def mutate(reply, replies, msg):
        arr = reply.content.array_records[ARRAYS][MASKED].numpy().copy()
        arr[index] = (int(arr[index]) + amount) % 2**32  # any ring element: SecAgg cannot see it
        reply.content.array_records[ARRAYS] = ArrayRecord({MASKED: Array(arr)})
        return reply
    return mutate


@pytest.mark.parametrize("index,amount,why", [(-1, 2**31, "summed weight"), (0, 2**31, "within \\+-secagg-clip")])
def test_out_of_range_ring_elements_fail_the_round_instead_of_scaling_the_model(tmp_path, index, amount, why):
    grid = InProcessGrid(misbehave(1002, "masked-input", _shift(index, amount)), N)
    wf = SyncWorkflow(cfg(**{"secure-aggregation": "secagg+"}), grid, RunDirectory(tmp_path / "a"), clock=VirtualClock())
    before = wf.weights.clone()
    wf.run()
    assert re.search(why, wf.history[0]["secagg_failure"]) and torch.equal(wf.weights, before)


def test_a_distributed_dp_round_failed_after_its_unmask_is_still_charged(tmp_path):
    """The coordinator saw the noised sum once it was unmasked: a check failing after that spends the round's budget."""
    grid = InProcessGrid(misbehave(1002, "masked-input", _shift(-1, 2**31)), N)  # its weight coordinate
    wf = SyncWorkflow(cfg(**DDP), grid, RunDirectory(tmp_path / "a"), clock=VirtualClock())
    before = wf.weights.clone()
    wf.run()
    row = wf.history[0]
    assert "summed weight" in row["secagg_failure"] and torch.equal(wf.weights, before)
    assert len(wf.dp.accountant.events) == 1 and wf.dp.epsilon > 0 and row["epsilon"] == pytest.approx(wf.dp.epsilon)


@pytest.mark.parametrize("bits,max_weight,fails", [(8, 10**6, True), (16, 10**4, False), (32, 10**6, False)])
def test_example_weights_below_the_rings_resolution_fail_the_round_clearly(tmp_path, bits, max_weight, fails):
    """With a coarse ring and a large weight cap, the summed weight (each client's examples / cap) can
    round to zero or below: the round fails with the reason instead of dividing by it."""
    kw = {"secure-aggregation": "secagg+", "secagg-bits": bits, "secagg-max-weight": max_weight}
    wf = SyncWorkflow(cfg(**kw), InProcessGrid(app, N), RunDirectory(tmp_path / "a"), clock=VirtualClock())
    before = wf.weights.clone()
    wf.run()
    row = wf.history[0]
    if fails:
        assert "is within 4x of the ring's rounding" in row["secagg_failure"] and torch.equal(wf.weights, before)
    else:
        assert "secagg_failure" not in row and wf.version == 1 and torch.isfinite(wf.weights).all()


def test_only_public_metrics_travel_in_the_clear(tmp_path):
    seen = []

    def spy(msg, ctx):
        reply = app(msg, ctx)
        if stage_of(msg) == "masked-input":
            seen.append(set(reply.content.metric_records["metrics"]))
        return reply

    run(tmp_path, InProcessGrid(spy, N), **{"secure-aggregation": "secagg+"})
    assert seen and all("train-loss" not in m and "num-examples" in m and "base-version" in m for m in seen)
    seen.clear()
    run(tmp_path, InProcessGrid(spy, N), "b", **DDP)
    assert seen and all(m <= {"base-version"} | {k for k in m if k.startswith("profile-")} for m in seen)


# -- pipelining: round r + 1's setup and share-keys ride on round r's masked-input and unmask ------------------------
SECURE = {"secure-aggregation": "secagg+"}


def round_of(msg: Message) -> int:
    return int(msg.metadata.group_id)


class RoundDroppingGrid(InProcessGrid):
    """``victims`` vanish at ``stage`` of round ``rnd`` (the message's round and its main stage): each gets that
    message, never answers, and is gone for good (also from the online nodes, as a dead SuperNode leaves the
    SuperLink's list)."""

    def __init__(self, client, num_nodes: int, victims: int | set[int], rnd: int, stage: str) -> None:
        super().__init__(client, num_nodes)
        self.victims = {victims} if isinstance(victims, int) else set(victims)
        self.at, self.gone = (rnd, stage), set()

    def get_node_ids(self):
        return [n for n in super().get_node_ids() if n not in self.gone]

    def push_messages(self, messages):
        messages = list(messages)
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages):
            node = msg.metadata.dst_node_id
            if node in self.gone or (node in self.victims and (round_of(msg), stage_of(msg)) == self.at):
                self.gone.add(node)
                self._replies.pop(mid, None)
        return ids


# Over several rounds the secure run and the plain one part by more than one round's quantization error (~1e-8):
# each client trains from the last round's weights, which that error moved. The stochastic rounding is seeded from
# the OS, so the gap varies: 1.5-1.8e-7 in 12 runs here, 2.4e-6 once in CI. A wrong cohort is off by ~1e-2.
ROUNDS_ATOL = 1e-5


def plain_by_round(tmp_path, cohorts: dict[int, list[int]], **kw) -> torch.Tensor:
    ref = SyncWorkflow(cfg(**kw), InProcessGrid(app, N), RunDirectory(tmp_path / "ref"))
    ref.select = lambda online, rnd: cohorts[rnd]
    ref.run()
    return ref.weights


ALL = list(range(1001, 1001 + N))


def test_pipelined_rounds_take_two_stages_and_equal_the_plain_mean(tmp_path):
    grid = InProcessGrid(app, N)
    wf = run(tmp_path, grid, **SECURE, **{"num-rounds": 3})
    first, *later = wf.history
    assert list(first["secagg_stage_s"]) == ["setup", "share-keys", "masked-input", "unmask"]
    assert not first["secagg_pipelined"]
    for row in later:  # set up during the previous round: two round trips, like a plain round plus the unmasking
        assert row["secagg_pipelined"] and list(row["secagg_stage_s"]) == ["masked-input", "unmask"], row
        assert row["secagg_survivors"] == N and row["rejected"] == 0 and row["replies"] == 2 * N
    assert first["replies"] == 4 * N
    ref = plain_by_round(tmp_path, dict.fromkeys((1, 2, 3), ALL), **{"num-rounds": 3})
    torch.testing.assert_close(wf.weights, ref, rtol=0, atol=ROUNDS_ATOL)
    assert wf.version == 3
    # every round's secrets were used once and deleted: nothing is left on the nodes
    assert not [k for ctx in grid.contexts.values() for k in ctx.state.config_records if k.startswith(STATE + ":")]
    off = run(tmp_path, InProcessGrid(app, N), name="off", **SECURE, **{"num-rounds": 3, "secagg-pipeline": False})
    assert [list(r["secagg_stage_s"]) for r in off.history] == [["setup", "share-keys", "masked-input", "unmask"]] * 3
    torch.testing.assert_close(off.weights, ref, rtol=0, atol=ROUNDS_ATOL)


@pytest.mark.parametrize("rnd,stage,cohorts,dropped", [
    # gone while round 1's masked-input (with round 2's setup) is out: dropped in round 1, never set up for 2
    (1, "masked-input", {1: "-", 2: "-", 3: "-"}, {1: 1, 2: 0, 3: 0}),
    # gone at round 1's unmask (with round 2's share-keys): round 1 has its input, round 2 never got its shares
    (1, "unmask", {1: "all", 2: "-", 3: "-"}, {1: 0, 2: 0, 3: 0}),
    # gone at round 2's masked-input after sharing round 2's keys in round 1: round 2 recovers its masks
    (2, "masked-input", {1: "all", 2: "-", 3: "-"}, {1: 0, 2: 1, 3: 0}),
])
def test_a_node_vanishing_in_a_pipelined_stage_leaves_each_rounds_survivors_mean(tmp_path, rnd, stage, cohorts,
                                                                                 dropped):
    victim = 1003
    wf = run(tmp_path, RoundDroppingGrid(app, N, victim, rnd, stage), **SECURE, **{"num-rounds": 3})
    nodes = {r: ALL if c == "all" else [n for n in ALL if n != victim] for r, c in cohorts.items()}
    for row in wf.history:
        r = row["round"]
        assert row["secagg_survivors"] == len(nodes[r]) and row["secagg_dropped"] == dropped[r], row
        assert row["secagg_pipelined"] == (r > 1) and "secagg_failure" not in row
    ref = plain_by_round(tmp_path, nodes, **{"num-rounds": 3})
    torch.testing.assert_close(wf.weights, ref, rtol=0, atol=ROUNDS_ATOL)


def test_partial_participation_sets_up_nodes_outside_this_round_with_messages_of_their_own(tmp_path):
    kw = {"num-rounds": 4, "fraction-train": 0.5}  # 3 of 6 nodes a round, picked by the seeded uniform policy
    grid = InProcessGrid(app, N)
    wf = run(tmp_path, grid, **SECURE, **kw)
    cohorts = {r: wf.select(ALL, r) for r in range(1, 5)}
    assert len({tuple(c) for c in cohorts.values()}) > 1, "the test needs cohorts that change"
    assert all(row["secagg_survivors"] == 3 and row["rejected"] == 0 for row in wf.history)
    assert [row["secagg_pipelined"] for row in wf.history] == [False, True, True, True]
    ref = plain_by_round(tmp_path, cohorts, **kw)
    torch.testing.assert_close(wf.weights, ref, rtol=0, atol=ROUNDS_ATOL)
    assert not [k for ctx in grid.contexts.values() for k in ctx.state.config_records if k.startswith(STATE + ":")]


def _mutating(node: int, rnd: int, stage: str, mutate):
    """The real client app, except that ``node``'s message (before) and reply (after) at ``stage`` of ``rnd``."""
    def client(msg: Message, ctx: Context) -> Message:
        hit = ctx.node_id == node and (round_of(msg), stage_of(msg)) == (rnd, stage)
        if hit:
            msg = mutate(msg, None)
        reply = app(msg, ctx)
        return mutate(None, reply) if hit else reply
    return client


def _bad_next_key(msg, reply):
    if reply is not None:  # a low-order point as the next round's key: it would break every neighbour's agreement
        keys = reply.content.config_records[NEXT_KEYS]["1002"]
        reply.content.config_records[NEXT_KEYS] = ConfigRecord({"1002": bytes(32) + keys[32:]})
    return msg if reply is None else reply


def _next_for_a_later_round(msg, reply):
    if msg is not None:  # the node must refuse to set up any round but the next one, and still answer this one
        msg.content.config_records[NEXT]["round"] = 5
    return msg if reply is None else reply


def _next_setup_without_a_field(msg, reply):
    if msg is not None:  # a malformed setup (float(None) inside): refused, and this round's answer still goes back
        del msg.content.config_records[NEXT]["sparse-ratio"]
    return msg if reply is None else reply


@pytest.mark.parametrize("mutate,rule", [(_bad_next_key, "bad-keys"), (_next_for_a_later_round, None),
                                         (_next_setup_without_a_field, None)])
def test_a_bad_piggybacked_stage_costs_the_node_the_next_round_only(tmp_path, caplog, mutate, rule):
    with caplog.at_level(logging.WARNING):
        wf = run(tmp_path, InProcessGrid(_mutating(1002, 1, "masked-input", mutate), N), **SECURE,
                 **{"num-rounds": 3})
    first, second, third = wf.history
    assert first["secagg_survivors"] == N and first["rejected"] == 0
    assert second["secagg_survivors"] == N - 1  # never set up for round 2
    assert second["rejected_by_rule"] == ({rule: 1} if rule else {})
    assert third["secagg_survivors"] == N  # set up for round 3 by a message of its own, during round 2
    if rule is None:
        assert "the next round's stage sent with round 1's masked-input was refused" in caplog.text
    nodes = {1: ALL, 2: [n for n in ALL if n != 1002], 3: ALL}
    torch.testing.assert_close(wf.weights, plain_by_round(tmp_path, nodes, **{"num-rounds": 3}), rtol=0, atol=ROUNDS_ATOL)


def test_a_piggybacked_stage_that_exhausts_memory_costs_the_node_the_next_round_only(tmp_path, monkeypatch, caplog):
    """A MemoryError (a coordinator's setup for a graph of 2**20 nodes) in the next round's part turned
    the whole reply into an error, this round's masked input with it."""
    from privacy.secagg import protocol

    setup = protocol.SecAggClient.setup.__func__

    def failing_setup(cls, node, params):
        if node == 1002 and params.round == 2:
            raise MemoryError("Unable to allocate 8.00 TiB")
        return setup(cls, node, params)

    monkeypatch.setattr(protocol.SecAggClient, "setup", classmethod(failing_setup))
    with caplog.at_level(logging.WARNING):
        wf = run(tmp_path, InProcessGrid(app, N), **SECURE, **{"num-rounds": 2})
    first, second = wf.history
    assert first["secagg_survivors"] == N and first["rejected"] == 0  # its masked input went back
    assert second["secagg_survivors"] == N - 1
    assert "was refused: MemoryError" in caplog.text


def test_a_round_failing_at_unmask_does_not_leave_the_next_one_half_set_up(tmp_path):
    # Half the nodes vanish at round 1's unmask, which also carries round 2's share-keys: round 1 cannot rebuild
    # its self seeds, and round 2 has too few sharers, so round 2 is set up again, on its own, with the nodes left.
    wf = run(tmp_path, RoundDroppingGrid(app, N, {1001, 1002, 1003}, 1, "unmask"), **SECURE, **{"num-rounds": 2})
    first, second = wf.history
    assert "secagg_failure" in first and first["accepted"] == 0
    assert not second["secagg_pipelined"] and list(second["secagg_stage_s"]) == ["setup", "share-keys",
                                                                                 "masked-input", "unmask"]
    assert second["secagg_survivors"] == 3 and "secagg_failure" not in second, second
    assert wf.version == 1


def test_a_node_set_up_on_its_own_that_never_answers_does_not_hold_this_round_open(tmp_path):
    kw = {"num-rounds": 2, "fraction-train": 0.5, "round-timeout": 600.0}
    probe = SyncWorkflow(cfg(**SECURE, **kw), InProcessGrid(app, N), RunDirectory(tmp_path / "probe"))
    outsider = sorted(set(probe.select(ALL, 2)) - set(probe.select(ALL, 1)))[0]
    # it gets round 2's setup as a message of its own during round 1's masked-input stage, and dies with it
    wf = run(tmp_path, RoundDroppingGrid(app, N, outsider, 2, "setup"), **SECURE, **kw)
    first, second = wf.history
    assert first["secagg_survivors"] == 3 and first["secagg_stage_s"]["masked-input"] < 60.0, first
    assert "secagg_failure" not in second and second["secagg_survivors"] >= 3


def _setup_message(nodes, degree: int, me: int = 1001) -> tuple[Message, "Context"]:
    from flwr.app import Context

    nodes = list(nodes)
    k = min(degree, len(nodes) - 1)
    params = SecAggParams.create(1, nodes, degree=degree, threshold=k // 2 + 1, bits=32, clip=1.0, dim=10)
    fields = {"stage": "setup", **params.to_fields(), "numel": 9, "sparse-ratio": 1.0, "subset-seed": bytes(32),
              "weighting": "uniform", "max-weight": 1}
    msg = Message(RecordDict({SECAGG: ConfigRecord(fields)}), dst_node_id=me, message_type="train.secagg", group_id="1")
    return msg, Context(run_id=1, node_id=me, node_config={}, state=RecordDict(), run_config={})


def test_a_client_builds_only_its_own_neighbours_and_refuses_too_many():
    """Share-keys built every node's neighbour set: 2.2 GB at 8000 nodes of the complete graph, a MemoryError at
    16000 (a review). A client now lists only its own, and refuses more than MAX_NEIGHBOURS."""
    import os

    from clients import ClientError
    from clients.secure import MAX_NEIGHBOURS
    from privacy.secagg.graph import complete_graph, harary_graph, neighbours_of

    ids = [7, 1001, 1002, 2**63 + 5, *range(3000, 3040)]
    for k in (2, 8, 40, 43, 99):
        seed = os.urandom(32)
        g = harary_graph(ids, k, seed) if k < len(ids) - 1 else complete_graph(ids)
        assert all(neighbours_of(ids, k, seed, me) == g[me] for me in ids)
    msg, ctx = _setup_message(range(1001, 1001 + MAX_NEIGHBOURS + 2), 1 << 20)
    with pytest.raises(ClientError, match=f"asks this node for {MAX_NEIGHBOURS + 1} neighbours; a node takes at most"):
        run_secagg_stage(msg, ctx)


@pytest.mark.parametrize("field", [{"survivors": ["a"]}, {"survivors": [1002.5]}, {"dropped": [True]}])
def test_unmask_ids_that_are_not_integers_are_refused(field):
    from clients import ClientError

    msg, ctx = _setup_message([1001, 1002, 1003], 2)
    run_secagg_stage(msg, ctx)
    unmask = ConfigRecord({"stage": "unmask", "round": 1, "survivors": [1002], "dropped": [], **field})
    with pytest.raises(ClientError, match="by their integer ids"):
        run_secagg_stage(Message(RecordDict({SECAGG: unmask}), dst_node_id=1001, message_type="train.secagg",
                                 group_id="1"), ctx)


def test_a_long_stage_name_is_cut_in_the_refusal():
    from clients import ClientError

    msg, ctx = _setup_message([1001, 1002, 1003], 2)
    bogus = ConfigRecord({"stage": "s" * 100_000, "round": 5})
    with pytest.raises(ClientError) as info:
        run_secagg_stage(Message(RecordDict({SECAGG: bogus}), dst_node_id=1001, message_type="train.secagg",
                                 group_id="5"), ctx)
    assert len(str(info.value)) < 300


def test_distributed_dp_is_accounted_by_its_proven_rdp_bound_even_under_the_pld_default(tmp_path):
    """The Skellam noise's bound is an RDP theorem: the ledger, the budget and the summary's epsilon are RDP's;
    the Gaussian PLD figure is only reported beside it."""
    from privacy import epsilon_of

    a = run(tmp_path, InProcessGrid(app, N), "a", **DDP)
    assert a.cfg.privacy.accountant == "pld" and a.dp.accountant.name == "rdp"
    summary = json.loads((tmp_path / "a" / SUMMARY).read_text())
    assert summary["accountant"] == "rdp"
    rdp = epsilon_of(a.dp.accountant.events, a.cfg.privacy.dp_delta, "rdp")
    assert summary["epsilon"] == pytest.approx(rdp) and summary["epsilon_by_accountant"]["rdp"] == pytest.approx(rdp)
