"""A user's own task (examples/tasks: a CNN with BatchNorm, a ResNet, a next-token model with its own loop)
through every round feature on the in-process engine: the flat update carries parameters and BatchNorm
statistics, and each feature aggregates it."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from clients import Dataset, Task
from clients.tasks import task_name
from coordinator.rundir import METRICS

from clients.client_app import app
from clients.tasks import get_task
from coordinator import RunConfig, RunDirectory
from coordinator.server_app import make_workflow
from simulations import load_scenario, run_scenario
from simulations.inprocess import InProcessGrid
from clients.ledger import PREFIX, STATE_DIR

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CNN = f"{EXAMPLES / 'tasks' / 'cnn_digits.py'}:CnnDigits"
N = 6


def run(tmp_path, name="r", clients=N, task=CNN, node_config=None, **kw):
    cfg = RunConfig.from_mapping({"task": task, "num-rounds": 2, "min-nodes": clients, "local-epochs": 1,
                                  "lr": 0.05, "seed": 0, **kw})
    wf = make_workflow(cfg, InProcessGrid(app, clients, node_config), RunDirectory(tmp_path / name))
    return wf, wf.run()


def bn_means(wf) -> torch.Tensor:
    names = [e for e in wf.layout.entries if e.name.endswith("running_mean")]
    return torch.cat([wf.weights[e.offset:e.offset + e.numel] for e in names])


def test_the_cnn_learns_and_its_batchnorm_statistics_are_averaged(tmp_path):
    """Learning band (both bounds) for 4 rounds; the global running means move from their initial zeros."""
    wf, s = run(tmp_path, **{"num-rounds": 4})
    assert s["status"] == "completed" and s["rounds"] == 4
    assert 0.70 <= s["final_test_accuracy"] <= 0.995
    assert any(e.buffer for e in wf.layout.entries)
    assert "1.num_batches_tracked" not in wf.layout.names + wf.layout.local  # (read only under momentum=None)
    assert bn_means(wf).abs().max() > 1e-3


def test_fedbn_keeps_batchnorm_statistics_on_the_clients(tmp_path):
    wf, s = run(tmp_path, task=f"{EXAMPLES / 'tasks' / 'cnn_digits.py'}:CnnDigitsFedBN")
    assert s["rounds"] == 2 and not any(e.buffer for e in wf.layout.entries)
    assert "1.running_mean" in wf.layout.local
    full = get_task(RunConfig.from_mapping({"task": CNN}).task).num_parameters()
    assert full - wf.numel == 2 * (16 + 32)  # the two BatchNorms' running means and variances


FEATURES = {
    "topk": {"codec": "topk", "topk-ratio": 0.1},
    "qsgd": {"codec": "qsgd"},
    "sign": {"codec": "sign"},
    "median": {"aggregator": "median"},
    "trimmed-mean": {"aggregator": "trimmed-mean", "trim-beta": 0.2, "min-nodes": 5},
    "krum": {"aggregator": "krum", "krum-f": 1},
    "fedadam": {"server-optimizer": "fedadam", "server-lr": 0.01},
    "fedprox": {"proximal-mu": 0.5},
    "fedbuff": {"workflow": "fedbuff", "buffer-size": 3, "concurrency": 6},
    "central-dp": {"dp": "central", "dp-noise-multiplier": 0.5, "dp-clip": 1.0},
    "secagg+": {"secure-aggregation": "secagg+", "secagg-clip": 10.0},
    "distributed-dp": {"secure-aggregation": "secagg+", "dp": "distributed", "dp-clip": 0.5,
                       "dp-noise-multiplier": 0.8, "secagg-weighting": "uniform", "secagg-clip": 2.0},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_round_feature_aggregates_the_cnn(tmp_path, feature):
    wf, s = run(tmp_path, **FEATURES[feature])
    first = get_task(wf.cfg.task).init_weights(0)
    assert s["rounds"] == 2 and s["version"] >= 2, s
    assert all(r["accepted"] >= 1 and not r["rejected"] for r in wf.history), wf.history
    assert bool(torch.isfinite(wf.weights).all()) and not torch.equal(wf.weights.cpu(), first)
    if feature.endswith("-dp"):  # noise for a 10k-parameter model over 6 clients swamps two rounds: charged, not learnt
        assert s["epsilon"] > 0
    elif feature != "fedbuff":  # (two releases of three updates, the second stale)
        assert s["final_test_accuracy"] > 0.15  # above chance (0.1) after two rounds


def test_local_dp_trains_the_opacus_fixed_cnn_on_both_sides(tmp_path):
    """BatchNorm cannot be trained by DP-SGD: the model becomes Opacus's GroupNorm fix on the clients and the
    coordinator alike (no running statistics left in the layout). Each client keeps its ledger on disk, as under
    ``fedshield simulate``: one named by the task's file (its path named a file no one could create)."""
    ledgers = tmp_path / "clients"
    for i in range(N):
        (ledgers / f"partition-{i}").mkdir(parents=True)
    wf, s = run(tmp_path, node_config=lambda i: {"partition-id": i, "num-partitions": N,
                                                 STATE_DIR: str(ledgers / f"partition-{i}")},
                **{"dp": "local", "local-noise-multiplier": 0.5})
    assert s["rounds"] == 2 and s["rejected_total"] == 0 and s["local_epsilon_max"] > 0, s
    assert sorted(p.name for p in ledgers.glob("partition-0/*.json")) == [f"{PREFIX}task-cnn_digits.py:CnnDigits.json"]
    assert any(isinstance(m, torch.nn.GroupNorm) for m in wf.model.modules())
    assert not any(e.buffer for e in wf.layout.entries)
    assert wf.numel == get_task(wf.cfg.task).num_parameters(private=True)


