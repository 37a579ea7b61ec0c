"""Device profiles: the registry's validation and state, the fast-fair policy, the end-to-end path."""

from __future__ import annotations

import io
import math
import random
import statistics

import pytest
import torch

from clients.client_app import run_train
from clients.config import TaskSpec
from clients.profile import PROFILE_KEYS, measure_profile
from clients.tasks import get_task
from coordinator import (CoordinatorError, ProfileRegistry, RunConfig, RunDirectory, SyncWorkflow, select_fast_fair,
                         select_uniform)
from coordinator.rundir import CHECKPOINT
from simulations.virtual import DeviceProfile, VirtualClock, VirtualGrid, tiered_profiles

GOOD = {"profile-cpus": 8, "profile-mem-gb": 16.0, "profile-cuda": 0, "profile-step-ms": 2.5, "profile-link-mbps": 50.0}


# -- registry ------------------------------------------------------------------------
def test_registry_keeps_valid_profile_and_ema():
    reg = ProfileRegistry(alpha=0.5)
    reg.update(7, {**GOOD, "num-examples": 10}, elapsed_s=2.0)
    reg.update(7, GOOD, elapsed_s=4.0)
    assert reg.profiles[7] == GOOD
    assert reg.ema_time[7] == pytest.approx(3.0)
    reg.participated(7)
    reg.participated(7)
    assert reg.count(7) == 2 and reg.count(8) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -1, -1.0, 0, 1e300, True, "fast", None,
                                 [1], {"a": 1}])
def test_registry_ignores_bad_values_without_raising(bad):
    reg = ProfileRegistry()
    reg.update(1, GOOD, elapsed_s=1.0)
    reg.update(1, {k: bad for k in GOOD}, elapsed_s=bad)  # type: ignore[arg-type]
    # every value either stays the old good one or is a valid replacement in range
    prof = reg.profiles[1]
    assert set(prof) == set(GOOD)
    for k, v in prof.items():
        assert v == GOOD[k] or (k == "profile-cuda" and v in (0, 1)) or (k == "profile-mem-gb" and v == 0)
    # a bad time is ignored; 0 s counts; a huge one is clamped to the largest plausible round trip
    assert 0 <= reg.ema_time[1] <= 1e7
    if bad not in (0, 1e300):
        assert reg.ema_time[1] == pytest.approx(1.0)
    reg.update(2, {}, elapsed_s=None)
    reg.update(3, {"profile-step-ms": bad})  # type: ignore[dict-item]
    assert 2 not in reg.profiles and 2 not in reg.ema_time
    assert "profile-step-ms" not in reg.profiles.get(3, {})


def test_registry_missing_and_huge_values():
    reg = ProfileRegistry()
    reg.update(1, {"profile-cpus": 10**9, "profile-step-ms": 1e12, "profile-cuda": 7}, elapsed_s=1e30)
    assert 1 not in reg.profiles
    assert reg.ema_time[1] <= 1e7  # clamped to the largest plausible round trip
    reg.update(2, {"profile-cpus": 4})
    assert reg.profiles[2] == {"profile-cpus": 4}
    with pytest.raises(CoordinatorError, match="alpha"):
        ProfileRegistry(alpha=0.0)


def test_registry_state_survives_weights_only_load():
    reg = ProfileRegistry(alpha=0.25)
    for n in range(1001, 1006):
        reg.update(n, {**GOOD, "profile-step-ms": float(n - 1000)}, elapsed_s=0.1 * n)
        for _ in range(n - 1000):
            reg.participated(n)
    reg.update(2**63 - 1, {}, elapsed_s=3.0)  # Flower node ids can be large
    reg.update(2**64 - 5, {"profile-cpus": 2}, elapsed_s=4.0)  # past int64: kept as its 64 bits
    buf = io.BytesIO()
    torch.save({"profiles": reg.state_dict()}, buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)["profiles"]
    back = ProfileRegistry()
    back.load_state_dict(state)
    assert back.alpha == reg.alpha and back.profiles == reg.profiles
    assert back.counts == reg.counts and back.ema_time == pytest.approx(reg.ema_time)
    back.load_state_dict({"nodes": {"x": {}, "5": "junk", "6": {"count": -3, "ema-time-s": float("nan")}}})
    assert back.counts == {} and back.ema_time == {}
    old = {"alpha": 0.25, "nodes": {"7": {"count": 2, "profile": {"profile-cpus": 4}, "ema-time-s": 1.5}}}
    back.load_state_dict(old)  # a checkpoint from before the columns
    assert back.counts == {7: 2} and back.profiles == {7: {"profile-cpus": 4}} and back.ema_time == {7: 1.5}


