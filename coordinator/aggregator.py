"""``fedshield aggregator start``: an edge aggregator, a client to the coordinator above and a coordinator below.

One config file: ``[coordinator]`` for the site's own SuperLink (TLS, the site agents' enrolled keys),
``[run]`` for the site's round (its task, ``min-nodes``, ``round-timeout``, validation limits, codec,
robust rule, SecAgg+, central or local DP), and ``[upstream]`` for the coordinator above (its address,
its CA certificate, this aggregator's node key enrolled there). Steps: start the site's SuperLink and
register its agents' keys (coordinator.service); submit the site's ServerApp (``coordinator.site:app``),
which serves a Unix socket in a fresh 0700 directory; once it serves, start the upward agent
(``fedshield agent start`` in forwarding mode: its warm worker hands each train message from above to the
site and pushes the site's reply back); stream the site's log until stopped (Ctrl-C, SIGTERM), then stop
everything it started.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from clients.cli import parse_address
from clients.config import ConfigError, build_config, check, parse_toml
from clients.supervisor import start_process

from ._errors import CoordinatorError
from .service import Coordinator, CoordinatorFile, load_coordinator_config, stop_groups, tree_groups, write_app_dir
from .rundir import check_run_dir
from .site import SOCKET_KEY, check_site_config


@dataclasses.dataclass(frozen=True)
class UpstreamSettings:
    """The ``[upstream]`` table: the coordinator this aggregator reports to. Paths are relative to the config."""

    coordinator: str = ""  # HOST:PORT of the coordinator above
    root_cert: str = ""  # its CA certificate (ca.crt)
    key: str = ""  # this aggregator's node private key, its public key enrolled at the coordinator above
    poll_interval: float = 0.2  # seconds between the upward node's requests for work (idle 10 s: up to max(3 s, this))

    def __post_init__(self) -> None:
        check(bool(self.coordinator), "coordinator", "be the HOST:PORT of the coordinator above", self.coordinator)
        check(math.isfinite(self.poll_interval) and 0.01 <= self.poll_interval <= 60, "poll-interval",
              "be in [0.01, 60] seconds", self.poll_interval)


def load_aggregator_config(path: str | os.PathLike) -> tuple[CoordinatorFile, UpstreamSettings]:
    """The site's coordinator file and its ``[upstream]`` table, every value checked."""
    cfg = load_coordinator_config(path, tables=("upstream",))
    data = parse_toml(Path(path).read_text(encoding="utf-8"), str(path))
    table = data.get("upstream")
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: [upstream] must be a table naming the coordinator above (coordinator, root-cert, "
                          "key). Found " + ("none." if table is None else f"{type(table).__name__}."))
    up = build_config(UpstreamSettings, table, "upstream")
    parse_address(up.coordinator)
    check_site_config(cfg.run, "run")
    return cfg, up


def _agent_command(cfg: CoordinatorFile, up: UpstreamSettings, insecure: bool) -> list[str]:
    """``fedshield agent start`` for the upward node (forwarding mode: its --site-socket comes last); its task timeout
    outlasts a site round."""
    cmd = [sys.executable, "-c", "import sys; from simulations.cli import entry; sys.exit(entry())", "agent", "start",
           "--coordinator", up.coordinator, "--poll-interval", str(up.poll_interval),
           "--task-timeout", str(2 * cfg.run.server.round_timeout + cfg.run.server.wait_nodes_timeout + 60)]
    if insecure:
        return [*cmd, "--insecure"]
    from privacy import check_ca_certificate, check_node_private_key

    for flag, value, key, checked in (("--root-cert", up.root_cert, "upstream.root-cert", check_ca_certificate),
                                      ("--key", up.key, "upstream.key", check_node_private_key)):
        if not value:
            raise ConfigError(f"{key} must be given unless --insecure. Found none.")
        cmd += [flag, str(checked(cfg.path(value, key)))]  # before anything starts: one line, as the agent says it
    return cmd


def start_aggregator(config: str, insecure: bool = False) -> int:
    cfg, up = load_aggregator_config(config)
    if insecure:
        print("fedshield aggregator: WARNING: --insecure: no TLS and no node authentication, above and below. Use "
              "only for local tests.", file=sys.stderr)
    coord = Coordinator(cfg, insecure)
    cfg = coord.cfg
    coord.check_port_free()
    check_run_dir(Path(cfg.run.server.run_dir), "run.run-dir")  # a file in the way, an unreadable checkpoint: now
    agent_cmd = _agent_command(cfg, up, insecure)  # (its paths checked before anything starts)
    sock_dir = Path(tempfile.mkdtemp(prefix="fedshield-site-"))  # 0700; short: a socket path has ~100 bytes
    socket_path = sock_dir / "site.sock"
    agent_cmd += ["--site-socket", str(socket_path)]
    mode = "INSECURE" if insecure else "TLS + node authentication"
    print(f"fedshield aggregator: site SuperLink on {coord.address} ({mode}), reporting to {up.coordinator}; site rows "
          f"in {cfg.run.server.run_dir}", file=sys.stderr)

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    agent: subprocess.Popen | None = None
    try:
        coord.start_superlink()
        coord.write_cli_config()
        if not insecure:
            coord.register_keys()
        app_dir = write_app_dir(coord.state / "app", cfg.run, serverapp="coordinator.site:app",
                                extra={SOCKET_KEY: str(socket_path)})
        run = threading.Thread(target=coord.submit_and_stream, args=(app_dir,), daemon=True, name="site-run")
        run.start()
        deadline = time.monotonic() + cfg.service.start_timeout + 60
        while not socket_path.exists():  # the site's ServerApp (its imports, its task) serves the socket
            if not run.is_alive() or time.monotonic() > deadline:
                raise CoordinatorError(f"the site's ServerApp must start serving within {cfg.service.start_timeout + 60:g} "
                                       f"s. Found {'its run ended' if not run.is_alive() else 'it did not'}; see the "
                                       "log above.")
            time.sleep(0.2)
        print(f"fedshield aggregator: site ready; connecting to {up.coordinator}", file=sys.stderr, flush=True)
        agent = start_process(agent_cmd)
        while run.is_alive():
            if agent.poll() == 0:  # the coordinator above ended its run after this site answered: done too
                print("fedshield aggregator: the coordinator above is gone after its run; stopping the site",
                      file=sys.stderr, flush=True)
                return 0
            if agent.poll() is not None:
                raise CoordinatorError(f"the upward agent must keep running. Found it ended with exit code "
                                       f"{agent.returncode}; see its lines above.")
            run.join(0.5)
        raise CoordinatorError("the site's run must keep serving. Found it ended; see the log above.")
    finally:
        if agent is not None:
            stop_groups(tree_groups(agent.pid), 15.0, agent.poll)
        coord.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


__all__ = ["UpstreamSettings", "load_aggregator_config", "start_aggregator"]
