"""Where the CUDA aggregation paths spend their time: torch.profiler tables (host ops and device
kernels) and a cProfile of the host's Python for one coordinator-path mean per codec, from Flower
records, and torch.profiler tables for the decode-and-add of device-resident updates. A diagnostic
for a GPU machine (``benchmarks/gpu_check.sh`` runs it), not a benchmark: no baseline, no targets.

    python benchmarks/gpu_profile.py [--clients 100] [--numel 1000000]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

_here = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
_spec = importlib.util.spec_from_file_location("fedshield_bench_aggregation", _here / "aggregation.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

from aggregation.codecs import create_codec  # noqa: E402

CASES = (("dense", {}), ("topk", {"ratio": 0.01}), ("qsgd", {"bits": 8}), ("qsgd", {"bits": 4}), ("sign", {}))


def _relative(text: str) -> str:
    """cProfile names functions by absolute file path: shown relative to the entry of ``sys.path`` (or the
    repository) they were imported from, so the printed tables name no machine's directories."""
    roots = {str(Path(p).resolve()) for p in sys.path if p} | {str(_here.parent)}
    for root in sorted(roots, key=len, reverse=True):
        text = text.replace(root.rstrip(os.sep) + os.sep, "")
    return text


def _table(prof, key: str, rows: int) -> str:
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=48)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--numel", type=int, default=1_000_000)
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    dev = torch.device("cuda")
    for name, params in CASES:
        codec = create_codec(name, **params)
        records = bench.make_records(codec, a.clients, a.numel)
        bench.ours_mean(codec, records, a.numel, dev)  # warm: allocator, kernels, pinned slots
        t0 = time.perf_counter()
        bench.ours_mean(codec, records, a.numel, dev)
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            bench.ours_mean(codec, records, a.numel, dev)
        label = bench.case_label(name, params)
        print(f"\n===== records path: {label}, {a.clients} x {a.numel}: {wall * 1e3:.1f} ms unprofiled")
        print(_table(prof, "self_cpu_time_total", 14))
        print(_table(prof, "self_cuda_time_total", 8))
        py = cProfile.Profile()
        py.runcall(bench.ours_mean, codec, records, a.numel, dev)
        text = io.StringIO()
        pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(14)
        print("host (Python) time by function, tottime:")
        print(_relative("\n".join(text.getvalue().splitlines()[6:])))
        parsed = bench.on_device(bench.parse_all(codec, records, a.numel), dev)
        out = torch.zeros(a.numel, device=dev)
        for q in parsed[:3]:
            codec.add_into(q, out, 1.0)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for q in parsed:
                codec.add_into(q, out, 1.0)
            torch.cuda.synchronize()
        print(f"\n===== device-resident add_into: {label}")
        print(_table(prof, "self_cpu_time_total", 10))
        print(_table(prof, "self_cuda_time_total", 6))


if __name__ == "__main__":
    main()
