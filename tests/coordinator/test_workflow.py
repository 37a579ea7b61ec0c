"""The synchronous workflow on the in-process Grid: learning, defences, resume."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from flwr.app import Array

from coordinator import RunConfig, RunDirectory, SyncWorkflow
from coordinator.rundir import CHECKPOINT, CONFIG, METRICS, MODEL, PLOT, SUMMARY
from simulations.inprocess import InProcessGrid

from .helpers import FakeClock, ForgingGrid, SlowRemoteGrid, mixed, stock_flower_bad

BAD_KINDS = ["wrong-length", "nan", "inf", "float64", "zero-examples", "huge-examples", "stale", "huge-values", "large-norm"]
RULE = {"wrong-length": "bad-array", "nan": "non-finite", "inf": "non-finite", "float64": "oversized",
        "zero-examples": "bad-num-examples", "huge-examples": "bad-num-examples", "stale": "stale-version",
        "huge-values": "non-finite", "large-norm": "norm-too-large"}


def cfg(**kw) -> RunConfig:
    base = {"num-rounds": 3, "min-nodes": 2, "task": "digits", "seed": 0}
    base.update(kw)
    return RunConfig.from_mapping(base)


def test_learns_and_writes_complete_run_dir(tmp_path):
    s = SyncWorkflow(cfg(**{"num-rounds": 5}), InProcessGrid(run_train_app(), 10), RunDirectory(tmp_path)).run()
    # Band: learning happened (>0.8), and no perfect score that would suggest test leakage.
    assert 0.80 <= s["final_test_accuracy"] <= 0.995
    for name in (CHECKPOINT, METRICS, SUMMARY, MODEL, PLOT, CONFIG):
        assert (tmp_path / name).is_file(), name
    rows = (tmp_path / METRICS).read_text().strip().splitlines()
    assert len(rows) == 1 + 5
    summary = json.loads((tmp_path / SUMMARY).read_text())
    assert summary["rounds"] == 5 and summary["rejected_total"] == 0


def run_train_app():
    from clients.client_app import app

    return app


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_bad_reply_rejected_and_only_good_updates_applied(tmp_path, kind):
    grid_bad = InProcessGrid(mixed({1001, 1003}, stock_flower_bad(kind)), 4)
    wf = SyncWorkflow(cfg(**{"num-rounds": 1}), grid_bad, RunDirectory(tmp_path / "a"))
    wf.run()
    row = wf.history[0]
    assert row["accepted"] == 2 and row["rejected"] == 2
    assert row["rejected_by_rule"] == {RULE[kind]: 2}
    # The global model equals the one made from the two honest clients alone.
    only_good = InProcessGrid(mixed(set(), stock_flower_bad(kind)), 4)
    ref = SyncWorkflow(cfg(**{"num-rounds": 1}), only_good, RunDirectory(tmp_path / "b"))
    ref.select = lambda nodes, rnd: [1002, 1004]  # the honest nodes only
    ref.run()
    assert torch.isfinite(wf.weights).all()
    torch.testing.assert_close(wf.weights, ref.weights, rtol=1e-5, atol=1e-6)


def test_all_bad_leaves_model_unchanged(tmp_path):
    wf = SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(stock_flower_bad("nan"), 3), RunDirectory(tmp_path))
    before = wf.weights.clone()
    wf.run()
    assert wf.version == 0
    assert torch.equal(wf.weights, before)
    assert [r["accepted"] for r in wf.history] == [0, 0]
    summary = json.loads((tmp_path / SUMMARY).read_text())
    assert summary["rounds_without_updates"] == 2  # a run that learned nothing says so, and is no success
    assert summary["status"] == "no-updates" and "refused replies: 6 non-finite" in summary["failure"]


def test_summary_counts_no_idle_round_when_every_round_learns(tmp_path):
    wf = SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(mixed({1001}, stock_flower_bad("nan")), 3), RunDirectory(tmp_path))
    wf.run()
    assert json.loads((tmp_path / SUMMARY).read_text())["rounds_without_updates"] == 0


def reporting(losses: dict[int, tuple[object, int]]):
    """Clients sending a zero update with their own (train-loss, num-examples), by node id."""
    from .helpers import reply_with

    def client(msg, ctx):
        numel = msg.content.array_records["arrays"]["weights"].shape[0]
        loss, examples = losses[ctx.node_id]
        extra = {"num-examples": examples}
        if loss is not None:
            extra["train-loss"] = loss
        m = reply_with(msg, Array(np.zeros(numel, np.float32)), extra)
        if loss is None:
            del m.content.metric_records["metrics"]["train-loss"]
        return m

    return client


@pytest.mark.parametrize("setting", [{}, {"dp": "central", "dp-noise-multiplier": 0.1, "dp-clip": 1.0}])
def test_the_round_train_loss_is_the_example_weighted_mean_of_the_losses_reported(tmp_path, setting):
    """A missing, nan or absurd (1e300) loss is left out instead of making the round's loss nan or
    inf; under central DP, where every update weighs 1 in the sum, the loss is still averaged over
    examples (it was divided by the number of updates)."""
    losses = {1001: (1.0, 10), 1002: (2.0, 30), 1003: (float("nan"), 50), 1004: (1e300, 70), 1005: (None, 90)}
    wf = SyncWorkflow(cfg(**{"num-rounds": 1, "min-nodes": 5, **setting}), InProcessGrid(reporting(losses), 5),
                      RunDirectory(tmp_path))
    wf.run()
    assert wf.history[0]["accepted"] == 5
    assert wf.history[0]["train_loss"] == pytest.approx((1.0 * 10 + 2.0 * 30) / 40)


@pytest.mark.parametrize("rule, extra", [("krum", {}), ("multi-krum", {"krum-m": 4}), ("trimmed-mean", {"trim-beta": 0.2})])
def test_krum_left_with_too_few_updates_skips_the_round_instead_of_crashing(tmp_path, rule, extra):
    """Five nodes (the fewest krum-f = 1 allows), one of them rejected: four valid updates are too
    few for Krum (n > 2f + 2) and for Multi-Krum with m = 4 (m <= n - f). The round used to end the
    run with an AggregationError; it must leave the model unchanged, say why, and the run go on. A trimmed
    mean of 0.2 trims nothing from four (floor(0.8) = 0): it was a plain mean, the outlier in it (review helper-56)."""
    wf = SyncWorkflow(cfg(**{"num-rounds": 2, "min-nodes": 5, "aggregator": rule, "krum-f": 1, **extra}),
                      InProcessGrid(mixed({1001}, stock_flower_bad("nan")), 5), RunDirectory(tmp_path))
    before = wf.weights.clone()
    wf.run()
    assert [(r["accepted"], r["rejected"], r["too_few_updates"]) for r in wf.history] == [(4, 1, 5)] * 2
    import csv  # the CSV says so too (the column was dropped: a round that changed nothing showed accepted = 4)
    with (tmp_path / METRICS).open() as f:
        assert [row["too_few_updates"] for row in csv.DictReader(f)] == ["5", "5"]
    assert torch.equal(wf.weights, before) and wf.version == 0
    assert json.loads((tmp_path / SUMMARY).read_text())["rounds_without_updates"] == 2
    clean = SyncWorkflow(cfg(**{"num-rounds": 1, "min-nodes": 5, "aggregator": rule, "krum-f": 1, **extra}),
                         InProcessGrid(mixed(set(), stock_flower_bad("nan")), 5), RunDirectory(tmp_path / "clean"))
    clean.run()
    assert clean.version == 1 and "too_few_updates" not in clean.history[0]


class GhostGrid(InProcessGrid):
    """Lists node 999, which has left: the grid takes no message for it, as Flower's grids do."""

    def get_node_ids(self):
        return [999, *super().get_node_ids()]

    def push_messages(self, messages):
        return super().push_messages([m for m in messages if m.metadata.dst_node_id != 999])