@pytest.mark.parametrize("damage", [
    lambda c: c.pop("count"),
    lambda c: c.__setitem__("ema-time-s", c["ema-time-s"][:-1]),
    lambda c: c.__setitem__("node", c["node"].float()),
    lambda c: c.__setitem__("profile-cpus", "junk"),
])
def test_damaged_profile_columns_restore_nothing(damage):
    reg = ProfileRegistry()
    for n in (1, 2, 3):
        reg.update(n, dict(GOOD), elapsed_s=1.0)
        reg.participated(n)
    state = reg.state_dict()
    damage(state["columns"])
    back = ProfileRegistry()
    back.load_state_dict(state)
    assert back.counts == {} and back.profiles == {} and back.ema_time == {}


def test_nodes_reporting_the_same_profile_share_one_dict():
    """A simulated million nodes report one profile: a dict each had been ~1 GB."""
    reg = ProfileRegistry()
    for n in range(100):
        reg.update(n, dict(GOOD))
    reg.update(5, {"profile-cpus": 99})
    assert len({id(p) for n, p in reg.profiles.items() if n != 5}) == 1
    assert reg.profiles[5]["profile-cpus"] == 99 and reg.profiles[4]["profile-cpus"] == GOOD["profile-cpus"]


# -- policies ------------------------------------------------------------------------
def test_uniform_is_todays_seeded_sample():
    nodes = list(range(1001, 1051))
    for seed in (0, 7):
        for rnd in range(1, 20):
            expect = sorted(random.Random(f"{seed}:{rnd}").sample(sorted(nodes), 10))
            assert select_uniform(reversed(nodes), 10, seed, rnd) == expect


def test_workflow_select_dispatches_on_config(tmp_path):
    from clients.client_app import app
    from simulations.inprocess import InProcessGrid

    nodes = list(range(1001, 1011))
    base = {"num-rounds": 2, "min-nodes": 2, "task": "digits", "seed": 3, "fraction-train": 0.3}
    wf = SyncWorkflow(RunConfig.from_mapping(base), InProcessGrid(app, 10), RunDirectory(tmp_path / "u"))
    assert wf.select(nodes, 4) == sorted(random.Random("3:4").sample(nodes, 3))
    ff = SyncWorkflow(RunConfig.from_mapping({**base, "selection": "fast-fair"}), InProcessGrid(app, 10),
                      RunDirectory(tmp_path / "f"))
    for n in nodes:
        ff.profiles.observe_time(n, float(n))
    assert len(ff.select(nodes, 4)) == 3  # nobody has participated yet: every node is below its fair share
    for n in nodes:
        ff.profiles.counts[n] = 5  # everyone at their fair share: the fastest win
    assert ff.select(nodes, 4) == [1001, 1002, 1003]


def simulate(policy, speeds: dict[int, float], k: int, rounds: int, seed: int = 0):
    reg = ProfileRegistry()
    picked_times = []
    for rnd in range(1, rounds + 1):
        sel = policy(list(speeds), k, reg, rnd)
        assert len(sel) == k == len(set(sel))
        for n in sel:
            reg.update(n, {"profile-step-ms": speeds[n] * 1e3}, elapsed_s=speeds[n])
            reg.participated(n)
            picked_times.append(speeds[n])
    return reg, statistics.fmean(picked_times)


@pytest.mark.parametrize("fairness", [1.0, 1.5, 2.0, 4.0])
def test_fast_fair_starves_no_one_and_prefers_fast(fairness):
    n, k, rounds = 50, 10, 300
    rng = random.Random(1)
    ids = rng.sample(range(1, 10**6), n)
    speeds = {node: 0.01 * 100 ** (i / (n - 1)) for i, node in enumerate(ids)}  # 100x spread
    reg, ff_mean = simulate(lambda nodes, k, reg, rnd: select_fast_fair(nodes, k, reg, fairness, 0, rnd),
                            speeds, k, rounds)
    _, uni_mean = simulate(lambda nodes, k, reg, rnd: select_uniform(nodes, k, 0, rnd), speeds, k, rounds)
    fair = rounds * k / n
    counts = [reg.count(node) for node in ids]
    assert sum(counts) == rounds * k
    assert min(counts) >= fair / fairness
    assert max(counts) <= math.ceil(fair * fairness)  # and nobody far above fair either
    if fairness > 1:
        assert ff_mean < 0.8 * uni_mean
        fastest = min(speeds, key=speeds.get)
        assert reg.count(fastest) > fair


