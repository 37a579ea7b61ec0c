"""Edge aggregators (coordinator.site, simulations.hierarchy): two-level FedAvg is flat FedAvg on the same updates."""

from __future__ import annotations

import pytest
import torch

from clients.client_app import app
from coordinator import RunConfig, RunDirectory, SyncWorkflow
from simulations.hierarchy import site_grid, site_sizes
from simulations.inprocess import InProcessGrid
from simulations.scenario import Scenario, site_config

N = 7  # clients; two sites of 4 and 3


def flat_config(i: int) -> dict:
    return {"partition-id": i, "num-partitions": N}


def top_cfg(tmp_path, name: str, **kw) -> RunConfig:
    base = {"num-rounds": 2, "min-nodes": 2, "task": "digits", "seed": 3, "local-epochs": 1,
            "run-dir": str(tmp_path / name)}
    return RunConfig.from_mapping({**base, **kw})


def two_level(tmp_path, top: RunConfig, site: dict | None = None, sites: int = 2) -> SyncWorkflow:
    grid = site_grid(site_config(top, site or {}), N, sites, top.server.run_dir, flat_config)
    return SyncWorkflow(top, grid, RunDirectory(top.server.run_dir))


def test_site_sizes_are_consecutive_blocks_differing_by_at_most_one():
    assert site_sizes(7, 2) == [4, 3] and site_sizes(7, 7) == [1] * 7 and sum(site_sizes(1000, 3)) == 1000


@pytest.mark.parametrize("optimizer", ["fedavg", "fedadam"])
def test_two_level_fedavg_equals_flat_fedavg(tmp_path, optimizer):
    """Each site replies with its clients' example-weighted mean and their example count: the coordinator's
    weighted mean of the sites' means is the flat weighted mean of the same clients' updates."""
    kw = {"server-optimizer": optimizer, **({"server-lr": 0.01} if optimizer == "fedadam" else {})}
    flat_cfg = top_cfg(tmp_path, "flat", **{**kw, "min-nodes": N})
    flat = SyncWorkflow(flat_cfg, InProcessGrid(app, N, flat_config), RunDirectory(flat_cfg.server.run_dir))
    flat_summary = flat.run()
    tiered = two_level(tmp_path, top_cfg(tmp_path, "tiered", **kw))
    summary = tiered.run()
    assert summary["rounds"] == 2 and summary["rejected_total"] == 0
    assert all(r["accepted"] == 2 for r in tiered.history)  # the coordinator heard from its two sites
    assert torch.allclose(tiered.weights, flat.weights, atol=1e-6, rtol=1e-5)
    assert summary["final_test_accuracy"] == pytest.approx(flat_summary["final_test_accuracy"], abs=1 / 360)
    # each site's rows: all its clients, and the weight it reported upward (its clients' examples)
    for k, size in enumerate(site_sizes(N, 2)):
        rows = tiered.grid.sites.workflows[k].history
        assert [r["accepted"] for r in rows] == [size, size] and all(r["weight_total"] > 0 for r in rows)
        assert (tmp_path / "tiered" / "sites" / f"site-{k}" / "metrics.csv").is_file()


def test_a_site_whose_clients_are_all_refused_is_a_dropped_client_and_the_round_goes_on(tmp_path):
    """Site 1 refuses every update (its own max-update-norm): it replies with an error, the coordinator counts it
    and applies site 0's update alone: its weights equal a run with site 0's clients only."""
    top = top_cfg(tmp_path, "tiered", **{"num-rounds": 1, "min-nodes": 1})
    grid = site_grid(site_config(top, {}), N, 2, top.server.run_dir, flat_config)
    sites = grid.sites.workflows
    sites[1].cfg = sites[1].cfg.replace(max_update_norm=1e-9)
    wf = SyncWorkflow(top, grid, RunDirectory(top.server.run_dir))
    wf.run()
    row = wf.history[0]
    assert row["accepted"] == 1 and row["rejected"] == 1
    assert sites[1].history[0]["rejected_by_rule"] == {"norm-too-large": 3} and sites[1].history[0]["accepted"] == 0
    ref_cfg = top_cfg(tmp_path, "ref", **{"num-rounds": 1, "min-nodes": 4})
    ref = SyncWorkflow(ref_cfg, InProcessGrid(app, N, flat_config), RunDirectory(ref_cfg.server.run_dir))
    ref.select = lambda nodes, rnd: [1001, 1002, 1003, 1004]  # site 0's clients
    ref.run()
    assert torch.allclose(wf.weights, ref.weights, atol=1e-6, rtol=1e-5)


