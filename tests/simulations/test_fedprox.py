"""FedProx against FedAvg on Synthetic(1,1) (Li et al., 2020, "Federated Optimization in Heterogeneous
Networks", MLSys; their Fig. 1/2): with many local epochs (E = 20) FedAvg's loss oscillates and drifts up on
Synthetic(1,1), while FedProx (mu = 1) keeps improving.

The paper's setup, on the in-process engine: 30 devices, device k holding source k of Synthetic(1,1) (its own
W_k, b_k, v_k: the paper's statistical heterogeneity; the built-in task's label-skew split of the pooled
sources is far milder, and FedAvg does as well as FedProx there), 10 sampled a round (fraction 0.33), E = 20,
batch 10, plain SGD (momentum 0). Step size 0.2 (the paper: 0.01 over 200 rounds): at 0.01 nothing separates
in the rounds a test can afford (10 rounds, seed 0: loss 1.52 FedAvg, 1.63 FedProx); at 0.1 FedProx's loss was
only 1.26-1.33x lower after 20 rounds. The loss is the global model's on the held-out 20% of the same 30
sources (each source keeps its training examples only).

Measured with this file's settings (20 rounds, lr 0.2; loss: the mean over rounds 11-20; acc: final accuracy):

    seed   FedAvg loss  FedProx loss  ratio   FedAvg acc  FedProx acc
    0      2.833        1.793         1.58    0.438       0.574
    1      2.644        1.598         1.65    0.398       0.509
    2      3.508        1.542         2.28    0.326       0.617
    3      3.074        2.113         1.46    0.393       0.594
    4      2.434        1.717         1.42    0.417       0.620

FedAvg's loss over rounds 11-20 is above its best of rounds 1-10 in every seed (by 0.14-1.02: it stopped
improving and oscillates or drifts up); FedProx's is 10-35% below its round-1 loss. The round-to-round change
is not a robust separator (FedAvg's mean |change| over rounds 10-20 was below FedProx's in seed 3), so the
test asserts on the loss levels. At 12 rounds the ratio was 1.28-1.67 (too close to a margin to assert).
The test runs seed 0: ~17-21 s FedAvg plus ~25-35 s FedProx on a shared 2-core machine (the proximal term
costs a sum over the parameters each step), hence slow.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import train_test_split

from clients.client_app import app
from clients.data import save_npz
from clients.tasks import Dataset, get_task
from clients.tasks.digits import TEST_FRACTION
from clients.tasks.synthetic import NUM_SOURCES, PER_SOURCE, synthetic
from coordinator import RunConfig, RunDirectory
from coordinator.server_app import make_workflow
from simulations.inprocess import InProcessGrid

pytestmark = pytest.mark.slow

ROUNDS, SEED = 20, 0
SETTINGS = {"task": "synthetic", "synthetic-alpha": 1.0, "synthetic-beta": 1.0, "data-seed": 0,
            "num-rounds": ROUNDS, "min-nodes": 10, "fraction-train": 0.33, "local-epochs": 20,
            "batch-size": 10, "lr": 0.2, "momentum": 0.0, "seed": SEED}


def source_files(directory: Path, cfg: RunConfig) -> list[str]:
    """One .npz per source of Synthetic(1,1): the source's examples in the task's training split."""
    x, y = synthetic(cfg.task.synthetic_alpha, cfg.task.synthetic_beta, cfg.task.data_seed)
    train, _ = train_test_split(np.arange(len(y)), test_size=TEST_FRACTION, stratify=y, random_state=cfg.task.data_seed)
    # the same split as the task's (else a device could hold the coordinator's test examples)
    assert np.array_equal(x[train], get_task(cfg.task).train_set.x)
    paths = []
    for k in range(NUM_SOURCES):
        rows = train[train // PER_SOURCE == k]
        path = directory / f"source-{k}.npz"
        save_npz(path, Dataset(x[rows], y[rows]), cfg.task)
        paths.append(str(path))
    return paths


def run(directory: Path, mu: float):
    cfg = RunConfig.from_mapping({**SETTINGS, "proximal-mu": mu})
    paths = source_files(directory, cfg)
    # partition-id keys each device's batch order (a data-path would key it by the temporary path)
    grid = InProcessGrid(app, NUM_SOURCES, node_config=lambda k: {"data-path": paths[k], "partition-id": k,
                                                                  "num-partitions": NUM_SOURCES})
    wf = make_workflow(cfg, grid, RunDirectory(directory / "run"))
    summary = wf.run()
    assert summary["status"] == "completed" and summary["rounds"] == ROUNDS, summary
    assert all(r["accepted"] == r["selected"] == 10 and not r["rejected"] for r in wf.history), wf.history
    return wf, summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {name: run(tmp_path_factory.mktemp(name), mu) for name, mu in (("fedavg", 0.0), ("fedprox", 1.0))}


def losses(wf) -> list[float]:
    return [r["test_loss"] for r in wf.history]


def late(values: list[float]) -> float:
    return statistics.mean(values[ROUNDS // 2:])


def test_fedprox_reaches_a_clearly_lower_loss_than_fedavg(runs):
    fedavg, fedprox = losses(runs["fedavg"][0]), losses(runs["fedprox"][0])
    assert all(np.isfinite(fedavg)) and all(np.isfinite(fedprox))
    assert late(fedavg) >= 1.25 * late(fedprox), (fedavg, fedprox)  # measured 1.42-2.28 over seeds 0-4


def test_fedavg_stops_improving_while_fedprox_keeps_learning(runs):
    fedavg, fedprox = losses(runs["fedavg"][0]), losses(runs["fedprox"][0])
    assert late(fedavg) >= min(fedavg[:ROUNDS // 2]), fedavg  # oscillates or drifts up under E = 20
    assert late(fedprox) <= 0.95 * fedprox[0], fedprox  # measured 0.65-0.90 of round 1's


def test_fedprox_ends_more_accurate_than_fedavg(runs):
    fedavg, fedprox = runs["fedavg"][1]["final_test_accuracy"], runs["fedprox"][1]["final_test_accuracy"]
    assert fedprox >= fedavg + 0.05, (fedavg, fedprox)  # measured +0.11 to +0.29


def test_fedprox_learns_within_a_sanity_band(runs):
    """Both bounds: chance is 0.10 and the largest class 0.16; one linear model cannot fit 30 sources'
    different labelling functions (0.51-0.62 measured; loss 1.54-2.11)."""
    wf, summary = runs["fedprox"]
    assert 0.35 <= summary["final_test_accuracy"] <= 0.80, summary
    assert 1.2 <= late(losses(wf)) <= 2.4, losses(wf)
    assert wf.cfg.train.proximal_mu == 1.0 and runs["fedavg"][0].cfg.train.proximal_mu == 0.0
