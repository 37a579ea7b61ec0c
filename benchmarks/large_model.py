"""An 11M-parameter model (ResNet-18-shaped, BatchNorm) through fedshield's path, against Flower's numpy path.

    python benchmarks/large_model.py [--clients 10,50] [--steps 10] [--threads N] [--json FILE] [--quick]

(a) Aggregation of N client updates of the model's flat vector (its ModelLayout: 11,173,962 parameters
    plus BatchNorm's running statistics) as the coordinator does it from Flower records as they arrive
    (parse each record, norm check fused with the weighted add: benchmarks/aggregation.py's ``ours_mean``),
    with the dense fp32 codec and the top-1% codec, against Flower's own numpy aggregation of the same
    dense records (``aggregate_arrayrecords``, FedAvg's, and the legacy ``aggregate``). Timed in turns
    (median of ``--repeat``), and each case's peak memory above its start (the process's peak RSS, VmHWM,
    reset before the case: every allocator counted, numpy's and torch's alike).
(b) One client's local training step of that model on CPU (forward, backward, SGD with momentum on a
    batch of 8 3x32x32 images) and the layout's flatten + load round trip (what a client does with the
    global model and its update each round), against Flower's round trip of the same state
    (``ArrayRecord(model.state_dict())`` then ``load_state_dict(record.to_torch_state_dict())``).

torchvision is not a dependency: ``resnet18`` below is written here (CIFAR stem: 3x3 conv, no max-pool).
No target is set by the issue for these figures; they show where an 11M model's round goes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
from simulations import bench as _report  # noqa: E402
Report = _report.Report

from aggregation.codecs import create_codec  # noqa: E402
from clients.tasks import ModelLayout, task_class  # noqa: E402

# ResNet-18's BasicBlock is examples/tasks/cifar_resnet.py's Block (conv-BN-ReLU-conv-BN plus a projected shortcut)
Block = sys.modules[task_class(f"{HERE.parent / 'examples' / 'tasks' / 'cifar_resnet.py'}:CifarResNet").__module__].Block


def _aggregation_bench():
    """benchmarks/aggregation.py as a module (its record making and coordinator path, reused as they are)."""
    spec = importlib.util.spec_from_file_location("fedshield_bench_aggregation", HERE / "aggregation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


# --- the model ----------------------------------------------------------------------------------------

class ResNet18(nn.Module):
    """ResNet-18 for 32x32 inputs: 3x3 stem, four stages of two BasicBlocks (64, 128, 256, 512), 10 classes:
    11,173,962 parameters."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


# --- memory -------------------------------------------------------------------------------------------

