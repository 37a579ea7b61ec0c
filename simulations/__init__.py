"""fedshield's simulations: scenarios, engines (Flower's Ray engine, in-process, virtual clock), the CLI.

Exports resolve lazily, so the ``fedshield`` entry point (``simulations.cli``) starts
without importing torch or Flower until a command needs them.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "batched_supported": ".batched",
    "train_batched": ".batched",
    "DEFAULT_TIERS": ".virtual",
    "DeviceProfile": ".virtual",
    "InProcessGrid": ".inprocess",
    "Scenario": ".scenario",
    "SimulationSettings": ".scenario",
    "VirtualClock": ".virtual",
    "VirtualGrid": ".virtual",
    "ensure_task_identity": ".inprocess",
    "load_scenario": ".scenario",
    "run_scenario": ".runner",
    "simulate": ".api",
    "tiered_profiles": ".virtual",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
