"""BufferedAsyncWorkflow (FedBuff) on the virtual-time Grid: learning, staleness weights, accounting."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from flwr.app import Array, Message

from clients.client_app import app
from clients.protocol import ARRAYS
from coordinator import CoordinatorError, RunConfig, RunDirectory, SyncWorkflow
from coordinator.async_workflow import BufferedAsyncWorkflow
from coordinator.rundir import time_label
from simulations.inprocess import InProcessGrid
from simulations.virtual import DeviceProfile, VirtualClock, VirtualGrid, tiered_profiles

from .helpers import FakeClock, ForgingGrid, SlowRemoteGrid, reply_with

FAST = DeviceProfile("fast", compute_s_per_example=0.001, uplink_mbps=100.0, downlink_mbps=100.0, latency_s=0.01)
SLOW = dataclasses.replace(FAST, tier="slow", compute_s_per_example=0.01)  # 10 examples x 3 epochs: 0.3 s vs 0.03 s
MEDIUM = dataclasses.replace(FAST, tier="medium", compute_s_per_example=0.05)  # 1.5 s


def cfg(**kw) -> RunConfig:
    return RunConfig.from_mapping({"num-rounds": 10, "min-nodes": 1, "seed": 0, "round-timeout": 60.0, **kw})


def constant_client(values: dict[int, float]):
    """Replies with the delta ``values[node]`` everywhere (0 for other nodes), 10 examples."""

    def client(msg: Message, ctx) -> Message:
        numel = msg.content.array_records[ARRAYS]["weights"].shape[0]
        return reply_with(msg, Array(np.full(numel, values.get(ctx.node_id, 0.0), np.float32)))

    return client


def make(tmp_path, client, profiles, name="run", seed=0, config=None, **kw):
    clock = VirtualClock()
    grid = VirtualGrid(client, len(profiles), clock, profiles, seed=seed)
    snaps: dict[int, torch.Tensor] = {}
    times: dict[int, float] = {}
    wf = BufferedAsyncWorkflow(config or cfg(), grid, RunDirectory(tmp_path / name), clock, **kw)

    def on_round(row):
        snaps[row["round"]] = wf.weights.detach().clone()
        times[row["round"]] = clock.now()

    wf.on_round = on_round
    snaps[0] = wf.weights.detach().clone()
    return wf, grid, clock, snaps, times


def check_accounting(wf, grid):
    """Every dispatched message is accepted, rejected, or still in flight, exactly once."""
    mids = [e.message_id for e in wf.ledger]
    assert len(mids) == len(set(mids)), "a message was resolved twice"
    assert not set(mids) & set(wf.inflight)
    assert wf.accepted_total + wf.rejected_total + len(wf.inflight) == wf.dispatched == len(grid.records)
    assert wf.accepted_total == sum(r["accepted"] for r in wf.history) == wf.buffer_size * len(wf.history)
    assert wf.rejected_total == sum(r["rejected"] for r in wf.history)  # the run stops right at a release
    # Never a second message to a node with one in flight.
    assert all(r.outstanding_at_push == 0 for r in grid.records.values())


def test_parameters_are_validated(tmp_path):
    grid = VirtualGrid(constant_client({}), 2, VirtualClock(), [FAST, FAST])
    for kw, match in [({"concurrency": 0}, "concurrency"), ({"buffer_size": 0}, "buffer_size"),
                      ({"max_staleness": -1}, "max_staleness"), ({"staleness": "nope"}, "staleness"),
                      ({"staleness": "hinge", "staleness_params": {"zzz": 1}}, "staleness"),
                      ({"message_ttl": 0.0}, "message_ttl")]:
        with pytest.raises(CoordinatorError, match=match):
            BufferedAsyncWorkflow(cfg(), grid, RunDirectory(tmp_path / "v"), VirtualClock(), **kw)
    # Central DP is supported (accounted per release): see tests/coordinator/test_privacy_policy.py.


def test_stale_update_weighted_by_polynomial_staleness(tmp_path):
    # Fast nodes 1001, 1002 send zero deltas and release every 2 replies; slow node 1003 sends ones,
    # trained on version 0, arriving after many releases.
    wf, grid, _, snaps, _ = make(tmp_path, constant_client({1003: 1.0}), [FAST, FAST, SLOW],
                                 concurrency=3, buffer_size=2, max_staleness=1000)
    wf.run()
    slow = [e for e in wf.ledger if e.node_id == 1003 and e.outcome == "accepted"]
    assert slow, "the slow node's update must be accepted"
    e = slow[0]
    assert e.base_version == 0 and e.staleness == e.version_at_arrival - e.base_version >= 3
    assert e.weight == pytest.approx(10 * (1 + e.staleness) ** -0.5)  # num_examples x 1/sqrt(1+s)
    # The release holding it moved the model by n s(t) / (sum of the buffer's examples), everywhere: the
    # staleness factor discounts the step (Nguyen et al.: sum s(t) delta / K), not only the weights between them.
    buf = [x for x in wf.ledger if x.released_in == e.released_in]
    assert len(buf) == 2
    expected = e.weight / (10 * len(buf))  # every client trains on 10 examples
    step = snaps[e.released_in] - snaps[e.released_in - 1]
    torch.testing.assert_close(step, torch.full_like(step, expected), rtol=1e-5, atol=1e-6)
    # Fresh updates weigh num_examples exactly.
    assert all(x.weight == 10.0 for x in wf.ledger if x.outcome == "accepted" and x.staleness == 0)
    check_accounting(wf, grid)


def test_a_release_of_equally_stale_updates_is_discounted_by_their_staleness(tmp_path):
    """Nguyen et al. 2022 (Alg. 1): a release moves the model by sum s(t_i) delta_i / K. Dividing by the
    sum of n_i s(t_i) instead (as before) cancelled the factors whenever a release's updates were equally
    stale: release 2 here (stalenesses [1, 1]) moved by the full 0.01 under any staleness-a (review helper-55)."""
    def hundredths(msg: Message, ctx) -> Message:
        n = msg.content.array_records[ARRAYS]["weights"].shape[0]
        return reply_with(msg, Array(np.full(n, 0.01, np.float32)))

    steps = {}
    for a in (0.0, 5.0):
        config = RunConfig.from_mapping({"num-rounds": 2, "min-nodes": 1, "seed": 0, "round-timeout": 60.0,
                                         "workflow": "fedbuff", "staleness-a": a})
        wf = BufferedAsyncWorkflow(config, InProcessGrid(hundredths, 4), RunDirectory(tmp_path / f"a{a}"),
                                   concurrency=4, buffer_size=2, staleness="polynomial", staleness_params={"a": a})
        before = [wf.weights.clone()]
        steps[a] = []

        def on_round(row, wf=wf, before=before, out=steps[a]):
            out.append((wf.weights - before[0]).double())
            before[0] = wf.weights.clone()

        wf.on_round = on_round
        wf.run()
        released = [[e.staleness for e in wf.ledger if e.released_in == r and e.outcome == "accepted"] for r in (1, 2)]
        assert released == [[0, 0], [1, 1]], released
    for a, want in ((0.0, 0.01), (5.0, 0.01 * 2.0 ** -5)):
        assert steps[a][0].sub(0.01).abs().max() < 1e-6  # fresh updates: the full mean
        assert steps[a][1].sub(want).abs().max() < 1e-6, (a, float(steps[a][1].mean()))


def test_too_stale_updates_refused_and_counted(tmp_path):
    wf, grid, _, snaps, _ = make(tmp_path, constant_client({1003: 1.0}), [FAST, FAST, SLOW],
                                 concurrency=3, buffer_size=2, max_staleness=1)
    s = wf.run()
    stale = [e for e in wf.ledger if e.outcome == "too-stale"]
    assert stale and all(e.node_id == 1003 for e in stale)
    assert s["rejected_by_rule"]["too-stale"] == len(stale)
    assert all(e.version_at_arrival - e.base_version > 1 for e in stale)
    assert torch.equal(snaps[len(wf.history)], snaps[0])  # only zero deltas were ever applied
    # The slow node became idle after its refused reply and was asked again.
    assert sum(r.node_id == 1003 for r in grid.records.values()) >= 2
    check_accounting(wf, grid)


def test_expired_messages_free_the_node_without_livelock(tmp_path):
    never = dataclasses.replace(FAST, tier="hopeless", compute_s_per_example=100.0)  # 3000 s > ttl
    wf, grid, clock, _, _ = make(tmp_path, constant_client({}), [MEDIUM, MEDIUM, never],
                                 config=cfg(**{"num-rounds": 30}), concurrency=3, buffer_size=2, message_ttl=5.0)
    s = wf.run()
    errors = [e for e in wf.ledger if e.outcome == "error-reply"]
    assert errors and all(e.node_id == 1003 for e in errors)
    to_hopeless = [r for r in grid.records.values() if r.node_id == 1003]
    # Re-asked only after each expiry (ttl 5 s), never while a message was in flight.
    assert len(to_hopeless) <= clock.now() / 5.0 + 1
    assert s["rounds"] == 30
    check_accounting(wf, grid)


def test_a_run_where_every_message_expires_stops_with_a_reason_instead_of_running_for_ever(tmp_path):
    """Every node needs longer than a message lives: each reply is an expiry (an error reply), the
    node is asked again, and so on. Expiries used to count as progress (the stall check looked for
    any message sent or received), so the run never ended; no update accepted for stall_timeout
    is what ends it now, with the rules the replies broke."""
    never = dataclasses.replace(FAST, tier="hopeless", compute_s_per_example=100.0)  # 3000 s > ttl
    wf, grid, clock, _, _ = make(tmp_path, constant_client({}), [never, never], config=cfg(**{"num-rounds": 3}),
                                 concurrency=2, buffer_size=1, message_ttl=5.0, stall_timeout=60.0)
    with pytest.raises(CoordinatorError, match=r"no update was accepted for 60 s \(rejected since the last "
                                                r"release: error-reply \d+; \d+ in flight, 2 nodes online\)"):
        wf.run()
    assert 60.0 <= clock.now() <= 70.0 and wf.history == []


def test_replays_exactly(tmp_path):
    def once(name):
        wf, grid, clock, _, _ = make(tmp_path, app, tiered_profiles(8, seed=1), name=name, seed=1,
                                     config=cfg(**{"num-rounds": 6}), concurrency=4, buffer_size=2)
        wf.run()
        return wf.weights, clock.now(), [(e.node_id, e.outcome, e.staleness) for e in wf.ledger]

    a, b = once("a"), once("b")
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]


def test_sim_time_only_on_a_simulated_clock_and_a_resumed_run_goes_on_from_its_times(tmp_path):
    """FedBuff wrote sim_time_s on any clock (the in-process engine's accuracy_vs_time.png then said
    "simulated on the virtual engine"), and a resumed run started its sim_time_s and wall_time_s again
    (4.3, 9.9, 4.3, 9.9)."""
    on_wall = BufferedAsyncWorkflow(cfg(**{"num-rounds": 2}), InProcessGrid(constant_client({}), 3),
                                    RunDirectory(tmp_path / "wall"), concurrency=3, buffer_size=2)
    s = on_wall.run()
    assert len(on_wall.history) == 2 and all("sim_time_s" not in r for r in on_wall.history) and "sim_time_s" not in s
    assert time_label([on_wall.history]) == "rounds' wall time summed"

    def run(rounds):
        wf, *_ = make(tmp_path, constant_client({}), [FAST, SLOW, MEDIUM], name="virtual",
                      config=cfg(**{"num-rounds": rounds}), concurrency=3, buffer_size=2)
        return wf, wf.run()

    first, _ = run(2)
    run_dir = RunDirectory(tmp_path / "virtual")
    ckpt = run_dir.load_checkpoint()
    assert ckpt["extra"] == {"dispatch-seq": first._seq, "dispatched": first.dispatched, "accepted": 4,
                             "rejected": first.rejected_total} and first._seq > 0
    for row in ckpt["history"]:  # as if the first session had taken 1000 s longer
        row["wall_time_s"] += 1000.0
    run_dir.save_checkpoint(ckpt)
    resumed, *_ = make(tmp_path, constant_client({}), [FAST, SLOW, MEDIUM], name="virtual",
                       config=cfg(**{"num-rounds": 4}), concurrency=3, buffer_size=2)  # the same engine: a resume
    assert resumed._seq == first._seq  # its dispatches go on: no sample or training seed drawn again
    wf, s = run(4)
    rows = wf.history
    sim, wall = [r["sim_time_s"] for r in rows], [r["wall_time_s"] for r in rows]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    assert sim == sorted(sim) and sim[2] == sim[1] + rows[2]["round_time_s"] and s["sim_time_s"] == sim[-1]
    assert wall == sorted(wall) and wall[2] > 1000.0 and s["wall_time_s"] >= wall[-1]
    # the summary's counts cover both sessions (they counted the last one only)
    assert s["accepted_total"] == sum(r["accepted"] for r in rows) == 8 and s["dispatched"] > first.dispatched


def _first_time_at(rows_times, threshold):
    return next((t for acc, t in rows_times if acc >= threshold), float("inf"))


def test_digits_fedbuff_band_and_faster_than_sync_to_85(tmp_path):
    n = 20
    profiles = tiered_profiles(n, seed=0)  # 70% edge CPUs (5% dropout, 80% availability), 25% laptops, 5% GPUs
    wall = time.monotonic()
    wf, grid, clock, _, times = make(tmp_path, app, profiles, name="async",
                                     config=cfg(**{"num-rounds": 30, "round-timeout": 30.0}),
                                     concurrency=10, buffer_size=5, max_staleness=20)
    s = wf.run()
    async_wall = time.monotonic() - wall
    assert 0.88 <= s["final_test_accuracy"] <= 0.995
    check_accounting(wf, grid)
    t_async = _first_time_at([(r["test_accuracy"], r["sim_time_s"]) for r in wf.history], 0.85)

    sclock = VirtualClock()
    sgrid = VirtualGrid(app, n, sclock, profiles, seed=0)
    sync_rows: list[tuple[float, float]] = []
    sync = SyncWorkflow(cfg(**{"num-rounds": 8, "round-timeout": 30.0, "min-nodes": 5}), sgrid,
                        RunDirectory(tmp_path / "sync"), sclock,
                        on_round=lambda row: sync_rows.append((row["test_accuracy"], sclock.now())))
    sync.run()
    t_sync = _first_time_at(sync_rows, 0.85)
    print(f"\nsimulated time to 0.85 accuracy: async {t_async:.2f} s, sync {t_sync:.2f} s; "
          f"async 30 releases {s['sim_time_s']:.2f} s sim, {async_wall:.2f} s wall; sync 8 rounds {sclock.now():.2f} s sim")
    assert t_async < t_sync < float("inf")


def test_a_vanishing_staleness_factor_is_refused_as_too_stale_and_the_model_stays_finite(tmp_path):
    """staleness-a = 100 makes a late update's factor ~1e-47 (0 in float32): refused, never a 0/0 release."""
    wf, grid, _, snaps, _ = make(tmp_path, constant_client({1003: 1.0}), [FAST, FAST, SLOW], concurrency=3,
                                 buffer_size=2, max_staleness=1000, staleness="polynomial", staleness_params={"a": 100.0})
    s = wf.run()
    stale = [e for e in wf.ledger if e.outcome == "too-stale"]
    assert stale and all(e.node_id == 1003 for e in stale)
    assert s["rejected_by_rule"]["too-stale"] == len(stale)
    assert all(torch.isfinite(w).all() for w in snaps.values()) and torch.equal(snaps[len(wf.history)], snaps[0])
    check_accounting(wf, grid)