def test_a_round_that_reached_fewer_nodes_than_krum_needs_keeps_the_model_instead_of_crashing(tmp_path):
    """Five nodes listed, four reached: Krum's aggregator still gets room for 2f + 3 (it raised, ending the run)."""
    wf = SyncWorkflow(cfg(**{"num-rounds": 2, "min-nodes": 5, "aggregator": "krum", "krum-f": 1}),
                      GhostGrid(mixed(set(), stock_flower_bad("nan")), 4), RunDirectory(tmp_path))
    before = wf.weights.clone()
    wf.run()
    assert [(r["accepted"], r["too_few_updates"]) for r in wf.history] == [(4, 5)] * 2
    assert torch.equal(wf.weights, before)


def test_krum_needs_enough_nodes_or_buffered_updates_by_config():
    from clients import ConfigError

    with pytest.raises(ConfigError, match=r"min-nodes must be >= 5 to give aggregator = 'krum' the 5 updates"):
        cfg(**{"min-nodes": 4, "aggregator": "krum", "krum-f": 1})
    with pytest.raises(ConfigError, match=r"min-nodes must be >= 7 .* krum-f = 1 and krum-m = 6"):
        cfg(**{"min-nodes": 6, "aggregator": "multi-krum", "krum-f": 1, "krum-m": 6})
    with pytest.raises(ConfigError, match=r"buffer-size must be >= 7 .* krum-f = 2"):
        cfg(**{"workflow": "fedbuff", "buffer-size": 5, "aggregator": "krum", "krum-f": 2})
    # a round closed after fewer replies than the rule needs never combines them: every round did nothing
    with pytest.raises(ConfigError, match=r"close-after-replies must be 0 or >= 5 to give aggregator = 'krum'"):
        cfg(**{"min-nodes": 6, "aggregator": "krum", "krum-f": 1, "close-after-replies": 4})
    cfg(**{"min-nodes": 5, "aggregator": "krum", "krum-f": 1})
    cfg(**{"min-nodes": 6, "aggregator": "krum", "krum-f": 1, "close-after-replies": 5})
    cfg(**{"workflow": "fedbuff", "buffer-size": 7, "aggregator": "krum", "krum-f": 2})


@pytest.mark.parametrize("key, value, rule", [
    ("server-lr", 1e39, "server-lr must be 0 (the default: 1.0 under fedavg and fedavgm) or in (0, 1e6]"),  # overflowed float32 in the first step
    ("seed", 2**64, "seed must be in [0, 2**32)"),  # torch.manual_seed overflowed
    ("max-update-mb", 1e308, "max-update-mb must be in (0, 1e6]"),  # int(inf) when the run started
    # a norm near 1.8e19 was accepted by one path and refused by another (float32 sums of squares)
    ("max-update-norm", 1e30, "max-update-norm must be in (0, 1e18]"),
    # a client claiming 1e38 examples made the float32 weighted sum, and the model, inf (review helper-56)
    ("max-examples", 10**13, "max-examples must be in [1, 1e12]"),
    ("device", "cuda:abc", "device must be auto, cpu or cuda[:N]"),
    ("run-dir", "a\0b", "run-dir must not contain a NUL character"),
])
def test_values_that_failed_only_once_the_run_started_are_config_errors(key, value, rule):
    from clients import ConfigError

    with pytest.raises(ConfigError, match=re.escape(rule)):
        cfg(**{key: value})
    with pytest.raises(ConfigError, match=re.escape("server-tau must be finite and > 0")):
        cfg(**{"server-optimizer": "fedadam", "server-lr": 0.1, "server-tau": 0.0})  # the optimizer's own rules, before the run


def test_a_run_table_that_is_not_a_table_is_one_config_error():
    from clients import ConfigError
    from clients.config import build_config
    from coordinator.config import ServerSettings

    with pytest.raises(ConfigError, match=r"\[run\] must be a table\. Found int 5"):
        build_config(ServerSettings, 5, "run")


def test_resume_continues_from_checkpoint(tmp_path):
    from clients.client_app import app

    full = SyncWorkflow(cfg(**{"num-rounds": 4}), InProcessGrid(app, 4), RunDirectory(tmp_path / "full"))
    full.run()
    part = SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(app, 4), RunDirectory(tmp_path / "part"))
    part.run()
    saved = part.weights.clone()
    resumed = SyncWorkflow(cfg(**{"num-rounds": 4}), InProcessGrid(app, 4), RunDirectory(tmp_path / "part"))
    assert resumed.round == 2 and resumed.version == 2
    assert torch.equal(resumed.weights, saved)
    resumed.run()
    assert [r["round"] for r in resumed.history] == [1, 2, 3, 4]
    torch.testing.assert_close(resumed.weights, full.weights)


def test_a_resumed_run_goes_on_from_the_wall_time_already_spent(tmp_path):
    """wall_time_s started again from 0 on resume: the resumed rows and summary.json counted only the
    last session."""
    from clients.client_app import app

    SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(app, 4), RunDirectory(tmp_path)).run()
    run_dir = RunDirectory(tmp_path)
    ckpt = run_dir.load_checkpoint()
    for row in ckpt["history"]:  # as if the first session had taken 1000 s longer
        row["wall_time_s"] += 1000.0
    run_dir.save_checkpoint(ckpt)
    resumed = SyncWorkflow(cfg(**{"num-rounds": 4}), InProcessGrid(app, 4), RunDirectory(tmp_path))
    s = resumed.run()
    wall = [r["wall_time_s"] for r in resumed.history]
    assert len(wall) == 4 and wall == sorted(wall) and wall[2] > 1000.0
    assert s["wall_time_s"] >= wall[-1] and json.loads((tmp_path / SUMMARY).read_text())["wall_time_s"] == s["wall_time_s"]
    assert all("sim_time_s" not in r for r in resumed.history)  # a wall clock: no simulated time


