"""Aggregation core vs Flower, from Flower records as they arrive.

    python benchmarks/aggregation.py [--clients 100] [--numel 1000000] [--json FILE] [--quick] [--device all|cpu|cuda]

Cases (targets from the issue): dense fp32 mean vs flwr's aggregate_arrayrecords /
legacy aggregate and the machine's read floor; top-1% sparse vs the read floor of
its nonzeros' bytes; 8/4-bit QSGD vs our dense fp32; median and trimmed mean vs
flwr's; peak memory of the dense mean path (in a subprocess). On CUDA the same
cases run on the GPU with effective GB/s against the pinned host-to-device copy and
the device's own read bandwidth, and each codec's decode-and-add of updates already on
the device against its copy bandwidth. ``--device cuda`` times the CUDA cases only.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

from aggregation import create_aggregator, get_device, kernels  # noqa: E402
from aggregation.codecs import create_codec  # noqa: E402
from coordinator.config import ServerSettings  # noqa: E402

MAX_NORM = ServerSettings.max_update_norm  # the coordinator's default max-update-norm


def sync(device) -> None:
    """Wait for the device's queued work (a CUDA timing must include it); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def parse_all(codec, records, numel: int) -> list:
    """Each record parsed and validated by the codec, as the coordinator does on arrival."""
    return [codec.parse(dict(rec["arrays"].items()), dict(rec["codec"]), numel, 1 << 40) for rec in records]


def dense_kernel_fn(parsed, numel: int):
    """The fused dense kernel alone over already-parsed updates into a warm sum (no parsing, no
    fresh buffers, no settling): what the rest of ``ours_mean`` costs on top of it."""
    xs = kernels.typed_list([p.tensors["values"].numpy() for p in parsed])
    ws, caps, out = np.ones(len(parsed)), np.full(len(parsed), np.inf), np.zeros(numel, np.float32)

    def run():
        sq, added = kernels.batch_arrays(len(parsed), numel, kernels.BLOCK)
        kernels.run_ranges(kernels.load().dense_range, numel, kernels.BLOCK, xs, ws, caps, out, kernels.BLOCK,
                           kernels.SUB, sq, added, True)  # zeroes the sum in its pass, as a fresh one is
    return run


def ours_mean(codec, records, numel: int, device, batched: bool = True) -> torch.Tensor:
    """The coordinator's path: parse each record, then the norm check against the default
    max-update-norm fused with the add into the "mean" rule. ``batched``: the whole pull at once
    (``add_checked_many``, what coordinator.validation.add_replies calls: on CPU the fused
    kernels of aggregation.kernels); else one ``add_checked`` per update (the async path's)."""
    acc = create_aggregator("mean", numel, device, len(records))
    parsed = parse_all(codec, records, numel)
    weights = [float(rec["metrics"]["num-examples"]) for rec in records]
    if batched:
        results = acc.add_checked_many(codec, parsed, weights, MAX_NORM)
        assert not any(isinstance(r, Exception) for r in results)
    else:
        for p, w in zip(parsed, weights):
            acc.add_checked(codec, p, w, MAX_NORM)
    out = acc.result()
    sync(device)
    return out


