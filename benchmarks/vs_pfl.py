"""Compute-bound rounds: fedshield's fastest engine vs pfl-research vs Flower's Ray simulation vs the floor.

    python benchmarks/vs_pfl.py [--model resnet|cnn] [--clients 10] [--rounds 5] [--examples 200]
                                [--skip pfl,flower] [--json FILE]

The same model on the same generated CIFAR-shaped data (examples/tasks/cifar_resnet.py's patterns:
3x32x32, 10 classes), the same iid partition (fedshield's ``Task.partition``), every client in every
round, ``--epochs`` local epochs of plain SGD (batch 32, lr 0.05, no momentum), one torch thread per
process for every contender. ``--model resnet`` is CifarResNet's ResNetMini (78,042 parameters, BatchNorm);
``--model cnn`` a smaller BatchNorm CNN (for quick runs); ``--model plain-cnn`` the same CNN without BatchNorm, which
fedshield's batched in-process engine trains as one computation (BatchNorm models it trains one by one). Contenders, timed one after another:

- fedshield: ``simulations.simulate(engine="inprocess")`` (its fastest engine: no vectorized engine exists),
  each round's wall time from the run's metrics.csv (``wall_time_s`` differences: training, wire records,
  aggregation, the checkpoint, and the central evaluation on the test set after the last round, as pfl
  evaluates once: ``--central-eval-every 1`` evaluates every round, fedshield's default);
- pfl 0.6 with its PyTorch backend: ``FederatedAveraging`` over ``SimulatedBackend`` and a
  ``FederatedDataset`` of the same per-client arrays, timed per central iteration by a callback
  (pfl averages trainable parameters only; BatchNorm statistics stay in its one module);
- Flower: a stock ``flwr.serverapp.strategy.FedAvg`` ServerApp and a torch ClientApp under
  ``flwr.simulation.run_simulation`` (Ray, one CPU per actor, ``--flower-actors`` actors: 1 by default, so
  that it computes on one core as the others do), timed per round by ``evaluate_fn``;
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
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
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
    """conv(3,16)-pool-conv(16,32)-pool-fc(512,10) without BatchNorm: 10,378 parameters (``--model plain-cnn``),
    a model fedshield's batched in-process engine trains as one computation (BatchNorm models train one by one)."""
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

def run_floor(spec: TaskSpec, clients: int, rounds: int, settings: TrainSettings) -> list[float]:
    """Seconds per round of a plain loop: global weights into one model, each client trained in turn, the
    trained states averaged (parameters and floating buffers, a torch mean: negligible here)."""
    task = get_task(spec)
    parts = [task.partition(i, clients) for i in range(clients)]
    torch.manual_seed(0)
    model = task.build()
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


def central_eval_time(spec: TaskSpec) -> float:
    """Seconds of one central evaluation on the test set (part of each fedshield round)."""
    task = get_task(spec)
    model = task.build()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        task.evaluate(model, task.test_set)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# --- pfl ----------------------------------------------------------------------------------------------

