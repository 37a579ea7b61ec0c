"""A user's own task through the real service: ``fedshield coordinator start`` (TLS, enrolled keys) and
three ``fedshield agent start --task ... --data ...`` nodes training a CNN with BatchNorm from a task file,
under SecAgg+ and local DP (Opacus's GroupNorm fix on both sides), data exported with the task's own split."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from coordinator.rundir import SUMMARY

from .deploy import metrics_rows, setup_deployment, start_coordinator

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TASK = f"{Path(__file__).resolve().parents[2] / 'examples' / 'tasks' / 'cnn_digits.py'}:CnnDigits"
NODES = 3


@pytest.mark.timeout(420)
def test_agents_train_their_own_cnn_under_secagg_and_local_dp(tmp_path, procs, fedshield_bin):
    port = setup_deployment(tmp_path, fedshield_bin, num_rounds=2, keys=NODES, nodes=NODES, extra="\n".join([
        f'task = "{TASK}"', "local-epochs = 1", 'secure-aggregation = "secagg+"', "secagg-clip = 10.0",
        'dp = "local"', "local-noise-multiplier = 0.8", ""]))
    subprocess.run([fedshield_bin, "data", "export", "--task", TASK, "--num-partitions", str(NODES), "--out", "cnn"],
                   cwd=tmp_path, check=True, capture_output=True, text=True)
    start_coordinator(procs, tmp_path, fedshield_bin, "coordinator")
    for i in range(NODES):
        home = tmp_path / f"agent-home-{i}"
        home.mkdir()
        procs.start(f"agent{i}", [fedshield_bin, "agent", "start", "--coordinator", f"127.0.0.1:{port}",
                                  "--root-cert", "certs/ca.crt", "--key", f"keys/client-{i}", "--task", TASK,
                                  "--data", f"cnn/client-{i}.npz", "--state-dir", str(home / "state")],
                    cwd=tmp_path, env={"FLWR_HOME": str(home)})
    assert procs.wait("coordinator", timeout=360) == 0, procs.log("coordinator")[-3000:]
    procs.stop_together()
    run_dir = tmp_path / "runs" / "deploy"
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 2, summary
    assert "DP-SGD" in summary["privacy_guarantee"] and not summary["rejected_by_rule"], summary
    rows = metrics_rows(run_dir)
    assert all(int(r["secagg_survivors"]) == NODES and not r["secagg_failure"] for r in rows), rows
    assert int(rows[-1]["version"]) == 2  # both rounds aggregated the agents' masked updates
    # under SecAgg+ a client's epsilon stays on the device (it depends on its data): its ledger file grew there
    assert all(any((tmp_path / f"agent-home-{i}" / "state").rglob("*.json")) for i in range(NODES))
    assert 0.1 <= summary["final_test_accuracy"] <= 1.0
    assert "GroupNorm" in procs.log("coordinator") or "GroupNorm" in procs.log("agent0")
