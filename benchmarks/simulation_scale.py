"""Population scale: seconds per round, per-client overhead and peak memory of fedshield's in-process engine.

    python benchmarks/simulation_scale.py [--populations 1000,100000,1000000] [--per-round 100,1000,10000]
                                          [--rounds 5] [--skip pfl,flower] [--json FILE]

The digits MLP (9,610 parameters), partitioning "sample" (each client draws 20 examples with replacement,
its own Dirichlet(0.5) class mix: a population larger than the data), 1 local epoch, batch 16, SGD lr 0.1
momentum 0.9, one torch thread. Each (population, clients per round) case runs in a process of its own, so
its peak RSS (read before the floors) is the run's own: the round logic on the batched in-process engine
(``BatchedGrid``: contexts made only for sampled clients, a round's clients trained together), then, in the
same process, two floors on the same clients' data:

- the plain torch loop: each client trained one after another (``Task.train``), what one-by-one engines
  (pfl, Flower) cannot go below;
- batched compute: ``train_batched`` on the same clients, the training this engine does.

Per-client overhead, two ways: over the plain loop, (round time - plain loop) / clients, the issue's
definition ("above pure local training compute, measured by a plain torch loop over the same data"; negative
where batching beats the loop by more than the round logic costs); and over batched compute, (round time -
batched compute) / clients, what the round logic, messages, codecs and validation cost above this engine's
own training. Goals from the issue: overhead <= 0.4 ms per client; 1M clients with 10k per round under 8 GB;
a round faster than pfl's on the same work.

The peers, each case in a process of its own, on the same task, data (``Task.client_data`` of the same
population), clients per round, local epoch, batch, learning rate and momentum (``simulations.bench``):

- pfl-research 0.6, PyTorch backend (``pfl_rounds``: its users' data made when sampled, so a million users
  fit), every case; installed beside the project (see benchmarks/vs_pfl.py), skipped with one line if not;
- Flower 1.42's Ray engine, a stock FedAvg and a torch ClientApp, one actor (``flower_rounds``), for
  populations up to ``--flower-max-population`` and rounds up to ``--flower-max-per-round`` (its engine builds
  every supernode up front, and a client costs it ~17-37 ms: a 10,000-client round would take minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def one_case(population: int, per_round: int, rounds: int) -> dict:
    """Run one case in this process; its figures as a dict."""
    import torch

    torch.set_num_threads(1)
    from clients.client_app import app, start_update
    from coordinator import RunConfig, RunDirectory
    from coordinator.server_app import make_workflow
    from simulations.batched import train_batched
    from simulations.batched_grid import BatchedGrid

    cfg = RunConfig.from_mapping({"num-rounds": rounds, "clients-per-round": per_round, "partitioning": "sample",
                                  "local-epochs": 1, "seed": 0, "min-nodes": 2})
    grid = BatchedGrid(app, population)
    with tempfile.TemporaryDirectory() as d:
        wf = make_workflow(cfg, grid, RunDirectory(d))
        wf.run()
        times = [r["round_time_s"] for r in wf.history]
        held = len(grid.contexts.items())  # (before the floors make contexts of their own)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the run's, before the floors' data
        # the floors, on the last round's clients and messages
        nodes = wf.select(sorted(grid.get_node_ids()), rounds)
        memo: dict = {}
        jobs = [start_update(m, grid.contexts[m.metadata.dst_node_id], memo) for m in _messages(wf, nodes)]
        t0 = time.perf_counter()
        model = jobs[0].task.build()
        for job in jobs:
            jobs[0].task.layout().load(model, job.weights)
            jobs[0].task.train(model, job.data, job.instr.train, torch.Generator().manual_seed(1))
        loop = time.perf_counter() - t0
        t0 = time.perf_counter()
        train_batched(jobs[0].task, jobs[0].weights, [j.data for j in jobs], jobs[0].instr.train,
                      [torch.Generator().manual_seed(1) for _ in jobs])
        batched = time.perf_counter() - t0
    return {"population": population, "per_round": per_round, "round_s": statistics.median(times[1:] or times),
            "first_round_s": times[0], "loop_s": loop, "batched_s": batched,
            "contexts_held": held,
            "peak_rss_mb": peak}


def peer_case(peer: str, population: int, per_round: int, rounds: int) -> dict:
    """One case on a peer (``pfl`` or ``flower``), in this process; its figures as a dict."""
    import torch

    torch.set_num_threads(1)
    from coordinator import RunConfig
    from simulations import bench

    cfg = RunConfig.from_mapping({"num-rounds": rounds, "clients-per-round": per_round, "partitioning": "sample",
                                  "local-epochs": 1, "seed": 0, "min-nodes": 2})
    run = bench.pfl_rounds if peer == "pfl" else bench.flower_rounds
    times, _ = run(cfg.task, population, per_round, rounds, cfg.train)
    return {"round_s": statistics.median(times[1:] or times), "first_round_s": times[0],
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _messages(wf, nodes: list[int]) -> list:
    """The train messages the workflow would send ``nodes`` (not pushed)."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

    from aggregation import tensor_to_array
    from clients.protocol import (
        ARRAYS,
        CODEC,
        CONFIG,
        MESSAGE_TYPE_TRAIN,
        WEIGHTS,
        TrainInstruction,
    )

    instr = TrainInstruction(round=1, version=wf.version, seed=0, task=wf.cfg.task, train=wf.cfg.train).to_record()
    content = RecordDict({ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(wf.weights)}), CONFIG: instr,
                          CODEC: ConfigRecord(wf.codec.config())})
    return [Message(content, dst_node_id=n, message_type=MESSAGE_TYPE_TRAIN, group_id="floor") for n in nodes]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--populations", default="1000,100000,1000000")
    p.add_argument("--per-round", default="100,1000,10000")
    p.add_argument("--rounds", type=int, default=5, help="rounds per case (the median of those after the first)")
    p.add_argument("--skip", default="", help="comma-separated peers not to run: pfl, flower")
    p.add_argument("--flower-max-population", type=int, default=1000)
    p.add_argument("--flower-max-per-round", type=int, default=100)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--one", nargs=3, type=int, metavar=("POP", "K", "ROUNDS"), help=argparse.SUPPRESS)
    p.add_argument("--one-peer", nargs=4, metavar=("PEER", "POP", "K", "ROUNDS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_case(*args.one)))
        return 0
    if args.one_peer:
        print(json.dumps(peer_case(args.one_peer[0], *map(int, args.one_peer[1:]))))
        return 0
    try:
        pops = [int(x) for x in args.populations.split(",")]
        ks = [int(x) for x in args.per_round.split(",")]
    except ValueError:
        p.error("--populations and --per-round take comma-separated integers")
    if args.rounds < 2 or min(pops + ks) < 1:
        p.error("--rounds must be >= 2 and every count >= 1")
    skip = {x.strip() for x in args.skip.split(",") if x.strip()}
    if skip - {"pfl", "flower"}:
        p.error(f"--skip takes pfl and flower. Found {sorted(skip - {'pfl', 'flower'})}.")
    from simulations.bench import Report, missing

    peers = []
    for peer in ("pfl", "flower"):
        why = "skipped by --skip" if peer in skip else missing(peer)
        if why:
            print(f"# {peer}: skipped ({why})", flush=True)
        else:
            peers.append(peer)

    rep = Report("simulation scale")
    cases = [(n, k) for n in pops for k in ks if k <= n]
    env = {**os.environ, "FEDSHIELD_DEVICE": os.environ.get("FEDSHIELD_DEVICE", "cpu")}
    def case(what: list[str], label: str) -> dict | None:
        out = subprocess.run([sys.executable, __file__, *what, str(args.rounds)], env=env, capture_output=True,
                             text=True, check=False)
        if out.returncode != 0:
            print(f"# {label}: failed: {out.stderr.strip().splitlines()[-1:]}", flush=True)
            return None
        return json.loads(out.stdout.strip().splitlines()[-1])

    for i, (n, k) in enumerate(cases, 1):
        print(f"# case {i}/{len(cases)}: population {n:,}, {k:,} per round", flush=True)
        tag = f"{n:,} / {k:,}"
        r = case(["--one", str(n), str(k)], f"fedshield {tag}")
        if r is None:
            continue
        rep.add(f"{tag}: s per round (ratio = one-by-one loop / round)", r["round_s"], "s", "plain torch loop s",
                r["loop_s"])
        plain = (r["round_s"] - r["loop_s"]) / k * 1e3
        rep.add(f"{tag}: per-client overhead over the plain loop", plain, "ms", "", None, "<= 0.4 ms", plain <= 0.4)
        over = (r["round_s"] - r["batched_s"]) / k * 1e3
        rep.add(f"{tag}: per-client overhead over batched compute", over, "ms", "", None, "<= 0.4 ms (stricter)",
                over <= 0.4)
        rep.add(f"{tag}: batched compute per client", r["batched_s"] / k * 1e3, "ms", "loop per client ms",
                r["loop_s"] / k * 1e3)
        rep.add(f"{tag}: peak RSS", r["peak_rss_mb"], "MB", "", None,
                "< 8 GB" if (n, k) == (1_000_000, 10_000) else "",
                r["peak_rss_mb"] < 8192 if (n, k) == (1_000_000, 10_000) else None)
        print(f"#   first round {r['first_round_s']:.2f} s; {r['contexts_held']:,} of {n:,} contexts held after the run "
              "(those that keep state)")
        for peer in peers:
            if peer == "flower" and (n > args.flower_max_population or k > args.flower_max_per_round):
                continue
            q = case(["--one-peer", peer, str(n), str(k)], f"{peer} {tag}")
            if q is None:
                continue
            name = {"pfl": "pfl 0.6", "flower": "Flower Ray"}[peer]
            rep.add(f"{tag}: {name} s per round (ratio = {peer} / ours)", r["round_s"], "s",
                    f"{name} s per round", q["round_s"], *(("faster than pfl", q["round_s"] > r["round_s"])
                                                             if peer == "pfl" else ()))
            if peer == "pfl":  # (Flower's figure would be its driver's alone: its Ray actors are other processes)
                rep.add(f"{tag}: {name} peak RSS", q["peak_rss_mb"], "MB", "fedshield peak RSS MB",
                        r["peak_rss_mb"], ratio=q["peak_rss_mb"] / r["peak_rss_mb"])
    rep.write_json(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