def test_fast_fair_is_deterministic_and_validates():
    reg = ProfileRegistry()
    nodes = list(range(20))
    for node in nodes:
        reg.observe_time(node, 1.0)  # all tied: the seeded draw decides
    a = select_fast_fair(nodes, 5, reg, 2.0, seed=1, rnd=3)
    assert a == select_fast_fair(list(reversed(nodes)), 5, reg, 2.0, seed=1, rnd=3)
    assert a != select_fast_fair(nodes, 5, reg, 2.0, seed=1, rnd=4) or a != select_fast_fair(nodes, 5, reg, 2.0, 2, 3)
    assert select_fast_fair(nodes, 50, reg, 2.0, 0, 1) == nodes
    assert select_fast_fair([], 5, reg, 2.0, 0, 1) == []
    with pytest.raises(CoordinatorError, match="fairness"):
        select_fast_fair(nodes, 5, reg, 0.5, 0, 1)


def test_config_rejects_bad_selection():
    from clients import ConfigError

    with pytest.raises(ConfigError, match="selection"):
        RunConfig.from_mapping({"selection": "fastest"})
    with pytest.raises(ConfigError, match="fairness"):
        RunConfig.from_mapping({"fairness": 0.9})
    with pytest.raises(ConfigError, match="fairness"):
        RunConfig.from_mapping({"fairness": float("inf")})


# -- client side -----------------------------------------------------------------------
def test_measure_profile_is_cheap_cached_and_numeric():
    task = get_task(TaskSpec(task="digits"))
    p = measure_profile(task, torch.device("cpu"), batch_size=16, node_config={"link-mbps": 25})
    assert set(p) == set(PROFILE_KEYS)
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in p.values())
    assert p["profile-cpus"] >= 1 and p["profile-cuda"] == 0 and p["profile-mem-gb"] > 0
    assert 0 < p["profile-step-ms"] < 50 and p["profile-link-mbps"] == 25.0
    q = measure_profile(task, torch.device("cpu"), batch_size=16, node_config={"link-mbps": float("nan")})
    assert "profile-link-mbps" not in q and q["profile-step-ms"] == p["profile-step-ms"]  # cached
    assert ProfileRegistry.clean_profile(p) == p  # what an honest client sends passes validation


# -- end to end ------------------------------------------------------------------------
def test_fast_fair_end_to_end_on_virtual_grid(tmp_path):
    replies = []

    def client(msg, ctx):
        reply = run_train(msg, ctx)
        replies.append(dict(reply.content.metric_records["metrics"]))
        return reply

    def run(num_rounds):
        cfg = RunConfig.from_mapping({"num-rounds": num_rounds, "min-nodes": 4, "round-timeout": 60.0, "task": "digits",
                                      "fraction-train": 0.25, "selection": "fast-fair", "seed": 0})
        clock = VirtualClock()
        grid = VirtualGrid(client, 20, clock, tiered_profiles(20, seed=0), seed=0)
        wf = SyncWorkflow(cfg, grid, RunDirectory(tmp_path), clock=clock)
        wf.run()
        return wf

    wf = run(4)
    assert len(wf.history) == 4
    assert all(r["selected"] == max(4, math.ceil(0.25 * r["nodes_online"])) for r in wf.history)
    assert sum(r["accepted"] for r in wf.history) > 0
    assert replies and all(m["profile-step-ms"] > 0 and "profile-cpus" in m for m in replies)
    assert sum(wf.profiles.counts.values()) == sum(r["accepted"] for r in wf.history)
    assert all("profile-step-ms" in wf.profiles.profiles[n] for n in wf.profiles.counts)
    state = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    saved = ProfileRegistry()
    saved.load_state_dict(state["profiles"])
    assert (saved.counts, saved.profiles) == (wf.profiles.counts, wf.profiles.profiles)
    assert saved.ema_time == pytest.approx(wf.profiles.ema_time)
    resumed = run(5)  # resumes from round 5 with the registry restored
    assert len(resumed.history) == 5
    assert sum(resumed.profiles.counts.values()) == sum(r["accepted"] for r in resumed.history)


