"""Flower ClientApps written with Flower's public API only (flwr.clientapp / flwr.app), in one in-process
fedshield run beside fedshield's own clients.

What fedshield does with them (measured, flwr 1.42):

* A client in the shape of Flower's PyTorch quickstart (``model.load_state_dict(msg.content["arrays"]
  .to_torch_state_dict())``) cannot load fedshield's flat ``"weights"`` array into its model: it raises,
  the node's reply is an error, and the coordinator rejects it under rule ``error-reply`` with the
  client's exception as the reason: ``code 2: 'RuntimeError(\\'Error(s) in loading state_dict for Linear:
  ... Missing key(s) in state_dict: "weight", "bias". ... Unexpected key(s) in state_dict: "weights".
  \\')'``.
* One adapted to load ``"weights"`` but replying its full ``state_dict`` (arrays ``weight``, ``bias``) is
  rejected under ``missing-record``: "reply must hold a 'codec' record, or exactly the array 'delta'".
* A plain client replying ``{"delta": flat float32}`` with ``num-examples`` only is rejected under
  ``missing-base-version`` ("metrics must give base-version, ..."): the plain format also needs the metric
  ``base-version`` echoed from ``config["version"]``. With it, the reply is aggregated as a plain FedAvg
  client's (weighted by ``num-examples``).

Each rejection costs its reply only: the run completes every round on the fedshield clients' updates, and
its global model is exactly that of a run without the Flower nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from clients.client_app import app as fedshield_app
from clients.tasks import get_task
from clients.tasks.synthetic import synthetic
from coordinator import RunConfig, RunDirectory
from coordinator.server_app import make_workflow
from simulations.inprocess import InProcessGrid

N_FEDSHIELD, N_FLOWER, ROUNDS = 4, 2, 2
FLOWER_NODES = {1001 + N_FEDSHIELD + i for i in range(N_FLOWER)}  # the last node ids of the grid
CONFIG = {"task": "synthetic", "num-rounds": ROUNDS, "local-epochs": 1, "lr": 0.05, "seed": 0}

# --- the Flower side: public API only (its own model, its own data) ------------------------------------------------

X, Y = synthetic(1.0, 1.0, 7)  # the Flower client's own data (another draw of the same kind)


def Net() -> nn.Module:  # noqa: N802 - the quickstart's name
    return nn.Linear(60, 10)


def train_fn(model: nn.Module, n: int, epochs: int, lr: float) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = torch.from_numpy(X[:n]), torch.from_numpy(Y[:n])
    loss = torch.tensor(float("nan"))
    for _ in range(epochs):
        for xb, yb in zip(x.split(32), y.split(32), strict=True):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
    return loss.item()


quickstart = ClientApp()


@quickstart.train()
def quickstart_train(msg: Message, context: Context) -> Message:
    """Flower's PyTorch quickstart ClientApp (flwr 1.2x+ Message API), as written there."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    train_loss = train_fn(model, 100, context.run_config["local-epochs"], msg.content["config"]["lr"])
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": train_loss, "num-examples": 100})})
    return Message(content=content, reply_to=msg)


def _load_flat(model: nn.Module, msg: Message) -> torch.Tensor:
    flat = torch.from_numpy(msg.content["arrays"]["weights"].numpy().copy())
    nn.utils.vector_to_parameters(flat, model.parameters())
    return flat


adapted = ClientApp()


@adapted.train()
def adapted_train(msg: Message, context: Context) -> Message:
    """The quickstart taught to read fedshield's flat "weights", still replying its full weights by name."""
    model = Net()
    _load_flat(model, msg)
    train_loss = train_fn(model, 100, context.run_config["local-epochs"], msg.content["config"]["lr"])
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": train_loss, "num-examples": 100})})
    return Message(content=content, reply_to=msg)


