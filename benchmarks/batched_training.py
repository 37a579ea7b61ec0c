"""Batched local training: K clients of the digits MLP trained as one torch computation vs one by one.

    python benchmarks/batched_training.py [--clients 100,1000] [--repeat 3] [--threads 1] [--model mlp|bn-mlp]
                                          [--json FILE]

Both sides do the same per-client work: load the global weights into the model, ``Task.train`` (SGD, lr 0.1,
momentum 0.9, batch 16, 1 local epoch) with the client's own generator, flatten, subtract. The one-by-one loop
reuses one model (its cheapest form: no model is built per client); the batched side is
``simulations.batched.train_batched`` (chunks of 512 clients). Data per K:

- K <= 718: the task's own Dirichlet(0.5) partitions of digits' 1,437 training examples (K = 100: 3 to 34
  examples, 14.4 on average);
- K > 718 (a Dirichlet partition would leave clients under 2 examples): each client draws U{10..30} examples
  (20 on average) with replacement, its labels skewed by its own Dirichlet(0.5) class proportions.

``--model bn-mlp`` puts BatchNorm1d after the hidden layer: the batched side then stacks each client's running
statistics and pads nothing (full batches first, then the partial last batches, those of one size together); a
last batch of one example joins the batch before it on both sides (BatchNorm1d refuses a batch of one in training).

The two sides are timed in turns (median of ``--repeat``) and checked to agree (max |delta difference|).
torch runs on 1 thread by default, as the issue measures.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402
Report = _report.Report

from clients import Dataset, Task, TaskSpec, TrainSettings  # noqa: E402
from clients.tasks import DigitsTask, get_task  # noqa: E402
from simulations.batched import DEFAULT_CHUNK, train_batched  # noqa: E402

SETTINGS = TrainSettings(local_epochs=1, batch_size=16, lr=0.1, momentum=0.9)
MAX_DIRICHLET = 718  # digits' 1,437 examples, >= 2 per client


class BatchNormDigits(DigitsTask):
    """The digits MLP with BatchNorm1d after its hidden layer (``--model bn-mlp``)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


def client_data(task: Task, k: int) -> list[Dataset]:
    """K clients' data: the task's Dirichlet partitions, or ~20 examples each drawn with replacement."""
    if k <= MAX_DIRICHLET:
        return [task.partition(i, k) for i in range(k)]
    train, rng = task.train_set, np.random.default_rng(0)
    by_class = [np.flatnonzero(train.y == c) for c in range(10)]
    out = []
    for _ in range(k):
        labels = rng.choice(10, size=rng.integers(10, 31), p=rng.dirichlet(np.full(10, 0.5)))
        idx = np.array([rng.choice(by_class[c]) for c in labels])
        out.append(Dataset(train.x[idx], train.y[idx]))
    return out


def seeds(k: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(hash((0, 1, i)) & 0x7FFFFFFF) for i in range(k)]  # as local_update


def one_by_one(task: Task, flat: torch.Tensor, data: list[Dataset]) -> torch.Tensor:
    """Each client alone, through Task.train, on one reused model."""
    model, layout = task.build(), task.layout()
    deltas = []
    for d, gen in zip(data, seeds(len(data)), strict=True):
        layout.load(model, flat)
        task.train(model, d, SETTINGS, gen)
        deltas.append(layout.flatten(model) - flat)
    return torch.stack(deltas)


def bench(rep: Report, task: Task, k: int, repeat: int, chunk: int) -> None:
    data, flat = client_data(task, k), task.init_weights(0)
    sizes = np.array([len(d) for d in data])
    kind = "Dirichlet(0.5) partitions" if k <= MAX_DIRICHLET else "U{10..30} with replacement, Dirichlet(0.5) labels"
    print(f"# K = {k}: {kind}, {sizes.min()}..{sizes.max()} examples (mean {sizes.mean():.1f})", flush=True)
    diff = (train_batched(task, flat, data, SETTINGS, seeds(k), chunk=chunk)[0] - one_by_one(task, flat, data))
    print(f"# K = {k}: max |batched - one-by-one delta| = {diff.abs().max().item():.2e}", flush=True)
    sides = {"loop": lambda: one_by_one(task, flat, data),
             "batched": lambda: train_batched(task, flat, data, SETTINGS, seeds(k), chunk=chunk)}
    med = _report.medians_interleaved(sides, repeat=repeat, warmup=0)  # (the agreement check above warmed both)
    loop, batched = med["loop"], med["batched"]
    rep.add(f"K={k}: one-by-one loop (Task.train)", loop, "s")
    rep.add(f"K={k}: batched (train_batched; ratio = speed-up)", batched, "s", "one-by-one loop s", loop)
    rep.add(f"K={k}: one-by-one, per client", loop / k * 1e3, "ms")
    rep.add(f"K={k}: batched, per client", batched / k * 1e3, "ms", "one-by-one per client ms", loop / k * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", default="100,1000", help="comma-separated K values")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each side (median)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="clients trained in one computation")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the issue measures with 1)")
    p.add_argument("--model", choices=("mlp", "bn-mlp"), default="mlp",
                   help="mlp: the built-in digits MLP; bn-mlp: the same with BatchNorm1d after its hidden layer")
    p.add_argument("--json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    task = get_task(TaskSpec()) if a.model == "mlp" else BatchNormDigits()
    print(f"# torch {torch.__version__}, CPU, torch threads: {torch.get_num_threads()}; digits MLP 64-128-10"
          f"{' with BatchNorm1d' if a.model == 'bn-mlp' else ''} "
          f"({task.layout().numel:,} parameters); 1 local epoch, batch 16, lr 0.1, momentum 0.9; chunk {a.chunk}",
          flush=True)
    rep = Report("batched_training")
    t0 = time.perf_counter()
    for k in (int(s) for s in a.clients.split(",")):
        bench(rep, task, k, a.repeat, a.chunk)
    print(f"# {time.perf_counter() - t0:.1f} s in all", flush=True)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
