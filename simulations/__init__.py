"""fedshield's simulations: scenarios, engines (Flower's Ray engine, in-process), the CLI."""

from .inprocess import InProcessGrid, ensure_task_identity
from .runner import run_scenario
from .scenario import Scenario, SimulationSettings, load_scenario

__all__ = ["InProcessGrid", "Scenario", "SimulationSettings", "ensure_task_identity", "load_scenario", "run_scenario"]