def test_work_deadline_gives_slow_nodes_fewer_epochs_and_shortens_rounds(tmp_path):
    asked: dict[int, list[int]] = {}

    def client(msg, ctx):
        asked.setdefault(ctx.node_id, []).append(int(msg.content.config_records["config"]["local-epochs"]))
        return run_train(msg, ctx)

    def run(deadline, name):
        cfg = RunConfig.from_mapping({"num-rounds": 3, "min-nodes": 20, "round-timeout": 600.0, "task": "digits",
                                      "local-epochs": 4, "seed": 0, "work-deadline": deadline, "poll-interval": 0.5})
        clock = VirtualClock()
        tiers = [(0.5, DeviceProfile("server", 0.001, 100.0, 100.0)), (0.5, DeviceProfile("edge", 0.05, 1.0, 2.0))]
        grid = VirtualGrid(client, 20, clock, tiered_profiles(20, tiers, seed=0), seed=0)
        wf = SyncWorkflow(cfg, grid, RunDirectory(tmp_path / name), clock=clock)
        wf.run()
        return wf

    full = run(0.0, "full")
    assert all(set(e) == {4} for e in asked.values()) and "reduced_work" not in full.history[0]
    asked.clear()
    capped = run(8.0, "capped")
    assert all(e[0] == 4 for e in asked.values())  # unmeasured nodes get the full work
    later = [e for v in asked.values() for e in v[1:]]
    assert min(later) >= 1 and max(later) == 4 and min(later) < 4  # fast nodes keep 4, slow ones get fewer
    assert capped.history[1]["reduced_work"] > 0
    for n, per in capped.profiles.ema_epoch.items():
        assert capped.profiles.local_epochs(n, 4, 8.0) == max(1, min(4, int(8.0 // per)))
    # The edge tier (50x slower per example) is cut to what fits in 8 s; its rounds get that much shorter.
    assert capped.history[1]["round_time_s"] < 0.6 * full.history[1]["round_time_s"]
    assert 0.5 <= capped.history[-1]["test_accuracy"] <= 0.995


def test_epochs_are_measured_from_the_reported_work_bounded_by_the_round_trip():
    reg = ProfileRegistry(alpha=0.5)
    reg.observe_epochs(1, 10.0, 5, work_s=1.0)  # 9 s of the round trip were transfers
    assert reg.ema_epoch[1] == pytest.approx(0.2)
    reg.observe_epochs(2, 10.0, 5, work_s=50.0)  # more work than the round trip took: not believed
    assert reg.ema_epoch[2] == pytest.approx(2.0)
    for bad in (None, float("nan"), float("inf"), -1.0, 0.0, True, "1.0"):
        reg.observe_epochs(3, 4.0, 2, work_s=bad)
        assert reg.ema_epoch.pop(3) == pytest.approx(2.0)


def test_a_missed_round_is_a_lower_bound_on_the_seconds_per_epoch_until_the_next_reply():
    reg = ProfileRegistry(alpha=0.5)
    reg.observe_missed(1, 5.0, 5)  # never measured: at least 1 s per epoch
    assert reg.seconds_per_epoch(1) == pytest.approx(1.0) and reg.local_epochs(1, 5, 2.0) == 2
    reg.observe_missed(1, 5.0, 2)  # missed again with 2 epochs: at least 2.5 s
    assert reg.seconds_per_epoch(1) == pytest.approx(2.5) and reg.local_epochs(1, 5, 2.0) == 1
    reg.observe_epochs(2, 0.5, 5)
    reg.observe_missed(2, 120.0, 5)  # measured fast, then dropped out once (a 120 s timeout)
    assert reg.local_epochs(2, 5, 10.0) == 1
    reg.observe_epochs(2, 0.6, 5)  # its next reply in time gives it its work back at once
    assert reg.seconds_per_epoch(2) == pytest.approx(0.11) and reg.local_epochs(2, 5, 10.0) == 5
    reg.observe_epochs(3, 20.0, 2)
    reg.observe_missed(3, 5.0, 5)  # already slower than the bound: nothing learnt
    assert reg.seconds_per_epoch(3) == pytest.approx(10.0) and 3 not in reg.missed_epoch
    for bad in (float("nan"), -1.0, 0.0, None):
        reg.observe_missed(4, bad, 5)
    reg.observe_missed(4, 5.0, 0)
    assert reg.seconds_per_epoch(4) is None
    restored = ProfileRegistry(alpha=0.5)
    restored.load_state_dict(reg.state_dict())
    assert restored.missed_epoch == reg.missed_epoch and restored.ema_epoch == pytest.approx(reg.ema_epoch)


def _deadline_run(tmp_path, name, profiles, rounds, **extra):
    asked: dict[int, list[int]] = {}

    def client(msg, ctx):
        asked.setdefault(ctx.node_id, []).append(int(msg.content.config_records["config"]["local-epochs"]))
        return run_train(msg, ctx)

    cfg = RunConfig.from_mapping({"num-rounds": rounds, "min-nodes": len(profiles), "task": "digits",
                                  "hidden-units": 16, "seed": 0, "poll-interval": 0.1, **extra})
    clock = VirtualClock()
    wf = SyncWorkflow(cfg, VirtualGrid(client, len(profiles), clock, profiles, seed=0),
                      RunDirectory(tmp_path / name), clock=clock)
    wf.run()
    return wf, asked


def test_work_deadline_cuts_the_work_of_nodes_that_always_miss_the_round(tmp_path):
    """Only replies in time measured the seconds per epoch: a node too slow for the round timeout
    never replied in time, so it ran local-epochs every round and never contributed."""
    fast = DeviceProfile("fast", 0.0001, 1000.0, 1000.0, latency_s=0.01)
    slow = DeviceProfile("slow", 0.005, 1000.0, 1000.0, latency_s=0.01)  # ~1.8 s per epoch: 9 s for 5
    wf, asked = _deadline_run(tmp_path, "wd", [fast, fast, slow, slow], 4, **{
        "local-epochs": 5, "work-deadline": 2.0, "round-timeout": 5.0})
    assert wf.history[0]["late"] == 2 and wf.history[0]["reduced_work"] == 0
    assert asked[1003][0] == asked[1004][0] == 5
    assert all(r["reduced_work"] == 2 for r in wf.history[1:])
    assert all(e < 5 for n in (1003, 1004) for e in asked[n][1:])
    assert all(asked[n] == [5] * 4 for n in (1001, 1002))
    assert max(r["accepted"] for r in wf.history[1:]) > 2  # the slow nodes now finish in time


def test_work_deadline_does_not_count_a_slow_link_as_work(tmp_path):
    """The node reports its local work; a slow link's transfers (4 s here) are not taken for epochs."""
    fast = DeviceProfile("fast", 0.0001, 1000.0, 1000.0, latency_s=0.01)
    slow_link = DeviceProfile("slow-link", 0.0001, 0.02, 0.02, latency_s=0.01)
    wf, asked = _deadline_run(tmp_path, "wdl", [fast, fast, slow_link], 3, **{
        "local-epochs": 5, "work-deadline": 1.0})
    assert all(r["reduced_work"] == 0 and r["accepted"] == 3 for r in wf.history)
    assert asked[1003] == [5, 5, 5]
    assert wf.profiles.ema_time[1003] > 3.0 and wf.profiles.ema_epoch[1003] < 0.1


def test_slow_links_are_asked_for_the_slow_link_codec(tmp_path):
    asked: dict[int, list[str]] = {}

    def client(msg, ctx):
        asked.setdefault(ctx.node_id, []).append(str(msg.content.config_records["codec"]["codec"]))
        return run_train(msg, ctx)

    cfg = RunConfig.from_mapping({"num-rounds": 3, "min-nodes": 20, "round-timeout": 600.0, "task": "digits",
                                  "seed": 0, "slow-link-mbps": 5.0, "slow-link-codec": "topk", "topk-ratio": 0.05,
                                  "poll-interval": 0.5})
    clock = VirtualClock()
    tiers = [(0.5, DeviceProfile("server", 0.001, 100.0, 100.0)), (0.5, DeviceProfile("edge", 0.002, 1.0, 2.0))]
    profiles = tiered_profiles(20, tiers, seed=0)
    wf = SyncWorkflow(cfg, VirtualGrid(client, 20, clock, profiles, seed=0), RunDirectory(tmp_path), clock=clock)
    wf.run()
    for i, p in enumerate(profiles):
        want = "topk" if p.tier == "edge" else "dense"
        assert asked[1001 + i] == ["dense", want, want], (p.tier, asked[1001 + i])  # round 1: no report yet
    rows = wf.history
    assert all(r["rejected"] == 0 and r["accepted"] == 20 for r in rows)
    assert rows[1]["bytes_up"] < 0.7 * rows[0]["bytes_up"]  # half the nodes now send 5% top-k
    assert 0.6 <= rows[-1]["test_accuracy"] <= 0.995
    from clients._errors import ConfigError

    with pytest.raises(ConfigError, match="slow-link-codec"):
        RunConfig.from_mapping({"slow-link-codec": "zip"})
