"""The batched in-process engine: the same round logic and reply path as the one-by-one in-process Grid, the
clients of a round trained together; the global model agrees within float tolerance, feature by feature."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clients.client_app import app
from clients.tasks import DigitsTask
from coordinator import RunConfig, RunDirectory
from coordinator.server_app import make_workflow
from simulations.batched_grid import BatchedGrid
from simulations.inprocess import InProcessGrid

N = 8
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run(tmp_path, grid, name, **kw):
    cfg = RunConfig.from_mapping({"num-rounds": 3, "min-nodes": N, "local-epochs": 2, "seed": 1, **kw})
    wf = make_workflow(cfg, grid, RunDirectory(tmp_path / name))
    return wf, wf.run()


@pytest.mark.parametrize("settings", [
    {},
    {"codec": "topk", "topk-ratio": 0.05},  # error feedback: each node's residual in its Context
    {"codec": "qsgd"},  # stochastic rounding: draws from the node's generator after training
    {"proximal-mu": 0.3, "momentum": 0.0, "batch-size": 7},
    {"aggregator": "median"},
    {"dp": "central", "dp-noise-multiplier": 0.3, "dp-expected-clients": N},  # noise: compared without it below
], ids=["dense", "topk", "qsgd", "fedprox", "median", "central-dp"])
def test_batched_equals_one_by_one(tmp_path, settings):
    one, s1 = run(tmp_path, InProcessGrid(app, N), "one", **settings)
    grid = BatchedGrid(app, N, chunk=3)
    many, s2 = run(tmp_path, grid, "many", **settings)
    assert grid.batched_messages == 3 * N and s1["rounds"] == s2["rounds"] == 3
    assert [r["accepted"] for r in one.history] == [r["accepted"] for r in many.history] == [N] * 3
    if "dp" in settings:  # the noise comes from the OS: the clipped updates agree, the releases do not
        return
    torch.testing.assert_close(many.weights, one.weights, rtol=1e-4, atol=2e-5)
    assert [round(r["train_loss"], 4) for r in one.history] == [round(r["train_loss"], 4) for r in many.history]


def test_what_cannot_be_batched_trains_one_by_one_with_the_same_result(tmp_path):
    """A BatchNorm CNN (convolutions, on CPU) and local DP go to the ClientApp: nothing batched, the same model."""
    task = f"{EXAMPLES / 'tasks' / 'cnn_digits.py'}:CnnDigits"
    one, _ = run(tmp_path, InProcessGrid(app, 4), "one", task=task, **{"min-nodes": 4, "num-rounds": 1})
    grid = BatchedGrid(app, 4)
    many, _ = run(tmp_path, grid, "many", task=task, **{"min-nodes": 4, "num-rounds": 1})
    assert grid.batched_messages == 0 and torch.equal(one.weights, many.weights)
    grid = BatchedGrid(app, 4)
    run(tmp_path, grid, "dp", **{"min-nodes": 4, "num-rounds": 1, "dp": "local", "local-noise-multiplier": 1.0})
    assert grid.batched_messages == 0


def test_a_node_that_refuses_is_refused_in_the_batch_too(tmp_path):
    """A node whose owner demands local DP refuses a plain round before training, batched or not."""
    cfg = lambda i: {"partition-id": i, "num-partitions": 4, **({"min-local-noise": 1.0} if i == 0 else {})}  # noqa: E731
    grid = BatchedGrid(app, 4, cfg)
    wf, _ = run(tmp_path, grid, "refuse", **{"min-nodes": 4, "num-rounds": 1})
    assert wf.history[0]["accepted"] == 3 and wf.history[0]["rejected_by_rule"] == {"error-reply": 1}
    assert grid.batched_messages == 3


class PlainConvDigits(DigitsTask):
    """Digits as 1x8x8 images through a convolution without BatchNorm: batchable, but not worth it on CPU."""

    input_shape = None

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Unflatten(1, (1, 8, 8)), torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(),
                                   torch.nn.Flatten(), torch.nn.Linear(144, 10))


def test_a_convolutional_model_trains_one_by_one_on_cpu(tmp_path):
    """vmap turns per-client convolutions into grouped ones, slower on CPU than one client at a time."""
    from clients.tasks import task_name

    grid = BatchedGrid(app, 4)
    run(tmp_path, grid, "conv", task=task_name(PlainConvDigits), **{"min-nodes": 4, "num-rounds": 1})
    assert grid.batched_messages == 0 and "convolutions" in next(iter(grid._support.values()))


class FailsUnderVmapDigits(DigitsTask):
    """A loss that fails only under vmap, found once the batched step runs, with an error of many lines (as torch's
    dispatcher errors are: a sparse gradient's ran to 5 kB)."""

    def loss(self, output, target):
        if torch._C._functorch.is_batchedtensor(output):
            raise NotImplementedError("Could not run this op under vmap.\n" + "a backend line\n" * 300)
        return torch.nn.functional.cross_entropy(output, target)


def test_a_batch_that_fails_trains_one_by_one_and_says_why_in_one_line(tmp_path, caplog):
    from clients.tasks import task_name

    one, _ = run(tmp_path, InProcessGrid(app, 4), "one", task=task_name(FailsUnderVmapDigits),
                 **{"min-nodes": 4, "num-rounds": 2})
    grid = BatchedGrid(app, 4)
    with caplog.at_level("WARNING"):
        many, _ = run(tmp_path, grid, "many", task=task_name(FailsUnderVmapDigits), **{"min-nodes": 4, "num-rounds": 2})
    said = [r.getMessage() for r in caplog.records if "batched training failed" in r.getMessage()]
    assert len(said) == 1 and "NotImplementedError: Could not run this op under vmap." in said[0], said
    assert "a backend line" not in said[0] and len(said[0]) < 500  # its first line, once; then one by one
    assert grid.batched_messages == 0 and [r["accepted"] for r in many.history] == [4, 4]
    torch.testing.assert_close(many.weights, one.weights, rtol=1e-4, atol=2e-5)


class LstmDigits(DigitsTask):
    """Digits as 8 rows of 8 read by an LSTM: vmap has no batching rule for its CPU kernel and loops over clients."""

    input_shape = None

    def build_model(self):
        class Rows(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.rnn, self.head = torch.nn.LSTM(8, 16, batch_first=True), torch.nn.Linear(16, 10)

            def forward(self, x):
                return self.head(self.rnn(x.view(-1, 8, 8))[0][:, -1])

        return Rows()


def test_a_model_vmap_runs_client_by_client_trains_one_by_one_from_the_start(tmp_path, caplog, recwarn):
    from clients.tasks import task_name

    one, _ = run(tmp_path, InProcessGrid(app, 4), "one", task=task_name(LstmDigits), **{"min-nodes": 4, "num-rounds": 1})
    grid = BatchedGrid(app, 4)
    with caplog.at_level("INFO"):
        many, _ = run(tmp_path, grid, "many", task=task_name(LstmDigits), **{"min-nodes": 4, "num-rounds": 1})
    why = next(iter(grid._support.values()))
    assert grid.batched_messages == 0 and "no batching rule for aten::" in why, why
    assert sum("clients train one at a time" in r.getMessage() for r in caplog.records) == 1
    assert not [w for w in recwarn if "batching rule" in str(w.message)]  # torch's warning is not shown
    torch.testing.assert_close(many.weights, one.weights, rtol=0, atol=0)


class BatchNormDigits(DigitsTask):
    """The digits MLP with BatchNorm: running statistics federated, the batch count kept on each node."""

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 10))