class GhostGrid(VirtualGrid):
    """Lists a node that has left: the grid takes no message for it (as Flower's grids do), so it
    returns fewer message ids than it was given."""

    def get_node_ids(self):
        return [999, *super().get_node_ids()]

    def push_messages(self, messages):
        messages = list(messages)
        return super().push_messages([m for m in messages if m.metadata.dst_node_id != 999])


def test_a_message_the_grid_leaves_out_does_not_shift_the_others_ids(tmp_path):
    clock = VirtualClock()
    grid = GhostGrid(constant_client({}), 3, clock, [FAST, FAST, FAST], seed=0)
    wf = BufferedAsyncWorkflow(cfg(**{"num-rounds": 3}), grid, RunDirectory(tmp_path / "run"), clock, concurrency=3,
                               buffer_size=2, stall_timeout=30.0)
    wf.run()
    assert {e.outcome for e in wf.ledger} == {"accepted"} and len(wf.history) == 3
    assert all(r.outstanding_at_push == 0 for r in grid.records.values())


@pytest.mark.parametrize("key,value", [("fraction-train", 0.1), ("close-after-replies", 3), ("late-replies", "carry"),
                                       ("work-deadline", 5.0), ("selection", "fast-fair")])
def test_settings_of_synchronous_rounds_are_refused_under_fedbuff_instead_of_ignored(key, value):
    from clients.config import ConfigError

    with pytest.raises(ConfigError, match=f"{key} must be .* under workflow = 'fedbuff'"):
        cfg(**{"workflow": "fedbuff", key: value})
    cfg(**{key: value, **({"min-nodes": 3} if key == "close-after-replies" else {})})  # fine for synchronous rounds


