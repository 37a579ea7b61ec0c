"""Stragglers: simulated time to a target accuracy, synchronous vs over-selection vs FedBuff.

    python benchmarks/async_vs_sync.py [--clients 100] [--target 0.90] [--json FILE]

digits, Dirichlet(0.5), on the virtual-clock engine with the default device tiers (70% edge
CPU on slow links, 25% laptops, 5% GPU servers; simulations/virtual.py). All three runs use the
same workflow code as the service; only the Grid (virtual) and the config differ.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402

from clients.client_app import app  # noqa: E402
from coordinator import RunConfig, RunDirectory  # noqa: E402
from coordinator.server_app import make_workflow  # noqa: E402
from simulations import VirtualClock, VirtualGrid, tiered_profiles  # noqa: E402


def run(clients: int, rounds: int, target: float, **kw) -> dict:
    cfg = RunConfig.from_mapping({"num-rounds": rounds, "round-timeout": 120.0, "seed": 0, **kw})
    clock = VirtualClock()
    grid = VirtualGrid(app, clients, clock, tiered_profiles(clients, seed=0), seed=0)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        wf = make_workflow(cfg, grid, RunDirectory(d), clock=clock)
        wf.run()
        wall = time.perf_counter() - t0
    sim, updates, reached = 0.0, 0, None
    for row in wf.history:
        sim = row.get("sim_time_s") or sim + row["round_time_s"]
        updates += row["accepted"]
        if reached is None and row["test_accuracy"] >= target:
            reached = (sim, updates, row["round"])
    return {"reached": reached, "sim_total": clock.now(), "wall": wall, "final": wf.history[-1]["test_accuracy"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--target", type=float, default=0.90)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--engine-rounds", type=int, default=5,
                   help="rounds of the synchronous case timed on both the virtual engine and Flower's (0: skip)")
    p.add_argument("--json")
    a = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    rep = _report.Report("async_vs_sync")
    if a.clients < 10:
        p.error(f"--clients must be >= 10 (the cases ask a fifth of them, over-selection 1.5x that). Found {a.clients}.")
    per_round = round(0.2 * a.clients)  # 20 of the default 100
    over, k = math.ceil(1.5 * per_round), max(1, per_round // 2)
    sync = f"sync FedAvg, {per_round} asked, wait for all"
    cases = {
        sync: {"min-nodes": per_round, "fraction-train": 0.01},
        f"sync, over-selection {over} asked, close at {per_round}": {
            "min-nodes": over, "fraction-train": 0.01, "close-after-replies": per_round},
        "sync, over-selection + late replies carried (1/sqrt(1+s))": {
            "min-nodes": over, "fraction-train": 0.01, "close-after-replies": per_round, "late-replies": "carry",
            "staleness": "polynomial", "staleness-a": 0.5},
        f"FedBuff K={k}, C={per_round}, 1/sqrt(1+s)": {"min-nodes": 1, "workflow": "fedbuff", "buffer-size": k,
                                                      "concurrency": per_round, "staleness": "polynomial",
                                                      "staleness-a": 0.5},
    }
    results = {name: run(a.clients, a.rounds, a.target, **kw) for name, kw in cases.items()}
    base = results[sync]["reached"]
    for name, res in results.items():
        if res["reached"] is None:
            rep.add(f"{name}: never reached {a.target} in {a.rounds} releases (final {res['final']:.3f})",
                    res["sim_total"], "s", "", None, "", False)
            continue
        sim, updates, rnd = res["reached"]
        target = {"FedBuff": ">= 3x sooner", "sync, over": ">= 1.5x sooner"}
        tgt = next((v for k, v in target.items() if name.startswith(k)), "")
        speed = base[0] / sim if base else None
        met = None if not tgt or speed is None else speed >= float(tgt.split("x")[0].lstrip(">= "))
        rep.add(f"{name}: simulated s to {a.target} (round {rnd}, {updates} updates)", sim, "s",
                "sync FedAvg (wait for all)", base[0] if base else None, tgt, met)
        rep.add(f"{name}: virtual engine speed (simulated / wall)", res["sim_total"] / res["wall"], "x",
                "real time", None, "", None)
    if a.engine_rounds:
        engines(rep, a.clients, a.engine_rounds, cases[sync])
    rep.write_json(a.json)


def engines(rep, clients: int, rounds: int, kw: dict) -> None:
    """Wall time of the same synchronous scenario on the virtual-clock engine and on Flower's (Ray)."""
    from simulations.runner import run_flower_engine
    from simulations.scenario import Scenario, SimulationSettings

    virtual = run(clients, rounds, 2.0, **kw)["wall"]
    with tempfile.TemporaryDirectory() as d:
        cfg = RunConfig.from_mapping({"num-rounds": rounds, "round-timeout": 120.0, "seed": 0, "run-dir": d, **kw})
        t0 = time.perf_counter()
        run_flower_engine(Scenario(sim=SimulationSettings(name="bench", num_supernodes=clients), run=cfg), None)
        flower = time.perf_counter() - t0
    rep.add(f"{clients} clients, {rounds} sync rounds: wall time on the virtual-clock engine", virtual, "s",
            "Flower's simulation engine (Ray)", flower, "", None)


if __name__ == "__main__":
    main()