def test_resume_refuses_other_configuration(tmp_path):
    from clients.client_app import app
    from coordinator import CoordinatorError

    SyncWorkflow(cfg(**{"num-rounds": 1}), InProcessGrid(app, 2), RunDirectory(tmp_path)).run()
    with pytest.raises(CoordinatorError, match="checkpoint of this configuration"):
        SyncWorkflow(cfg(**{"num-rounds": 2, "task": "synthetic"}), InProcessGrid(app, 2), RunDirectory(tmp_path))


def test_resume_refuses_any_changed_setting_but_operational_ones(tmp_path):
    """Only task, seed, optimizer and DP were compared: another lr, codec, data split or node count
    resumed without a word (the run a mix of two experiments, config.json rewritten to claim the new one)."""
    import torch

    from clients.client_app import app
    from coordinator import CoordinatorError

    SyncWorkflow(cfg(**{"num-rounds": 1}), InProcessGrid(app, 3), RunDirectory(tmp_path)).run()
    with pytest.raises(CoordinatorError, match="checkpoint of this configuration") as info:
        SyncWorkflow(cfg(**{"num-rounds": 2, "lr": 0.01, "codec": "sign", "partitioning": "iid", "topk-ratio": 0.5}),
                     InProcessGrid(app, 4), RunDirectory(tmp_path))
    for named in ("codec = 'dense' there, 'sign' now", "lr = ", "partitioning = 'dirichlet' there, 'iid' now",
                  "nodes = 3 there, 4 now"):
        assert named in str(info.value), named
    assert "topk-ratio" not in str(info.value)  # (no codec in use reads it: a new user's resume listed it)
    # settings of codecs and rules not in use (range-checked, never read) may change
    ops = {"num-rounds": 3, "round-timeout": 99.0, "poll-interval": 0.02, "wait-nodes-timeout": 5.0, "topk-ratio": 0.5,
           "trim-beta": 0.3, "qsgd-bits": 4, "slow-link-codec": "sign"}
    assert SyncWorkflow(cfg(**ops), InProcessGrid(app, 3), RunDirectory(tmp_path)).round == 1
    # a checkpoint of an earlier fedshield recorded fewer settings: those it has must agree
    path = tmp_path / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    state["fingerprint"] = {k: state["fingerprint"][k] for k in ("task", "numel", "seed", "server-optimizer", "dp")}
    torch.save(state, path)
    assert SyncWorkflow(cfg(**{**ops, "lr": 0.01}), InProcessGrid(app, 4), RunDirectory(tmp_path)).round == 1


def test_the_unused_settings_are_those_of_the_codecs_and_rules_not_in_use():
    agg = cfg(**{"codec": "topk", "aggregator": "krum", "min-nodes": 5}).aggregation
    assert {"topk-ratio", "topk-value-dtype", "error-feedback", "krum-f"}.isdisjoint(agg.unused_keys())
    assert {"qsgd-bits", "codec-dtype", "trim-beta", "krum-m", "clip-norm", "slow-link-codec"} <= agg.unused_keys()
    slow = cfg(**{"slow-link-mbps": 5.0, "slow-link-codec": "qsgd"}).aggregation  # dense, and qsgd on slow links
    assert {"qsgd-bits", "codec-dtype", "slow-link-codec"}.isdisjoint(slow.unused_keys())


def test_a_dp_checkpoint_without_its_accounting_is_refused(tmp_path):
    """Resumed with exit 0 and epsilon started again from zero (or a KeyError traceback)."""
    import torch

    from clients.client_app import app
    from coordinator import CoordinatorError

    SyncWorkflow(cfg(**{"num-rounds": 1, **CENTRAL}), InProcessGrid(app, 2), RunDirectory(tmp_path)).run()
    path = tmp_path / "checkpoint.pt"
    state = torch.load(path, weights_only=True)
    for privacy, rule in (({}, "must hold its privacy accounting"), ({"x": 1}, "privacy accounting must be readable")):
        torch.save({**state, "privacy": privacy}, path)
        with pytest.raises(CoordinatorError, match=rule):
            SyncWorkflow(cfg(**{"num-rounds": 2, **CENTRAL}), InProcessGrid(app, 2), RunDirectory(tmp_path))


CENTRAL = {"dp": "central", "dp-noise-multiplier": 1.0, "dp-clip": 1.0}


@pytest.mark.parametrize(("before", "after", "named"), [
    ({}, CENTRAL, "dp = 'none' there, 'central' now"),
    (CENTRAL, {}, "dp = 'central' there, 'none' now"),
    (CENTRAL, {**CENTRAL, "dp-noise-multiplier": 5.0}, "dp-noise-multiplier = 1.0 there, 5.0 now"),
    (CENTRAL, {**CENTRAL, "dp-clip": 0.1}, "dp-clip = 1.0 there, 0.1 now"),
])
def test_resume_refuses_changed_privacy_settings_naming_them(tmp_path, before, after, named):
    """Resuming non-private rounds under DP claimed a guarantee for all of them (the accountant
    started at zero); a changed noise or clip was overridden by the checkpoint's without a word."""
    from clients.client_app import app
    from coordinator import CoordinatorError

    SyncWorkflow(cfg(**{"num-rounds": 1, **before}), InProcessGrid(app, 2), RunDirectory(tmp_path)).run()
    with pytest.raises(CoordinatorError, match="checkpoint of this configuration") as info:
        SyncWorkflow(cfg(**{"num-rounds": 2, **after}), InProcessGrid(app, 2), RunDirectory(tmp_path))
    assert named in str(info.value) and "\n" not in str(info.value)
    resumed = SyncWorkflow(cfg(**{"num-rounds": 2, **before}), InProcessGrid(app, 2), RunDirectory(tmp_path))
    assert resumed.round == 1  # the settings it was run with resume


def test_waits_for_min_nodes_then_fails_clearly(tmp_path):
    from clients.client_app import app
    from coordinator import CoordinatorError

    wf = SyncWorkflow(cfg(**{"min-nodes": 5, "wait-nodes-timeout": 3.0}), InProcessGrid(app, 2), RunDirectory(tmp_path),
                      clock=FakeClock())
    with pytest.raises(CoordinatorError, match="min-nodes=5 nodes must be online"):
        wf.run()


