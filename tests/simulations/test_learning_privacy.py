"""Learning under central DP: digits, 100 clients, 20% sampled per round, 20 rounds (in-process engine).

Measured on this machine (seeds 0/1/2): non-private 0.869/0.900/0.894; epsilon 1 0.256/0.286/0.458 (before
rounds took a secret Poisson sample); epsilon 8 (clip 0.5) with it: see the test.
"""

from __future__ import annotations

import tempfile

import pytest

from clients.client_app import app
from coordinator import RunConfig, RunDirectory, SyncWorkflow
from simulations.inprocess import InProcessGrid

pytestmark = pytest.mark.slow


def run(**kw) -> dict:
    cfg = RunConfig.from_mapping({"num-rounds": 20, "min-nodes": 2, "fraction-train": 0.2, "seed": 0, **kw})
    with tempfile.TemporaryDirectory() as d:
        return SyncWorkflow(cfg, InProcessGrid(app, 100), RunDirectory(d)).run()


@pytest.fixture(scope="module")
def non_private() -> float:
    acc = run()["final_test_accuracy"]
    assert 0.80 <= acc <= 0.97
    return acc


def test_epsilon_8_stays_near_non_private(non_private):
    """Rounds take a secret Poisson sample from the OS (what q = fraction-train's accounting assumes), so
    runs differ: 10 runs gave 0.733-0.842, median 0.822, against 0.869 non-private (seed 0). The band is
    on the median of 5 runs: within 12 points below (P(fail) ~1% at that spread), and not above the
    non-private run (noise silently off would be)."""
    import statistics

    runs = [run(dp="central", **{"target-epsilon": 8.0, "dp-clip": 0.5}) for _ in range(5)]
    assert all(s["epsilon"] <= 8.0 and s["rounds"] == 20 for s in runs)
    assert non_private - 0.12 <= statistics.median(s["final_test_accuracy"] for s in runs) <= non_private + 0.01


def test_strong_privacy_costs_accuracy(non_private):
    """An upper bound: if the noise were silently switched off this run would learn like the non-private one."""
    s = run(dp="central", **{"target-epsilon": 1.0, "dp-clip": 0.5})
    assert s["epsilon"] <= 1.0
    assert 0.10 <= s["final_test_accuracy"] <= min(0.70, non_private - 0.15)


def test_the_secagg_dp_example_learns_as_it_is_within_its_budget(tmp_path):
    """examples/scenarios/secagg-dp.toml (SecAgg+ with distributed DP at epsilon 8, 50 clients) on the
    in-process engine: measured 0.819 at epsilon 7.51 (RDP, which distributed DP is charged by)."""
    from pathlib import Path

    from simulations import load_scenario, run_scenario

    path = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "secagg-dp.toml"
    s = run_scenario(load_scenario(path, {"simulation.engine": "inprocess"}), tmp_path / "r", show_progress=False)
    assert s["status"] == "completed" and s["rounds"] == 10, s
    assert 0.65 <= s["final_test_accuracy"] <= 0.95, s["final_test_accuracy"]
    assert 6.0 <= s["epsilon"] <= 8.0 and s["epsilon"] == s["epsilon_by_accountant"]["rdp"], s["epsilon_by_accountant"]
