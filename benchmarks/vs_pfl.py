"""Compute-bound rounds: fedshield's fastest engine vs pfl-research vs Flower's Ray simulation vs the floor.

    python benchmarks/vs_pfl.py [--model resnet|cnn] [--clients 10] [--rounds 5] [--examples 200]
                                [--skip pfl,flower] [--device cpu|cuda] [--json FILE]

The same model on the same generated CIFAR-shaped data (examples/tasks/cifar_resnet.py's patterns:
3x32x32, 10 classes), the same iid partition (fedshield's ``Task.partition``), every client in every
round, ``--epochs`` local epochs of plain SGD (batch 32, lr 0.05, no momentum), one torch thread per
process for every contender. ``--model resnet`` is CifarResNet's ResNetMini (78,042 parameters, BatchNorm);
``--model cnn`` a smaller BatchNorm CNN (for quick runs); ``--model plain-cnn`` the same CNN without BatchNorm (on a
GPU fedshield's in-process engine trains a round's clients of any of these as one batched computation; on CPU,
convolutional models one by one). Contenders, timed one after another:

- fedshield: ``simulations.simulate(engine="inprocess")`` (its fastest engine; batched where the model and device allow),
  each round's wall time from the run's metrics.csv (``wall_time_s`` differences: training, wire records,
  aggregation, the checkpoint, and the central evaluation on the test set after the last round, as pfl
  evaluates once: ``--central-eval-every 1`` evaluates every round, fedshield's default);
- pfl 0.6 with its PyTorch backend: ``FederatedAveraging`` over ``SimulatedBackend`` and a
  ``FederatedDataset`` of the same per-client arrays, timed per central iteration by a callback
  (pfl averages trainable parameters only; BatchNorm statistics stay in its one module); ``pfl-cl`` is the
  same with its module put in channels-last memory format by hand (fedshield's default loop does that itself
  on CPU; pfl does not);
- Flower: a stock ``flwr.serverapp.strategy.FedAvg`` ServerApp and a torch ClientApp under
  ``flwr.simulation.run_simulation`` (Ray, one CPU per actor, ``--flower-actors`` actors: 1 by default, so
  that it computes on one core as the others do), timed per round by ``evaluate_fn`` (both peers' runners are
  ``simulations.bench.pfl_rounds`` / ``flower_rounds``, shared with benchmarks/simulation_scale.py);
- the floor: a plain torch loop that loads the global weights into one model and trains the same clients
  one after another in this process (``Task.train``, the loop the others' clients run), timed at the start
  and at the end of the run (the median of both).

Contenders run in turns, ``--repeat`` times each (A, B, A, B, ...: a drifting machine speed, common on a shared
VM, hits each alike); a round time is the median of every run's rounds after its first (and, for fedshield
evaluating after its last round only, before its last: each contender's one evaluation is left out); per-client overhead = (round - floor) /
clients. Goal from the issue: fedshield faster than pfl and >= 5x faster than Flower's engine.

pfl is not a fedshield dependency, and pfl 0.6.0 pins dp-accounting<0.6 (fedshield uses 0.6): install it
beside the project's venv, not into it, and put it on PYTHONPATH::

    pip install --target /tmp/pfl-site --no-deps pfl==0.6.0 multiprocess==0.70.19 dill prv-accountant==0.2.0
    PYTHONPATH=/tmp/pfl-site python benchmarks/vs_pfl.py --json /tmp/vs_pfl.json

(its PyTorch backend needs nothing else here: numpy, scipy, packaging and torch come from the venv).
A contender whose package is missing (pfl; ray for Flower) is skipped with one line.

``--device cuda`` (default: ``FEDSHIELD_DEVICE``, else CUDA where present) trains every contender on the GPU:
the floor's model, fedshield (which then trains a round's clients as one batched computation, BatchNorm
included: on CPU it trains convolutional models one by one), pfl (``PFL_PYTORCH_DEVICE``) and Flower's
ClientApp (each actor 1/``--flower-actors`` of the GPU).
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from aggregation import AggregationError, get_device  # noqa: E402
from clients import Dataset, TaskSpec, TrainSettings  # noqa: E402
from clients.tasks import get_task, task_class  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
_CifarResNet = task_class(f"{ROOT / 'examples' / 'tasks' / 'cifar_resnet.py'}:CifarResNet")
_cifar = sys.modules[_CifarResNet.__module__]
# The data's size reaches every process (Ray's actors too) through the environment.
TRAIN_ENV, TEST_ENV = "FEDSHIELD_VS_PFL_TRAIN", "FEDSHIELD_VS_PFL_TEST"
CONTENDERS = ("fedshield", "pfl", "pfl-cl", "flower")


def small_cnn() -> nn.Module:
    """conv(3,16)-BN-pool-conv(16,32)-BN-pool-fc(512,10): 10,266 parameters (``--model cnn``)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(4),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