def test_selection_is_seeded_fraction(tmp_path):
    from clients.client_app import app

    wf = SyncWorkflow(cfg(**{"fraction-train": 0.3, "min-nodes": 2}), InProcessGrid(app, 10), RunDirectory(tmp_path))
    nodes = list(range(1001, 1011))
    a, b = wf.select(nodes, 1), wf.select(nodes, 1)
    assert a == b and len(a) == 3 and set(a) <= set(nodes)
    assert any(wf.select(nodes, r) != a for r in range(2, 6))


class HoldingGrid(InProcessGrid):
    """Node ``slow``'s reply to its first message is held back until the next push (a straggler)."""

    def __init__(self, client, num_nodes, slow):
        super().__init__(client, num_nodes)
        self.slow, self.held = slow, {}

    def push_messages(self, messages):
        messages = list(messages)
        self._replies.update(self.held)
        self.held = {}
        ids = list(super().push_messages(messages))
        for mid, msg in zip(ids, messages):
            if msg.metadata.dst_node_id == self.slow and msg.metadata.group_id == "1":
                self.held[mid] = self._replies.pop(mid)
        return ids


@pytest.mark.parametrize("policy", ["drop", "carry"])
def test_a_late_reply_is_dropped_or_carried_into_the_next_round_weighted_by_staleness(tmp_path, policy):
    from simulations.virtual import VirtualClock

    grid = HoldingGrid(run_train_app(), 4, slow=1004)
    c = cfg(**{"num-rounds": 2, "min-nodes": 3, "close-after-replies": 3, "late-replies": policy,
               "poll-interval": 1.0, "staleness": "polynomial", "staleness-a": 1.0})
    wf = SyncWorkflow(c, grid, RunDirectory(tmp_path), clock=VirtualClock())
    seen = []
    fn = wf.staleness_fn
    wf.staleness_fn = lambda s: seen.append(s) or fn(s)
    wf.run()
    r1, r2 = wf.history
    assert r1["accepted"] == 3 and r1["late"] == 1
    if policy == "carry":
        assert r2["selected"] == 3  # the straggler was still busy: not asked again
        assert r2["late_accepted"] == 1 and r2["accepted"] == 4 and seen == [1] and r2["mean_staleness"] == 1
        assert fn(1) == pytest.approx(0.5) and wf._late == {}
    else:
        assert "late_accepted" not in r2 and r2["accepted"] == r2["selected"] and seen == []


@pytest.mark.parametrize("rule", ["median", "norm-bounded-mean"])
def test_under_a_robust_rule_a_carried_late_reply_and_a_fresh_one_of_the_same_node_are_one_row(tmp_path, rule):
    """A review: with fewer idle nodes than min-nodes a busy node is asked again, and its late reply and its fresh
    one both entered the round: two of a median's rows (twice the clip bound) for one node. The second is refused."""
    import coordinator.workflow as W
    from simulations.virtual import VirtualClock

    c = cfg(**{"num-rounds": 2, "min-nodes": 4, "close-after-replies": 3, "late-replies": "carry", "aggregator": rule,
               "poll-interval": 1.0, **({"clip-norm": 1.0} if rule == "norm-bounded-mean" else {})})
    added: list[int] = []
    real = W.add_replies
    W.add_replies = lambda acc, items: added.extend(ok.node_id for ok, _, _ in items) or real(acc, items)
    try:
        wf = SyncWorkflow(c, HoldingGrid(run_train_app(), 4, slow=1004), RunDirectory(tmp_path), clock=VirtualClock())
        wf.run()
    finally:
        W.add_replies = real
    r1, r2 = wf.history
    assert r1["accepted"] == 3 and r1["late"] == 1 and r2["selected"] == 4  # the busy node was asked again
    assert r2["rejected_by_rule"] == {"duplicate-contributor": 1} and r2["accepted"] == 4, r2
    assert sorted(added[3:]) == [1001, 1002, 1003, 1004]

    # One of its replies refused by the norm rules (checked while adding, after the pull is read): the other is
    # still its row (here the fresh one, read first, is refused, and the late one waited for its outcome)
    def client(msg, ctx):
        bad = ctx.node_id == 1004 and msg.metadata.group_id == "2"
        return stock_flower_bad("large-norm")(msg, ctx) if bad else run_train_app()(msg, ctx)

    wf = SyncWorkflow(c, HoldingGrid(client, 4, slow=1004), RunDirectory(tmp_path / "b"), clock=VirtualClock())
    wf.run()
    r2 = wf.history[1]
    assert r2["rejected_by_rule"] == {"norm-too-large": 1} and r2["accepted"] == 4, r2


def test_a_reply_flower_cannot_inflate_is_refused_and_the_rest_of_its_pull_kept(tmp_path):
    """A review: the SuperLink checks only an object's head; an Array whose JSON body Flower's constructor refuses
    (a float in its shape) raised out of the ServerApp grid's pull and ended the run, losing the pull's other
    replies. Pulled as Flower's HttpGrid pulls (every reply deflated, inflated by the patched function)."""
    import importlib

    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from clients.client_app import app
    from clients.flower_pins import patch_grid
    from clients.protocol import ARRAYS

    patch_grid()
    http_grid = importlib.import_module("flwr.superlink.grid.http_grid")

    class WireGrid(InProcessGrid):
        def pull_messages(self, message_ids):
            out = []
            for m in super().pull_messages(message_ids):
                objects = get_all_nested_objects(m)  # (the message last, after its children)
                contents = {oid: o.deflate() for oid, o in objects.items()}
                got = http_grid.inflate_object_from_contents(list(objects)[-1], contents)
                got.metadata.__dict__["_message_id"] = list(objects)[-1]
                out.append(got)
            return out

    def client(msg, ctx):
        reply = app(msg, ctx)
        if ctx.node_id == 1002:
            for a in reply.content[ARRAYS].values():
                a.__dict__["shape"] = tuple(float(s) for s in a.shape)
                a.__dict__.pop("_object_id", None)
        return reply

    c = cfg(**{"num-rounds": 2, "min-nodes": 3, "round-timeout": 20.0})  # (a reply left unmatched: 20 s, not 300)
    wf = SyncWorkflow(c, WireGrid(client, 3), RunDirectory(tmp_path))
    wf.run()
    assert wf.round == 2 and [r["accepted"] for r in wf.history] == [2, 2]
    assert all(r["rejected_by_rule"] == {"error-reply": 1} for r in wf.history), wf.history


