"""A population larger than the data, held lazily: partitioning "sample" draws each client's examples on demand,
the in-process grid makes a node's Context only when it is sampled, and the client data cache is bounded."""

from __future__ import annotations

import numpy as np
import pytest

from clients import TaskSpec
from clients import data as data_mod
from clients.client_app import app
from clients.tasks import get_task
from coordinator import RunConfig, RunDirectory
from coordinator.server_app import make_workflow
from simulations.batched_grid import BatchedGrid
from simulations.inprocess import LazyContexts


def test_sampled_clients_are_deterministic_skewed_and_need_no_population_sized_structure():
    task = get_task(TaskSpec(partitioning="sample", client_examples=30, dirichlet_alpha=0.1))
    a, b = task.client_data(123_456, 1_000_000), task.client_data(123_456, 1_000_000)
    assert len(a) == 30 and np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    other = task.client_data(7, 1_000_000)
    assert not np.array_equal(a.y, other.y)
    # Dirichlet(0.1) mixes: most clients hold few classes (iid draws of 30 would hold ~9.6 of 10 on average)
    held = [len(np.unique(task.client_data(k, 1_000_000).y)) for k in range(200)]
    assert np.mean(held) < 5
    assert not hasattr(task, "_parts")  # no per-partition index lists were built


def test_lazy_contexts_cover_every_node_and_make_only_those_used():
    made = []
    ctxs = LazyContexts(1_000_000, lambda n: made.append(n) or f"ctx{n}")
    assert len(ctxs) == 1_000_000 and 1001 in ctxs and 1_001_000 in ctxs and 1_001_001 not in ctxs and "x" not in ctxs
    assert ctxs[5000] == "ctx5000" and ctxs[5000] == "ctx5000" and made == [5000]
    del ctxs[1001]
    assert 1001 not in ctxs and len(ctxs) == 999_999 and next(iter(ctxs)) == 1002
    with pytest.raises(KeyError):
        ctxs[1001]
    assert list(ctxs.items()) == [(5000, "ctx5000")]


def test_a_million_node_ids_are_a_range_until_one_leaves_and_select_the_same_clients_as_a_list():
    """Listing and sorting a million ids, and copying them for the idle ones, took ~90 ms of a 1M-client round."""
    from coordinator.profiles import select_uniform

    grid = BatchedGrid(app, 1_000_000)
    ids = grid.get_node_ids()
    assert ids == range(1001, 1_001_001)
    assert select_uniform(ids, 100, 0, 3) == select_uniform(list(ids), 100, 0, 3)
    del grid.contexts[1005]
    left = grid.get_node_ids()
    assert isinstance(left, list) and len(left) == 999_999 and 1005 not in left and left == sorted(left)


def test_a_population_of_a_hundred_thousand_trains_only_its_sampled_clients(tmp_path, monkeypatch):
    monkeypatch.setattr(data_mod, "_CACHE_SIZE", 150)
    cfg = RunConfig.from_mapping({"num-rounds": 2, "clients-per-round": 200, "partitioning": "sample",
                                  "client-examples": 12, "local-epochs": 1, "seed": 0})
    grid = BatchedGrid(app, 100_000)
    wf = make_workflow(cfg, grid, RunDirectory(tmp_path))
    s = wf.run()
    assert s["rounds"] == 2 and [r["accepted"] for r in wf.history] == [200, 200]
    assert [r["nodes_online"] for r in wf.history] == [100_000, 100_000]
    assert len(grid.contexts.items()) == 0 and grid.batched_messages == 400  # no node keeps state: none held
    assert len(data_mod._CACHE) <= 150
    assert s["version"] == 2 and bool(wf.weights.isfinite().all())


def test_only_the_contexts_that_keep_state_are_held(tmp_path):
    """Error feedback (top-k) keeps each trained node's residual: those Contexts stay, and only those."""
    cfg = RunConfig.from_mapping({"num-rounds": 2, "clients-per-round": 30, "partitioning": "sample",
                                  "codec": "topk", "topk-ratio": 0.1, "local-epochs": 1, "seed": 0})
    grid = BatchedGrid(app, 10_000)
    wf = make_workflow(cfg, grid, RunDirectory(tmp_path))
    wf.run()
    trained = {n for r in (1, 2) for n in wf.select(list(range(1001, 11_001)), r)}
    assert set(dict(grid.contexts.items())) == trained and all(len(c.state) for _, c in grid.contexts.items())
    grid.contexts[1001].run_config = {"local-epochs": 1}  # a Context changed by its user (a test, an example) stays
    grid.contexts.release_empty([1001])
    assert grid.contexts[1001].run_config == {"local-epochs": 1}


def test_clients_per_round_is_exclusive_with_fraction_and_central_dp():
    from clients import ConfigError

    with pytest.raises(ConfigError, match="fraction-train must be left at 1.0 when clients-per-round is given"):
        RunConfig.from_mapping({"clients-per-round": 10, "fraction-train": 0.5})
    with pytest.raises(ConfigError, match="clients-per-round must be 0 under central DP"):
        RunConfig.from_mapping({"clients-per-round": 10, "dp": "central", "dp-noise-multiplier": 1.0})