def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def peak_above_start(fn) -> float | None:
    """Bytes the process's peak RSS rose above its RSS at the start of ``fn()`` (None where the peak cannot
    be reset: not Linux)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        base = _status("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) back to the current RSS
    except OSError:
        return None
    result = fn()
    peak = _status("VmHWM:") - base
    del result
    return float(peak)


# --- (a) aggregation ----------------------------------------------------------------------------------

def aggregation_cases(rep: Report, agg, n: int, numel: int, repeat: int) -> None:
    from flwr.app import RecordDict
    from flwr.server.strategy.aggregate import aggregate
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    cpu = torch.device("cpu")
    dense, topk = create_codec("dense"), create_codec("topk", ratio=0.01)
    t0 = time.perf_counter()
    dense_recs = agg.make_records(dense, n, numel)
    topk_recs = agg.make_records(topk, n, numel, seed=1)
    flwr_recs = [RecordDict({"arrays": r["arrays"], "metrics": r["metrics"]}) for r in dense_recs]
    print(f"# {n} client updates of {numel:,} made and encoded in {time.perf_counter() - t0:.1f} s", flush=True)

    def legacy():
        return aggregate([([a.numpy() for a in r["arrays"].values()], int(r["metrics"]["num-examples"]))
                          for r in dense_recs])

    fns = {"dense": lambda: agg.ours_mean(dense, dense_recs, numel, cpu),
           "topk": lambda: agg.ours_mean(topk, topk_recs, numel, cpu),
           "flwr": lambda: aggregate_arrayrecords(flwr_recs, "num-examples"),
           "legacy": legacy}
    t = _report.medians_interleaved(fns, repeat=repeat)
    ref = aggregate_arrayrecords(flwr_recs, "num-examples")["values"].numpy()
    got = agg.ours_mean(dense, dense_recs, numel, cpu).numpy()
    if not abs(got - ref).max() < 1e-4:
        raise RuntimeError("fedshield's dense mean and Flower's aggregate_arrayrecords disagree")
    mem = {name: peak_above_start(fn) for name, fn in fns.items()}
    tag = f"{n}x{numel / 1e6:.1f}M"
    base = t["flwr"] * 1e3
    rep.add(f"dense fp32 mean {tag} vs aggregate_arrayrecords", t["dense"] * 1e3, "ms",
            "flwr aggregate_arrayrecords", base)
    rep.add(f"dense fp32 mean {tag} vs legacy aggregate", t["dense"] * 1e3, "ms", "flwr aggregate (legacy)",
            t["legacy"] * 1e3)
    rep.add(f"top-1% sparse mean {tag} vs flwr on dense records", t["topk"] * 1e3, "ms",
            "flwr aggregate_arrayrecords", base)
    model_mb = numel * 4 / 1e6
    for name, label in (("dense", "dense fp32 mean"), ("topk", "top-1% sparse mean"),
                        ("flwr", "flwr aggregate_arrayrecords"), ("legacy", "flwr aggregate (legacy)")):
        if mem[name] is not None:
            rep.add(f"peak memory above start: {label} {tag}", mem[name] / 1e6, "MB",
                    "one model's size (MB); ratio = peak / it", model_mb, ratio=mem[name] / 1e6 / model_mb)


# --- (b) the client side ------------------------------------------------------------------------------

def client_cases(rep: Report, steps: int) -> None:
    from flwr.app import ArrayRecord

    torch.manual_seed(0)
    model = ResNet18()
    layout = ModelLayout.of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
    model.train()

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def ours():
        layout.load(model, layout.flatten(model))

    def flwr():
        model.load_state_dict(ArrayRecord(model.state_dict()).to_torch_state_dict())

    t = _report.medians_interleaved({"step": step, "ours": ours, "flwr": flwr}, repeat=steps, warmup=2)
    rep.add("ResNet-18 local training step, batch 8 (CPU)", t["step"] * 1e3, "ms")
    rep.add("layout flatten + load round trip vs Flower's", t["ours"] * 1e3, "ms",
            "ArrayRecord(state_dict) + load_state_dict", t["flwr"] * 1e3)
    rep.add("layout flatten + load round trip vs the training step", t["ours"] * 1e3, "ms",
            "one training step, batch 8", t["step"] * 1e3, ratio=t["ours"] / t["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="10,50", help="comma-separated numbers of client updates to aggregate")
    p.add_argument("--numel", type=int, default=0, help="the update's length (default: the ResNet-18's layout)")
    p.add_argument("--repeat", type=int, default=5, help="timed aggregations per case (median)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps and round trips (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all CPUs this process may use)")
    p.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    p.add_argument("--json")
    a = p.parse_args()
    if a.quick:
        a.clients, a.numel, a.repeat, a.steps = "3", 200_000, 2, 2
    clients = [int(c) for c in a.clients.split(",") if c.strip()]
    if not clients or min(clients) < 1:
        p.error(f"--clients must be positive integers. Found {a.clients!r}.")
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(a.threads or cpus)
    model = ResNet18()
    numel = a.numel or ModelLayout.of(model).numel
    params = sum(t.numel() for t in model.parameters())
    del model
    print(f"# torch {torch.__version__}, CPU, torch threads: {torch.get_num_threads()} (of {cpus} CPUs); "
          f"ResNet-18: {params:,} parameters, flat update {numel:,} floats ({numel * 4 / 1e6:.1f} MB)", flush=True)
    rep = Report("large_model")
    agg = _aggregation_bench()
    for n in clients:
        aggregation_cases(rep, agg, n, numel, a.repeat)
        gc.collect()
    client_cases(rep, a.steps)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
