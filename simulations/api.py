"""``simulate``: a run from Python (a notebook, a script) with the user's own task, no TOML needed."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any


def simulate(task: Any = "digits", *, run_dir: str | Path | None = None, show_progress: bool = False,
             **settings: Any) -> dict[str, Any]:
    """Run a simulation and return its summary (``final_test_accuracy``, ``rounds``, ``epsilon``, ...).

    ``task``: a :class:`clients.Task` subclass, or its name / import path as a scenario takes it.
    ``settings``: scenario keys in snake_case: ``engine`` (default ``"inprocess"``), ``num_supernodes`` and the
    other ``[simulation]`` keys; every other key is a ``[run]`` key (``num_rounds=5``, ``dp="central"``).
    ``run_dir``: where results go (default ``runs/NAME-TIMESTAMP``); an existing one resumes.

    Example::

        from simulations import simulate
        summary = simulate(MyTask, num_supernodes=20, num_rounds=10, local_epochs=1)
    """
    from clients.config import resolve_task
    from clients.tasks import task_name

    from .runner import run_scenario
    from .scenario import Scenario, SimulationSettings

    sim_keys = {f.name for f in dataclasses.fields(SimulationSettings)}  # every [simulation] key, sites included

    name = task if isinstance(task, str) else task_name(task)
    if isinstance(task, type) and settings.get("engine", "inprocess") == "flower" and task.__module__ == "__main__":
        from clients.config import ConfigError

        raise ConfigError("task must be importable (package.module:Class or file.py:Class) on Flower's engine, whose "
                          f"Ray workers import it by name. Found {name!r}, defined in __main__.")
    sim = {"engine": "inprocess", **{k.replace("_", "-"): v for k, v in settings.items() if k in sim_keys}}
    run = {"task": resolve_task(name), **{k.replace("_", "-"): v for k, v in settings.items() if k not in sim_keys}}
    sim.setdefault("name", name.rpartition(":")[2].lower() or "run")
    run.setdefault("min-nodes", min(int(sim.get("num-supernodes", 20)), 2))
    scn = Scenario.from_mapping({"simulation": sim, "run": run}, "simulate()")
    where = Path(run_dir) if run_dir is not None else Path("runs") / f"{scn.sim.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return run_scenario(scn, where, show_progress=show_progress)


__all__ = ["simulate"]
