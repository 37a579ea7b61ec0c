"""SecAgg+ round cost: fedshield vs Flower's SecAggPlusWorkflow vs a plain round, on one engine in one run.

    python benchmarks/secagg.py [--clients 100] [--dim 100000] [--threshold 0.6] [--dropout 0.1]
                                [--skip-flwr-complete] [--json FILE]

Part 1 runs fedshield's protocol state machines in memory and prints each
stage's compute time per client (mean) and on the server, for the complete
graph and the log-degree graph. Part 2 runs one round end to end on
fedshield's in-process Grid (the same engine for every case, no Ray; each of
fedshield's cases three times, in turns, the median kept), with
``--clients`` nodes and a digits MLP widened to about ``--dim`` parameters:
fedshield plain, fedshield SecAgg+ (complete graph, and the log-degree graph
chosen for ``--dropout``, both pipelined, and the log-degree graph with
``secagg-pipeline = false``), and Flower's legacy SecAggPlusWorkflow (complete
graph, and 11 shares) against a Flower plain round with the same update size.
Each fedshield case runs three rounds and times the second: what every round
of a longer run costs (under SecAgg+ it was set up during the first and sets
the third up); the first round, which also sets itself up, is printed too.
Thresholds are ``--threshold`` of each node's share holders. ``--engine flower`` runs
part 2 on Flower's simulation engine (Ray) instead, where every message costs what it costs
in a Flower simulation; there the second round also has warm actors; Flower's
workflows are timed over one round.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("FEDSHIELD_DEVICE", "cpu")
from simulations import bench as _report  # noqa: E402

Report = _report.Report


# -- part 1: the protocol's compute per stage -------------------------------------------------------
def protocol_stage_times(n: int, dim: int, k: int, t: int, liars: int = 0) -> dict[str, float]:
    """Each stage's compute; ``liars``: that many holders flip a byte of every share they hand back
    for unmasking (the server decodes around them and names them)."""
    from privacy.secagg.protocol import SecAggClient, SecAggParams, SecAggServer

    params = SecAggParams.create(1, range(1, n + 1), degree=k, threshold=t, bits=32, clip=1.0, dim=dim)
    server = SecAggServer(params)
    times = {s: 0.0 for s in ("client setup", "client share-keys", "client masked-input", "client unmask",
                              "server setup", "server share-keys", "server masked-input", "server unmask")}
    clients, keys = {}, {}

    def timed(name, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        times[name] += time.perf_counter() - t0
        return out

    for v in params.nodes:
        clients[v], keys[v] = timed("client setup", SecAggClient.setup, v, params)
        timed("server setup", server.on_keys, v, keys[v])
    reqs = timed("server share-keys", server.share_keys_requests)
    for v, r in reqs.items():
        cts = timed("client share-keys", clients[v].share_keys, r)
        timed("server share-keys", server.on_shares, v, cts)
    reqs = timed("server masked-input", server.masked_input_requests)
    q = torch.randint(0, params.levels, (dim,))
    for v, cts in reqs.items():
        timed("client masked-input", clients[v].receive_shares, cts)
        masked = timed("client masked-input", clients[v].mask, q.clone())
        timed("server masked-input", server.add_masked, v, masked)
    reqs = timed("server unmask", server.unmask_requests)
    for v, (surv, drop) in reqs.items():
        shares = timed("client unmask", clients[v].unmask, surv, drop)
        if v <= liars:
            shares = {name: b[:-1] + bytes([b[-1] ^ 0x55]) for name, b in shares.items()}
        timed("server unmask", server.on_unmask, v, shares)
    result = timed("server unmask", server.finish)
    assert torch.equal(result.total, (q * n) & 0xFFFFFFFF), "unmasked sum must equal the plain sum"
    assert sorted(server.bad_share_holders) == list(range(1, liars + 1)), "the wrong shares' holders must be named"
    return {name: (v / n if name.startswith("client") else v) for name, v in times.items()}


# -- part 2: one round end to end -------------------------------------------------------------------
ENGINE = "inprocess"
_BACKEND = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"logging_level": logging.WARNING}}


def fedshield_round(n: int, hidden: int, extra: dict) -> tuple[dict, dict]:
    """Three rounds; returns the rows of the first and of the second (the timed one).

    The second round is what every round of a longer run costs: under SecAgg+ it was set up during
    the first (``secagg-pipeline``) and sets the third up, and on Flower's engine its actors are warm.
    The first also pays for setting itself up (and on Flower's engine for starting the actors).
    """
    from clients.client_app import app
    from coordinator import RunConfig, RunDirectory, SyncWorkflow
    from simulations.inprocess import InProcessGrid

    with tempfile.TemporaryDirectory() as d:
        cfg = RunConfig.from_mapping({"num-rounds": 3, "min-nodes": n, "task": "digits", "hidden-units": hidden,
                                      "local-epochs": 1, "seed": 0, "poll-interval": 0.01, "secagg-clip": 10.0,
                                      "run-dir": d, **extra})
        if ENGINE == "flower":  # Flower's simulation engine (Ray)
            from simulations.runner import run_flower_engine
            from simulations.scenario import Scenario, SimulationSettings

            rows: list[dict] = []
            run_flower_engine(Scenario(sim=SimulationSettings(name="bench", num_supernodes=n), run=cfg), rows.append)
            return rows[0], rows[1]
        wf = SyncWorkflow(cfg, InProcessGrid(app, n), RunDirectory(d))
        wf.run()
    return wf.history[0], wf.history[1]


class _RandomClient:
    """A Flower NumPyClient whose fit returns a random update of ``dim`` floats (no training)."""

    def __init__(self, dim: int) -> None:
        from flwr.client import NumPyClient

        class C(NumPyClient):
            def fit(self, parameters, config):
                return [np.random.default_rng().standard_normal(dim).astype(np.float32) * 0.01], 10, {}

        self.client = C().to_client()


def flwr_round(n: int, dim: int, shares: int | None, threshold: int | None) -> float:
    """Seconds for one round of Flower's DefaultWorkflow (with SecAggPlusWorkflow when ``shares``)."""
    import logging

    from flwr.app import Context, RecordDict
    from flwr.client import ClientApp
    from flwr.client.mod import secaggplus_mod
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    from simulations.inprocess import InProcessGrid

    logging.getLogger("flwr").setLevel(logging.WARNING)
    client_app = ClientApp(client_fn=lambda ctx: _RandomClient(dim).client, mods=[secaggplus_mod] if shares else [])
    strategy = FedAvg(fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=n, min_available_clients=n,
                      initial_parameters=ndarrays_to_parameters([np.zeros(dim, np.float32)]))
    ctx = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                        config=ServerConfig(num_rounds=1), strategy=strategy)
    fit = SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold) if shares else None
    workflow = DefaultWorkflow(fit_workflow=fit) if fit else DefaultWorkflow()
    if ENGINE == "flower":
        from flwr.serverapp import ServerApp
        from flwr.simulation import run_simulation

        server_app, took = ServerApp(), []

        @server_app.main()
        def _main(grid, context) -> None:
            legacy = LegacyContext(context, config=ServerConfig(num_rounds=1), strategy=strategy)
            t0 = time.perf_counter()
            workflow(grid, legacy)
            took.append(time.perf_counter() - t0)

        from simulations.runner import local_ray_auth

        with local_ray_auth(joining=False):  # as fedshield simulate runs its own Ray
            run_simulation(server_app=server_app, client_app=client_app, num_supernodes=n, backend_config=_BACKEND)
        return took[0]
    grid = InProcessGrid(client_app, n)
    t0 = time.perf_counter()
    workflow(grid, ctx)
    return time.perf_counter() - t0