def floor_fn(records):
    """The machine's read floor for these records: a torch sum over as many bytes, in as
    many separate float32 buffers (one per client), as the records carry."""
    sizes = [sum(len(a.data) for a in r["arrays"].values()) // 4 for r in records]
    bufs = [torch.randn(s) for s in sizes]
    return lambda: [b.sum() for b in bufs]


def dense_cases(rep: Report, n: int, numel: int, device) -> float:
    from flwr.server.strategy.aggregate import aggregate
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    codec = create_codec("dense")
    records = make_records(codec, n, numel)
    flwr_records = [RecordDict({"arrays": r["arrays"], "metrics": r["metrics"]}) for r in records]
    # ours, flwr's and the floor timed in turns: on a shared machine they see the same load
    fns = {"ours": lambda: ours_mean(codec, records, numel, device),
           "flwr": lambda: aggregate_arrayrecords(flwr_records, "num-examples"),
           "floor": floor_fn(records),
           "single": lambda: ours_mean(codec, records, numel, device, batched=False),
           "parse": lambda: parse_all(codec, records, numel)}
    kernel_alone = device.type == "cpu" and kernels.enabled()
    if kernel_alone:
        fns["kernel"] = dense_kernel_fn(parse_all(codec, records, numel), numel)
    t = _report.medians_interleaved(fns, repeat=7)
    ours, flwr_new, floor, single = t["ours"], t["flwr"], t["floor"], t["single"]
    flwr_legacy = best_of(lambda: aggregate([([a.numpy() for a in r["arrays"].values()], int(r["metrics"]["num-examples"]))
                                             for r in records]), repeat=3)
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
    rep.add(f"dense fp32 mean {tag} [{device.type}] batch vs one update at a time",
            ours * 1e3, "ms", "add_checked per update (torch)", single * 1e3, "", None)
    rep.add(f"  of which: parsing the {n} records", t["parse"] * 1e3, "ms", "torch sum over same bytes", floor * 1e3,
            ratio=t["parse"] / floor)
    if kernel_alone:
        rep.add("  the fused kernel alone (parsed updates, warm sum)", t["kernel"] * 1e3, "ms",
                "torch sum over same bytes", floor * 1e3, ratio=t["kernel"] / floor)
    if device.type == "cuda":
        gbs = n * numel * 4 / ours / 1e9
        h2d, dev_read, pack = cuda_bandwidths(device, n * numel * 4, numel * 4)
        rep.add(f"dense fp32 effective bandwidth [{device.type}]", gbs, "GB/s", "pinned host->device copy, GB/s",
                h2d, "", None, ratio=gbs / h2d)
        rep.add(f"dense fp32 effective bandwidth [{device.type}] vs host packing", gbs, "GB/s",
                "pageable->pinned host copy, GB/s", pack, "", None, ratio=gbs / pack)
        rep.add(f"dense fp32 effective bandwidth [{device.type}] vs device memory", gbs, "GB/s",
                "device read (torch sum), GB/s", dev_read, "", None, ratio=gbs / dev_read)
    return ours


def cuda_bandwidths(device, nbytes: int, piece: int) -> tuple[float, float, float]:
    """The bounds for a sum of updates that arrive in host memory, in GB/s: a pinned host-to-device
    copy of ``nbytes`` (the updates must cross it), a read of as many bytes in device memory (a
    torch sum), and the host's copy of pageable memory into a pinned buffer in pieces of ``piece``
    bytes (what staging does with each update before the device can copy it)."""
    host = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
    on_dev = torch.empty_like(host, device=device)
    pageable = [torch.randn(piece // 4) for _ in range(max(1, nbytes // piece))]
    slot = torch.empty(piece // 4, dtype=torch.float32).pin_memory()

    def copy():
        on_dev.copy_(host, non_blocking=True)
        sync(device)

    def read():
        on_dev.sum()
        sync(device)

    def pack():
        for p in pageable:
            slot.copy_(p)

    t = _report.medians_interleaved({"copy": copy, "read": read, "pack": pack}, repeat=5)
    return nbytes / t["copy"] / 1e9, nbytes / t["read"] / 1e9, len(pageable) * piece / t["pack"] / 1e9


def on_device(parsed: list, device) -> list:
    """Parsed updates with their tensors moved to ``device``: as staging leaves them, or as clients on
    the same GPU would hand them over."""
    return [dataclasses.replace(p, tensors={k: v.to(device) for k, v in p.tensors.items()}) for p in parsed]


def case_label(name: str, params: dict) -> str:
    """A codec case's name in the printed figures: "qsgd 8", "topk 0.01"."""
    return name + "".join(f" {v}" for v in params.values())


def resident_cases(rep: Report, n: int, numel: int, device) -> None:
    """CUDA only: each codec's decode-and-add (``codec.add_into``) of updates already on the device
    (as after staging, or from clients on the same GPU), against the device's copy bandwidth. Bytes
    counted: each update's encoded bytes read, and the float32 sum read and written per update."""
    nbytes = 1 << 30
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        sync(device)

    copy_gbs = 2 * nbytes / _report.medians_interleaved({"copy": copy}, repeat=9)["copy"] / 1e9
    src = dst = None  # freed before the updates are made
    for name, params in (("dense", {}), ("dense", {"dtype": "bfloat16"}), ("topk", {"ratio": 0.01}),
                         ("qsgd", {"bits": 8}), ("qsgd", {"bits": 4}), ("sign", {})):
        codec = create_codec(name, **params)
        parsed = on_device(parse_all(codec, make_records(codec, n, numel), numel), device)
        out = torch.zeros(numel, dtype=torch.float32, device=device)

        def add_all():
            for p in parsed:
                codec.add_into(p, out, 1.0)
            sync(device)

        t = _report.medians_interleaved({"add": add_all}, repeat=9)["add"]
        traffic = sum(v.numel() * v.element_size() for p in parsed for v in p.tensors.values()) + n * numel * 8
        rep.add(f"device-resident decode-and-add {case_label(name, params)} {n}x{numel} [{device.type}]",
                traffic / t / 1e9, "GB/s", "device copy (read + write), GB/s", copy_gbs, "", None,
                ratio=traffic / t / 1e9 / copy_gbs)
        parsed = None
        gc.collect()


def sparse_kernel_fn(parsed, numel: int):
    """The scatter kernel alone over already-parsed top-k updates into a warm sum."""
    idx = kernels.typed_list([p.host["indices"] for p in parsed])
    vals = kernels.typed_list([p.host["values"] for p in parsed])
    ws, out = np.ones(len(parsed)), np.zeros(numel, np.float32)
    return lambda: kernels.run_ranges(kernels.load().scatter_range, numel, kernels.BLOCK, idx, vals, ws, out, True,
                                      per_thread=2)


def sparse_case(rep: Report, n: int, numel: int, device) -> None:
    codec = create_codec("topk", ratio=0.01)
    records = make_records(codec, n, numel)
    fns = {"ours": lambda: ours_mean(codec, records, numel, device), "floor": floor_fn(records),
           "parse": lambda: parse_all(codec, records, numel)}
    kernel_alone = device.type == "cpu" and kernels.enabled()
    if kernel_alone:
        fns["kernel"] = sparse_kernel_fn(parse_all(codec, records, numel), numel)
    t = _report.medians_interleaved(fns, repeat=9)
    ours, floor = t["ours"], t["floor"]
    rep.add(f"top-1% sparse mean {n}x{numel} [{device.type}] vs nonzeros' read floor", ours * 1e3, "ms",
            "torch sum over the sparse bytes", floor * 1e3, "<= 2x floor", ours <= 2 * floor, ratio=ours / floor)
    rep.add(f"  of which: parsing the {n} records", t["parse"] * 1e3, "ms", "torch sum over the sparse bytes",
            floor * 1e3, ratio=t["parse"] / floor)
    if kernel_alone:
        rep.add("  the scatter kernel alone (parsed updates, warm sum)", t["kernel"] * 1e3, "ms",
                "torch sum over the sparse bytes", floor * 1e3, ratio=t["kernel"] / floor)


def quant_cases(rep: Report, n: int, numel: int, device, dense_time: float) -> None:
    for bits in (8, 4):
        codec = create_codec("qsgd", bits=bits)
        records = make_records(codec, n, numel)
        ours = best_of(lambda: ours_mean(codec, records, numel, device), repeat=3)
        rep.add(f"qsgd {bits}-bit mean {n}x{numel} [{device.type}] vs our dense fp32", ours * 1e3, "ms",
                "fedshield dense fp32", dense_time * 1e3, "<= 1.5x dense", ours <= 1.5 * dense_time, ratio=ours / dense_time)
        records = None  # this width's replies are freed before the next width's are made
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
        sync(device)
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
import ctypes, sys, torch
from flwr.app import ArrayRecord
from aggregation import create_aggregator
from aggregation.codecs import create_codec
n, numel, batched = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "batch"
codec = create_codec("dense")
gen = torch.Generator().manual_seed(0)
# the replies as they arrived from the network (held by the grid either way), then the path warmed up
records = [ArrayRecord(codec.encode(torch.randn(numel, generator=gen))[0].arrays) for _ in range(n)]
header = {"codec": "dense", "numel": numel, "dtype": "float32"}
warm = create_aggregator("mean", numel, "cpu", 2)
warm.add_checked_many(codec, [codec.parse(records[0], header, numel, 1 << 40)], [1.0]); warm.result()
del warm
ctypes.CDLL("libc.so.6").malloc_trim(0)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
acc = create_aggregator("mean", numel, "cpu", n)
parsed = [codec.parse(rec, header, numel, 1 << 40) for rec in records]
if batched:
    acc.add_checked_many(codec, parsed, [1.0] * n)
else:
    for p in parsed:
        acc.add_checked(codec, p, 1.0)
acc.result()
print(status("VmHWM:") - base)
"""


def memory_case(rep: Report, n: int, numel: int) -> None:
    """Peak RSS above the baseline (the records already received, the code warmed up) while the
    dense mean of ``n`` updates is computed, in a fresh process: batched and one at a time."""
    model = numel * 4
    for mode in ("batch", "single"):
        out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(n), str(numel), mode], capture_output=True,
                             text=True, check=True, env={**os.environ, "FEDSHIELD_DEVICE": "cpu"})
        peak = int(out.stdout.strip().splitlines()[-1])
        # The target is for the 1M-parameter model: below that, the fixed buffers (a 512 KB
        # block copy per kernel thread, the pool's stacks) outweigh a model, so no target is shown.
        full = numel >= 1_000_000
        rep.add(f"dense mean peak memory above baseline {n}x{numel} ({mode})", peak / 1e6, "MB",
                "one model's size (MB); ratio = peak / it", model / 1e6,
                "< 3x model" if full else "(target at >= 1M parameters)", peak < 3 * model if full else None,
                ratio=peak / model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--numel", type=int, default=1_000_000)
    p.add_argument("--robust-clients", type=int, default=50)
    p.add_argument("--json", help="also write every figure as JSON to this file")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                   help="the aggregation devices to time: all (CPU, and CUDA when present), cpu, or cuda only")
    a = p.parse_args()
    if a.quick:
        a.clients, a.numel, a.robust_clients = 10, 100_000, 10
    torch.set_num_threads(os.cpu_count() or 1)
    rep = Report("aggregation")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda needs a CUDA device; none is present")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, clients={a.clients}, numel={a.numel}")
    print(f"{'case':<58} {'ours':>10} {'unit':<5} | {'baseline':<34} {'value':>10} | {'ratio':>9} | target")
    devices = ([torch.device("cpu")] if a.device in ("all", "cpu") else []) + (
        [get_device("cuda")] if a.device in ("all", "cuda") and torch.cuda.is_available() else [])
    for dev in devices:
        dense_t = dense_cases(rep, a.clients, a.numel, dev)
        gc.collect()
        sparse_case(rep, a.clients, a.numel, dev)
        gc.collect()
        quant_cases(rep, a.clients, a.numel, dev, dense_t)
        gc.collect()
        robust_cases(rep, a.robust_clients, a.numel, dev)
        gc.collect()
        if dev.type == "cuda":
            resident_cases(rep, a.clients, a.numel, dev)
    if a.device != "cuda":  # the peak-memory case is the CPU process's
        memory_case(rep, a.clients, a.numel)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