def test_a_resumed_cnn_run_continues_from_its_checkpoint(tmp_path):
    wf, _ = run(tmp_path, "resume", **{"num-rounds": 1})
    wf2, s = run(tmp_path, "resume", **{"num-rounds": 2})
    assert s["rounds"] == 2 and len(wf2.history) == 2 and wf2.history[0] == wf.history[0]


@pytest.mark.parametrize("scenario, band", [("cnn-digits", (0.5, 0.99)), ("cifar-resnet", (0.15, 1.0)),
                                            ("next-token", (0.08, 0.7)), ("recommender", (0.3, 0.675))])
def test_each_example_scenario_runs_as_it_is(tmp_path, scenario, band):
    """The examples README points at, shortened to two rounds: each trains its own model above chance (the
    recommender, a regression: its mean absolute error below that of predicting the training mean, 0.684)."""
    scn = load_scenario(EXAMPLES / "scenarios" / f"{scenario}.toml", {"run.num-rounds": 2})
    s = run_scenario(scn, tmp_path / scenario, show_progress=False)
    figure = s["final_test_metrics"]["mae"] if scenario == "recommender" else s["final_test_accuracy"]
    assert s["rounds"] == 2 and band[0] <= figure <= band[1]
    if scenario == "recommender":
        task = get_task(scn.run.task)
        mean_guess = float(np.abs(task.test_set.y - task.train_set.y.mean()).mean())
        assert figure < mean_guess == pytest.approx(0.684, abs=1e-3)
    if scenario == "next-token":  # its own metric, recorded: the test set's perplexity
        assert s["final_test_metrics"] == {"perplexity": pytest.approx(math.exp(s["final_test_loss"]), rel=1e-6)}