def plain_cnn() -> nn.Module:
    """conv(3,16)-pool-conv(16,32)-pool-fc(512,10) without BatchNorm: 10,378 parameters (``--model plain-cnn``)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(4),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


class BenchCifarResNet(_CifarResNet):
    """CifarResNet with its data sized by the benchmark (the same class patterns, fixed seeds)."""

    def load_data(self) -> tuple[Dataset, Dataset]:
        patterns = _cifar.class_patterns(1234)
        n_train, n_test = int(os.environ.get(TRAIN_ENV, _cifar.TRAIN)), int(os.environ.get(TEST_ENV, _cifar.TEST))
        return Dataset(*_cifar.cifar_like(n_train, 1, patterns)), Dataset(*_cifar.cifar_like(n_test, 2, patterns))


class BenchCifarCnn(BenchCifarResNet):
    def build_model(self) -> nn.Module:
        return small_cnn()


class BenchCifarPlainCnn(BenchCifarResNet):
    def build_model(self) -> nn.Module:
        return plain_cnn()


def spec_for(model: str) -> TaskSpec:
    cls = {"resnet": "BenchCifarResNet", "cnn": "BenchCifarCnn", "plain-cnn": "BenchCifarPlainCnn"}[model]
    return TaskSpec(task=f"{THIS}:{cls}", partitioning="iid")


def median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


# --- the floor ----------------------------------------------------------------------------------------

def run_floor(spec: TaskSpec, clients: int, rounds: int, settings: TrainSettings,
              device: torch.device) -> list[float]:
    """Seconds per round of a plain loop: global weights into one model, each client trained in turn, the
    trained states averaged (parameters and floating buffers, a torch mean: negligible here)."""
    task = get_task(spec)
    parts = [task.partition(i, clients) for i in range(clients)]
    torch.manual_seed(0)
    model = task.build().to(device)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        states = []
        for data in parts:
            model.load_state_dict(global_state)
            task.train(model, data, settings, gen)
            states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        global_state = {k: (torch.stack([s[k] for s in states]).float().mean(0).to(v.dtype)
                            if v.is_floating_point() else states[-1][k]) for k, v in global_state.items()}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


# --- fedshield ----------------------------------------------------------------------------------------

def run_fedshield(spec: TaskSpec, clients: int, rounds: int, settings: TrainSettings,
                  run_dir: Path, central_eval_every: int = 0) -> tuple[list[float], float]:
    """(seconds per round, the whole call's seconds) of ``simulate(engine="inprocess")``; the test set is
    evaluated after the last round only by default (pfl evaluates once too, before its first round)."""
    from simulations import simulate

    t0 = time.perf_counter()
    simulate(spec.task, run_dir=run_dir, engine="inprocess", num_supernodes=clients, num_rounds=rounds,
             min_nodes=clients, local_epochs=settings.local_epochs, batch_size=settings.batch_size, lr=settings.lr,
             momentum=settings.momentum, partitioning="iid", central_eval_every=central_eval_every)
    total = time.perf_counter() - t0
    with open(run_dir / "metrics.csv", newline="") as f:
        walls = [float(row["wall_time_s"]) for row in csv.DictReader(f)]
    return [b - a for a, b in zip([0.0, *walls], walls)], total


def central_eval_time(spec: TaskSpec, device: torch.device) -> float:
    """Seconds of one central evaluation on the test set (part of each fedshield round)."""
    task = get_task(spec)
    model = task.build().to(device)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        task.evaluate(model, task.test_set)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# --- the report ---------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("resnet", "cnn", "plain-cnn"), default="resnet",
                   help="resnet: CifarResNet's ResNetMini (78,042 parameters); cnn: a 10,266-parameter BN CNN")
    p.add_argument("--clients", type=int, default=10, help="clients, all in every round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per contender (the first is left out)")
    p.add_argument("--examples", type=int, default=200, help="training examples per client")
    p.add_argument("--test-examples", type=int, default=500, help="the test set fedshield evaluates each round on")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--flower-actors", type=int, default=1,
                   help="Flower's client actors (1: one core, as every other contender has; 2 fills 2 cores)")
    p.add_argument("--central-eval-every", type=int, default=0,
                   help="fedshield's central-eval-every (0: the test set after the last round only, as pfl evaluates "
                        "once; 1: every round, fedshield's default)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each contender, in turns (their rounds after the "
                   "first pooled: the median)")
    p.add_argument("--skip", default="", help="comma-separated contenders not to run: pfl, pfl-cl (pfl with its "
                   "model in channels-last memory format by hand), flower")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] for every contender (default: FEDSHIELD_DEVICE, else CUDA where present)")
    p.add_argument("--json")
    a = p.parse_args()
    try:
        device = get_device(a.device)
    except AggregationError as exc:
        p.error(str(exc))
    if a.clients < 2 or a.rounds < 2 or a.examples < 1 or a.repeat < 1:
        p.error(f"--clients and --rounds must be >= 2, --examples and --repeat >= 1. Found {a.clients}, {a.rounds}, "
                f"{a.examples}, {a.repeat}.")
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    if skip - set(CONTENDERS[1:]):
        p.error(f"--skip takes pfl, pfl-cl and flower. Found {sorted(skip - set(CONTENDERS[1:]))}.")

    os.environ["FEDSHIELD_TORCH_THREADS"] = "1"
    os.environ["FEDSHIELD_DEVICE"] = os.environ["PFL_PYTORCH_DEVICE"] = str(device)  # (fedshield's, pfl's, actors')
    os.environ[TRAIN_ENV], os.environ[TEST_ENV] = str(a.clients * a.examples), str(a.test_examples)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from simulations import bench as _report

    spec = spec_for(a.model)
    settings = TrainSettings(local_epochs=a.epochs, batch_size=a.batch, lr=a.lr, momentum=0.0)
    task = get_task(spec)
    params = sum(t.numel() for t in task.build().parameters())
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"# torch {torch.__version__} on {device} ({where}), 1 torch thread per process, {os.cpu_count()} CPUs; "
          f"model {a.model} "
          f"({params:,} parameters); {a.clients} clients x {a.examples} examples, all per round; {a.rounds} rounds; "
          f"{a.epochs} local epoch(s), batch {a.batch}, SGD lr {a.lr}", flush=True)

    floor = run_floor(spec, a.clients, a.rounds, settings, device)
    print(f"# floor (plain torch loop): rounds {[round(t, 2) for t in floor]} s", flush=True)
    per_round: dict[str, float] = {}
    first: dict[str, float] = {}
    later: dict[str, list[float]] = {}  # every repeat's rounds after its first
    tmp = Path(tempfile.mkdtemp(prefix="vs_pfl-"))
    try:
        ready = []
        for name in CONTENDERS:
            why = "skipped by --skip" if name in skip else _report.missing(name)
            if why:
                print(f"# {name}: skipped ({why})", flush=True)
            else:
                ready.append(name)
        for rep_i in range(a.repeat):  # in turns (A, B, A, B): a drifting machine speed hits every contender alike
            for name in ready:
                if name == "fedshield":
                    times, total = run_fedshield(spec, a.clients, a.rounds, settings, tmp / f"run-{rep_i}",
                                                 a.central_eval_every)
                elif name in ("pfl", "pfl-cl"):
                    times, total = _report.pfl_rounds(spec, a.clients, a.clients, a.rounds, settings,
                                                      channels_last=name == "pfl-cl")
                else:
                    times, total = _report.flower_rounds(spec, a.clients, a.clients, a.rounds, settings,
                                                         a.flower_actors, str(device))
                # each contender's one evaluation round is left out: pfl's first, fedshield's last (with
                # --central-eval-every 0; its other rounds evaluate nothing)
                evaluated_last = name == "fedshield" and a.central_eval_every == 0 and len(times) > 2
                later.setdefault(name, []).extend(times[1:-1] if evaluated_last else times[1:])
                first.setdefault(name, times[0])
                print(f"# {name}: rounds {[round(t, 2) for t in times]} s; whole run {total:.1f} s", flush=True)
        per_round = {name: statistics.median(ts) for name, ts in later.items()}
        floor += run_floor(spec, a.clients, a.rounds, settings, device)[1:]  # again, after the others: same load
        eval_s = central_eval_time(spec, device)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    floor_s = median_after_first(floor)
    n = a.clients

    rep = _report.Report("vs_pfl")
    rep.add("floor: plain torch loop, s per round", floor_s, "s")
    ours = per_round.get("fedshield")
    for name in CONTENDERS:
        if name not in per_round:
            continue
        t = per_round[name]
        label = {"fedshield": "fedshield inprocess", "pfl": "pfl 0.6 PyTorch", "flower": "Flower Ray FedAvg",
                 "pfl-cl": "pfl 0.6, model channels-last by hand"}[name]
        rep.add(f"{label}: s per round (ratio = round / floor)", t, "s", "floor s per round", floor_s,
                ratio=t / floor_s)
        rep.add(f"{label}: per-client overhead over the floor", (t - floor_s) / n * 1e3, "ms",
                "floor per client, ms", floor_s / n * 1e3, ratio=(t - floor_s) / floor_s)
        rep.add(f"{label}: first round", first[name], "s", "floor s per round", floor_s, ratio=first[name] / floor_s)
    if ours is not None:
        rep.add(f"  fedshield's central evaluation, in every {a.central_eval_every or a.rounds}th round", eval_s * 1e3,
                "ms", "fedshield s per round, in ms", ours * 1e3, ratio=eval_s / ours)
        if "pfl" in per_round:
            r = per_round["pfl"] / ours
            rep.add("fedshield vs pfl: s per round (ratio = pfl / ours)", ours, "s", "pfl 0.6 s per round",
                    per_round["pfl"], "faster than pfl", r > 1, ratio=r)
        if "pfl-cl" in per_round:
            r = per_round["pfl-cl"] / ours
            rep.add("fedshield vs pfl, its model channels-last by hand (ratio = pfl / ours)", ours, "s",
                    "pfl 0.6 (channels-last) s per round", per_round["pfl-cl"], ratio=r)
        if "flower" in per_round:
            r = per_round["flower"] / ours
            rep.add("fedshield vs Flower Ray: s per round (ratio = Flower / ours)", ours, "s",
                    "Flower Ray FedAvg s per round", per_round["flower"], ">= 5x faster", r >= 5, ratio=r)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
