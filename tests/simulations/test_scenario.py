"""Scenario files: what the loader exposes, and one clear line for every bad table or key."""

from __future__ import annotations

from pathlib import Path

import pytest

from clients import ConfigError
from simulations import load_scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
TIERED = (EXAMPLES / "tiered-virtual.toml").read_text()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_run_dir_from_the_file_or_from_set_is_exposed_to_the_cli(tmp_path):
    """`run-dir` in [run] (or --set run.run-dir=...) is what `fedshield simulate` must use without --run-dir."""
    assert load_scenario(None).run.server.run_dir == ""
    target = str(tmp_path / "mydir")
    assert load_scenario(None, {"run.run-dir": target}).run.server.run_dir == target
    scn = tmp_path / "s.toml"
    scn.write_text(f'[simulation]\nengine = "inprocess"\n[run]\nrun-dir = "{target}"\n')
    assert load_scenario(scn).run.server.run_dir == target


@pytest.mark.parametrize("engine", ["flower", "inprocess"])
def test_tiers_under_another_engine_are_refused_after_overrides(tmp_path, engine):
    # as `fedshield simulate tiered-virtual.toml --engine X` passes it: an override of simulation.engine
    with pytest.raises(ConfigError) as info:
        load_scenario(EXAMPLES / "tiered-virtual.toml", {"simulation.engine": engine})
    msg = _one_line(info)
    assert "simulation.engine must be 'virtual' when the scenario has [[tiers]]" in msg and repr(engine) in msg
    no_engine = tmp_path / "no-engine.toml"  # the default engine (flower) with tiers: refused too
    no_engine.write_text(TIERED.replace('engine = "virtual"\n', ""))
    with pytest.raises(ConfigError, match=r"simulation\.engine must be 'virtual'.*Found 'flower'"):
        load_scenario(no_engine)
    assert load_scenario(no_engine, {"simulation.engine": "virtual"}).tiers  # overridden to virtual: fine


@pytest.mark.parametrize("engine", ["inprocess", "virtual"])
def test_a_ray_cluster_named_for_an_engine_without_ray_is_refused(engine):
    """ray-address under the in-process or virtual engine was ignored without a word: the run went
    on this machine while the user believed it on the cluster."""
    with pytest.raises(ConfigError) as info:
        load_scenario(None, {"simulation.engine": engine, "simulation.ray-address": "127.0.0.1:6379"})
    msg = _one_line(info)
    assert "simulation.engine must be 'flower' when simulation.ray-address is set" in msg and repr(engine) in msg
    assert load_scenario(None, {"simulation.ray-address": "127.0.0.1:6379"}).sim.ray_address == "127.0.0.1:6379"


def test_a_huge_value_is_shown_cut_short_in_the_one_line():
    with pytest.raises(ConfigError) as info:
        load_scenario(None, {"run.num-rounds": 1e300})
    msg = _one_line(info)
    assert msg.startswith("run.num-rounds must be in [1, 1000000]. Found 1000") and "... (301 characters)." in msg
    assert len(msg) < 200