def test_federated_evaluation_runs_the_task_evaluate_on_each_clients_held_out_data(tmp_path):
    """Each client evaluates the global model on its share of the test set; the coordinator's weighted mean
    over all of them covers every test example once. FedBN's clients evaluate with their own statistics."""
    wf, s = run(tmp_path, **{"num-rounds": 3, "federated-eval-every": 2})
    rows = {r["round"]: r for r in wf.history}
    assert "fed_eval_nodes" not in rows[1] and rows[2]["fed_eval_nodes"] == N == rows[3]["fed_eval_nodes"]
    test_n = len(get_task(wf.cfg.task).test_set)
    assert rows[3]["fed_eval_examples"] == test_n and not rows[3]["fed_eval_rejected"]
    # the same model on the same examples: the clients' weighted mean is the coordinator's own figure
    assert rows[3]["fed_eval_accuracy"] == pytest.approx(rows[3]["test_accuracy"], abs=1e-6)
    assert rows[3]["fed_eval_loss"] == pytest.approx(rows[3]["test_loss"], rel=1e-4)
    assert s["final_fed_eval_accuracy"] == rows[3]["fed_eval_accuracy"] and s["fed_eval_round"] == 3
    fedbn, s2 = run(tmp_path, "fedbn", task=f"{EXAMPLES / 'tasks' / 'cnn_digits.py'}:CnnDigitsFedBN",
                    **{"num-rounds": 2, "federated-eval-every": 1})
    assert fedbn.history[-1]["fed_eval_nodes"] == N and 0.1 < s2["final_fed_eval_accuracy"] <= 1.0


def test_a_hostile_evaluation_reply_is_refused_and_the_rest_still_count(tmp_path, monkeypatch):
    import clients.client_app as ca

    real = ca.run_evaluate

    def lying(msg, context):
        reply = real(msg, context)
        if context.node_config["partition-id"] == 0:
            reply.content["metrics"]["eval-loss"] = float("nan")
        if context.node_config["partition-id"] == 1:
            reply.content["metrics"]["num-examples"] = 10**15
        return reply

    monkeypatch.setattr(ca, "run_evaluate", lying)
    wf, s = run(tmp_path, **{"num-rounds": 1, "federated-eval-every": 1})
    row = wf.history[-1]
    assert row["fed_eval_rejected"] == {"non-finite": 1, "bad-num-examples": 1} and row["fed_eval_nodes"] == N - 2
    assert 0 < row["fed_eval_loss"] < 10 and s["status"] == "completed"


class Ratings(Task):
    """A regression with metrics of its own (rmse, mae) and no accuracy."""

    y_dtype, num_classes = "float32", None

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1), nn.Flatten(0))

    def load_data(self):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(360, 5)).astype(np.float32)
        y = (x @ np.array([1.0, -2.0, 0.5, 0.0, 1.5]) + rng.normal(0, 0.1, 360)).astype(np.float32)
        return Dataset(x[:300], y[:300]), Dataset(x[300:], y[300:])

    def loss(self, output, target):
        return nn.functional.mse_loss(output, target)

    def metrics(self, output, target):
        return {"rmse": float(nn.functional.mse_loss(output, target).sqrt()), "mae": float((output - target).abs().mean())}


def test_a_tasks_own_metrics_are_recorded_centrally_and_federated(tmp_path):
    """A task's metrics besides loss and accuracy (they were dropped: a regression's run said only 'acc nan'):
    each round's test_metrics and fed_eval_metrics, the summary's, metrics.csv's, the round line's and the report's."""
    from coordinator.progress import format_row, result_text
    from simulations.reports import format_runs, list_runs, report

    wf, s = run(tmp_path, task=task_name(Ratings), partitioning="iid", **{"federated-eval-every": 1})
    for r in wf.history:  # the test set is one batch of evaluate's: its rmse is the square root of its loss
        assert set(r["test_metrics"]) == {"rmse", "mae"} and set(r["fed_eval_metrics"]) == {"rmse", "mae"}
        assert r["test_metrics"]["rmse"] == pytest.approx(math.sqrt(r["test_loss"]), rel=1e-5)
        # every test example once, on the same model: the clients' weighted mean is the coordinator's own mae
        assert r["fed_eval_metrics"]["mae"] == pytest.approx(r["test_metrics"]["mae"], rel=1e-4)
    last = wf.history[-1]
    assert math.isnan(s["final_test_accuracy"]) and s["final_test_metrics"] == last["test_metrics"]
    assert s["final_fed_eval_metrics"] == last["fed_eval_metrics"] and s["final_fed_eval_accuracy"] is None
    mae, rmse = last["test_metrics"]["mae"], last["test_metrics"]["rmse"]  # shown: the first by name
    assert f"  mae {mae:.4g}  loss " in format_row(last, 2) and result_text(s) == f"test mae {mae:.4g}"
    with open(tmp_path / "r" / METRICS) as fh:
        csv_rows = list(csv.DictReader(fh))
    assert json.loads(csv_rows[-1]["test_metrics"]) == pytest.approx(last["test_metrics"])
    assert f"metrics   test mae {mae:.4g}, rmse {rmse:.4g} after round 2" in report(tmp_path / "r")
    row = format_runs(list_runs(str(tmp_path)), str(tmp_path)).splitlines()[1].split()  # fedshield runs
    assert row[3:5] == [f"mae={mae:.4g}", f"mae={last['fed_eval_metrics']['mae']:.4g}"]


