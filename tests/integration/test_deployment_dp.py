"""Central DP through the real service: ``fedshield coordinator start`` stops the run when the budget is spent.

A TLS SuperLink with node authentication on 127.0.0.1 (its own ports and FLWR_HOME)
and two real SuperNodes (``fedshield agent start``), as in test_deployment.py, whose
helpers this reuses; one local epoch per round keeps it short. The noise multiplier
is fixed and the target epsilon sits between the epsilon of two and of three rounds,
so the coordinator's budget check stops the run before round 3 and the service
still exits cleanly (status 0, summary status ``budget-exhausted``).
"""

from __future__ import annotations

import json

import pytest

from coordinator.rundir import EPSILON_PLOT, METRICS, PLOT, SUMMARY
from privacy import PrivacyEvent, create_accountant

from .deploy import metrics_rows, setup_deployment, start_agent, start_coordinator

pytestmark = [pytest.mark.integration, pytest.mark.slow]

Z, DELTA, NODES = 2.0, 1e-5, 2


def _epsilon(rounds: int) -> float:
    """Central epsilon after ``rounds`` rounds with every node selected (fraction-train 1: q = 1), under the
    run's default accountant (PLD)."""
    accountant = create_accountant("pld", DELTA)
    accountant.compose(PrivacyEvent(sampling_rate=1.0, noise_multiplier=Z, steps=rounds))
    return accountant.epsilon()


@pytest.mark.timeout(240)
def test_central_dp_run_stops_cleanly_when_the_budget_is_spent(tmp_path, procs, fedshield_bin):
    eps2, eps3 = _epsilon(2), _epsilon(3)
    target = (eps2 + eps3) / 2  # round 3 would overspend it
    port = setup_deployment(tmp_path, fedshield_bin, num_rounds=6, keys=3)  # three keys enrolled, two agents run
    config = tmp_path / "coordinator.toml"
    text = config.read_text().replace("min-nodes = 3", f"min-nodes = {NODES}")
    assert f"min-nodes = {NODES}" in text
    config.write_text(text + (  # [run] is the file's last table
        f'local-epochs = 1\ndp = "central"\ndp-noise-multiplier = {Z}\ntarget-epsilon = {target!r}\n'
        f"dp-delta = {DELTA}\ndp-clip = 1.0\n"))
    start_coordinator(procs, tmp_path, fedshield_bin, "coordinator")
    for i in range(NODES):
        start_agent(procs, tmp_path, fedshield_bin, port, i)
    assert procs.wait("coordinator", timeout=180) == 0, procs.log("coordinator")[-3000:]
    procs.stop_together()  # the agents wait for more work: stop them in parallel (the fixture would one by one)

    run_dir = tmp_path / "runs" / "deploy"
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert summary["status"] == "budget-exhausted", summary
    assert summary["rounds"] == 2
    assert summary["epsilon"] == pytest.approx(eps2, rel=1e-9) and summary["epsilon"] <= target
    assert summary["noise_multiplier"] == Z and summary["delta"] == DELTA
    # the noised sum is divided by the enrolled keys' count (public), not by the two agents that took part
    assert json.loads((run_dir / "config.json").read_text())["dp-expected-clients"] == 3
    guarantee = summary["privacy_guarantee"]
    assert f"({eps2:.3g}, {DELTA:g})-differential privacy at the user level after 2 rounds" in guarantee
    assert f"target epsilon {target:g}" in guarantee
    rows = metrics_rows(run_dir)
    assert [int(r["round"]) for r in rows] == [1, 2]
    assert all(int(r["accepted"]) == NODES for r in rows)
    eps = [float(r["epsilon"]) for r in rows]
    assert eps == pytest.approx([_epsilon(1), eps2], rel=1e-9) and 0 < eps[0] < eps[1] <= target
    assert (run_dir / EPSILON_PLOT).stat().st_size > 0 and (run_dir / PLOT).is_file()
    assert (run_dir / METRICS).is_file()
    log = procs.log("coordinator")
    assert "stopping before round 3" in log and "run completed" in log
    print(f"\ncentral DP deployment: stopped after 2 rounds at epsilon {eps[-1]:.3g} (target {target:.3g}); "
          "seconds per round:", [round(float(r["round_time_s"]), 2) for r in rows])