def test_federated_running_statistics_take_the_plain_mean_and_a_variance_never_goes_below_zero(tmp_path):
    """A new user's BatchNorm CNN evaluated to NaN under topk, qsgd, FedAdam, FedBuff and distributed DP: a sum of
    deltas that is not their plain mean (an adaptive step, a stale reply, a codec's error, noise) took running_var
    below 0. Buffers now take the plain mean delta whatever the server optimizer, and a variance the sum would take
    below 0 keeps its value."""
    from pathlib import Path

    cnn = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "cnn_digits.py"
    wf = SyncWorkflow(cfg(**{"task": f"{cnn}:CnnDigits", "server-optimizer": "fedadam", "server-lr": 0.1}),
                      InProcessGrid(run_train_app(), 2), RunDirectory(tmp_path))
    lay = wf.layout
    buffers, var = lay.index(buffers=True), lay.index(lay.nonneg)
    params = torch.ones(lay.numel, dtype=torch.bool)
    params[buffers] = False
    assert len(lay.nonneg) == 2 and var.numel() == 16 + 32 and buffers.numel() == 2 * var.numel()
    before = wf.weights.clone()
    delta = torch.full_like(before, 0.5)
    delta[var[:5]] = -before[var[:5]] - 1.0  # takes these five variances to -1
    assert wf._step(1, delta, {})
    expected = before[buffers] + delta[buffers]
    expected[torch.isin(buffers, var[:5])] = before[var[:5]]  # kept
    torch.testing.assert_close(wf.weights[buffers], expected, rtol=0, atol=0)
    assert (wf.weights[var] >= 0).all()
    moved = (wf.weights - before)[params]  # the parameters took FedAdam's step: lr 0.1 (1 - beta1) / sqrt(...)
    assert moved.abs().max() < 0.5 and moved.abs().min() > 0


def test_a_batchnorm_cnn_learns_under_topk_with_its_statistics_sent_exactly(tmp_path):
    """The shipped CNN with BatchNorm under topk (1%): NaN from round 3 (its running variances went below 0), then
    0.18 after 5 rounds once they were kept >= 0; with its statistics sent exactly beside top-k's k it learns."""
    from pathlib import Path

    cnn = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "cnn_digits.py"
    wf = SyncWorkflow(cfg(**{"task": f"{cnn}:CnnDigits", "codec": "topk", "num-rounds": 5}),
                      InProcessGrid(run_train_app(), 10), RunDirectory(tmp_path))
    summary = wf.run()
    assert 0.80 <= summary["final_test_accuracy"] <= 0.99
    assert (wf.weights[wf.layout.index(wf.layout.nonneg)] > 0).all()


def test_what_a_task_cannot_get_from_a_setting_is_said_once_at_start(tmp_path, caplog):
    """A lossy codec over federated statistics, and proximal-mu with the task's own train (it was silently
    ignored): each said in one line when the run is set up."""
    import logging
    from pathlib import Path

    from clients.tasks import task_name
    from clients.tasks.digits import DigitsTask

    class OwnLoop(DigitsTask):
        def train(self, model, data, settings, generator):
            return {}

    cnn = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "cnn_digits.py"
    with caplog.at_level(logging.WARNING):
        SyncWorkflow(cfg(**{"task": f"{cnn}:CnnDigits", "codec": "qsgd"}), InProcessGrid(run_train_app(), 2),
                     RunDirectory(tmp_path / "a"))
        topk = SyncWorkflow(cfg(**{"task": f"{cnn}:CnnDigits", "codec": "topk"}), InProcessGrid(run_train_app(), 2),
                            RunDirectory(tmp_path / "d"))  # (sends them exactly: nothing said)
        SyncWorkflow(cfg(**{"task": task_name(OwnLoop), "proximal-mu": 0.5}), InProcessGrid(run_train_app(), 2),
                     RunDirectory(tmp_path / "b"))
        SyncWorkflow(cfg(**{"task": f"{cnn}:CnnDigitsFedBN", "codec": "topk", "proximal-mu": 0.5}),
                     InProcessGrid(run_train_app(), 2), RunDirectory(tmp_path / "c"))  # neither applies: nothing said
    said = [r.getMessage() for r in caplog.records]
    assert [m for m in said if "CnnDigits federates 96 buffer values (running statistics) and codec 'qsgd'" in m and "FedBN" in m]
    assert topk.codec.config()["exact"] == topk.layout.buffer_ranges() == [192, 32, 4928, 64]
    assert [m for m in said if "OwnLoop brings its own train: proximal-mu = 0.5 reaches it" in m]
    assert len([m for m in said if "federates" in m or "brings its own train" in m]) == 2


def test_carrying_late_replies_is_refused_where_a_round_must_hold_only_its_own_clients():
    from clients._errors import ConfigError

    with pytest.raises(ConfigError, match="proximal-mu must be 0 under dp = 'local'"):  # (DP-SGD's loop: no such term)
        cfg(**{"proximal-mu": 0.1, "dp": "local", "local-noise-multiplier": 1.0})

    with pytest.raises(ConfigError, match="late-replies must be 'drop' under central"):
        cfg(**{"late-replies": "carry", "dp": "central", "dp-noise-multiplier": 1.0})


@pytest.mark.parametrize(("setting", "message"), [
    ({"qsgd-bits": 3}, "run.qsgd-bits must be one of [2, 4, 8]. Found 3."),
    ({"qsgd-chunk": 100}, "run.qsgd-chunk must be a power of two"),
    ({"topk-ratio": 0.0}, "run.topk-ratio must be a number in (0, 1]. Found 0.0."),
    ({"topk-value-dtype": "int8"}, "run.topk-value-dtype must be one of ['float16', 'float32']. Found 'int8'."),
    ({"codec-dtype": "int8"}, "run.codec-dtype must be one of"),
    ({"trim-beta": 0.5}, "run.trim-beta must be in [0, 0.5). Found 0.5."),
    ({"krum-f": -1}, "run.krum-f must be >= 0. Found -1."),
    ({"krum-m": 0}, "run.krum-m must be >= 1. Found 0."),
    ({"clip-norm": 0.0}, "run.clip-norm must be finite and > 0. Found 0.0."),
])
def test_settings_of_codecs_and_rules_not_in_use_are_still_checked(setting, message):
    """codec = "dense" and aggregator = "mean": a wrong qsgd-bits or trim-beta is still a mistake."""
    from clients._errors import ConfigError

    with pytest.raises(ConfigError) as info:
        cfg(**setting)
    assert message in str(info.value)