def test_a_metric_some_replies_lack_is_the_mean_of_those_that_give_it_and_odd_names_are_refused(tmp_path, monkeypatch):
    import clients.client_app as ca

    real, sent = ca.run_evaluate, {}

    def partial(msg, context):
        reply = real(msg, context)
        metrics, pid = reply.content["metrics"], context.node_config["partition-id"]
        if pid == 0:
            sent["mae"] = metrics["eval-mae"]
        elif pid == 1:
            metrics["eval-\x1b[31mloss"] = 1.0  # a name that would forge terminal colours in the log
        else:
            del metrics["eval-mae"]
            if pid == 2:  # names the task does not give: an accuracy for a regression, one first by name
                metrics["eval-accuracy"], metrics["eval-!"] = 1.0, 5.0
        return reply

    monkeypatch.setattr(ca, "run_evaluate", partial)
    wf, _ = run(tmp_path, task=task_name(Ratings), partitioning="iid",
                **{"num-rounds": 2, "federated-eval-every": 1, "central-eval-every": 0})
    first, row = wf.history  # round 1: no central evaluation yet to name the task's metrics (one is run for them)
    assert "test_metrics" not in first and set(first["fed_eval_metrics"]) == {"mae", "rmse"}
    assert row["fed_eval_rejected"] == {"malformed": 1} and row["fed_eval_nodes"] == N - 1
    assert row["fed_eval_metrics"]["mae"] == pytest.approx(sent["mae"])  # node 0's alone: not diluted by the rest
    assert set(row["fed_eval_metrics"]) == {"mae", "rmse"} and row["fed_eval_accuracy"] is None


def test_the_virtual_engine_runs_a_user_task_on_simulated_time(tmp_path):
    scn = load_scenario(EXAMPLES / "scenarios" / "cnn-digits.toml",
                        {"simulation.engine": "virtual", "run.num-rounds": 2, "run.min-nodes": 4})
    s = run_scenario(scn, tmp_path / "virtual", show_progress=False)
    assert s["rounds"] == 2 and 0.3 <= s["final_test_accuracy"] <= 0.99
    import csv

    rows = list(csv.DictReader(open(tmp_path / "virtual" / "metrics.csv")))
    assert 0 < float(rows[0]["sim_time_s"]) < float(rows[1]["sim_time_s"])  # the simulated devices' clock


def test_secagg_with_local_dp_trains_by_dp_sgd_on_every_client(tmp_path):
    """The masked-input stage carries the local-DP record: each client trains the GroupNorm-fixed CNN by DP-SGD
    (its ledger grows) and masks that update. (It once carried none: clients trained without DP, and the
    coordinator's private layout refused their non-private one.)"""
    from clients.client_app import DP_LEDGER

    cfg = RunConfig.from_mapping({"task": CNN, "num-rounds": 2, "min-nodes": 3, "local-epochs": 1, "seed": 0,
                                  "secure-aggregation": "secagg+", "secagg-clip": 10.0, "dp": "local",
                                  "local-noise-multiplier": 0.8})
    grid = InProcessGrid(app, 3)
    wf = make_workflow(cfg, grid, RunDirectory(tmp_path / "sa"))
    s = wf.run()
    assert s["rounds"] == 2 and all(r["accepted"] == 3 and not r.get("secagg_failure") for r in wf.history)
    assert all(DP_LEDGER in ctx.state for ctx in grid.contexts.values())
