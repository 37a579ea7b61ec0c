"""Two-level simulations: edge aggregators (sites) between the coordinator and the clients.

``simulation.sites = K`` splits the ``num-supernodes`` clients into K sites of consecutive partitions
(sizes differ by at most one). The coordinator's Grid has K nodes, one per site; a train message to
site k runs ``coordinator.site.SiteWorkflow.answer``: one round of the site's own settings (``[site]``)
on its clients' in-process Grid, replied upward as one client with the site's weight. The clients keep
their global partition ids, so their batches are the flat run's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message

from coordinator import RunDirectory
from coordinator.config import RunConfig
from coordinator.site import SiteWorkflow

from .inprocess import InProcessGrid


def site_sizes(clients: int, sites: int) -> list[int]:
    """How many of ``clients`` each of ``sites`` holds: consecutive blocks differing by at most one."""
    return [clients // sites + (1 if k < clients % sites else 0) for k in range(sites)]


class Sites:
    """The simulated edge aggregators of a run: ``client`` is the ClientFn of the coordinator's Grid."""

    def __init__(self, site_cfg: RunConfig, clients: int, sites: int, run_dir: str | Path,
                 node_config: Callable[[int], dict[str, Any]], grid_type: type = InProcessGrid) -> None:
        from clients.client_app import app as client_app

        self.workflows: list[SiteWorkflow] = []
        offset = 0
        for k, size in enumerate(site_sizes(clients, sites)):
            grid = grid_type(client_app, size, lambda j, first=offset: node_config(first + j), run_id=1)
            cfg = site_cfg.replace(run_dir=str(Path(run_dir) / "sites" / f"site-{k}"))
            self.workflows.append(SiteWorkflow(cfg, grid, RunDirectory(cfg.server.run_dir), name=f"site {k}"))
            offset += size

    def client(self, msg: Message, context: Context) -> Message:
        return self.workflows[context.node_config["site"]].answer(msg, context)


def site_grid(site_cfg: RunConfig, clients: int, sites: int, run_dir: str | Path,
              node_config: Callable[[int], dict[str, Any]], grid_type: type = InProcessGrid) -> InProcessGrid:
    """The coordinator's Grid over ``sites`` simulated edge aggregators of ``clients`` clients in all (``.sites``:
    their ``Sites``)."""
    held = Sites(site_cfg, clients, sites, run_dir, node_config, grid_type)
    grid = InProcessGrid(held.client, sites, lambda k: {"site": k})
    grid.sites = held
    return grid


__all__ = ["Sites", "site_grid", "site_sizes"]
