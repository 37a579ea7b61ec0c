"""Aggregation core vs Flower, from Flower records as they arrive.

    python benchmarks/aggregation.py [--clients 100] [--numel 1000000] [--json FILE] [--quick]

Cases (targets from the issue): dense fp32 mean vs flwr's aggregate_arrayrecords /
legacy aggregate and the machine's read floor; top-1% sparse vs the read floor of
its nonzeros' bytes; 8/4-bit QSGD vs our dense fp32; median and trimmed mean vs
flwr's; peak memory of the dense mean path (in a subprocess). On CUDA the same
cases run on the GPU with effective GB/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402
Report, best_of = _report.Report, _report.best_of

from aggregation import create_aggregator, get_device  # noqa: E402
from aggregation.codecs import create_codec  # noqa: E402
from coordinator.config import ServerSettings  # noqa: E402

MAX_NORM = ServerSettings.max_update_norm  # the coordinator's default max-update-norm


def make_records(codec, n_clients: int, numel: int, seed: int = 0) -> list[RecordDict]:
    """Client replies as Flower RecordDicts (encoded on the client side, not timed)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_clients):
        delta = torch.randn(numel, generator=gen)
        enc, _ = codec.encode(delta, None, gen)
        out.append(RecordDict({"arrays": ArrayRecord(enc.arrays),
                               "metrics": MetricRecord({"num-examples": 10 + i}),
                               "codec": ConfigRecord(enc.header)}))
    return out