def plain_delta_app(echo_version: bool) -> ClientApp:
    """A Flower-API-only client in fedshield's plain format: arrays {"delta": new - old, flat float32}."""
    plain = ClientApp()

    @plain.train()
    def plain_train(msg: Message, context: Context) -> Message:
        model = Net()
        old = _load_flat(model, msg)
        n = 60 + 20 * (context.node_id % 3)  # clients of different sizes: the weighting shows
        train_loss = train_fn(model, n, 1, msg.content["config"]["lr"])
        delta = nn.utils.parameters_to_vector(model.parameters()).detach() - old
        metrics = {"train_loss": train_loss, "num-examples": n}
        if echo_version:
            metrics["base-version"] = msg.content["config"]["version"]
        content = RecordDict({"arrays": ArrayRecord({"delta": Array(delta.numpy())}), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    return plain


# --- the run ----------------------------------------------------------------------------------------------------------

Sent = list[tuple[int, int, np.ndarray, np.ndarray | None, int | None]]  # (round, node, weights, delta, num-examples)


def mixed(flower: ClientApp, sent: Sent) -> Callable[[Message, Context], Message]:
    """One ClientApp for the grid: Flower's on FLOWER_NODES, fedshield's on the others; records every delta
    a reply carries in the plain or fedshield's dense format (for the FedAvg check)."""

    def dispatch(msg: Message, ctx: Context) -> Message:
        weights = msg.content["arrays"]["weights"].numpy().copy()
        reply = (flower if ctx.node_id in FLOWER_NODES else fedshield_app)(msg, ctx)
        delta = num = None
        if not reply.has_error():
            arrays = reply.content["arrays"]
            name = next((k for k in ("delta", "values") if k in arrays), None)
            delta = arrays[name].numpy().copy() if name else None
            num = reply.content["metrics"].get("num-examples")
        sent.append((int(msg.metadata.group_id), ctx.node_id, weights, delta, num))
        return reply

    return dispatch


def run(tmp_path, client, name: str, nodes: int = N_FEDSHIELD + N_FLOWER, drop_flower: bool = False):
    grid = InProcessGrid(client, nodes)
    for node in FLOWER_NODES & set(grid.contexts):
        grid.contexts[node].run_config = {"local-epochs": 1}  # what the quickstart reads from its app's pyproject
        if drop_flower:  # the reference: the same fedshield nodes and partitions, no Flower nodes at all
            del grid.contexts[node]
    online = len(grid.contexts)
    cfg = RunConfig.from_mapping({**CONFIG, "min-nodes": online})
    wf = make_workflow(cfg, grid, RunDirectory(tmp_path / name))
    return wf, wf.run()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The fedshield nodes alone (partitions i of 6, as in the mixed runs)."""
    wf, s = run(tmp_path_factory.mktemp("ref"), fedshield_app, "ref", drop_flower=True)
    assert s["rounds"] == ROUNDS and all(r["accepted"] == N_FEDSHIELD and not r["rejected"] for r in wf.history)
    return wf


@pytest.fixture
def flwr_log(caplog):
    """Flower's logger (fedshield's log lines) propagates to the root logger caplog listens on."""
    with caplog.at_level(logging.WARNING):
        yield caplog


QUICKSTART_CASES = {
    "quickstart": (quickstart, "error-reply", ["code 2: ", "Error(s) in loading state_dict for Linear",
                                               'Missing key(s) in state_dict: "weight", "bias"',
                                               'Unexpected key(s) in state_dict: "weights"']),
    "quickstart-reading-weights": (adapted, "missing-record",
                                   ["reply must hold a 'codec' record, or exactly the array 'delta'"]),
}


@pytest.mark.parametrize("case", list(QUICKSTART_CASES))
def test_a_flower_quickstart_client_is_rejected_each_round_and_the_run_goes_on(tmp_path, flwr_log, reference, case):
    flower, rule, reason = QUICKSTART_CASES[case]
    sent: Sent = []
    wf, s = run(tmp_path, mixed(flower, sent), case)
    assert s["status"] == "completed" and s["rounds"] == ROUNDS, s
    for row in wf.history:
        assert row["selected"] == N_FEDSHIELD + N_FLOWER, row
        assert row["accepted"] == N_FEDSHIELD and row["rejected"] == N_FLOWER, row
        assert row["rejected_by_rule"] == {rule: N_FLOWER}, row
    assert s["rejected_by_rule"] == {rule: N_FLOWER * ROUNDS}
    # one clear, named rejection per Flower reply, with the reason
    lines = [r.getMessage() for r in flwr_log.records if "rejected reply from node" in r.getMessage()]
    assert len(lines) == N_FLOWER * ROUNDS, lines
    for rnd in range(1, ROUNDS + 1):
        for node in FLOWER_NODES:
            head = f"[fedshield] round {rnd}: rejected reply from node {node} ({rule}): "
            [line] = [x for x in lines if x.startswith(head)]
            assert all(part in line for part in reason), line
    # the fedshield clients' updates were aggregated, the rejected replies left no trace
    assert bool(torch.isfinite(wf.weights).all())
    assert not torch.equal(wf.weights.cpu(), get_task(wf.cfg.task).init_weights(0))
    assert 0.6 <= s["final_test_accuracy"] <= 0.99
    torch.testing.assert_close(wf.weights, reference.weights, rtol=0, atol=0)


@pytest.mark.parametrize("echo_version", [False, True], ids=["num-examples-only", "with-base-version"])
def test_a_plain_flower_client_sending_a_delta(tmp_path, flwr_log, reference, echo_version):
    """{"delta": flat float32} and num-examples: the protocol's plain format. Without "base-version" it is
    refused under missing-base-version (the coordinator cannot tell which model it trained from); with it, it is
    aggregated as a plain FedAvg client, weighted by its num-examples."""
    sent: Sent = []
    wf, s = run(tmp_path, mixed(plain_delta_app(echo_version), sent), "plain")
    assert s["status"] == "completed" and s["rounds"] == ROUNDS, s
    assert bool(torch.isfinite(wf.weights).all())
    if not echo_version:
        for row in wf.history:
            assert row["accepted"] == N_FEDSHIELD and row["rejected_by_rule"] == {"missing-base-version": N_FLOWER}, row
        lines = [r.getMessage() for r in flwr_log.records if "(missing-base-version)" in r.getMessage()]
        assert len(lines) == N_FLOWER * ROUNDS and all("metrics must give base-version" in x for x in lines)
        torch.testing.assert_close(wf.weights, reference.weights, rtol=0, atol=0)
        return
    for row in wf.history:
        assert row["accepted"] == N_FEDSHIELD + N_FLOWER and row["rejected"] == 0, row
    assert not any("rejected reply" in r.getMessage() for r in flwr_log.records)
    # the last round's step is the num-examples-weighted mean of its deltas (fedavg, server-lr 1)
    last = [(w, d, n) for rnd, _, w, d, n in sent if rnd == ROUNDS]
    assert len(last) == N_FEDSHIELD + N_FLOWER and len({n for *_, n in last}) > 1
    base = torch.from_numpy(last[0][0])
    assert all(np.array_equal(w, last[0][0]) for w, _, _ in last)
    step = sum(n * torch.from_numpy(d) for _, d, n in last) / sum(n for *_, n in last)
    torch.testing.assert_close(wf.weights.cpu(), base + step, rtol=0, atol=1e-6)
    assert not torch.equal(wf.weights.cpu(), reference.weights.cpu())  # the Flower clients' deltas count
