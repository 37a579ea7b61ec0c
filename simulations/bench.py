"""Benchmark reporting: each figure printed beside its baseline and ratio, and written as JSON (--json)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    baseline: str
    baseline_value: float | None
    ratio: float | None
    target: str
    met: bool | None


def medians_interleaved(fns: dict[str, Callable[[], object]], repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median timing (seconds) of each function, timed in turns (a, b, c, a, b, c, ...) so that
    ours and its baselines see the same background load on a shared machine: their ratio is
    steadier than from timings taken one after the other."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def best_of(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median of ``repeat`` timings in seconds after ``warmup`` untimed calls."""
    return medians_interleaved({"fn": fn}, repeat, warmup)["fn"]


class Report:
    def __init__(self, title: str) -> None:
        self.title = title
        self.figures: list[Figure] = []

    def add(self, name: str, value: float, unit: str, baseline: str = "", baseline_value: float | None = None,
            target: str = "", met: bool | None = None, ratio: float | None = None) -> Figure:
        if ratio is None and baseline_value:
            ratio = baseline_value / value if value else None
        fig = Figure(name, value, unit, baseline, baseline_value, ratio, target, met)
        self.figures.append(fig)
        ratio_s = f"{fig.ratio:8.2f}x" if fig.ratio is not None else "        -"
        base_s = f"{baseline_value:10.3f}" if baseline_value is not None else "          "
        mark = {True: "MET", False: "NOT MET", None: ""}[met]
        print(f"{name:<58} {value:10.3f} {unit:<5} | {baseline:<34} {base_s} | {ratio_s} | {target} {mark}", flush=True)
        return fig

    def write_json(self, path: str | None) -> None:
        if path:
            Path(path).write_text(json.dumps({"title": self.title, "figures": [asdict(f) for f in self.figures]}, indent=2))


# --- the peers the benchmarks time fedshield against (imported only when run) ---------------------------

def missing(contender: str) -> str | None:
    """Why a peer cannot run here (its package is missing), or None: pfl (installed beside the project, see
    benchmarks/vs_pfl.py), Flower's Ray engine (the ``simulation`` extra)."""
    import importlib.util

    pfl = ("pfl", "multiprocess", "prv_accountant")
    need = {"pfl": pfl, "pfl-cl": pfl, "flower": ("ray",)}.get(contender, ())
    gone = [m for m in need if importlib.util.find_spec(m) is None]
    return f"{', '.join(gone)} not installed" if gone else None


def pfl_rounds(spec, population: int, cohort: int, rounds: int, settings,
               channels_last: bool = False) -> tuple[list[float], float]:
    """(seconds per central iteration, the whole run's seconds) of pfl-research's FederatedAveraging, PyTorch
    backend, on ``spec``'s task: ``cohort`` of ``population`` users a round, in turn (pfl's minimize-reuse
    sampler), each user's data made when it is sampled (``Task.client_data``); SGD with the settings' learning
    rate and momentum. ``channels_last``: the module put in channels-last memory format by hand."""
    import functools

    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset as PflDataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from torch import nn

    from clients.tasks import get_task

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

    def user_data(uid):
        d = task.client_data(uid, population)
        return PflDataset([d.x, d.y], user_id=uid)

    fed = FederatedDataset(user_data, get_user_sampler("minimize_reuse", range(population)))
    torch.manual_seed(0)
    net = PflModule(task.build())
    if channels_last:
        net.to(memory_format=torch.channels_last)
    model = PyTorchModel(net, local_optimizer_create=functools.partial(torch.optim.SGD, momentum=settings.momentum),
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    # evaluation_frequency past the run: pfl evaluates only at iteration 0 (the first round, left out)
    algo_params = NNAlgorithmParams(central_num_iterations=rounds, evaluation_frequency=rounds + 1,
                                    train_cohort_size=cohort, val_cohort_size=0)
    train_params = NNTrainHyperParams(local_num_epochs=settings.local_epochs, local_learning_rate=settings.lr,
                                      local_batch_size=settings.batch_size)
    watch = Stopwatch()
    t0 = time.perf_counter()
    FederatedAveraging().run(algorithm_params=algo_params, backend=SimulatedBackend(training_data=fed, val_data=fed),
                             model=model, model_train_params=train_params, callbacks=[watch],
                             send_metrics_to_platform=False)  # (else pfl prints every iteration's metrics)
    return [b - a for a, b in zip(watch.marks, watch.marks[1:])], time.perf_counter() - t0


def flower_rounds(spec, population: int, cohort: int, rounds: int, settings,
                  actors: int = 1, device: str = "cpu") -> tuple[list[float], float]:
    """(seconds per round, the whole run's seconds incl. Ray's start) of a stock Flower app on its Ray engine:
    ``flwr.serverapp.strategy.FedAvg`` asking ``cohort`` of ``population`` supernodes a round, and a torch
    ClientApp training ``spec``'s task on ``Task.client_data`` with ``Task.train``; ``actors`` client actors
    (one CPU each, and 1/actors of the GPU with ``device`` "cuda", which the ClientApp trains on); each round
    timed by ``evaluate_fn``."""
    import logging
    import os
    import warnings

    import torch

    from clients.tasks import get_task

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
        model.to(device)
        data = task.client_data(int(context.node_config["partition-id"]), population)
        task.train(model, data, settings, torch.Generator().manual_seed(int(context.node_id) % 2**31))
        state = {k: v.cpu() for k, v in model.state_dict().items()}
        return Message(RecordDict({"arrays": ArrayRecord(state),
                                   "metrics": MetricRecord({"num-examples": len(data)})}), reply_to=msg)

    marks: list[float] = []
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        strategy = FedAvg(fraction_train=cohort / population, fraction_evaluate=0.0, min_train_nodes=cohort,
                          min_evaluate_nodes=0, min_available_nodes=population)
        strategy.start(grid, ArrayRecord(get_task(spec).build().state_dict()), num_rounds=rounds,
                       evaluate_fn=lambda rnd, arrays: marks.append(time.perf_counter()))

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_simulation(server_app=server_app, client_app=client_app, num_supernodes=population,
                       backend_config={"client_resources": {"num_cpus": 1,
                                                            "num_gpus": 1 / actors if device != "cpu" else 0},
                                       "init_args": {"num_cpus": actors, "logging_level": logging.WARNING,
                                                     "log_to_driver": False}})
    total = time.perf_counter() - t0
    if len(marks) != rounds + 1:
        raise RuntimeError(f"Flower's run must time {rounds} rounds. Found {max(len(marks) - 1, 0)}.")
    return [b - a for a, b in zip(marks, marks[1:])], total
