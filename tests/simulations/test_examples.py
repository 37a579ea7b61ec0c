"""Every example the README points at parses with the current configuration schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.service import load_coordinator_config
from simulations import load_scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("path", sorted((EXAMPLES / "scenarios").glob("*.toml")), ids=lambda p: p.name)
def test_example_scenarios_load(path):
    scn = load_scenario(path)
    assert scn.sim.name and scn.run.server.num_rounds >= 1


def test_example_coordinator_config_loads():
    cfg = load_coordinator_config(EXAMPLES / "coordinator.toml")
    assert len(cfg.service.enrolled_keys) == 3 and cfg.run.server.min_nodes == 3


def test_example_coordinator_for_sites_pairs_with_the_aggregator():
    """coordinator-sites.toml enrols the aggregator's key, counts sites, and outwaits the site's round."""
    from coordinator.aggregator import load_aggregator_config

    cfg = load_coordinator_config(EXAMPLES / "coordinator-sites.toml")
    site, up = load_aggregator_config(EXAMPLES / "aggregator.toml")
    assert list(cfg.service.enrolled_keys) == [f"{up.key}.pub"] and cfg.run.server.min_nodes == 1
    assert up.coordinator == f"127.0.0.1:{cfg.service.port}" and site.run.task == cfg.run.task
    assert cfg.run.server.round_timeout > site.run.server.round_timeout


def test_example_aggregator_config_loads():
    from coordinator.aggregator import load_aggregator_config

    cfg, up = load_aggregator_config(EXAMPLES / "aggregator.toml")
    assert cfg.run.secure.enabled and up.coordinator == "127.0.0.1:9092" and up.key == "keys/aggregator-0"


def test_packaged_default_scenario_equals_the_example():
    assert load_scenario(None) == load_scenario(EXAMPLES / "scenarios" / "default.toml")