def test_bytes_up_counts_refused_replies_too(tmp_path):
    """Only accepted updates' bytes were counted: traffic looked smaller exactly when clients misbehaved."""
    from .helpers import mixed, stock_flower_bad

    client = mixed({1001}, stock_flower_bad("large-norm"))
    wf, grid, *_ = make(tmp_path, client, [FAST] * 4, config=cfg(**{"num-rounds": 3}), buffer_size=2, concurrency=4)
    wf.run()
    assert wf.rejected_total > 0
    came_up = sum(r.bytes_up for mid, r in grid.records.items() if mid not in wf.inflight)
    assert sum(row["bytes_up"] for row in wf.history) == came_up


def _contributors(wf) -> list[list[int]]:
    by_release: dict[int, list[int]] = {}
    for e in wf.ledger:
        if e.outcome == "accepted":
            by_release.setdefault(e.released_in, []).append(e.node_id)
    return [sorted(v) for _, v in sorted(by_release.items())]


@pytest.mark.parametrize("rule, params", [("median", {}), ("trimmed-mean", {"trim-beta": 0.34, "min-nodes": 3}),
                                          ("norm-bounded-mean", {"clip-norm": 1.0})])
def test_under_a_robust_rule_a_release_takes_one_update_per_node(tmp_path, rule, params):
    """A review: without DP a fast node was sent new work as soon as its reply was in, and filled releases with its
    own updates ([1001, 1001, 1001]): a fast Byzantine node was then the median. The robust rules count updates
    as distinct clients, as central DP does; the mean (FedBuff's own) may still take several from one node."""
    profiles = [FAST, SLOW, SLOW, SLOW, SLOW]
    wf, grid, *_ = make(tmp_path, constant_client({1001: 5.0}), profiles, name=rule,
                        config=cfg(**{"num-rounds": 6, "aggregator": rule, **params}), concurrency=5, buffer_size=3)
    wf.run()
    assert len(wf.history) == 6 and all(len(set(c)) == len(c) == 3 for c in _contributors(wf)), _contributors(wf)
    mean, grid, *_ = make(tmp_path, constant_client({1001: 5.0}), profiles, name="mean",
                          config=cfg(**{"num-rounds": 6}), concurrency=5, buffer_size=3)
    mean.run()
    assert any(len(set(c)) < len(c) for c in _contributors(mean))  # the setting a fast node used to exploit


