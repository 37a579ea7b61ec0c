"""The virtual-time engine: clock, device profiles, VirtualGrid, and SyncWorkflow running on it."""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode

from clients.client_app import app
from clients.protocol import ARRAYS, CONFIG
from coordinator import RunConfig, RunDirectory, SyncWorkflow
from simulations.inprocess import InProcessGrid
from simulations.virtual import (
    DEFAULT_TIERS,
    DeviceProfile,
    VirtualClock,
    VirtualGrid,
    message_nbytes,
    tiered_profiles,
)
from tests.coordinator.helpers import reply_with

FLAT = DeviceProfile("flat", compute_s_per_example=0.01, uplink_mbps=8.0, downlink_mbps=16.0, latency_s=0.1)


def zeros_client(msg: Message, ctx) -> Message:
    numel = msg.content.array_records[ARRAYS]["weights"].shape[0]
    return reply_with(msg, Array(np.zeros(numel, np.float32)))  # num-examples 10


def instruction(node: int, numel: int = 1000, ttl: float | None = None, epochs: int = 2) -> Message:
    content = RecordDict({ARRAYS: ArrayRecord({"weights": Array(np.zeros(numel, np.float32))}),
                          CONFIG: ConfigRecord({"version": 0, "local-epochs": epochs})})
    return Message(content, dst_node_id=node, message_type="train", group_id="1", ttl=ttl)


# -- clock -----------------------------------------------------------------------
def test_clock_sleep_jumps_to_next_event_and_advance_to_is_monotonic():
    clock = VirtualClock()
    clock.sleep(2.5)
    assert clock.now() == 2.5
    events = [3.0, 10.0]
    clock.add_source(lambda t: min((e for e in events if e > t), default=None))
    clock.sleep(100.0)
    assert clock.now() == 3.0  # woke at the completion, not after 100 s
    clock.sleep(0.5)
    assert clock.now() == 3.5
    clock.advance_to(20.0)
    assert clock.now() == 20.0
    clock.sleep(1.0)  # no event left in the future
    assert clock.now() == 21.0
    with pytest.raises(ValueError):
        clock.advance_to(5.0)
    with pytest.raises(ValueError):
        clock.sleep(-1)


# -- profiles --------------------------------------------------------------------
def test_profile_validation():
    with pytest.raises(ValueError, match="availability"):
        dataclasses.replace(FLAT, availability=0.0)
    with pytest.raises(ValueError, match="dropout"):
        dataclasses.replace(FLAT, dropout=1.0)
    with pytest.raises(ValueError, match="uplink"):
        dataclasses.replace(FLAT, uplink_mbps=0)


def test_tiered_profiles_counts_and_seeded_shuffle():
    profs = tiered_profiles(20, seed=3)
    counts = {t: sum(p.tier == t for p in profs) for t in ("edge-cpu", "laptop", "gpu-server")}
    assert counts == {"edge-cpu": 14, "laptop": 5, "gpu-server": 1}
    assert profs == tiered_profiles(20, DEFAULT_TIERS, seed=3)
    assert profs != tiered_profiles(20, seed=4)
    assert len(tiered_profiles(7)) == 7


# -- grid --------------------------------------------------------------------------
def test_reply_visible_at_completion_time_and_busy_node_queues():
    clock = VirtualClock()
    grid = VirtualGrid(zeros_client, 2, clock, [FLAT, FLAT])
    m1, m2 = instruction(1001), instruction(1001)
    down = message_nbytes(m1)
    assert 4000 <= down <= 4600  # float32 data plus the serialized array header, the records' names and keys
    id1, id2 = grid.push_messages([m1, m2])
    r1, r2 = grid.records[id1], grid.records[id2]
    up = r1.bytes_up
    assert 4000 <= up <= 4600
    expected = 0.1 + 8 * down / 16e6 + 0.01 * 10 * 2 + 0.1 + 8 * up / 8e6
    assert r1.done == pytest.approx(expected)
    assert r2.start == pytest.approx(r1.done) and r2.done == pytest.approx(2 * expected)  # queued behind the first
    assert r2.outstanding_at_push == 1
    assert list(grid.pull_messages([id1, id2])) == []  # nothing arrived yet
    clock.sleep(1000.0)
    assert clock.now() == pytest.approx(r1.done)
    (rep,) = grid.pull_messages([id1, id2])
    assert rep.metadata.reply_to_message_id == id1
    assert list(grid.pull_messages([id1])) == []  # each reply once
    clock.sleep(1000.0)
    assert [r.metadata.reply_to_message_id for r in grid.pull_messages([id1, id2])] == [id2]


