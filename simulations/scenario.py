"""Scenario files: what a simulation runs (TOML, ``[simulation]`` + ``[run]``, and ``[[tiers]]`` of devices
for the virtual-clock engine)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from clients.config import ConfigError, build_config, check
from coordinator.config import RunConfig

from .virtual import DeviceProfile

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

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, "name", "be a non-empty name without '/'", self.name)
        check(self.engine in ENGINES, "engine", f"be one of {list(ENGINES)}", self.engine)
        check(1 <= self.num_supernodes <= 1_000_000, "num-supernodes", "be in [1, 1000000]", self.num_supernodes)
        check(self.client_cpus > 0, "client-cpus", "be > 0", self.client_cpus)
        check(0 <= self.client_gpus <= 1, "client-gpus", "be in [0, 1]", self.client_gpus)
        check(self.ray_num_cpus >= 0, "ray-num-cpus", "be >= 0 (0: all)", self.ray_num_cpus)


TIER_KEYS = {"name": "tier", "fraction": None, "compute-s-per-example": "compute_s_per_example",
             "uplink-mbps": "uplink_mbps", "downlink-mbps": "downlink_mbps", "latency-s": "latency_s",
             "sigma": "sigma", "availability": "availability", "dropout": "dropout"}


def parse_tiers(items: Any, source: str) -> tuple[tuple[float, DeviceProfile], ...]:
    """``[[tiers]]`` tables -> (fraction, DeviceProfile) pairs for the virtual engine."""
    check(isinstance(items, list) and items, f"{source}: [[tiers]]", "be a non-empty array of tables", type(items).__name__)
    out = []
    for i, t in enumerate(items):
        where = f"{source}: tiers[{i}]"
        check(isinstance(t, Mapping), where, "be a table", type(t).__name__)
        unknown = sorted(set(t) - set(TIER_KEYS))
        check(not unknown, f"{where}.{unknown[0] if unknown else ''}", f"be one of {sorted(TIER_KEYS)}", "an unknown key")
        for key in ("name", "fraction", "compute-s-per-example", "uplink-mbps", "downlink-mbps"):
            check(key in t, f"{where}.{key}", "be given", None)
        frac = t["fraction"]
        check(isinstance(frac, int | float) and not isinstance(frac, bool) and frac > 0, f"{where}.fraction",
              "be a number > 0 (fractions are normalised to sum to 1)", frac)
        try:
            profile = DeviceProfile(**{TIER_KEYS[k]: v for k, v in t.items() if TIER_KEYS[k]})
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out.append((float(frac), profile))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Scenario:
    sim: SimulationSettings
    run: RunConfig
    tiers: tuple[tuple[float, DeviceProfile], ...] = ()  # the virtual engine's device tiers (default: DEFAULT_TIERS)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "scenario") -> "Scenario":
        unknown = sorted(set(data) - {"simulation", "run", "tiers"})
        if unknown:
            raise ConfigError(f"{source}: [{unknown[0]}] is not a known table. Known tables: [simulation], [run], "
                              "[[tiers]].")
        for table in ("simulation", "run"):
            check(isinstance(data.get(table, {}), Mapping), f"{source}: [{table}]", "be a table", data.get(table))
        sim = build_config(SimulationSettings, data.get("simulation", {}), "simulation")
        run = RunConfig.from_mapping(data.get("run", {}))
        if run.server.min_nodes > sim.num_supernodes:
            raise ConfigError(f"run.min-nodes must be <= simulation.num-supernodes={sim.num_supernodes}. Found {run.server.min_nodes}.")
        tiers = parse_tiers(data["tiers"], source) if "tiers" in data else ()
        return cls(sim=sim, run=run, tiers=tiers)


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
            raise ConfigError(f"scenario must be an existing TOML file. Found {str(p)!r} (no such file).")
        text, source = p.read_text(), str(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source} must be valid TOML. Found error: {exc}.") from None
    for dotted, value in (overrides or {}).items():
        table, _, key = dotted.partition(".")
        if table not in ("simulation", "run") or not key:
            raise ConfigError(f"--set key must look like run.KEY or simulation.KEY. Found {dotted!r}.")
        data.setdefault(table, {})[key] = value
    return Scenario.from_mapping(data, source)


def parse_override(text: str) -> tuple[str, Any]:
    """``run.num-rounds=5`` -> ("run.num-rounds", 5); the value is read as TOML, else as a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set must be KEY=VALUE. Found {text!r}.")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value