def test_a_remote_grid_is_pulled_in_bounded_asks_and_a_release_dispatches_before_the_rest_is_asked(tmp_path, monkeypatch):
    """FedBuff had asked for every in-flight reply in one pull: through a busy SuperLink one such pull takes tens of
    seconds, and the nodes whose replies filled a release waited for all of it before getting the new model."""
    import coordinator.validation as validation

    monkeypatch.setattr(validation, "PULL_CHUNK", 4)
    clock = FakeClock()
    grid = SlowRemoteGrid(constant_client({}), 16, clock, push_s=1.0, pull_s=1.0)
    wf = BufferedAsyncWorkflow(cfg(**{"num-rounds": 3, "poll-interval": 0.5}), grid, RunDirectory(tmp_path / "run"),
                               clock, concurrency=16, buffer_size=4, stall_timeout=60.0)
    wf.run()
    assert len(wf.history) == 3 and max(grid.asks) == 4
    # 16 out, one ask of 4 fills the first release; its 4 nodes get the next version before the next ask
    assert grid.events[:4] == [("push", 16), ("pull", 4), ("push", 4), ("pull", 4)], grid.events
    assert wf.history[1]["mean_staleness"] == pytest.approx(1.0)  # the second release: replies to version 0
    assert wf.accepted_total == 12 and wf.accepted_total + wf.rejected_total + len(wf.inflight) == wf.dispatched


