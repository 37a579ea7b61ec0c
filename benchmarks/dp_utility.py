"""DP utility by accountant: the noise each accountant needs for the same (epsilon, delta), and what it buys.

    python benchmarks/dp_utility.py [--rounds 20] [--seeds 3] [--clients 100] [--epsilons 1,3,8]
                                    [--hot-path-rounds 200] [--local-rounds 20] [--json FILE]

digits, 100 clients with Dirichlet(0.3) label skew, central DP (each round a secret Poisson
sample at q = fraction-train = 0.2, clip 0.5, delta 1e-5), the in-process engine. For each
target epsilon the noise multiplier is calibrated over the run's rounds under the PLD
accountant (fedshield's default) and under RDP (orders 1.1 to 1024), and each is trained
with every seed: the table gives both multipliers, the mean final accuracy under each (and
per seed), and the ratios RDP / PLD. Then the accountant's own cost on the hot path: a
run's per-round work (the budget check, "epsilon if one more round ran", and the charge
after it) timed over 200 rounds at q = 0.2 and 500 at q = 0.01, against dp-accounting's own
PLD accountant charged the same events; then per event for a local-DP ledger (one client
round = hundreds of DP-SGD steps, one composition per round). --hot-path-only skips training.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402
Report = _report.Report

from clients.client_app import app  # noqa: E402
from coordinator import RunConfig, RunDirectory, SyncWorkflow  # noqa: E402
from privacy import PrivacyBudget, PrivacyEvent, calibrate_noise_multiplier, create_accountant  # noqa: E402
from simulations.inprocess import InProcessGrid  # noqa: E402

ACCOUNTANTS = ("pld", "rdp")
DELTA, Q, CLIP = 1e-5, 0.2, 0.5


def train(clients: int, rounds: int, seed: int, **kw) -> dict:
    cfg = RunConfig.from_mapping({"num-rounds": rounds, "min-nodes": 2, "fraction-train": Q, "seed": seed,
                                  "partitioning": "dirichlet", "dirichlet-alpha": 0.3, **kw})
    with tempfile.TemporaryDirectory() as d:
        return SyncWorkflow(cfg, InProcessGrid(app, clients), RunDirectory(d)).run()


def utility(rep: Report, eps: float, clients: int, rounds: int, seeds: int) -> None:
    z = {name: calibrate_noise_multiplier(eps, DELTA, Q, rounds, accountant=name) for name in ACCOUNTANTS}
    acc: dict[str, list[float]] = {}
    for name in ACCOUNTANTS:
        runs = [train(clients, rounds, seed, dp="central", accountant=name, **{"dp-noise-multiplier": z[name],
                      "dp-clip": CLIP, "target-epsilon": eps}) for seed in range(seeds)]
        assert all(s["epsilon"] <= eps and s["rounds"] == rounds for s in runs), runs
        acc[name] = [s["final_test_accuracy"] for s in runs]
        print(f"# epsilon {eps:g}, {name}: z = {z[name]:.4f}, accuracy per seed "
              f"{', '.join(f'{a:.3f}' for a in acc[name])}, epsilon spent {runs[0]['epsilon']:.4f} "
              f"(pld {runs[0]['epsilon_by_accountant']['pld']:.4f}, rdp {runs[0]['epsilon_by_accountant']['rdp']:.4f})",
              flush=True)
    rep.add(f"epsilon {eps:g}: noise multiplier, PLD (ratio = RDP / PLD)", z["pld"], "z", "RDP's noise multiplier",
            z["rdp"], "< RDP's", z["pld"] < z["rdp"])
    mean = {name: statistics.mean(a) for name, a in acc.items()}
    rep.add(f"epsilon {eps:g}: final accuracy with PLD's z (mean of {seeds})", mean["pld"], "acc",
            f"with RDP's z (mean of {seeds})", mean["rdp"], ratio=mean["pld"] / mean["rdp"] if mean["rdp"] else None)


# (q, z, rounds as a multiple of --hot-path-rounds): the utility runs' setting, and a cross-device one (small q: a
# finer interval, a longer PLD)
HOT_PATH_CASES = ((Q, 1.0, 1.0), (0.01, 1.0, 2.5))


def dp_accounting_round_times(q: float, z: float, rounds: int, interval: float) -> list[float]:
    """The baseline: dp-accounting's own PLD accountant charged one event a round and asked epsilon after each (a
    budget check would need one more composition on a copy; it is not counted)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        acc.compose(event)
        acc.get_epsilon(DELTA)
        times.append(time.perf_counter() - start)
    return times


