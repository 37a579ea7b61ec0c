"""The batched engine sharded over Ray actors on 127.0.0.1 (``simulation.batched-shards``): the same run as the
in-process batched engine, to float tolerance, a stochastic codec drawing from the generators the actors
advanced included."""

from __future__ import annotations

import importlib.util
import time

import pytest
import torch

from clients.client_app import app
from coordinator import RunConfig, RunDirectory
from coordinator.server_app import make_workflow
from simulations.batched_grid import BatchedGrid

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs fedshield[simulation]")]


FEDBN = """
import torch
from clients.tasks import DigitsTask

class FedBNDigits(DigitsTask):
    federate_buffers = False  # BatchNorm's statistics and batch count stay on each node

    def build_model(self):
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, 10))
"""


def _run(grid, tmp_path, name, **settings):
    cfg = RunConfig.from_mapping({"num-rounds": 2, "clients-per-round": 12, "partitioning": "sample",
                                  "codec": "qsgd", "qsgd-bits": 4, "local-epochs": 2, "seed": 3, **settings})
    wf = make_workflow(cfg, grid, RunDirectory(tmp_path / name))
    wf.run()
    return wf


def test_sharded_batched_training_equals_the_in_process_batched_engine(tmp_path):
    import ray

    from clients.client_app import kept_entries
    from simulations.ray_shards import ShardedBatchedGrid
    from simulations.runner import local_ray_auth

    (tmp_path / "fedbn.py").write_text(FEDBN)
    fedbn = {"task": f"{tmp_path / 'fedbn.py'}:FedBNDigits", "codec": "dense", "num-rounds": 3, "clients-per-round": 40}
    local = _run(BatchedGrid(app, 500), tmp_path, "local")
    local_bn = _run(bn_grid := BatchedGrid(app, 60), tmp_path, "local-bn", **fedbn)
    with local_ray_auth(joining=False):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
        try:
            grid = ShardedBatchedGrid(app, 500, shards=2)
            sharded = _run(grid, tmp_path, "sharded")
            workers = list(grid._workers)  # (held here: an actor whose last handle goes is ended by Ray anyway)
            grid.close()  # (their CPUs, for the next grid's actors)
            deadline = time.monotonic() + 60  # (ray.kill is asynchronous: the actors' CPUs come back shortly)
            while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert grid._workers == [] and ray.available_resources().get("CPU", 0) == 2
            del workers
            sharded_bn = _run(sharded_bn_grid := ShardedBatchedGrid(app, 60, shards=2), tmp_path, "sharded-bn", **fedbn)
        finally:
            ray.shutdown()
    assert grid.batched_messages == 24 and local.history[-1]["accepted"] == 12
    assert [r["accepted"] for r in sharded.history] == [r["accepted"] for r in local.history]
    assert sharded.version == local.version == 2
    torch.testing.assert_close(sharded.weights, local.weights, rtol=1e-5, atol=1e-6)
    # FedBN: each node's statistics go to the actors and come back to its Context (3 rounds of 40 of 60 nodes:
    # most are sampled again and start from what they kept)
    assert sharded_bn_grid.batched_messages == bn_grid.batched_messages == 120
    torch.testing.assert_close(sharded_bn.weights, local_bn.weights, rtol=1e-5, atol=1e-6)
    kept = {node: kept_entries(ctx) for node, ctx in bn_grid.contexts.items()}
    assert len(kept) > 40 and all("1.running_mean" in k for k in kept.values())
    for node, want in kept.items():
        got = kept_entries(sharded_bn_grid.contexts[node])
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_simulate_runs_sharded_and_refuses_more_shards_than_cpus(tmp_path):
    from coordinator import CoordinatorError
    from simulations import simulate

    s = simulate("digits", run_dir=tmp_path / "run", engine="inprocess", batched_shards=2, ray_num_cpus=2,
                 num_supernodes=20, num_rounds=3, partitioning="iid", local_epochs=1)
    assert s["rounds"] == 3 and 0.5 <= s["final_test_accuracy"] <= 0.99  # learnt; no perfect score from leakage
    with pytest.raises(CoordinatorError, match="batched-shards must be <= the 2 CPUs of the Ray instance") as info:
        simulate("digits", run_dir=tmp_path / "big", engine="inprocess", batched_shards=3, ray_num_cpus=2,
                 num_supernodes=20, num_rounds=1)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("settings", "rule"), [
    ({"engine": "flower", "batched_shards": 2}, "batched-shards must be 0 unless engine = 'inprocess'"),
    ({"engine": "inprocess", "batched": False, "batched_shards": 2}, "with batched = true"),
    ({"engine": "inprocess", "ray_address": "127.0.0.1:1"}, "simulation.engine must be 'flower' when simulation.ray-address"),
    ({"engine": "inprocess", "batched_shards": -1}, "batched-shards must be in [0, 4096]"),
])
def test_shards_where_they_cannot_apply_are_one_line(tmp_path, settings, rule):
    from clients import ConfigError
    from simulations import simulate

    with pytest.raises(ConfigError) as info:
        simulate("digits", run_dir=tmp_path / "r", num_supernodes=4, num_rounds=1, **settings)
    assert rule in str(info.value) and "\n" not in str(info.value)