def test_a_reply_forged_from_another_node_is_counted_and_leaves_the_message_open_for_its_own(tmp_path):
    """Node 1001 also answers node 1002's messages: FedBuff took the forged copy as the answer, refused it, and
    ignored 1002's own reply uncounted. Now the copy is refused (unknown-sender) and 1002's update is used."""
    grid = ForgingGrid(app, 3, victim=1002, forger=1001)
    wf = BufferedAsyncWorkflow(cfg(**{"workflow": "fedbuff", "buffer-size": 3, "concurrency": 3, "num-rounds": 2,
                                      "min-nodes": 3, "task": "digits"}), grid, RunDirectory(tmp_path))
    wf.run()
    assert grid.forged >= 2 and wf.round == 2
    strays = sum(r.get("stray_replies", {}).get("unknown-sender", 0) for r in wf.history)
    assert 1 <= strays <= grid.forged  # (pulled after the last release: left unread, as every reply then)
    assert all(r["rejected"] == 0 for r in wf.history)  # not a message's outcome: the ledger holds none of them
    assert sum(1 for e in wf.ledger if e.node_id == 1002 and e.outcome == "accepted") >= 2
    mids = [e.message_id for e in wf.ledger]
    assert len(mids) == len(set(mids)) and wf.accepted_total + wf.rejected_total + len(wf.inflight) == wf.dispatched
