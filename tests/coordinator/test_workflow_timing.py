"""Round deadlines, quorums and measured round trips on the virtual clock (exact times, no waiting)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from clients.client_app import app
from coordinator import RunConfig, RunDirectory, SyncWorkflow
from simulations.inprocess import InProcessGrid
from simulations.virtual import DeviceProfile, VirtualClock, VirtualGrid

FAST = DeviceProfile("fast", compute_s_per_example=0.0, uplink_mbps=1000.0, downlink_mbps=1000.0, latency_s=0.5)  # ~1 s
SLOW = dataclasses.replace(FAST, tier="slow", latency_s=2.25)  # ~4.5 s round trip


def _run(tmp_path, profiles, **kw) -> tuple[SyncWorkflow, VirtualGrid]:
    cfg = RunConfig.from_mapping({"num-rounds": 2, "min-nodes": 2, "task": "digits", "seed": 0, "hidden-units": 16,
                                  "local-epochs": 1, **kw})
    clock = VirtualClock()
    grid = VirtualGrid(app, len(profiles), clock, profiles)
    wf = SyncWorkflow(cfg, grid, RunDirectory(tmp_path), clock=clock)
    wf.run()
    return wf, grid


def test_a_reply_after_the_deadline_is_not_counted_and_the_round_ends_at_it(tmp_path):
    """The loop slept a whole poll-interval past the deadline, then pulled: a reply at t=6 s was accepted
    by a round with round-timeout 2 s, and a round missing a reply lasted poll-interval (10 s), not 2 s."""
    very_slow = dataclasses.replace(FAST, tier="very-slow", latency_s=3.0)
    wf, _ = _run(tmp_path / "a", [FAST, FAST, very_slow], **{"num-rounds": 1, "round-timeout": 2.0, "poll-interval": 10.0})
    row = wf.history[0]
    assert (row["accepted"], row["late"]) == (2, 1) and row["round_time_s"] == pytest.approx(2.0, abs=0.01)
    lost = dataclasses.replace(FAST, tier="lost", dropout=0.999999)
    wf, _ = _run(tmp_path / "b", [FAST, FAST, lost], **{"num-rounds": 1, "round-timeout": 2.0, "poll-interval": 10.0})
    assert wf.history[0]["round_time_s"] == pytest.approx(2.0, abs=0.01)


def test_close_after_replies_counts_the_rounds_own_replies_not_carried_ones(tmp_path):
    """Carried stragglers filled the quorum: rounds closed with none of their own replies, all stale."""
    wf, _ = _run(tmp_path, [FAST, FAST, SLOW, SLOW], **{"num-rounds": 8, "close-after-replies": 2,
                                                         "late-replies": "carry"})
    assert all(r["accepted"] - r.get("late_accepted", 0) >= 2 for r in wf.history), wf.history


def test_a_carried_reply_is_timed_from_its_own_rounds_send(tmp_path):
    """It was timed from the round it landed in: a 4.5 s straggler was recorded faster than 1 s nodes,
    and fast-fair then picked it first."""
    wf, grid = _run(tmp_path, [FAST, FAST, FAST, SLOW], **{"num-rounds": 6, "close-after-replies": 3,
                                                            "late-replies": "carry", "selection": "fast-fair",
                                                            "fairness": 4.0})
    assert wf.profiles.ema_time[1004] > 1.5 * max(wf.profiles.ema_time[n] for n in (1001, 1002, 1003))
    assert sorted(range(1001, 1005), key=wf.profiles.speed_key)[-1] == 1004  # the slowest, last


def test_bytes_up_counts_every_reply_that_came_up(tmp_path):
    """Rejected replies' bytes were left out: traffic looked smaller exactly when clients misbehaved."""
    wf, grid = _run(tmp_path, [FAST] * 4, **{"num-rounds": 1, "max-update-norm": 1e-9})  # every update refused
    row = wf.history[0]
    # the same model's bytes each way; only the small records beside it differ
    assert row["accepted"] == 0 and row["rejected"] == 4 and row["bytes_down"] > 0
    assert row["bytes_up"] == pytest.approx(row["bytes_down"], rel=0.1)


class _ForgingGrid(InProcessGrid):
    """Node 1002 answers node 1001's message first; 1001's own reply comes one pull later."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.held = {}

    def push_messages(self, messages):
        ids = list(super().push_messages(messages))
        for mid in ids:
            r = self._replies[mid]
            if r.metadata.src_node_id == 1001 and not r.has_error():
                forged = copy.deepcopy(r)
                forged.metadata.__dict__["_src_node_id"] = 1002
                self.held[mid], self._replies[mid] = r, forged
        return ids

    def pull_messages(self, message_ids):
        message_ids = list(message_ids)
        out = list(super().pull_messages(message_ids))
        for m in [self.held.pop(m) for m in message_ids if m in self.held]:  # available to the next pull
            self._replies[m.metadata.reply_to_message_id] = m
        return out


def test_a_reply_from_another_node_leaves_the_asked_node_s_message_open(tmp_path):
    """The workflow took the message as answered before checking the sender: the asked node's own reply, one pull
    later, was never pulled (a review)."""
    cfg = RunConfig.from_mapping({"num-rounds": 1, "min-nodes": 3, "local-epochs": 1, "round-timeout": 30.0,
                                  "poll-interval": 0.01})
    wf = SyncWorkflow(cfg, _ForgingGrid(app, 3), RunDirectory(tmp_path))
    wf.run()
    row = wf.history[0]
    assert row["accepted"] == 3 and row["late"] == 0 and row["rejected_by_rule"] == {"unknown-sender": 1}, row