def hot_path(rep: Report, rounds: int = 200, local_rounds: int = 20) -> None:
    """Per-round accountant work as a run does it: check_next (epsilon if one more), compose, epsilon."""
    from privacy.pld import discretisation_interval

    for q, z, share in HOT_PATH_CASES:
        n = max(2, round(rounds * share))
        times: dict[str, list[float]] = {}
        for name in ACCOUNTANTS:
            acc, budget, event = create_accountant(name, DELTA), PrivacyBudget(1e9, DELTA), PrivacyEvent(q, z)
            times[name] = []
            for _ in range(n):
                start = time.perf_counter()
                budget.check_next(acc, event)
                acc.compose(event)
                acc.epsilon()
                times[name].append(time.perf_counter() - start)
        # dp-accounting at the interval our ledger ended on (one interval for its whole run: its cheapest case)
        interval = discretisation_interval(((q, z, n),), DELTA)
        base = dp_accounting_round_times(q, z, n, interval)
        first = times["pld"][0] * 1e3  # imports, the one-event PLD: once a run
        pld_mean = statistics.mean(times["pld"][1:]) * 1e3
        rep.add(f"pld: time per central-DP round, q={q:g} z={z:g}, rounds 2-{n}", pld_mean, "ms",
                "dp-accounting's PLD accountant", statistics.mean(base[1:]) * 1e3, "< 1 ms", pld_mean < 1.0)
        rep.add("pld: its slowest round (an interval change)", max(times["pld"][1:]) * 1e3, "ms")
        rep.add(f"pld: first round, q={q:g} (imports, one-event PLD; once a run)", first, "ms")
        rep.add(f"rdp: time per central-DP round, q={q:g} z={z:g}", statistics.mean(times["rdp"][1:]) * 1e3, "ms")
    for name in ACCOUNTANTS:
        acc, event = create_accountant(name, DELTA), PrivacyEvent(Q, 1.0)
        acc.compose(event)
        acc.epsilon()
        start = time.perf_counter()
        for _ in range(1000):  # the same state asked again (a report, the summary): cached
            acc.epsilon()
        cached = (time.perf_counter() - start) / 1000 * 1e3
        rep.add(f"{name}: accountant time per repeated question (cached)", cached, "ms", "", None, "<< 1 ms",
                cached < 1.0)
    for name in ACCOUNTANTS:  # local DP: a client round of 4 epochs x 150 steps at q = 1/150 charges 600 events
        acc, steps = create_accountant(name, DELTA), 600
        start = time.perf_counter()
        for _ in range(local_rounds):
            acc.compose(PrivacyEvent(1 / 150, 1.0, steps))
            acc.epsilon()
        per_event = (time.perf_counter() - start) / (local_rounds * steps) * 1e3
        rep.add(f"{name}: accountant time per local DP-SGD step (600-step rounds)", per_event, "ms", "", None,
                "< 1 ms", per_event < 1.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--epsilons", default="1,3,8")
    p.add_argument("--hot-path-rounds", type=int, default=200, help="central-DP rounds timed on the hot path")
    p.add_argument("--hot-path-only", action="store_true", help="time the accountants only (no training)")
    p.add_argument("--local-rounds", type=int, default=20, help="local-DP client rounds timed on the hot path")
    p.add_argument("--json")
    a = p.parse_args()
    print(f"# digits, {a.clients} clients Dirichlet(0.3), central DP at q = {Q}, clip {CLIP}, delta {DELTA:g}, "
          f"{a.rounds} rounds, seeds 0..{a.seeds - 1}, in-process engine", flush=True)
    rep = Report("dp_utility")
    if a.hot_path_only:
        hot_path(rep, a.hot_path_rounds, a.local_rounds)
        return rep.write_json(a.json)
    base = [train(a.clients, a.rounds, seed)["final_test_accuracy"] for seed in range(a.seeds)]
    rep.add(f"non-private final accuracy (mean of {a.seeds})", statistics.mean(base), "acc")
    for eps in (float(e) for e in a.epsilons.split(",")):
        utility(rep, eps, a.clients, a.rounds, a.seeds)
    hot_path(rep, a.hot_path_rounds, a.local_rounds)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
