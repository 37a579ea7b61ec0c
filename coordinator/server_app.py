"""fedshield's ServerApp: the synchronous workflow on whatever Grid Flower gives it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .config import RunConfig
from .rundir import RunDirectory
from .workflow import RoundCallback, SyncWorkflow

HOME_ENV = "FEDSHIELD_HOME"


def default_run_dir(run_id: int) -> Path:
    home = Path(os.environ.get(HOME_ENV, Path.home() / ".fedshield"))
    return home / "runs" / f"run-{run_id}"


def make_server_app(
    cfg: RunConfig | None = None, on_round: RoundCallback | None = None, result: dict[str, Any] | None = None
) -> ServerApp:
    """A ServerApp running ``cfg`` (or, when None, the config in ``context.run_config``).

    ``result`` (optional) receives the run's summary, for in-process callers.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run_cfg = cfg if cfg is not None else RunConfig.from_mapping(context.run_config)
        run_dir = RunDirectory(run_cfg.server.run_dir or default_run_dir(context.run_id))
        summary = SyncWorkflow(run_cfg, grid, run_dir, on_round=on_round).run()
        if result is not None:
            result.update(summary)

    return app


app = make_server_app()