def run_pfl(spec: TaskSpec, clients: int, rounds: int, settings: TrainSettings,
            channels_last: bool = False) -> tuple[list[float], float]:
    """(seconds per central iteration, the whole run's seconds) of pfl's FedAvg, PyTorch backend; with
    ``channels_last`` the module is put in channels-last memory format by hand (pfl does not by itself)."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    task = get_task(spec)

    class PflModule(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x)

        def loss(self, x, y, eval=False):  # noqa: A002 - pfl's signature
            self.eval() if eval else self.train()
            return task.loss(self(x), y.long())  # pfl hands over every array as float32

        @torch.no_grad()
        def metrics(self, x, y, eval=False):  # noqa: A002
            self.eval() if eval else self.train()
            return {"loss": Weighted(task.loss(self(x), y.long()).item() * len(y), len(y))}

    class Stopwatch(TrainingProcessCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, *, model):
            self.marks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.marks.append(time.perf_counter())
            return False, Metrics()

    parts = {i: task.partition(i, clients) for i in range(clients)}
    data = {i: [d.x, d.y] for i, d in parts.items()}
    fed = FederatedDataset.from_slices(data, get_user_sampler("minimize_reuse", list(data)))
    torch.manual_seed(0)
    net = PflModule(task.build())
    if channels_last:
        net.to(memory_format=torch.channels_last)
    model = PyTorchModel(net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    # evaluation_frequency past the run: pfl evaluates only at iteration 0 (the first round, left out)
    algo_params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                    train_cohort_size=clients, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_num_epochs=settings.local_epochs, local_learning_rate=settings.lr,
                                      local_batch_size=settings.batch_size)
    watch = Stopwatch()
    t0 = time.perf_counter()
    FederatedAveraging().run(algorithm_params=algo_params, backend=SimulatedBackend(training_data=fed, val_data=fed),
                             model=model, model_train_params=train_params, callbacks=[watch],
                             send_metrics_to_platform=False)  # (else pfl prints every iteration's metrics)
    total = time.perf_counter() - t0
    return [b - a for a, b in zip(watch.marks, watch.marks[1:])], total


# --- Flower's Ray simulation, stock FedAvg ------------------------------------------------------------

def run_flower(spec: TaskSpec, clients: int, rounds: int, settings: TrainSettings,
               actors: int) -> tuple[list[float], float]:
    """(seconds per round, the whole run's seconds incl. Ray's start) of a stock Flower app on Ray with
    ``actors`` client actors (Ray CPUs, one per actor)."""
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        task = get_task(spec)  # cached per actor: data made once
        model = task.build()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        data = task.partition(int(context.node_config["partition-id"]), clients)
        task.train(model, data, settings, torch.Generator().manual_seed(int(context.node_id) % 2**31))
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": len(data)})}), reply_to=msg)

    marks: list[float] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=clients,
                          min_evaluate_nodes=0, min_available_nodes=clients)
        strategy.start(grid, ArrayRecord(get_task(spec).build().state_dict()), num_rounds=rounds,
                       evaluate_fn=lambda rnd, arrays: marks.append(time.perf_counter()))

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=clients,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0},
                                       "init_args": {"num_cpus": actors, "logging_level": logging.WARNING,
                                                     "log_to_driver": False}})
    total = time.perf_counter() - t0
    if len(marks) != rounds + 1:
        raise RuntimeError(f"Flower's run must time {rounds} rounds. Found {max(len(marks) - 1, 0)}.")
    return [b - a for a, b in zip(marks, marks[1:])], total


# --- the report ---------------------------------------------------------------------------------------

def missing(contender: str) -> str | None:
    """Why a contender cannot run here (its package is missing), or None."""
    pfl = ("pfl", "multiprocess", "prv_accountant")
    need = {"pfl": pfl, "pfl-cl": pfl, "flower": ("ray",)}.get(contender, ())
    gone = [m for m in need if importlib.util.find_spec(m) is None]
    return f"{', '.join(gone)} not installed" if gone else None


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
    p.add_argument("--json")
    a = p.parse_args()
    if a.clients < 2 or a.rounds < 2 or a.examples < 1 or a.repeat < 1:
        p.error(f"--clients and --rounds must be >= 2, --examples and --repeat >= 1. Found {a.clients}, {a.rounds}, "
                f"{a.examples}, {a.repeat}.")
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    if skip - set(CONTENDERS[1:]):
        p.error(f"--skip takes pfl, pfl-cl and flower. Found {sorted(skip - set(CONTENDERS[1:]))}.")

    os.environ["FEDSHIELD_TORCH_THREADS"] = "1"
    os.environ[TRAIN_ENV], os.environ[TEST_ENV] = str(a.clients * a.examples), str(a.test_examples)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    from simulations import bench as _report

    spec = spec_for(a.model)
    settings = TrainSettings(local_epochs=a.epochs, batch_size=a.batch, lr=a.lr, momentum=0.0)
    task = get_task(spec)
    params = sum(t.numel() for t in task.build().parameters())
    print(f"# torch {torch.__version__}, 1 torch thread per process, {os.cpu_count()} CPUs; model {a.model} "
          f"({params:,} parameters); {a.clients} clients x {a.examples} examples, all per round; {a.rounds} rounds; "
          f"{a.epochs} local epoch(s), batch {a.batch}, SGD lr {a.lr}", flush=True)

    floor = run_floor(spec, a.clients, a.rounds, settings)
    print(f"# floor (plain torch loop): rounds {[round(t, 2) for t in floor]} s", flush=True)
    per_round: dict[str, float] = {}
    first: dict[str, float] = {}
    later: dict[str, list[float]] = {}  # every repeat's rounds after its first
    tmp = Path(tempfile.mkdtemp(prefix="vs_pfl-"))
    try:
        ready = []
        for name in CONTENDERS:
            why = "skipped by --skip" if name in skip else missing(name)
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
                    times, total = run_pfl(spec, a.clients, a.rounds, settings, channels_last=name == "pfl-cl")
                else:
                    times, total = run_flower(spec, a.clients, a.rounds, settings, a.flower_actors)
                # each contender's one evaluation round is left out: pfl's first, fedshield's last (with
                # --central-eval-every 0; its other rounds evaluate nothing)
                evaluated_last = name == "fedshield" and a.central_eval_every == 0 and len(times) > 2
                later.setdefault(name, []).extend(times[1:-1] if evaluated_last else times[1:])
                first.setdefault(name, times[0])
                print(f"# {name}: rounds {[round(t, 2) for t in times]} s; whole run {total:.1f} s", flush=True)
        per_round = {name: statistics.median(ts) for name, ts in later.items()}
        floor += run_floor(spec, a.clients, a.rounds, settings)[1:]  # again, after the others: same load
        eval_s = central_eval_time(spec)
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