@pytest.mark.parametrize("setting", [
    {"late-replies": "carry", "dp": "central", "dp-noise-multiplier": 1.0},
    {"dp": "central", "dp-noise-multiplier": 1.0, "aggregator": "median"},
    {"secure-aggregation": "secagg+", "codec": "topk"},
    {"slow-link-mbps": 1.0, "workflow": "fedbuff"},
    {"dp": "distributed", "dp-noise-multiplier": 1.0},
])
def test_rules_over_several_keys_name_their_key_with_the_run_table_once(setting):
    """A rule tying keys together names its key as the file does (run.KEY), like single-key rules."""
    from clients._errors import ConfigError

    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(setting)
    msg = str(info.value)
    key = msg.split(" must ")[0]
    assert key.startswith("run.") and not key.startswith("run.run.") and key[4:] in setting.keys() | {
        "secure-aggregation"}, msg
    assert "\n" not in msg and "_" not in key


@pytest.mark.parametrize("setting", [{"trim-beta": 0.5}, {"late-replies": "carry", "dp": "central",
                                                           "dp-noise-multiplier": 1.0}])
def test_messages_name_the_table_given_by_the_caller(setting):
    from clients._errors import ConfigError

    with pytest.raises(ConfigError, match=r"^tool\.flwr\.app\.config\.[a-z-]+ must "):
        RunConfig.from_mapping(setting, where="tool.flwr.app.config")


def test_a_checkpoint_with_a_setting_now_refused_as_ignored_still_resumes_without_it(tmp_path):
    """A run started with dp-clip = 5 under dp = "none" (accepted and ignored then, refused now) resumes
    once its config drops the setting: a setting the config does not read is not compared."""
    from coordinator import CoordinatorError
    from coordinator.workflow import check_fingerprint, run_fingerprint

    now = RunConfig.from_mapping({"num-rounds": 2})
    before = {**run_fingerprint(now, 100), "dp-clip": 5.0, "clip-learning-rate": 0.5}
    check_fingerprint({"fingerprint": before}, run_fingerprint(now, 100), tmp_path)
    central = RunConfig.from_mapping({"dp": "central", "dp-noise-multiplier": 1.0})
    with pytest.raises(CoordinatorError, match="dp-clip = 5.0 there, 1.0 now"):  # read under central DP: compared
        check_fingerprint({"fingerprint": {**run_fingerprint(central, 100), "dp-clip": 5.0}},
                          run_fingerprint(central, 100), tmp_path)


def test_a_run_resumes_with_its_frozen_values_up_to_float_noise_and_not_with_others(tmp_path):
    from coordinator import CoordinatorError
    from coordinator.workflow import check_fingerprint, run_fingerprint

    cfg = RunConfig.from_mapping({"num-rounds": 2})
    frozen = (0.01, 0.5, 0.3, -0.2, 0.7, -0.6)  # one frozen tensor's summary: mean, RMS, four values
    noise = tuple(v + 1e-7 for v in frozen)  # the same build on another machine
    check_fingerprint({"fingerprint": run_fingerprint(cfg, 100, frozen=frozen)}, run_fingerprint(cfg, 100, frozen=noise),
                      tmp_path)
    with pytest.raises(CoordinatorError, match="frozen-check"):
        check_fingerprint({"fingerprint": run_fingerprint(cfg, 100, frozen=frozen)},
                          run_fingerprint(cfg, 100, frozen=(0.02, *frozen[1:])), tmp_path)
    # a checkpoint from before frozen parameters stayed off the wire: the whole model travelled, no summary
    with pytest.raises(CoordinatorError, match=r"numel = 164 there, 100 now.*set federate_frozen = True on the task "
                                               r"to resume it\); use another run-dir"):
        check_fingerprint({"fingerprint": run_fingerprint(cfg, 164)}, run_fingerprint(cfg, 100, frozen=frozen), tmp_path)


# -- a checkpoint edited or cut short (review helper-50) ---------------------------------------------------------
def test_a_run_stopped_before_its_last_metrics_write_gets_the_row_back_on_resume(tmp_path):
    """Killed between the last round's checkpoint and metrics.csv: the resume had nothing to train and the
    row stayed missing."""
    import csv

    from clients.client_app import app

    SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(app, 2), RunDirectory(tmp_path)).run()
    run_dir = RunDirectory(tmp_path)
    run_dir.write_metrics(run_dir.load_checkpoint()["history"][:1])  # as if killed before the second write
    SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(app, 2), RunDirectory(tmp_path)).run()
    assert [r["round"] for r in csv.DictReader(open(tmp_path / METRICS))] == ["1", "2"]


def _dp_run(tmp_path, nodes=2):
    from clients.client_app import app

    kw = {"num-rounds": 2, "dp": "central", "dp-noise-multiplier": 1.0, "fraction-train": 1.0}
    SyncWorkflow(cfg(**kw), InProcessGrid(app, nodes), RunDirectory(tmp_path)).run()
    return kw


@pytest.mark.parametrize("damage, found", [
    (lambda p: p["accountant"].update(events=[]), "must give the epsilon its last round recorded"),
    (lambda p: p.update(z=0.0), r"must be readable. Found it is not \(ValueError: .its noise multiplier \(0\) and clip \(1\)"),
    (lambda p: p.update(clip=float("nan")), r"must be readable. Found it is not \(ValueError: .its noise multiplier \(1\) and clip \(nan\)"),
])
def test_a_checkpoint_s_privacy_accounting_that_was_changed_is_refused(tmp_path, damage, found):
    """An accountant with its events taken out resumed and reported epsilon 4.73 for a run that had spent 10.73."""
    from clients.client_app import app
    from coordinator import CoordinatorError

    kw = _dp_run(tmp_path)
    run_dir = RunDirectory(tmp_path)
    ckpt = run_dir.load_checkpoint()
    assert "events" in ckpt["privacy"]["accountant"]
    damage(ckpt["privacy"])
    run_dir.save_checkpoint(ckpt)
    with pytest.raises(CoordinatorError, match=found):
        SyncWorkflow(cfg(**{**kw, "num-rounds": 3}), InProcessGrid(app, 2), RunDirectory(tmp_path))


