"""Flower's own ways in: ``flwr run .`` from pyproject.toml, and stock Flower clients sending bad updates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from coordinator import RunConfig
from coordinator.rundir import SUMMARY
from coordinator.server_app import make_server_app

from .procs import free_port, wait_for

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_flwr_run_dot(tmp_path, procs):
    """``flwr run .`` against a simulation SuperLink on 127.0.0.1 (own port and FLWR_HOME), training a user's own
    task from its file (a CNN with BatchNorm, examples/tasks/cnn_digits.py) named in the run config."""
    app = tmp_path / "fedshield"  # Flower requires the app directory's name to be a valid app name
    app.mkdir()
    for item in ("pyproject.toml", "README.md", "coordinator", "clients", "aggregation", "privacy", "simulations"):
        src = REPO / item
        (shutil.copytree(src, app / item, ignore=shutil.ignore_patterns("__pycache__")) if src.is_dir()
         else shutil.copy(src, app / item))
    home = tmp_path / "flwr-home"
    home.mkdir()
    port = free_port()
    env = {"FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    procs.start("superlink", ["flower-superlink", "--insecure", "--simulation", "--disable-runtime-dependency-installation",
                              "--host", "127.0.0.1", "--port", str(port)], env=env)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "sim"\n[superlink.sim]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    wait_for(lambda: "Starting" in procs.log("superlink") or procs.procs["superlink"].poll() is not None, 30, "SuperLink")
    run_dir = tmp_path / "run"
    task = f"{REPO / 'examples' / 'tasks' / 'cnn_digits.py'}:CnnDigits"
    procs.start("flwr-run", ["flwr", "run", ".", "sim", "--stream",
                             "--federation-config", "num-supernodes=4 client-resources-num-cpus=1",
                             "--run-config", f"num-rounds=2 run-dir='{run_dir}' task='{task}' local-epochs=1 lr=0.05"],
               cwd=app, env=env)
    assert procs.wait("flwr-run", timeout=240) == 0, procs.log("flwr-run")[-3000:]
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert summary["rounds"] == 2 and summary["task"] == task and 0.5 <= summary["final_test_accuracy"] <= 0.99


def _stock_client(kind: str) -> ClientApp:
    """A ClientApp written the stock Flower way, replying with a broken update."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        n = msg.content.array_records["arrays"]["weights"].shape[0]
        delta = np.zeros(n - 7 if kind == "wrong-length" else n, np.float32)
        if kind == "nan":
            delta[::100] = np.nan
        content = RecordDict({"arrays": ArrayRecord({"delta": Array(delta)}),
                              "metrics": MetricRecord({"num-examples": 50, "base-version": 0})})
        return Message(content, reply_to=msg)

    return app


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["wrong-length", "nan"])
def test_stock_flower_client_bad_update_rejected_model_unchanged(tmp_path, kind):
    from flwr.simulation import run_simulation

    cfg = RunConfig.from_mapping({"num-rounds": 2, "min-nodes": 3, "run-dir": str(tmp_path)})
    result: dict = {}
    run_simulation(server_app=make_server_app(cfg, None, result), client_app=_stock_client(kind), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    rule = "bad-array" if kind == "wrong-length" else "non-finite"
    assert result["rejected_by_rule"] == {rule: 6} and result["version"] == 0
    from clients.tasks import get_task

    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["weights"]
    assert torch.equal(saved, get_task(cfg.task).init_weights(cfg.server.seed))  # global model unchanged


@pytest.mark.timeout(300)
def test_flower_engine_and_inprocess_engine_give_the_same_model(tmp_path):
    """One round logic, several backends: Flower's simulation engine (Ray) and the in-process Grid
    run the same workflow; with the same seeds and selection the models agree within float tolerance."""
    from flwr.simulation import run_simulation

    from clients.client_app import app as client_app
    from coordinator import RunDirectory, SyncWorkflow
    from simulations.inprocess import InProcessGrid

    base = {"num-rounds": 3, "min-nodes": 4, "fraction-train": 1.0, "seed": 3, "codec": "topk", "topk-ratio": 0.1}
    cfg = RunConfig.from_mapping({**base, "run-dir": str(tmp_path / "flower")})
    result: dict = {}
    run_simulation(server_app=make_server_app(cfg, None, result), client_app=client_app, num_supernodes=4,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}})
    flower = torch.load(tmp_path / "flower" / "checkpoint.pt", weights_only=True)["weights"]

    local = SyncWorkflow(RunConfig.from_mapping(base), InProcessGrid(client_app, 4), RunDirectory(tmp_path / "local"))
    local.run()
    assert result["rounds"] == 3
    # Same updates, possibly added in another order: float32 rounding only.
    torch.testing.assert_close(flower, local.weights, rtol=1e-4, atol=1e-5)