class FedBNDigits(BatchNormDigits):
    federate_buffers = False


class HeadDigits(DigitsTask):
    # A personal output layer, drawn at random when built, trained under FedProx. (On the BatchNorm MLP, one node
    # whose last batch is 3 examples turns 2e-6 of float noise in round 2's start into 0.03-0.15 of its result.)
    keep_local = ("2.*",)


@pytest.mark.parametrize("task", [BatchNormDigits, FedBNDigits, HeadDigits], ids=["bn", "fedbn", "personal-head"])
def test_batchnorm_trains_batched_and_keeps_each_nodes_entries(tmp_path, task):
    """A BatchNorm model trains batched over 2 rounds under FedProx: each node's kept entries (none for BatchNorm
    alone, whose batch count is unused; FedBN's statistics; a personal head, which starts from the run seed's
    model in both engines, whichever task instance serves a node) carried from round to round in its Context, the
    global model the one-by-one engine's.
    Dividing by a batch of 2-7 examples' deviation amplifies float noise: the two engines differ by up to 1e-4
    (each is 6e-5 to 1.1e-4 from a float64 run); padded batches, BatchNorm's statistics then wrong, differ by 11."""
    from clients.client_app import kept_entries
    from clients.tasks import task_name

    kw = {"task": task_name(task), "batch-size": 7, "num-rounds": 2, "proximal-mu": 0.5}
    one_grid = InProcessGrid(app, N)
    one, _ = run(tmp_path, one_grid, "one", **kw)
    grid = BatchedGrid(app, N, chunk=3)
    many, _ = run(tmp_path, grid, "many", **kw)
    assert grid.batched_messages == 2 * N
    torch.testing.assert_close(many.weights, one.weights, rtol=1e-3, atol=1e-3)
    for node in one_grid.get_node_ids():
        want, got = (kept_entries(g.contexts[node]) for g in (one_grid, grid))
        assert want.keys() == got.keys() == set(task().layout().local)  # (BatchNorm alone: nothing kept)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-3)


