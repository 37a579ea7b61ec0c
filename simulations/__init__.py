"""fedshield's simulations: scenarios, engines (Flower's Ray engine, in-process), the CLI."""

from .inprocess import InProcessGrid, ensure_task_identity
from .runner import run_scenario
from .scenario import Scenario, SimulationSettings, load_scenario
from .virtual import DEFAULT_TIERS, DeviceProfile, VirtualClock, VirtualGrid, tiered_profiles

__all__ = [
    "DEFAULT_TIERS",
    "DeviceProfile",
    "InProcessGrid",
    "Scenario",
    "SimulationSettings",
    "VirtualClock",
    "VirtualGrid",
    "ensure_task_identity",
    "load_scenario",
    "run_scenario",
    "tiered_profiles",
]