def test_expired_message_gives_error_reply_at_ttl():
    slow = dataclasses.replace(FLAT, compute_s_per_example=10.0)
    clock = VirtualClock()
    grid = VirtualGrid(zeros_client, 1, clock, [slow])
    (mid,) = grid.push_messages([instruction(1001, ttl=50.0)])
    clock.sleep(1e6)
    assert clock.now() == 50.0
    (rep,) = grid.pull_messages([mid])
    assert rep.has_error() and rep.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert grid.records[mid].expired


def test_a_message_whose_ttl_runs_out_in_the_queue_is_never_run():
    """Flower's SuperLink deletes an expired message instead of delivering it: the node neither runs
    it (no state change, no work) nor stays busy for it, so its next message starts at once."""
    slow = dataclasses.replace(FLAT, compute_s_per_example=10.0)  # 200 s per message (10 examples, 2 epochs)
    calls: list[int] = []

    def client(msg, ctx):
        calls.append(ctx.node_id)
        return zeros_client(msg, ctx)

    clock = VirtualClock()
    grid = VirtualGrid(client, 1, clock, [slow])
    first, queued = grid.push_messages([instruction(1001, ttl=500.0), instruction(1001, ttl=50.0)])
    assert calls == [1001]  # the second would start at ~200 s, past its 50 s TTL
    rec = grid.records[queued]
    assert rec.expired and rec.start == math.inf and rec.bytes_down == rec.bytes_up == 0
    clock.sleep(60.0)
    (rep,) = grid.pull_messages([queued])
    assert rep.has_error() and rep.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    (later,) = grid.push_messages([instruction(1001, ttl=1000.0)])
    assert grid.records[later].start == pytest.approx(grid.records[first].done)  # not behind the expired one
    assert calls == [1001, 1001]


def test_a_reply_not_pulled_by_its_ttl_is_deleted_as_the_superlink_does():
    """Review helper-55: a reply nobody pulls (a round closed early) stayed in the grid for ever, whole
    update and all. The SuperLink deletes an expired message's reply; pulling it then gives an error."""
    clock = VirtualClock()
    grid = VirtualGrid(zeros_client, 2, clock, [FLAT, FLAT])
    a, b = grid.push_messages([instruction(1001, ttl=50.0), instruction(1001, ttl=50.0)])  # b queued behind a
    (c,) = grid.push_messages([instruction(1002, ttl=500.0)])
    assert grid.records[a].deadline == grid.records[b].deadline == 50.0 and grid.records[c].deadline == 500.0
    assert grid.records[b].done < 50.0 and grid.records[b].outstanding_at_push == 1
    clock.advance_to(50.0)  # at the deadline the replies are still there
    assert grid.next_event_after(clock.now()) is None
    assert set(grid._pending) == {a, b, c}
    clock.advance_to(50.5)
    assert grid.next_event_after(clock.now()) is None
    assert set(grid._pending) == {c} and grid._outstanding(1001) == 0 and grid._outstanding(1002) == 1
    (err,) = grid.pull_messages([a])  # not the reply: the SuperLink's error for a message it deleted
    assert err.has_error() and err.error.code == ErrorCode.MESSAGE_UNAVAILABLE
    assert err.metadata.reply_to_message_id == a and grid.records[a].pulled_at == 50.5
    assert list(grid.pull_messages([a])) == []  # once
    (rep,) = grid.pull_messages([c])  # within its TTL: delivered
    assert not rep.has_error() and rep.metadata.reply_to_message_id == c
    (d,) = grid.push_messages([instruction(1001, ttl=50.0)])
    assert grid.records[d].outstanding_at_push == 0


def test_a_round_closed_early_leaves_no_reply_past_its_ttl(tmp_path):
    """Review helper-55's run: each round closes after the two fast nodes' replies; the slow nodes' late
    replies (late-replies = "drop") are never pulled, and must go once their message's TTL (round-timeout
    + 60 s) has passed."""
    fast = dataclasses.replace(FLAT, compute_s_per_example=0.3)  # 10 examples x 3 epochs: 9 s
    slow = dataclasses.replace(FLAT, tier="slow", compute_s_per_example=2.0)  # 60 s
    cfg = RunConfig.from_mapping({"num-rounds": 12, "min-nodes": 2, "seed": 0, "round-timeout": 20.0,
                                  "close-after-replies": 2})
    clock = VirtualClock()
    grid = VirtualGrid(zeros_client, 4, clock, [fast, fast, slow, slow])
    SyncWorkflow(cfg, grid, RunDirectory(tmp_path / "r"), clock).run()
    now = clock.now()
    assert now > 100.0  # past the TTL (80 s) of the first rounds' messages
    assert any(r.pulled_at is None and math.isfinite(r.done) and r.deadline < now for r in grid.records.values())
    assert all(grid.records[m].deadline >= now for m in grid._pending)
    assert +grid._pending_of == Counter(grid.records[m].node_id for m in grid._pending)  # kept in step


