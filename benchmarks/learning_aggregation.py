"""Learning checks of the aggregation core, as numbers: accuracy and uplink bytes per codec / rule.

    python benchmarks/learning_aggregation.py [--rounds 20] [--json FILE]

digits, 20 clients, Dirichlet(0.5), on the in-process engine (the same workflow as the
service). Codecs are compared with dense fp32; robust rules run with 20% of the clients
sending sign-flipped updates scaled by 4 and are compared with the clean dense run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402
Report = _report.Report

from clients.client_app import app  # noqa: E402
from coordinator import RunConfig, RunDirectory, SyncWorkflow  # noqa: E402
from simulations.inprocess import InProcessGrid  # noqa: E402

CLIENTS = 20


def attacker(scale: float = -4.0):
    from flwr.app import ArrayRecord, ConfigRecord

    from aggregation.codecs import create_codec
    from clients.client_app import run_train

    dense = create_codec("dense")

    def client(msg, ctx):
        reply = run_train(msg, ctx)
        if ctx.node_id - 1001 >= CLIENTS // 5:
            return reply
        arrays, header = dict(reply.content.array_records["arrays"].items()), dict(reply.content.config_records["codec"])
        delta = dense.decode(dense.parse(arrays, header, int(header["numel"]), 1 << 30))
        enc, _ = dense.encode(delta * scale)
        reply.content.array_records["arrays"] = ArrayRecord(enc.arrays)
        reply.content.config_records["codec"] = ConfigRecord(enc.header)
        return reply

    return client


def run(rounds: int, client=None, **kw) -> tuple[float, int]:
    cfg = RunConfig.from_mapping({"num-rounds": rounds, "min-nodes": CLIENTS, **kw})
    with tempfile.TemporaryDirectory() as d:
        s = SyncWorkflow(cfg, InProcessGrid(client or app, CLIENTS), RunDirectory(d)).run()
    return s["final_test_accuracy"], s["total_update_bytes_up"]  # the updates' bytes: what a codec compresses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    rep = Report("learning_aggregation")
    acc0, up0 = run(a.rounds)
    rep.add("dense fp32: test accuracy", acc0, "acc", "", None, "")
    for name, kw, tol, min_ratio in (
        ("topk 1% fp16 values + error feedback", {"codec": "topk", "topk-ratio": 0.01}, 0.02, 50),
        ("qsgd 8-bit", {"codec": "qsgd", "qsgd-bits": 8}, 0.01, None),
        ("qsgd 4-bit", {"codec": "qsgd", "qsgd-bits": 4}, None, None),
        ("sign + error feedback", {"codec": "sign"}, None, None),
        ("dense fp16", {"codec": "dense", "codec-dtype": "float16"}, None, None),
    ):
        acc, up = run(a.rounds, **kw)
        rep.add(f"{name}: accuracy (baseline dense)", acc, "acc", "dense fp32", acc0,
                f">= dense - {tol}" if tol else "", (acc >= acc0 - tol) if tol else None, ratio=acc - acc0)
        rep.add(f"{name}: uplink update bytes", up / 1e6, "MB", "dense fp32 MB", up0 / 1e6,
                f">= {min_ratio}x fewer" if min_ratio else "", (up0 / up >= min_ratio) if min_ratio else None)
    for rule, kw in (("mean (FedAvg)", {}), ("median", {"aggregator": "median"}),
                     ("trimmed-mean 0.25", {"aggregator": "trimmed-mean", "trim-beta": 0.25}),
                     ("krum f=4", {"aggregator": "krum", "krum-f": 4}),
                     ("multi-krum f=4 m=16", {"aggregator": "multi-krum", "krum-f": 4, "krum-m": 16})):
        acc, _ = run(a.rounds, attacker(), **kw)
        collapse = rule.startswith("mean")
        rep.add(f"20% sign-flip x4 attack, {rule}: accuracy", acc, "acc", "clean dense", acc0,
                "collapses (< clean - 0.20)" if collapse else ">= clean - 0.05",
                (acc < acc0 - 0.20) if collapse else (acc >= acc0 - 0.05), ratio=acc - acc0)
        if rule.startswith("krum"):  # one client's update per round: also set against its own clean run
            clean, _ = run(a.rounds, **kw)
            rep.add(f"20% sign-flip x4 attack, {rule}: accuracy", acc, "acc", f"clean {rule}", clean,
                    ">= its clean run - 0.05", acc >= clean - 0.05, ratio=acc - clean)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