def test_secagg_inside_each_site_gives_the_flat_mean_within_the_rings_rounding(tmp_path):
    """SecAgg+ runs inside each site (the coordinator sees only site aggregates): the result is the flat FedAvg
    within the ring's quantisation."""
    flat_cfg = top_cfg(tmp_path, "flat", **{"num-rounds": 1, "min-nodes": N})
    flat = SyncWorkflow(flat_cfg, InProcessGrid(app, N, flat_config), RunDirectory(flat_cfg.server.run_dir))
    flat.run()
    tiered = two_level(tmp_path, top_cfg(tmp_path, "tiered", **{"num-rounds": 1}),
                       {"secure-aggregation": "secagg+", "min-nodes": 3})
    tiered.run()
    sites = tiered.grid.sites.workflows
    assert [s.history[0]["secagg_survivors"] for s in sites] == site_sizes(N, 2)
    delta_flat, delta = flat.weights - flat.task.init_weights(3, False), tiered.weights - flat.task.init_weights(3, False)
    assert torch.linalg.vector_norm(delta - delta_flat) <= 1e-3 * torch.linalg.vector_norm(delta_flat)


def test_central_dp_in_a_site_weighs_its_noised_sum_by_its_public_count(tmp_path):
    tiered = two_level(tmp_path, top_cfg(tmp_path, "tiered", **{"num-rounds": 1}),
                       {"dp": "central", "dp-noise-multiplier": 1.0, "dp-clip": 0.5, "min-nodes": 3})
    tiered.run()
    for site, size in zip(tiered.grid.sites.workflows, site_sizes(N, 2), strict=True):
        row = site.history[0]
        assert row["epsilon"] > 0 and row["weight_total"] == site.dp_divisor == size


def test_scenario_sites_and_site_table(tmp_path):
    scn = Scenario.from_mapping({"simulation": {"engine": "inprocess", "num-supernodes": N, "sites": 2},
                                 "run": {"min-nodes": 2, "num-rounds": 1},
                                 "site": {"aggregator": "median", "min-nodes": 2}})
    assert scn.site.aggregation.aggregator == "median" and scn.site.server.fraction_train == 1.0
    assert scn.site.task == scn.run.task
    from clients import ConfigError

    for bad, match in (({"site": {"lr": 0.5}}, "site.lr is set by the coordinator"),
                       ({"simulation": {"engine": "virtual", "num-supernodes": N, "sites": 2}},
                        "be 'inprocess' when simulation.sites > 0"),
                       ({"simulation": {"engine": "inprocess", "num-supernodes": N}, "site": {}},
                        r"\[site\] must come with simulation.sites > 0"),
                       ({"run": {"min-nodes": 3}}, r"run.min-nodes must be <= simulation.sites=2"),
                       ({"site": {"min-nodes": 4}}, r"site.min-nodes must be <= 3, the clients of the smallest site"),
                       ({"run": {"min-nodes": 2, "federated-eval-every": 1}}, "nor federated-eval-every above the sites")):
        data = {"simulation": {"engine": "inprocess", "num-supernodes": N, "sites": 2}, "run": {"min-nodes": 2}, **bad}
        with pytest.raises(ConfigError, match=match):
            Scenario.from_mapping(data)


def test_a_site_answers_train_messages_only(tmp_path):
    from flwr.app import Message, RecordDict

    from clients import ClientError

    top = top_cfg(tmp_path, "tiered")
    site = site_grid(site_config(top, {}), N, 2, top.server.run_dir, flat_config).sites.workflows[0]
    with pytest.raises(ClientError, match="answers train messages only"):
        site.answer(Message(RecordDict(), dst_node_id=1001, message_type="evaluate"), None)


def test_a_restarted_site_resumes_whatever_training_the_coordinator_asked_for(tmp_path):
    """The site's checkpoint fingerprints its own settings only: the clients' training and the seed come with each
    message, so a site restarted with its config's defaults resumes (its round count and rows go on)."""
    top = top_cfg(tmp_path, "tiered", **{"num-rounds": 1, "lr": 0.05, "local-epochs": 2})
    two_level(tmp_path, top).run()
    site_cfg = site_config(top_cfg(tmp_path, "tiered"), {}).replace(
        run_dir=str(tmp_path / "tiered" / "sites" / "site-0"))  # lr 0.1, 1 epoch: not what the coordinator sent
    from coordinator.site import SiteWorkflow

    again = SiteWorkflow(site_cfg, InProcessGrid(app, 4, flat_config), RunDirectory(site_cfg.server.run_dir))
    assert again.round == 1 and len(again.history) == 1