def test_a_grid_restored_from_its_state_goes_on_as_the_original():
    """What a resumed run's grid is given: it started its clock at 0, each node's draws from its first
    message again, and every node free, though one may still be working on a reply the run stopped
    waiting for."""
    slow = dataclasses.replace(FLAT, compute_s_per_example=10.0, sigma=0.5)
    clock = VirtualClock()
    grid = VirtualGrid(zeros_client, 2, clock, [slow, FLAT], seed=3)
    (mid,) = grid.push_messages([instruction(1001, ttl=50.0)])
    clock.sleep(1e6)
    assert clock.now() == 50.0 and list(grid.pull_messages([mid]))[0].has_error()
    assert grid.records[mid].done > 50.0  # the node is still at work on it
    restored_clock = VirtualClock()
    restored = VirtualGrid(zeros_client, 2, restored_clock, [slow, FLAT], seed=3)
    restored.load_state_dict(grid.state_dict())
    assert restored_clock.now() == 50.0
    a, b = (g.records[list(g.push_messages([instruction(1001)]))[0]] for g in (grid, restored))
    assert a.message_id == b.message_id and a.start == b.start == grid.records[mid].done and a.done == b.done


def test_availability_windows_are_seeded():
    flaky = dataclasses.replace(FLAT, availability=0.5)

    def online_trace(seed):
        clock = VirtualClock()
        grid = VirtualGrid(zeros_client, 30, clock, lambda i: flaky, seed=seed, availability_window_s=10.0)
        trace = []
        for _ in range(5):
            trace.append(tuple(grid.get_node_ids()))
            clock.sleep(10.0)
        return trace

    a = online_trace(1)
    assert a == online_trace(1)
    assert a != online_trace(2)
    assert all(5 <= len(t) <= 25 for t in a) and len(set(a)) > 1


# -- SyncWorkflow on the virtual grid ------------------------------------------------
def _cfg(**kw) -> RunConfig:
    return RunConfig.from_mapping({"num-rounds": 4, "min-nodes": 2, "seed": 0, "round-timeout": 120.0, **kw})


def _reliable(p: DeviceProfile) -> DeviceProfile:
    return dataclasses.replace(p, availability=1.0, dropout=0.0)


def run_sync_virtual(tmp_path, name, n=10, grid_seed=0, profiles=None, **kw):
    clock = VirtualClock()
    grid = VirtualGrid(app, n, clock, profiles or [_reliable(p) for p in tiered_profiles(n, seed=grid_seed)], seed=grid_seed)
    ends: list[float] = []
    wf = SyncWorkflow(_cfg(**kw), grid, RunDirectory(tmp_path / name), clock, on_round=lambda row: ends.append(clock.now()))
    start = time.monotonic()
    wf.run()
    return wf, grid, ends, time.monotonic() - start


def test_sync_round_time_is_the_slowest_selected_client(tmp_path):
    wf, grid, ends, wall = run_sync_virtual(tmp_path, "a", **{"fraction-train": 0.6})
    starts = [0.0] + ends[:-1]
    for row, t0, t1 in zip(wf.history, starts, ends, strict=True):
        recs = [r for r in grid.records.values() if t0 <= r.pushed_at < t1]
        assert len(recs) == row["selected"] == 6
        slowest = max(r.done - r.pushed_at for r in recs)
        assert row["round_time_s"] == pytest.approx(slowest, rel=1e-9)
        assert t1 == pytest.approx(t0 + slowest)
    sim = ends[-1]
    print(f"\nsync on virtual grid: {sim:.2f} s simulated in {wall:.2f} s wall")
    assert sim > 5.0  # edge devices with 3 local epochs take seconds


def test_sync_on_virtual_grid_replays_exactly(tmp_path):
    a, _, ends_a, _ = run_sync_virtual(tmp_path, "a", grid_seed=5, **{"fraction-train": 0.5, "seed": 5})
    b, _, ends_b, _ = run_sync_virtual(tmp_path, "b", grid_seed=5, **{"fraction-train": 0.5, "seed": 5})
    assert torch.equal(a.weights, b.weights)
    assert ends_a == ends_b
    assert [r["round_time_s"] for r in a.history] == [r["round_time_s"] for r in b.history]


