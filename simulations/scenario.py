"""Scenario files: what a simulation runs (TOML, ``[simulation]`` + ``[run]``, and ``[[tiers]]`` of devices
for the virtual-clock engine)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from aggregation._errors import shown, shown_key
from clients.config import ConfigError, build_config, check, parse_toml, resolve_task
from coordinator.config import RunConfig

from .virtual import PROFILE_RULES, DeviceProfile, rule_holds

ENGINES = ("flower", "inprocess", "virtual")


@dataclasses.dataclass(frozen=True)
class SimulationSettings:
    """How the simulation engine is set up."""

    name: str = "default"
    engine: str = "flower"
    num_supernodes: int = 20
    client_cpus: float = 1.0
    client_gpus: float = 0.0
    ray_num_cpus: int = 0
    ray_address: str = ""
    batched: bool = True  # the in-process engine trains a round's clients together where the task allows
    batched_shards: int = 0  # >0: the batched training runs on this many Ray actors (one CPU each)
    sites: int = 0  # edge aggregators between the coordinator and the clients (0: none, clients report directly)

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, "name", "be a non-empty name without '/'", self.name)
        check(self.engine in ENGINES, "engine", f"be one of {list(ENGINES)}", self.engine)
        check(1 <= self.num_supernodes <= 1_000_000, "num-supernodes", "be in [1, 1000000]", self.num_supernodes)
        check(self.client_cpus > 0, "client-cpus", "be > 0", self.client_cpus)
        check(0 <= self.client_gpus <= 1, "client-gpus", "be in [0, 1]", self.client_gpus)
        check(self.ray_num_cpus >= 0, "ray-num-cpus", "be >= 0 (0: all)", self.ray_num_cpus)
        check(0 <= self.batched_shards <= 4096, "batched-shards", "be in [0, 4096] (0: train in this process)",
              self.batched_shards)
        if self.batched_shards:
            check(self.engine == "inprocess" and self.batched and not self.sites, "batched-shards",
                  "be 0 unless engine = 'inprocess' with batched = true and no sites (it shards the in-process "
                  "engine's batched training over Ray actors)", self.batched_shards)
        check(0 <= self.sites <= self.num_supernodes, "sites", "be in [0, num-supernodes] (0: no edge aggregators)",
              self.sites)


TIER_KEYS = {"name": "tier", "fraction": None, "compute-s-per-example": "compute_s_per_example",
             "uplink-mbps": "uplink_mbps", "downlink-mbps": "downlink_mbps", "latency-s": "latency_s",
             "sigma": "sigma", "availability": "availability", "dropout": "dropout"}
REQUIRED_TIER_KEYS = ("name", "fraction", "compute-s-per-example", "uplink-mbps", "downlink-mbps")
# fraction is the scenario's own number; the others are DeviceProfile's, under its rules
TIER_RULES = {"fraction": (0.0, True, 1e6, False, "a number in (0, 1e6] (fractions are normalised to sum to 1)"),
              **{key: PROFILE_RULES[attr] for key, attr in TIER_KEYS.items() if attr in PROFILE_RULES}}


def parse_tiers(items: Any, source: str) -> tuple[tuple[float, DeviceProfile], ...]:
    """``[[tiers]]`` tables -> (fraction, DeviceProfile) pairs for the virtual engine.

    Every message names the key as the file writes it (``tiers[0]: uplink-mbps must ...``).
    """
    check(isinstance(items, list) and bool(items) and all(isinstance(t, Mapping) for t in items),
          f"{source}: tiers", "be a non-empty array of [[tiers]] tables", type(items).__name__)
    out = []
    for i, t in enumerate(items):
        where = f"{source}: tiers[{i}]"
        unknown = sorted(set(t) - set(TIER_KEYS))
        if unknown:
            raise ConfigError(f"{where}.{shown_key(unknown[0])} must be one of the tier keys {sorted(TIER_KEYS)}. "
                              f"Found unknown key {shown(unknown[0], 40)}.")
        for key in REQUIRED_TIER_KEYS:
            check(key in t, f"{where}: {key}", "be given", None)
        check(isinstance(t["name"], str) and bool(t["name"]), f"{where}: name", "be a non-empty string", t["name"])
        for key, rule in TIER_RULES.items():
            if key in t:
                check(rule_holds(t[key], rule), f"{where}: {key}", f"be {rule[-1]}", t[key])
        out.append((float(t["fraction"]), DeviceProfile(**{TIER_KEYS[k]: v for k, v in t.items() if TIER_KEYS[k]})))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Scenario:
    sim: SimulationSettings
    run: RunConfig
    tiers: tuple[tuple[float, DeviceProfile], ...] = ()  # the virtual engine's device tiers (default: DEFAULT_TIERS)
    site: RunConfig | None = None  # each edge aggregator's settings (simulation.sites > 0): see site_config

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "scenario") -> "Scenario":
        unknown = sorted(set(data) - {"simulation", "run", "tiers", "site"})
        if unknown:
            raise ConfigError(f"{source}: [{shown_key(unknown[0])}] is not a known table. Known tables: [simulation], [run], "
                              "[[tiers]], [site].")
        for table in ("simulation", "run", "site"):
            check(isinstance(data.get(table, {}), Mapping), f"{source}: [{table}]", "be a table", data.get(table))
        sim = build_config(SimulationSettings, data.get("simulation", {}), "simulation")
        run = RunConfig.from_mapping(data.get("run", {}))
        if run.server.min_nodes > sim.num_supernodes:
            raise ConfigError(f"run.min-nodes must be <= simulation.num-supernodes={sim.num_supernodes}. Found {run.server.min_nodes}.")
        why = run.release_short_of_nodes(sim.num_supernodes)
        if why:
            raise ConfigError(f"simulation.num-supernodes must be >= run.buffer-size = {run.asynchrony.buffer_size} (a FedBuff "
                              f"release {why} takes one update from each of buffer-size nodes). Found "
                              f"{sim.num_supernodes}.")
        tiers = parse_tiers(data["tiers"], source) if "tiers" in data else ()
        if tiers:  # only the virtual engine simulates devices: tiers under another engine would be ignored silently
            check(sim.engine == "virtual", f"{source}: simulation.engine",
                  "be 'virtual' when the scenario has [[tiers]] (only the virtual engine simulates device tiers; "
                  "use --engine virtual, or remove the [[tiers]] tables)", sim.engine)
        if sim.ray_address:  # only Flower's engine and the sharded batched engine run on Ray: else ignored silently
            check(sim.engine == "flower" or sim.batched_shards > 0, f"{source}: simulation.engine",
                  "be 'flower' when simulation.ray-address is set (only Flower's engine, or the in-process engine "
                  "with batched-shards > 0, runs on a Ray cluster; use --engine flower, or remove ray-address)",
                  sim.engine)
        site = None
        if sim.sites:
            check(sim.engine == "inprocess", f"{source}: simulation.engine", "be 'inprocess' when simulation.sites > 0 "
                  "(edge aggregators are simulated in-process)", sim.engine)
            check(run.server.min_nodes <= sim.sites, f"{source}: run.min-nodes", f"be <= simulation.sites={sim.sites} "
                  "(the coordinator's nodes are the sites)", run.server.min_nodes)
            check(not run.secure.enabled and run.asynchrony.workflow == "sync" and not run.server.federated_eval_every,
                  f"{source}: run", "use neither secure-aggregation, workflow = 'fedbuff' nor federated-eval-every above "
                  "the sites (SecAgg+ runs inside a site: set it in [site]; a site holds no data to evaluate on)",
                  {k: v for k, v in run.to_mapping().items()
                   if k in ("secure-aggregation", "workflow", "federated-eval-every")})
            site = site_config(run, data.get("site", {}))
            smallest = sim.num_supernodes // sim.sites
            check(site.server.min_nodes <= smallest, f"{source}: site.min-nodes", f"be <= {smallest}, the clients of the "
                  f"smallest site ({sim.num_supernodes} clients over {sim.sites} sites)", site.server.min_nodes)
        elif "site" in data:
            raise ConfigError(f"{source}: [site] must come with simulation.sites > 0 (it sets the edge aggregators).")
        return cls(sim=sim, run=run, tiers=tiers, site=site)


def site_config(run: RunConfig, table: Mapping[str, Any]) -> RunConfig:
    """An edge aggregator's settings: the ``[site]`` table's keys over these defaults: the coordinator's task (and
    its data keys) and round timeout, every client of the site asked each round (``fraction-train = 1``,
    ``min-nodes = 1``). The task, the clients' training and the seed come from the coordinator's message;
    a site runs synchronous rounds and no federated evaluation of its own."""
    from clients.config import TaskSpec, config_keys, to_mapping
    from coordinator.site import check_site_config, from_above

    # the site's run-dir is the coordinator's RUN_DIR/sites/site-K; its task is the coordinator's
    fixed = sorted(k for k in table if k in (*from_above(), *config_keys(TaskSpec), "run-dir"))
    if fixed:
        raise ConfigError(f"site.{fixed[0]} is set by the coordinator for every site (its task, model, seed and the "
                          "clients' training come with each round's message): remove it from [site].")
    base = {**to_mapping(run.task), **to_mapping(run.train), "seed": run.server.seed, "min-nodes": 1,
            "fraction-train": 1.0, "round-timeout": run.server.round_timeout, "num-rounds": run.server.num_rounds}
    cfg = RunConfig.from_mapping({**base, **table}, where="site")
    check_site_config(cfg, "site")
    return cfg


def load_scenario(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Scenario:
    """Read a scenario file (the packaged default when ``path`` is None), then apply overrides.

    ``overrides`` maps ``table.key`` (e.g. ``run.num-rounds``) to values.
    """
    if path is None:
        text = resources.files("simulations").joinpath("scenarios/default.toml").read_text()
        source = "default scenario"
    else:
        p = Path(path)
        if not p.is_file():
            what = "a directory" if p.is_dir() else "no such file"
            raise ConfigError(f"scenario must be an existing TOML file. Found {str(p)!r} ({what}).")
        try:
            text, source = p.read_text(encoding="utf-8"), str(p)
        except UnicodeDecodeError as exc:
            raise ConfigError(f"scenario {str(p)!r} must be UTF-8 text (TOML). Found byte "
                              f"0x{exc.object[exc.start]:02x} at offset {exc.start}.") from None
        except OSError as exc:
            raise ConfigError(f"scenario {str(p)!r} must be readable. Found: {exc.strerror or exc}.") from None
    data = parse_toml(text, source)
    run = data.get("run")
    if isinstance(run, dict) and "task" in run:  # a task file: relative to the scenario's own directory
        run["task"] = resolve_task(run["task"], Path(path).resolve().parent if path is not None else None)
    for dotted, value in (overrides or {}).items():
        if dotted == "run.task":
            value = resolve_task(value)
        table, _, key = dotted.partition(".")
        if table not in ("simulation", "run") or not key:
            raise ConfigError(f"--set key must look like run.KEY or simulation.KEY. Found {dotted!r}.")
        section = data.setdefault(table, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{source}: [{table}] must be a table. Found {type(section).__name__}.")
        section[key] = value
    return Scenario.from_mapping(data, source)


def parse_override(text: str) -> tuple[str, Any]:
    """``run.num-rounds=5`` -> ("run.num-rounds", 5); the value is read as TOML, else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set must be KEY=VALUE. Found {shown(text, 80)}.")
    if "\n" in raw or "\r" in raw:  # read as TOML, a second line would set another key, silently dropped
        raise ConfigError(f"--set {key.strip()[:40]}=VALUE must be one line. Found a line break in {shown(raw, 80)}.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except (ValueError, RecursionError):  # not TOML (TOMLDecodeError, a 5000-digit integer, deep nesting): a string
        value = raw
    return key.strip(), value