def test_damaged_engine_and_profile_state_is_refused_or_left_out_not_a_traceback(tmp_path):
    from clients.client_app import app
    from coordinator import CoordinatorError

    SyncWorkflow(cfg(**{"num-rounds": 1, "codec": "topk"}), InProcessGrid(app, 2), RunDirectory(tmp_path)).run()
    run_dir = RunDirectory(tmp_path)
    ckpt = run_dir.load_checkpoint()
    ckpt["profiles"] = {"nodes": [1, 2]}  # not a mapping: nothing of it kept (it only steers selection)
    run_dir.save_checkpoint(ckpt)
    assert SyncWorkflow(cfg(**{"num-rounds": 2, "codec": "topk"}), InProcessGrid(app, 2), RunDirectory(tmp_path)).round == 1
    (name, per_node), = ckpt["engine"]["client-state"].items()
    node = next(iter(per_node))
    per_node[node] = torch.full_like(per_node[node], float("nan"))  # every later update of the node refused
    run_dir.save_checkpoint(ckpt)
    with pytest.raises(CoordinatorError, match=rf"engine state must be this engine's. Found it unreadable \(ValueError: "
                                               rf".node {node}'s {name} must be finite"):
        SyncWorkflow(cfg(**{"num-rounds": 2, "codec": "topk"}), InProcessGrid(app, 2), RunDirectory(tmp_path))


def test_an_adaptive_server_optimizer_needs_its_learning_rate_given():
    """It ran at server-lr = 1.0, fedavg's: a FedAdam step moved weights of 0.05 to 0.67 where FedAvg's moved
    them to 0.07 (review helper-56). Adaptive steps are about lr per coordinate, whatever the update's size."""
    from clients import ConfigError
    from coordinator.workflow import run_fingerprint

    for name in ("fedadam", "fedyogi", "fedadagrad"):
        with pytest.raises(ConfigError, match=rf"^run\.server-lr must be given for server-optimizer = '{name}' .*"
                                              r"Found 0\.0\."):
            RunConfig.from_mapping({"server-optimizer": name}, where="run")
        assert cfg(**{"server-optimizer": name, "server-lr": 0.05}).server.optimizer_params()["lr"] == 0.05
    for name in ("fedavg", "fedavgm"):  # a full step: 1.0 applies the mean as it is
        config = cfg(**{"server-optimizer": name})
        assert config.server.server_lr == 0 and config.server.optimizer_params()["lr"] == 1.0
        # checkpoints written before (server-lr = 1.0 recorded) still match the default's fingerprint
        assert run_fingerprint(config, 10)["server-lr"] == 1.0 == run_fingerprint(cfg(**{"server-optimizer": name,
                                                                                        "server-lr": 1.0}), 10)["server-lr"]


@pytest.mark.parametrize("beta, need", [(0.0, 1), (0.1, 10), (0.2, 5), (0.25, 4), (0.3, 4), (0.34, 3), (0.49, 3)])
def test_a_trimmed_mean_needs_enough_nodes_to_trim_anything(beta, need):
    from aggregation.robust import trimmed_mean_min_updates
    from clients import ConfigError

    assert trimmed_mean_min_updates(beta) == need
    assert need == 1 or int(beta * need) == 1 > int(beta * (need - 1))
    if need > 1:
        with pytest.raises(ConfigError, match=rf"min-nodes must be >= {need} to give aggregator = 'trimmed-mean' the "
                                              rf"{need} updates it needs with trim-beta = {beta} \(with fewer, floor"):
            cfg(**{"aggregator": "trimmed-mean", "trim-beta": beta, "min-nodes": need - 1})
        with pytest.raises(ConfigError, match=rf"buffer-size must be >= {need} "):
            cfg(**{"workflow": "fedbuff", "aggregator": "trimmed-mean", "trim-beta": beta, "buffer-size": need - 1})
    cfg(**{"aggregator": "trimmed-mean", "trim-beta": beta, "min-nodes": need})


def test_a_non_finite_aggregate_leaves_the_model_and_its_version_as_they_were(tmp_path, monkeypatch):
    import csv

    from aggregation import robust

    # an aggregate past float32's range (no honest configuration reaches it since max-examples is capped)
    monkeypatch.setattr(robust.Mean, "_result", lambda self: torch.full((self.numel,), float("inf")))
    run = SyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(run_train_app(), 2), RunDirectory(tmp_path / "inf"))
    before = run.weights.clone()
    summary = run.run()
    assert torch.equal(run.weights, before) and summary["version"] == 0
    with (tmp_path / "inf" / METRICS).open() as f:  # the CSV says so, and the summary counts them (review helper-58)
        assert [row["non_finite_aggregate"] for row in csv.DictReader(f)] == ["True", "True"]
    assert summary["rounds_without_updates"] == 2
    monkeypatch.undo()
    wf = SyncWorkflow(cfg(), InProcessGrid(run_train_app(), 2), RunDirectory(tmp_path))
    before, row = wf.weights.clone(), {}
    bad = torch.zeros_like(wf.weights)
    bad[7] = float("inf")
    assert not wf._step(1, bad, row)
    assert torch.equal(wf.weights, before) and wf.version == 0 and row == {"non_finite_aggregate": True}
    assert wf._step(1, torch.full_like(wf.weights, 0.5), row) and wf.version == 1
    torch.testing.assert_close(wf.weights, before + 0.5)


def test_the_default_scenario_does_not_hand_an_adaptive_optimizer_fedavgs_learning_rate():
    """Its server-lr = 1.0 line made --set run.server-optimizer=fedadam run at 1.0 again (review helper-58)."""
    from clients import ConfigError
    from simulations.scenario import load_scenario

    assert load_scenario(None).run.server.effective_server_lr() == 1.0
    with pytest.raises(ConfigError, match="server-lr must be given for server-optimizer = 'fedadam'"):
        load_scenario(None, {"run.server-optimizer": "fedadam"})


def test_a_fedbuff_checkpoint_from_before_the_staleness_discount_is_refused_naming_it(tmp_path):
    """Its releases divided by sum n s: resumed, the run would mix two release rules (review helper-58)."""
    from coordinator import CoordinatorError
    from coordinator.workflow import check_fingerprint, run_fingerprint

    now = run_fingerprint(cfg(**{"workflow": "fedbuff", "fraction-train": 1.0}), 100)
    assert now["fedbuff-release"] == "sum n s delta / sum n"
    before = {k: v for k, v in now.items() if k != "fedbuff-release"}
    with pytest.raises(CoordinatorError, match=r"Found fedbuff-release = '\(unset\)' there"):
        check_fingerprint({"fingerprint": before}, now, tmp_path)
    assert "fedbuff-release" not in run_fingerprint(cfg(), 100)