def test_a_node_whose_last_batch_is_one_example_trains_batched_as_one_by_one(tmp_path):
    """BatchNorm1d refuses a batch of one example in training: a node whose data leaves one merges it into the
    batch before it, batched or not (such a node failed every round), and stays batched."""
    from clients.tasks import task_name

    sizes = [len(BatchNormDigits().partition(k, N)) for k in range(N)]
    batch = next(b for b in range(5, 64) if 1 <= sum(n % b == 1 for n in sizes) < N // 2)
    kw = {"task": task_name(BatchNormDigits), "batch-size": batch, "num-rounds": 2}
    one, _ = run(tmp_path, InProcessGrid(app, N), "one", **kw)
    grid = BatchedGrid(app, N)
    many, _ = run(tmp_path, grid, "many", **kw)
    assert grid.batched_messages == 2 * N and list(grid._support.values()) == [None]
    for rnd in (one, many):
        assert [r["accepted"] for r in rnd.history] == [N] * 2
    torch.testing.assert_close(many.weights, one.weights, rtol=1e-3, atol=1e-3)


def test_a_node_of_one_example_trains_alone_and_the_rest_stay_batched(tmp_path):
    """A node whose data is one example (a batch of one, whatever the batch size) trains one by one and fails there,
    as it would in any engine; its error no longer turns batching off for the others."""
    import numpy as np

    from clients.tasks import task_name

    x, y = BatchNormDigits().train_set.x[:1], BatchNormDigits().train_set.y[:1]
    np.savez(tmp_path / "one.npz", x=x, y=y)
    cfg = lambda i: {"data-path": str(tmp_path / "one.npz")} if i == 0 else {"partition-id": i, "num-partitions": N}  # noqa: E731
    grid = BatchedGrid(app, N, cfg)
    wf, _ = run(tmp_path, grid, "alone", task=task_name(BatchNormDigits), **{"num-rounds": 1, "min-nodes": N})
    assert grid.batched_messages == N - 1 and list(grid._support.values()) == [None]
    assert wf.history[0]["accepted"] == N - 1 and wf.history[0]["rejected_by_rule"] == {"error-reply": 1}