@pytest.mark.parametrize(("old", "new", "message"), [
    ("uplink-mbps = 1.0", "uplink-mbps = -1.0", "tiers[0]: uplink-mbps must be a finite number > 0 (Mbit/s). Found -1.0."),
    ("compute-s-per-example = 0.02", "compute-s-per-example = -0.5",
     "tiers[0]: compute-s-per-example must be a finite number >= 0"),
    ("latency-s = 0.03", 'latency-s = "fast"', "tiers[1]: latency-s must be a finite number >= 0 (seconds). Found 'fast'."),
    ("availability = 0.9", "availability = 0.0", "tiers[1]: availability must be a number in (0, 1]. Found 0.0."),
    ("dropout = 0.01", "dropout = 1.0", "tiers[1]: dropout must be a number in [0, 1). Found 1.0."),
    ("fraction = 0.25", "fraction = 0", "tiers[1]: fraction must be a number in (0, 1e6]"),
    ("fraction = 0.25", "fraction = 1e308", "tiers[1]: fraction must be a number in (0, 1e6]"),  # sums overflowed to inf
    ("sigma = 0.3", "sigma = 1e308", "tiers[1]: sigma must be a number in [0, 10]"),  # lognormvariate overflowed
    ('name = "laptop"', "name = 3", "tiers[1]: name must be a non-empty string. Found 3."),
    ('name = "laptop"', "", "tiers[1]: name must be given. Found None."),
    ("sigma = 0.3", "speed = 3", "tiers[1].speed must be one of the tier keys ["),
])
def test_bad_tiers_name_the_key_as_the_file_writes_it(tmp_path, old, new, message):
    bad = tmp_path / "bad.toml"
    assert old in TIERED
    bad.write_text(TIERED.replace(old, new, 1))
    with pytest.raises(ConfigError) as info:
        load_scenario(bad)
    msg = _one_line(info)
    assert msg.startswith(f"{bad}: {message}"), msg
    assert "DeviceProfile" not in msg and "_" not in msg[len(f"{bad}: "):].split(" must ")[0]
    if "speed" in new:
        assert msg.endswith("Found unknown key 'speed'.") and "an unknown key" not in msg


def test_tiers_must_be_an_array_of_tables(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('tiers = 3\n[simulation]\nengine = "virtual"\n')
    with pytest.raises(ConfigError, match=r"tiers must be a non-empty array of \[\[tiers\]\] tables"):
        load_scenario(bad)


def test_the_fedbuff_example_differs_from_the_sync_one_only_in_its_workflow():
    """The two example files the README and tiered-virtual.toml compare: same clients, devices, task and
    number of client updates; one synchronous, one FedBuff."""
    from simulations.virtual import DEFAULT_TIERS

    sync = load_scenario(EXAMPLES / "tiered-virtual.toml")
    fedbuff = load_scenario(EXAMPLES / "tiered-virtual-fedbuff.toml")
    assert sync.run.asynchrony.workflow == "sync" and fedbuff.run.asynchrony.workflow == "fedbuff"
    assert sync.sim.name != fedbuff.sim.name  # one run directory each in a comparison
    assert sync.sim.engine == fedbuff.sim.engine == "virtual"
    assert sync.sim.num_supernodes == fedbuff.sim.num_supernodes
    assert list(fedbuff.tiers or DEFAULT_TIERS) == list(sync.tiers)
    assert (sync.run.task, sync.run.train, sync.run.server.seed) == (fedbuff.run.task, fedbuff.run.train,
                                                                     fedbuff.run.server.seed)
    s, f = sync.run.server, fedbuff.run
    assert s.num_rounds * s.close_after_replies == f.server.num_rounds * f.asynchrony.buffer_size
    assert f.asynchrony.concurrency == s.min_nodes  # as many clients at work as sync asks each round
    for path in (EXAMPLES / "tiered-virtual.toml", EXAMPLES / "tiered-virtual-fedbuff.toml"):
        assert "--set run.workflow=fedbuff ..." not in path.read_text()


def test_load_scenario_names_a_directory_and_bytes_that_are_not_utf8(tmp_path):
    from clients import ConfigError
    from simulations import load_scenario

    with pytest.raises(ConfigError, match=r"\(a directory\)"):
        load_scenario(tmp_path)
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[run]\n")
    with pytest.raises(ConfigError, match="must be UTF-8 text .* byte 0xff at offset 0"):
        load_scenario(binary)


@pytest.mark.parametrize("table", ["run", "simulation"])
def test_a_table_that_is_not_one_is_one_error_with_or_without_overrides(tmp_path, table):
    """``run = 5`` plus any --set used to raise TypeError (item assignment on an int)."""
    scn = tmp_path / "s.toml"
    scn.write_text(f"{table} = 5\n")
    for overrides in ({}, {f"{table}.seed" if table == "run" else "simulation.name": 1}):
        with pytest.raises(ConfigError, match=rf"\[{table}\] must be a table"):
            load_scenario(scn, overrides)
