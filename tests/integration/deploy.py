"""A deployment on 127.0.0.1 for integration tests: certificates, keys, data, coordinator config, processes."""

from __future__ import annotations

import csv

from coordinator.rundir import METRICS

from .procs import free_port, wait_for


def setup_deployment(tmp_path, fedshield_bin, num_rounds: int, keys: int = 4, nodes: int = 3, extra: str = "",
                     min_nodes: int | None = None, round_timeout: float = 120.0, wait_nodes_timeout: float = 120.0):
    # The library calls behind `fedshield certs init`, `keys new` and `data export` (their CLI is tested in
    # tests/simulations/test_cli.py): each CLI process imported torch, ~3 s, up to 8 per deployment test.
    from clients.cli import export_partitions
    from privacy import init_certificates, new_node_key

    init_certificates(tmp_path / "certs")
    for i in range(keys):
        new_node_key(tmp_path / "keys" / f"client-{i}")
    export_partitions("digits", nodes, str(tmp_path / "data"))
    port = free_port()
    (tmp_path / "coordinator.toml").write_text(f"""
[coordinator]
host = "127.0.0.1"
port = {port}
enrolled-keys = [{", ".join(f'"keys/client-{i}.pub"' for i in range(nodes))}]

[run]
run-dir = "runs/deploy"
num-rounds = {num_rounds}
min-nodes = {min_nodes or nodes}
wait-nodes-timeout = {wait_nodes_timeout}
round-timeout = {round_timeout}
{extra}""")
    return port


def start_agent(procs, tmp_path, fedshield_bin, port, i, key=None, data=None, name=None, extra=()):
    home = tmp_path / f"agent-home-{name or i}"
    home.mkdir(exist_ok=True)
    return procs.start(name or f"agent{i}", [
        fedshield_bin, "agent", "start", "--coordinator", f"127.0.0.1:{port}", "--root-cert", "certs/ca.crt",
        "--key", key or f"keys/client-{i}", "--data", data or f"data/client-{i}.npz", *extra,
    ], cwd=tmp_path, env={"FLWR_HOME": str(home)})


def start_coordinator(procs, tmp_path, fedshield_bin, name, nodes: int = 3):
    procs.start(name, [fedshield_bin, "coordinator", "start", "--config", "coordinator.toml"], cwd=tmp_path)
    wait_for(lambda: f"enrolled client-{nodes - 1}.pub" in procs.log(name) or procs.procs[name].poll() is not None,
             90, "the coordinator to enrol the keys")
    assert procs.procs[name].poll() is None, procs.log(name)[-2000:]


def metrics_rows(run_dir):
    with open(run_dir / METRICS) as fh:
        return list(csv.DictReader(fh))
