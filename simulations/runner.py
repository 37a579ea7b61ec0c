"""Run a scenario on Flower's simulation engine (Ray) or the in-process engine."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from coordinator import CoordinatorError, RunDirectory
from coordinator.progress import RoundProgress
from coordinator.server_app import make_server_app, make_workflow
from coordinator.workflow import RoundCallback

from .inprocess import InProcessGrid
from .virtual import VirtualClock, VirtualGrid, tiered_profiles
from .scenario import Scenario


def _backend_config(scn: Scenario) -> dict[str, Any]:
    init: dict[str, Any] = {"logging_level": logging.WARNING}
    if scn.sim.ray_num_cpus:
        init["num_cpus"] = scn.sim.ray_num_cpus
    if scn.sim.ray_address:
        init["address"] = scn.sim.ray_address
    return {
        "client_resources": {"num_cpus": scn.sim.client_cpus, "num_gpus": scn.sim.client_gpus},
        "init_args": init,
    }


def _not_for_our_users(record: logging.LogRecord) -> bool:
    """Drops Flower's notice that ``run_simulation`` (which ``fedshield simulate`` calls for its users)
    is deprecated: nothing a user of fedshield can act on. Everything else passes."""
    return "`run_simulation` function is deprecated" not in record.getMessage()


def run_flower_engine(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The ServerApp and ClientApp under ``flwr.simulation.run_simulation``."""
    from flwr.simulation import run_simulation

    from clients.client_app import app as client_app

    # One torch thread per client actor: actors already fill the cores.
    os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")
    result: dict[str, Any] = {}
    stop = threading.Event()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addFilter(_not_for_our_users)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            run_simulation(
                server_app=make_server_app(scn.run, on_round, result, stop=stop),
                client_app=client_app,
                num_supernodes=scn.sim.num_supernodes,
                backend_config=_backend_config(scn),
            )
    except BaseException:
        # Ctrl-C (or any failure) reaches only this thread: the ServerApp's thread would go on
        # running rounds with no clients (and the interpreter would wait for it at exit).
        stop.set()
        raise
    finally:
        flwr_logger.removeFilter(_not_for_our_users)
    if not result:
        raise CoordinatorError("the simulation must end with a summary. Found none: the ServerApp failed (see the log above).")
    return result


def run_inprocess_engine(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The same workflow on an in-process Grid (clients run one by one, no Ray)."""
    from clients.client_app import app as client_app

    grid = InProcessGrid(client_app, scn.sim.num_supernodes)
    return make_workflow(scn.run, grid, RunDirectory(scn.run.server.run_dir), on_round=on_round).run()


def run_virtual_engine(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The same workflow on the virtual clock: replies arrive at times drawn from device-profile tiers."""
    from clients.client_app import app as client_app

    clock = VirtualClock()
    profiles = tiered_profiles(scn.sim.num_supernodes, scn.tiers or None, seed=scn.run.server.seed)
    grid = VirtualGrid(client_app, scn.sim.num_supernodes, clock, profiles, seed=scn.run.server.seed)
    return make_workflow(scn.run, grid, RunDirectory(scn.run.server.run_dir), clock=clock, on_round=on_round).run()


def run_scenario(scn: Scenario, run_dir: str | Path, show_progress: bool = True) -> dict[str, Any]:
    """Run ``scn`` writing into ``run_dir`` (resuming if it holds a checkpoint)."""
    scn = dataclasses.replace(scn, run=scn.run.replace(run_dir=str(Path(run_dir).resolve())))
    start = RunDirectory(run_dir).load_checkpoint()
    done = int(start["round"]) if start else 0
    from clients.tasks import get_task

    get_task(scn.run.task).partition(0, scn.sim.num_supernodes)  # can the data be split this way? (one clear error)
    engine = {"flower": run_flower_engine, "inprocess": run_inprocess_engine, "virtual": run_virtual_engine}[scn.sim.engine]
    if not show_progress:
        return engine(scn, None)
    title = f"{scn.sim.name} ({scn.sim.engine})"
    with RoundProgress(scn.run.server.num_rounds, title, start=done) as prog:
        return engine(scn, prog.update)
