"""fedshield's ServerApp: the synchronous workflow on whatever Grid Flower gives it."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from clients.flower_pins import patch_grid

from .config import RunConfig
from .rundir import LOCK_WAIT_S, RunDirectory, lock_run_dir, unlock_run_dir
from .workflow import Clock, RoundCallback, StoppableClock, SyncWorkflow


def make_workflow(cfg: RunConfig, grid: Grid, run_dir: RunDirectory, clock: Clock | None = None,
                  on_round: RoundCallback | None = None, sim_nodes: int | None = None) -> SyncWorkflow:
    """The round logic ``cfg`` asks for (synchronous, or FedBuff) on this Grid and Clock. ``sim_nodes``: a
    simulation's node count, where the grid does not tell it (Flower's engine): a resume must agree with it."""
    if cfg.asynchrony.workflow == "fedbuff":
        from .async_workflow import BufferedAsyncWorkflow

        return BufferedAsyncWorkflow(cfg, grid, run_dir, clock, on_round, **cfg.asynchrony.workflow_kwargs(),
                                     sim_nodes=sim_nodes)
    return SyncWorkflow(cfg, grid, run_dir, clock=clock, on_round=on_round, sim_nodes=sim_nodes)

HOME_ENV = "FEDSHIELD_HOME"


class OneLineErrors(logging.Filter):
    """Flower logs a ServerApp's exception with its traceback. fedshield's own errors (a run that
    cannot go on, such as too few nodes within wait-nodes-timeout) are messages for the operator, not
    bugs: they are logged as one line (and the run still ends as failed, with that message)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None:
            return True
        from aggregation import AggregationError
        from clients import ClientError
        from privacy import PrivacyError

        from ._errors import CoordinatorError

        if isinstance(exc, CoordinatorError | AggregationError | PrivacyError | ClientError):
            record.msg, record.args = "ServerApp stopped: %s", (exc,)
            record.exc_info, record.exc_text = None, None
        return True


_FLWR_LOGGER = logging.getLogger("flwr")
if not any(isinstance(f, OneLineErrors) for f in _FLWR_LOGGER.filters):
    _FLWR_LOGGER.addFilter(OneLineErrors())


def default_run_dir(run_id: int) -> Path:
    home = Path(os.environ.get(HOME_ENV, Path.home() / ".fedshield"))
    return home / "runs" / f"run-{run_id}"


def make_server_app(
    cfg: RunConfig | None = None, on_round: RoundCallback | None = None, result: dict[str, Any] | None = None,
    stop: threading.Event | None = None, sim_nodes: int | None = None,
) -> ServerApp:
    """A ServerApp running ``cfg`` (or, when None, the config in ``context.run_config``).

    ``result`` (optional) receives the run's summary, for in-process callers. ``stop`` (optional):
    setting it ends the run within one poll interval (RunInterrupted), nothing more saved.
    ``sim_nodes``: a simulation's node count (it sets the data split, so a resume must agree with it).
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        patch_grid()  # replies are pulled from 20 ms on, not 1 s, while their objects upload
        run_cfg = cfg if cfg is not None else RunConfig.from_mapping(context.run_config)
        run_dir = RunDirectory(run_cfg.server.run_dir or default_run_dir(context.run_id))
        # held for the run (under fedshield simulate, this process holds it already); a ServerApp of a coordinator
        # killed a moment ago may still hold it: waited for, a little
        took = lock_run_dir(run_dir.path, "run-dir", wait=LOCK_WAIT_S)
        clock = StoppableClock(stop) if stop is not None else None
        summary = make_workflow(run_cfg, grid, run_dir, clock=clock, on_round=on_round, sim_nodes=sim_nodes).run()
        if took:  # a finished run leaves no lock file behind
            unlock_run_dir(run_dir.path, remove=True)
        if result is not None:
            result.update(summary)

    return app


app = make_server_app()