def test_sync_virtual_matches_inprocess(tmp_path):
    kw = {"fraction-train": 0.5, "num-rounds": 3}
    virt, _, _, _ = run_sync_virtual(tmp_path, "v", **kw)
    ref = SyncWorkflow(_cfg(**kw), InProcessGrid(app, 10), RunDirectory(tmp_path / "ref"))
    ref.run()
    # Same selection, same client seeds: only the order of the float sums differs.
    torch.testing.assert_close(virt.weights, ref.weights, rtol=1e-5, atol=1e-6)
    assert [r["test_accuracy"] for r in virt.history] == pytest.approx([r["test_accuracy"] for r in ref.history], abs=0.01)


def test_sync_with_dropouts_waits_until_deadline(tmp_path):
    lossy = [dataclasses.replace(FLAT, dropout=0.5)] * 6
    wf, _, _, _ = run_sync_virtual(tmp_path, "d", n=6, profiles=lossy, **{"num-rounds": 3, "round-timeout": 40.0})
    lost = [r for r in wf.history if r["replies"] < r["selected"]]
    assert lost, "with 50% dropout some round must miss replies"
    for r in lost:
        assert r["round_time_s"] == pytest.approx(40.0, abs=0.2)
    assert all(math.isfinite(r["round_time_s"]) for r in wf.history)


def test_waiting_on_the_virtual_clock_never_sleeps_on_the_wall(tmp_path, monkeypatch):
    import time as _time

    def no_sleep(_seconds):
        raise AssertionError("the virtual engine must not sleep in real time")

    monkeypatch.setattr(_time, "sleep", no_sleep)
    wf, _grid, ends, _wall = run_sync_virtual(tmp_path, "nosleep", **{"fraction-train": 0.6})
    assert ends[-1] > 5.0 and len(wf.history) > 0


def test_the_clients_residuals_survive_a_grid_state_round_trip():
    """Both kinds a simulated client keeps between rounds: its codec's and SecAgg+'s shared-seed sparsification's."""
    from flwr.app import Array as FlwrArray

    from simulations.inprocess import KEPT_STATE

    grid = InProcessGrid(zeros_client, 3)
    for i, name in enumerate(KEPT_STATE):
        grid.contexts[1001 + i].state.array_records[name] = ArrayRecord({"r": FlwrArray(np.full(5, i + 1.5, np.float32))})
    state = grid.state_dict()
    fresh = InProcessGrid(zeros_client, 3)
    fresh.load_state_dict(state)
    for i, name in enumerate(KEPT_STATE):
        assert np.array_equal(fresh.contexts[1001 + i].state.array_records[name]["r"].numpy(), np.full(5, i + 1.5, np.float32))
    assert not fresh.contexts[1003].state.array_records
    with pytest.raises(TypeError):
        fresh.load_state_dict({"client-state": {KEPT_STATE[0]: {"1001": torch.zeros(2, 2)}}})


def test_the_clients_kept_entries_survive_a_grid_state_round_trip():
    """A node's kept model entries (batch counts, FedBN's statistics) go into the checkpoint and back."""
    from clients.client_app import keep_entries, kept_entries
    from simulations.inprocess import KEPT_STATE

    grid = InProcessGrid(zeros_client, 3)
    keep_entries(grid.contexts[1002], {"bn.num_batches_tracked": torch.tensor(7), "bn.running_mean": torch.ones(4)})
    state = grid.state_dict()
    assert set(state["kept-entries"]) == {"1002"}
    fresh = InProcessGrid(zeros_client, 3)
    fresh.load_state_dict(state)
    back = kept_entries(fresh.contexts[1002])
    assert int(back["bn.num_batches_tracked"]) == 7 and torch.equal(back["bn.running_mean"], torch.ones(4))
    assert kept_entries(fresh.contexts[1001]) == {}
    with pytest.raises(TypeError, match="must be a 1-D tensor"):
        fresh.load_state_dict({"kept-entries": {"1001": {"bn.running_mean": torch.ones(2, 2)}}})
    with pytest.raises(ValueError, match="must be finite"):
        fresh.load_state_dict({"kept-entries": {"1001": {"bn.running_mean": torch.tensor([float("nan")])}}})
    for odd in (torch.empty(2, device="meta"), torch.ones(2).to_sparse(), torch.ones(2, dtype=torch.complex64)):
        with pytest.raises(TypeError, match="must be a 1-D tensor of a real dtype"):  # (not their own errors)
            fresh.load_state_dict({"kept-entries": {"1001": {"x": odd}}})
        with pytest.raises(TypeError, match="must be a 1-D float32 tensor"):
            fresh.load_state_dict({"client-state": {KEPT_STATE[0]: {"1001": odd}}})
