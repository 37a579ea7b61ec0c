"""The warm agent through the real service: one ClientApp worker per agent serves every message; a worker
that crashes or hangs is a failed reply and a restarted worker, never a dead agent; an idle worker released
(--release-worker-after) is started again by the next message; a device whose task takes longer to import
than Flower's 30 s claim window still trains.

Two agents train a task file (the built-in digits MLP). The flaky agent's task reads a plan from
FLAKY_PLAN, one word per train message: "crash" (SIGKILL itself), "hang" (sleep past --task-timeout),
anything else trains. The other agent always trains, so every round aggregates something.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from coordinator.rundir import SUMMARY

from .deploy import metrics_rows, setup_deployment, start_coordinator
from .procs import agent_child, cmdline, children

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK_FILE = '''
import os, signal, time
from clients.tasks.digits import DigitsTask

time.sleep(float(os.environ.get("SLOW_IMPORT_S", "0")))  # a slow device: its task takes this long to import


class Flaky(DigitsTask):
    def train(self, model, data, settings, generator):
        plan = os.environ.get("FLAKY_PLAN")
        if plan and os.path.exists(plan):
            words = open(plan).read().split()
            open(plan, "w").write(" ".join(words[1:]))
            if words[:1] == ["crash"]:
                os.kill(os.getpid(), signal.SIGKILL)
            if words[:1] == ["hang"]:
                time.sleep(3600)
        return super().train(model, data, settings, generator)
'''


def _setup(tmp_path, fedshield_bin, **kw) -> int:
    port = setup_deployment(tmp_path, fedshield_bin, keys=2, nodes=2, extra='task = "flaky.py:Flaky"\n', **kw)
    (tmp_path / "flaky.py").write_text(TASK_FILE)
    subprocess.run([fedshield_bin, "data", "export", "--task", "flaky.py:Flaky", "--num-partitions", "2", "--out",
                    "data"], cwd=tmp_path, check=True, capture_output=True, text=True)
    return port


def _agent(procs, tmp_path, fedshield_bin, port, i, env=None, extra=()):
    home = tmp_path / f"agent-home-{i}"
    home.mkdir(exist_ok=True)
    return procs.start(f"agent{i}", [
        fedshield_bin, "agent", "start", "--coordinator", f"127.0.0.1:{port}", "--root-cert", "certs/ca.crt",
        "--key", f"keys/client-{i}", "--task", "flaky.py:Flaky", "--data", f"data/client-{i}.npz",
        "--state-dir", str(home / "state"), *extra], cwd=tmp_path, env={"FLWR_HOME": str(home), **(env or {})})


def _workers(pid: int) -> list[int]:
    return [c for c in children(pid) if "-m clients.worker" in cmdline(c)]


@pytest.mark.timeout(400)
def test_a_worker_that_crashes_or_hangs_is_a_failed_reply_and_a_new_worker(tmp_path, procs, fedshield_bin):
    port = _setup(tmp_path, fedshield_bin, num_rounds=3, round_timeout=60.0)
    plan = tmp_path / "plan.txt"
    plan.write_text("crash hang")
    start_coordinator(procs, tmp_path, fedshield_bin, "coordinator", nodes=2)
    # the steady agent waits seconds for the flaky one each round: its worker is released and started again
    steady = _agent(procs, tmp_path, fedshield_bin, port, 0, extra=("--release-worker-after", "2"))
    flaky = _agent(procs, tmp_path, fedshield_bin, port, 1, env={"FLAKY_PLAN": str(plan)},
                   extra=("--task-timeout", "5"))
    most = 0
    deadline = time.monotonic() + 300
    while procs.procs["coordinator"].poll() is None and time.monotonic() < deadline:
        most = max(most, len(_workers(flaky.pid)), len(_workers(steady.pid)))
        time.sleep(0.1)
    assert procs.wait("coordinator", timeout=30) == 0, procs.log("coordinator")[-3000:]
    log = procs.log("agent1")
    assert "the ClientApp worker died (signal SIGKILL)" in log, log[-3000:]
    assert "for more than 5 s (--task-timeout)" in log, log[-3000:]
    assert log.count("with an error reply") == 2, log[-3000:]  # each lost message answered by the next worker
    assert most == 1  # never two workers in one agent
    released = procs.log("agent0")
    assert released.count("the ClientApp worker stopped to free its memory") >= 1, released[-3000:]
    assert released.count("a message came: starting the ClientApp worker again.") >= 1, released[-3000:]
    assert "died" not in released and "error reply" not in released, released[-3000:]
    assert flaky.poll() is None and agent_child(flaky.pid, "worker") is not None  # the agent is still serving
    rows = metrics_rows(tmp_path / "runs" / "deploy")
    assert [int(r["accepted"]) for r in rows] == [1, 1, 2], rows  # the flaky node's rounds 1-2 failed, round 3 not
    summary = json.loads((tmp_path / "runs" / "deploy" / SUMMARY).read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 3, summary


@pytest.mark.timeout(420)
def test_a_device_slower_than_flowers_claim_window_still_trains(tmp_path, procs, fedshield_bin):
    """Its task takes 35 s to import (Flower gives a claimed task 30 s to check in): the node joins once its
    worker is warm, and a worker restarted mid-run takes its messages when ready (they wait, unclaimed)."""
    port = _setup(tmp_path, fedshield_bin, num_rounds=2, round_timeout=150.0, wait_nodes_timeout=300.0)
    plan = tmp_path / "plan.txt"
    plan.write_text("crash")  # round 1: the slow device's worker dies; round 2 waits for its 35 s restart
    start_coordinator(procs, tmp_path, fedshield_bin, "coordinator", nodes=2)
    _agent(procs, tmp_path, fedshield_bin, port, 0)
    slow = _agent(procs, tmp_path, fedshield_bin, port, 1, env={"SLOW_IMPORT_S": "35", "FLAKY_PLAN": str(plan)})
    assert procs.wait("coordinator", timeout=400) == 0, procs.log("coordinator")[-3000:]
    rows = metrics_rows(tmp_path / "runs" / "deploy")
    assert [int(r["accepted"]) for r in rows] == [1, 2], rows
    log = procs.log("agent1")
    assert "Runtime task-token authentication failed" not in log and slow.poll() is None