def ours_mean(codec, records, numel: int, device, fused: bool = True) -> torch.Tensor:
    """The coordinator's path: parse each record, then its norm check against the default
    max-update-norm and its add into the "mean" rule. ``fused``: one ``add_checked`` (what
    validation.add_reply calls); else the two-pass form (``codec.norm``, then ``add(norm=)``)."""
    acc = create_aggregator("mean", numel, device, len(records))
    for rec in records:
        parsed = codec.parse(dict(rec["arrays"].items()), dict(rec["codec"]), numel, 1 << 40)
        weight = float(rec["metrics"]["num-examples"])
        if fused:
            acc.add_checked(codec, parsed, weight, MAX_NORM)
        else:
            norm = codec.norm(parsed)
            assert math.isfinite(norm) and norm <= MAX_NORM
            acc.add(codec, parsed, weight, norm=norm)
    out = acc.result()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def read_floor(records) -> float:
    """The machine's read floor for these records: a torch sum over as many bytes, in as
    many separate float32 buffers (one per client), as the records carry."""
    sizes = [sum(len(a.data) for a in r["arrays"].values()) // 4 for r in records]
    bufs = [torch.randn(s) for s in sizes]
    return best_of(lambda: [b.sum() for b in bufs])


def dense_cases(rep: Report, n: int, numel: int, device) -> float:
    from flwr.server.strategy.aggregate import aggregate
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    codec = create_codec("dense")
    records = make_records(codec, n, numel)
    ours = best_of(lambda: ours_mean(codec, records, numel, device), repeat=5)
    flwr_records = [RecordDict({"arrays": r["arrays"], "metrics": r["metrics"]}) for r in records]
    flwr_new = best_of(lambda: aggregate_arrayrecords(flwr_records, "num-examples"), repeat=3)
    flwr_legacy = best_of(lambda: aggregate([([a.numpy() for a in r["arrays"].values()], int(r["metrics"]["num-examples"]))
                                             for r in records]), repeat=3)
    floor = read_floor(records)
    ref = aggregate_arrayrecords(flwr_records, "num-examples")["values"].numpy()
    got = ours_mean(codec, records, numel, device).cpu().numpy()
    assert np.allclose(got, ref, atol=1e-5), "fedshield and flwr disagree"
    tag = f"{n}x{numel // 10**6 or numel}M" if numel >= 10**6 else f"{n}x{numel}"
    r1 = flwr_new / ours
    rep.add(f"dense fp32 mean {tag} [{device.type}] vs aggregate_arrayrecords", ours * 1e3, "ms",
            "flwr aggregate_arrayrecords", flwr_new * 1e3, ">= 5x faster", r1 >= 5)
    rep.add(f"dense fp32 mean {tag} [{device.type}] vs legacy aggregate", ours * 1e3, "ms",
            "flwr aggregate (legacy)", flwr_legacy * 1e3, ">= 5x faster", flwr_legacy / ours >= 5)
    rep.add(f"dense fp32 mean {tag} [{device.type}] vs read floor", ours * 1e3, "ms", "torch sum over same bytes",
            floor * 1e3, "<= 2x floor", ours <= 2 * floor, ratio=ours / floor)
    two_pass = best_of(lambda: ours_mean(codec, records, numel, device, fused=False), repeat=5)
    rep.add(f"dense fp32 mean {tag} [{device.type}] fused check+add vs two passes",
            ours * 1e3, "ms", "norm, then add (two reads)", two_pass * 1e3, "", None)
    if device.type == "cuda":
        gbs = n * numel * 4 / ours / 1e9
        rep.add(f"dense fp32 effective bandwidth [{device.type}]", gbs, "GB/s", "host->device copies included", None, "")
    return ours


def sparse_case(rep: Report, n: int, numel: int, device) -> None:
    codec = create_codec("topk", ratio=0.01)
    records = make_records(codec, n, numel)
    ours = best_of(lambda: ours_mean(codec, records, numel, device))
    floor = read_floor(records)
    rep.add(f"top-1% sparse mean {n}x{numel} [{device.type}] vs nonzeros' read floor", ours * 1e3, "ms",
            "torch sum over the sparse bytes", floor * 1e3, "<= 2x floor", ours <= 2 * floor, ratio=ours / floor)


def quant_cases(rep: Report, n: int, numel: int, device, dense_time: float) -> None:
    for bits in (8, 4):
        codec = create_codec("qsgd", bits=bits)
        records = make_records(codec, n, numel)
        ours = best_of(lambda: ours_mean(codec, records, numel, device), repeat=3)
        rep.add(f"qsgd {bits}-bit mean {n}x{numel} [{device.type}] vs our dense fp32", ours * 1e3, "ms",
                "fedshield dense fp32", dense_time * 1e3, "<= 1.5x dense", ours <= 1.5 * dense_time, ratio=ours / dense_time)
        del records
        gc.collect()


def robust_cases(rep: Report, n: int, numel: int, device) -> None:
    from flwr.server.strategy.aggregate import aggregate_median, aggregate_trimmed_avg

    codec = create_codec("dense")
    records = make_records(codec, n, numel)
    nd = [([r["arrays"]["values"].numpy()], int(r["metrics"]["num-examples"])) for r in records]

    def ours(rule: str, **params):
        agg = create_aggregator(rule, numel, device, n, **params)
        for rec in records:
            parsed = codec.parse(dict(rec["arrays"].items()), dict(rec["codec"]), numel, 1 << 40)
            agg.add_checked(codec, parsed, float(rec["metrics"]["num-examples"]), MAX_NORM)
        res = agg.result()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return res

    for rule, params, base_fn, base_name in (
        ("median", {}, lambda: aggregate_median(nd), "flwr FedMedian aggregate_median"),
        ("trimmed-mean", {"beta": 0.2}, lambda: aggregate_trimmed_avg(nd, 0.2), "flwr FedTrimmedAvg"),
    ):
        t_ours = best_of(lambda: ours(rule, **params), repeat=3)
        t_base = best_of(base_fn, repeat=2, warmup=0)
        rep.add(f"{rule} {n}x{numel} [{device.type}] vs {base_name.split()[1]}", t_ours * 1e3, "ms", base_name,
                t_base * 1e3, ">= 3x faster", t_base / t_ours >= 3)


_MEMORY_CHILD = r"""
import resource, sys, torch
from flwr.app import ArrayRecord
from aggregation import create_aggregator
from aggregation.codecs import create_codec
n, numel = int(sys.argv[1]), int(sys.argv[2])
codec = create_codec("dense")
gen = torch.Generator().manual_seed(0)
torch.randn(numel, generator=gen); codec.encode(torch.zeros(numel))  # warm allocator and code paths
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
acc = create_aggregator("mean", numel, "cpu", n)
for i in range(n):  # records arrive one at a time, as from the network
    enc, _ = codec.encode(torch.randn(numel, generator=gen))
    rec = ArrayRecord(enc.arrays)
    del enc
    acc.add(codec, codec.parse(rec, {"codec": "dense", "numel": numel, "dtype": "float32"}, numel, 1 << 40), 1.0)
    del rec
acc.result()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
"""


def memory_case(rep: Report, n: int, numel: int) -> None:
    out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(n), str(numel)], capture_output=True, text=True,
                         check=True, env={**os.environ, "FEDSHIELD_DEVICE": "cpu"})
    peak = int(out.stdout.strip()) * 1024
    model = numel * 4
    rep.add(f"dense mean peak memory above baseline {n}x{numel}", peak / model, "x", "one model's size (MB)",
            model / 1e6, "< 3x model", peak < 3 * model, ratio=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--numel", type=int, default=1_000_000)
    p.add_argument("--robust-clients", type=int, default=50)
    p.add_argument("--json", help="also write every figure as JSON to this file")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    a = p.parse_args()
    if a.quick:
        a.clients, a.numel, a.robust_clients = 10, 100_000, 10
    torch.set_num_threads(os.cpu_count() or 1)
    rep = Report("aggregation")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, clients={a.clients}, numel={a.numel}")
    print(f"{'case':<58} {'ours':>10} {'unit':<5} | {'baseline':<34} {'value':>10} | {'ratio':>9} | target")
    devices = [torch.device("cpu")] + ([get_device("cuda")] if torch.cuda.is_available() else [])
    for dev in devices:
        dense_t = dense_cases(rep, a.clients, a.numel, dev)
        gc.collect()
        sparse_case(rep, a.clients, a.numel, dev)
        gc.collect()
        quant_cases(rep, a.clients, a.numel, dev, dense_t)
        gc.collect()
        robust_cases(rep, a.robust_clients, a.numel, dev)
        gc.collect()
    memory_case(rep, a.clients, a.numel)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