def test_central_eval_every_evaluates_those_rounds_and_the_last(tmp_path):
    import math

    wf = SyncWorkflow(cfg(**{"num-rounds": 5, "central-eval-every": 2}), InProcessGrid(run_train_app(), 3),
                      RunDirectory(tmp_path))
    summary = wf.run()
    evaluated = [r["round"] for r in wf.history if math.isfinite(r["test_accuracy"])]
    assert evaluated == [2, 4, 5] and summary["final_test_accuracy"] == wf.history[-1]["test_accuracy"]
    only_last = SyncWorkflow(cfg(**{"num-rounds": 3, "central-eval-every": 0}), InProcessGrid(run_train_app(), 3),
                             RunDirectory(tmp_path / "b"))
    only_last.run()
    assert [math.isfinite(r["test_accuracy"]) for r in only_last.history] == [False, False, True]
    every_round = SyncWorkflow(cfg(**{"num-rounds": 3}), InProcessGrid(run_train_app(), 3), RunDirectory(tmp_path / "c"))
    every_round.run()
    assert torch.equal(only_last.weights, every_round.weights)  # evaluation changes the rows, not the model


def test_a_run_stopped_by_its_budget_before_an_evaluated_round_is_evaluated_at_its_end(tmp_path):
    import math

    wf = SyncWorkflow(cfg(**{"num-rounds": 50, "central-eval-every": 0, "dp": "central", "dp-noise-multiplier": 1.0,
                              "dp-clip": 0.5, "target-epsilon": 8.0}), InProcessGrid(run_train_app(), 3),
                      RunDirectory(tmp_path))
    summary = wf.run()
    assert summary["status"] == "budget-exhausted" and summary["rounds"] < 50
    assert math.isfinite(summary["final_test_accuracy"]) and math.isfinite(wf.history[-1]["test_accuracy"])


@pytest.mark.parametrize(("timeout", "accepted", "asks"), [
    (25.0, 4, [4]),  # push 0-20 s, first ask 20-30 s: past the deadline of 25 s, counted from before the push
    (45.0, 12, [4, 4, 4]),  # asks end at 30, 40, 50 s: the fourth is not made
    (99.0, 16, [4, 4, 4, 4]),
])
def test_a_remote_grids_deadline_counts_from_the_push_and_is_checked_between_bounded_pulls(
        tmp_path, monkeypatch, timeout, accepted, asks):
    """Before, the deadline counted from after the push and one pull asked for every reply: through a busy
    SuperLink a 60 s round-timeout gave 85-107 s rounds."""
    import coordinator.validation as validation

    monkeypatch.setattr(validation, "PULL_CHUNK", 4)
    clock = FakeClock()
    grid = SlowRemoteGrid(run_train_app(), 16, clock, push_s=20.0, pull_s=10.0)
    wf = SyncWorkflow(cfg(**{"num-rounds": 1, "min-nodes": 16, "round-timeout": timeout, "poll-interval": 1.0}), grid,
                      RunDirectory(tmp_path), clock=clock)
    wf.run()
    row = wf.history[0]
    assert (row["accepted"], row["late"], grid.asks) == (accepted, 16 - accepted, asks)
    assert row["round_time_s"] <= 20.0 + 10.0 * len(asks) + 1e-9


def test_an_in_process_grids_deadline_counts_from_after_the_push_that_trained(tmp_path):
    """The in-process engines train while they push: however long that took, every reply is in the round."""

    clock = FakeClock()
    grid = SlowRemoteGrid(run_train_app(), 6, clock, push_s=500.0, pull_s=0.0)
    grid.computes_replies_at_push = True
    wf = SyncWorkflow(cfg(**{"num-rounds": 1, "min-nodes": 6, "round-timeout": 10.0}), grid, RunDirectory(tmp_path),
                      clock=clock)
    wf.run()
    assert wf.history[0]["accepted"] == 6 and grid.asks == [6]


def test_federated_evaluation_keeps_the_same_deadline_and_bounded_pulls(tmp_path, monkeypatch):
    """Evaluation's pull loop had its own deadline from after its push and one unbounded pull."""
    import coordinator.validation as validation

    monkeypatch.setattr(validation, "PULL_CHUNK", 4)
    clock = FakeClock()
    grid = SlowRemoteGrid(run_train_app(), 16, clock, push_s=20.0, pull_s=10.0)
    wf = SyncWorkflow(cfg(**{"num-rounds": 1, "min-nodes": 16, "round-timeout": 45.0, "poll-interval": 1.0,
                             "federated-eval-every": 1}), grid, RunDirectory(tmp_path), clock=clock)
    wf.run()
    row = wf.history[0]
    # train: push 0-20 s, asks end at 30, 40, 50; evaluation: push 50-70 s (deadline 95), asks end at 80, 90, 100
    assert row["accepted"] == 12 and row["fed_eval_nodes"] == 12 and row["fed_eval_missing"] == 4
    assert grid.asks == [4, 4, 4, 4, 4, 4]


def test_a_reply_forged_from_another_node_leaves_the_message_open_for_its_own_in_training_and_evaluation(tmp_path):
    """Node 1001 also answers node 1002's messages (the SuperLink refuses that; behind it, the coordinator must
    too): refused and counted, and 1002's own reply still used, in the round and in its federated evaluation."""
    c = cfg(**{"num-rounds": 1, "min-nodes": 3, "federated-eval-every": 1, "round-timeout": 20.0})
    grid = ForgingGrid(run_train_app(), 3, victim=1002, forger=1001)
    wf = SyncWorkflow(c, grid, RunDirectory(tmp_path / "a"))
    wf.run()
    row = wf.history[0]
    assert grid.forged == 2 and row["rejected_by_rule"] == {"unknown-sender": 1} and row["accepted"] == 3
    assert row["fed_eval_nodes"] == 3 and row["fed_eval_missing"] == 0 and row["fed_eval_rejected"] == {"wrong-node": 1}
    ref = SyncWorkflow(c, InProcessGrid(run_train_app(), 3), RunDirectory(tmp_path / "b"))
    ref.run()
    torch.testing.assert_close(wf.weights, ref.weights, rtol=0, atol=0)
    assert row["fed_eval_accuracy"] == ref.history[0]["fed_eval_accuracy"]


def test_a_row_counts_as_evaluated_by_any_figure_of_the_tasks():
    """The end of a run evaluates its last row again only when it holds none (a task without accuracy, or
    without a loss, was evaluated twice at every end)."""
    from coordinator.workflow import _evaluated

    nan = float("nan")
    assert _evaluated({"test_accuracy": 0.9, "test_loss": nan}) and _evaluated({"test_accuracy": nan, "test_loss": 1.0})
    assert _evaluated({"test_accuracy": nan, "test_loss": nan, "test_metrics": {"auc": 0.7}})
    assert not _evaluated({"test_accuracy": nan, "test_loss": nan}) and not _evaluated({"test_metrics": {"auc": nan}})