# -- part 3: compression under secure aggregation ----------------------------------------------------
def learning(rep: Report, clients: int = 20, rounds: int = 20) -> None:
    """digits, Dirichlet(0.5), the default scenario's training: dense SecAgg vs its compressed variants."""
    from clients.client_app import app
    from coordinator import RunConfig, RunDirectory, SyncWorkflow
    from simulations.inprocess import InProcessGrid

    print(f"\n## Part 3: compression under SecAgg+ (digits, {clients} clients, Dirichlet(0.5), {rounds} rounds)")
    base = {"num-rounds": rounds, "min-nodes": clients, "task": "digits", "partitioning": "dirichlet",
            "dirichlet-alpha": 0.5, "local-epochs": 3, "batch-size": 16, "lr": 0.1, "momentum": 0.9, "seed": 0,
            "poll-interval": 0.01}
    variants = {"plain (no SecAgg)": {}, "SecAgg+ dense 32-bit": {"secure-aggregation": "secagg+"},
                "SecAgg+ 16-bit ring": {"secure-aggregation": "secagg+", "secagg-bits": 16},
                "SecAgg+ shared-seed 25% + error feedback": {"secure-aggregation": "secagg+", "secagg-sparse-ratio": 0.25},
                "SecAgg+ shared-seed 10% + error feedback": {"secure-aggregation": "secagg+", "secagg-sparse-ratio": 0.1}}
    ref_bytes = None
    for name, extra in variants.items():
        with tempfile.TemporaryDirectory() as d:
            s = SyncWorkflow(RunConfig.from_mapping({**base, **extra}), InProcessGrid(app, clients), RunDirectory(d)).run()
        up = s["total_bytes_up"]
        ref_bytes = ref_bytes or up
        rep.add(f"{name}: final test accuracy", s["final_test_accuracy"], "acc")
        rep.add(f"{name}: uplink bytes", up / 2**20, "MiB", "plain uplink", ref_bytes / 2**20, ratio=ref_bytes / up)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--dim", type=int, default=100_000)
    ap.add_argument("--threshold", type=float, default=0.6, help="fraction of each node's share holders")
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout rate the log-degree graph is chosen for")
    ap.add_argument("--skip-flwr-complete", action="store_true", help="skip Flower's complete graph (minutes)")
    ap.add_argument("--engine", choices=["inprocess", "flower"], default="inprocess",
                    help="part 2's engine: fedshield's in-process Grid, or Flower's simulation engine (Ray)")
    ap.add_argument("--skip-learning", action="store_true", help="skip part 3 (compression under SecAgg, digits)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    global ENGINE
    ENGINE = args.engine
    if ENGINE == "flower":
        os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    from privacy.secagg import choose_degree

    n, dim = args.clients, args.dim
    hidden = max(1, round((dim - 10) / 75))  # 64-h-10 MLP: 75h + 10 parameters
    numel = 75 * hidden + 10
    k_log, _ = choose_degree(n, args.dropout)
    graphs = {"complete": (n - 1, math.ceil(args.threshold * (n - 1))),
              "log-degree": (k_log, max(k_log // 2 + 1, math.ceil(args.threshold * k_log)))}
    rep = Report(f"SecAgg+ with {n} clients x {numel} parameters")
    print(f"# SecAgg+: {n} clients, {numel} parameters, threshold {args.threshold:.0%}; log-degree graph k={k_log} "
          f"for dropout {args.dropout:.0%}; torch threads {torch.get_num_threads()}")

    print("\n## Part 1: compute per stage (fedshield's protocol in memory; client = mean per client)")
    for name, (k, t) in graphs.items():
        honest = protocol_stage_times(n, numel + 1, k, t)
        for stage, sec in honest.items():
            rep.add(f"{name} (k={k}, t={t}): {stage}", sec * 1e3, "ms")
        wrong = min(2, (k - t + 1) // 2)  # holders handing back only wrong shares: as many as can be told apart
        if wrong:
            sec = protocol_stage_times(n, numel + 1, k, t, liars=wrong)["server unmask"]
            rep.add(f"{name} (k={k}, t={t}): server unmask, {wrong} holders' shares all wrong", sec * 1e3, "ms",
                    "all shares right", honest["server unmask"] * 1e3, ratio=sec / honest["server unmask"])

    print(f"\n## Part 2: one round end to end on {'Flower' if ENGINE == 'flower' else 'fedshield'}'s "
          f"{'simulation engine (Ray)' if ENGINE == 'flower' else 'in-process Grid'}")
    fedshield_round(n, hidden, {})  # warm-up: imports, data partitions, the clients' profile measurement
    # In-process: three runs of each case, in turns (a shared machine's load hits all cases alike),
    # the median kept. Flower's engine: one each (every call starts Ray and its actors).
    secure = {name: {"secure-aggregation": "secagg+", "secagg-degree": k, "secagg-threshold": t}
              for name, (k, t) in graphs.items()}
    cases = {"plain": {}, **secure, "log-degree, not pipelined": {**secure["log-degree"], "secagg-pipeline": False}}
    runs: dict[str, list[tuple[dict, dict]]] = {name: [] for name in cases}
    for _ in range(1 if ENGINE == "flower" else 3):
        for name, extra in cases.items():
            runs[name].append(fedshield_round(n, hidden, extra))
    def median(rs: list[dict]) -> dict:
        return sorted(rs, key=lambda r: r["round_time_s"])[len(rs) // 2]

    firsts = {name: median([r[0] for r in rs]) for name, rs in runs.items()}
    rows = {name: median([r[1] for r in rs]) for name, rs in runs.items()}
    plain = rows["plain"]
    rep.add("fedshield plain round", plain["round_time_s"], "s")
    plain_bytes = plain["bytes_up"] + plain["bytes_down"]
    for name in cases:
        if name == "plain":
            continue
        row = rows[name]
        k, t = row["secagg_degree"], row["secagg_threshold"]
        assert row["secagg_survivors"] == n and row["secagg_pipelined"] == (name in graphs), row
        if name == "complete":
            target, met = "<= 10 s per round", row["round_time_s"] <= 10
        elif name == "log-degree":
            target, met = "<= 1.3x the plain round", row["round_time_s"] <= 1.3 * plain["round_time_s"]
        else:
            target, met = "", None
        rep.add(f"fedshield SecAgg+ {name} (k={k}, t={t}) round", row["round_time_s"], "s", "fedshield plain round",
                plain["round_time_s"], target, met, ratio=row["round_time_s"] / plain["round_time_s"])
        first = firsts[name]
        rep.add(f"  its first round (four stages{', and sets round 2 up' if name in graphs else ''})",
                first["round_time_s"], "s", "plain first round", firsts["plain"]["round_time_s"],
                ratio=first["round_time_s"] / firsts["plain"]["round_time_s"])
        expansion = (row["bytes_up"] + row["bytes_down"]) / plain_bytes
        rep.add(f"fedshield SecAgg+ {name}: bytes sent / plain bytes", expansion, "x", "", None, "<= 2x", expansion <= 2)
        rep.add(f"fedshield SecAgg+ {name}: server compute in the round", row["secagg_server_s"], "s")
        for stage, sec in row["secagg_stage_s"].items():  # sending to last reply, all nodes together
            rep.add(f"fedshield SecAgg+ {name}: stage {stage}", sec, "s", "fedshield plain round",
                    plain["round_time_s"], ratio=sec / plain["round_time_s"])

    flwr_plain = flwr_round(n, numel, None, None)
    rep.add("flwr plain round (random updates, no training)", flwr_plain, "s")
    few = min(11, n)  # Flower's num_shares must not exceed the nodes (a smaller run asks fewer)
    cases = [(f"{few} shares", few, max(2, math.ceil(args.threshold * few)))]
    if not args.skip_flwr_complete:
        cases.insert(0, ("complete graph", n, math.ceil(args.threshold * n)))
    for name, shares, t in cases:
        sec = flwr_round(n, numel, shares, t)
        rep.add(f"flwr SecAggPlusWorkflow {name} (t={t}) round", sec, "s", "flwr plain round", flwr_plain,
                ratio=sec / flwr_plain)
    if not args.skip_learning:
        learning(rep)
    rep.write_json(args.json)


if __name__ == "__main__":
    main()
