"""Edge aggregators deployed: a coordinator, two ``fedshield aggregator start`` processes, two agents each.

Every link is TLS with enrolled keys: the aggregators' keys at the coordinator, each site's agents' keys
at its aggregator. Each aggregator runs its site's round (its clients send QSGD at site 1) and sends one
update up. SecAgg+ inside a site needs 3 clients or more: it is tested in simulation (tests/coordinator/
test_site.py), where a site is the same SiteWorkflow.
"""

from __future__ import annotations

import json

import pytest

from coordinator.rundir import SUMMARY
from coordinator.service import descendants

from .deploy import metrics_rows
from .procs import free_port, running, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def setup_two_levels(tmp_path, rounds: int) -> tuple[int, list[int]]:
    from clients.cli import export_partitions
    from privacy import init_certificates, new_node_key

    init_certificates(tmp_path / "certs")
    for k in range(2):
        init_certificates(tmp_path / f"certs-site-{k}")
        new_node_key(tmp_path / "keys" / f"aggregator-{k}")
    for i in range(4):
        new_node_key(tmp_path / "keys" / f"client-{i}")
    export_partitions("digits", 4, str(tmp_path / "data"))
    top, sites = free_port(), [free_port(), free_port()]
    (tmp_path / "coordinator.toml").write_text(f"""
[coordinator]
host = "127.0.0.1"
port = {top}
enrolled-keys = ["keys/aggregator-0.pub", "keys/aggregator-1.pub"]

[run]
run-dir = "runs/top"
num-rounds = {rounds}
min-nodes = 2
round-timeout = 120
""")
    for k, port in enumerate(sites):
        (tmp_path / f"site-{k}.toml").write_text(f"""
[coordinator]
host = "127.0.0.1"
port = {port}
certs-dir = "certs-site-{k}"
enrolled-keys = ["keys/client-{2 * k}.pub", "keys/client-{2 * k + 1}.pub"]
state-dir = "site-{k}-state"
status-port = -1

[run]
run-dir = "runs/site-{k}"
min-nodes = 2
round-timeout = 60
{'codec = "qsgd"' if k == 1 else ''}

[upstream]
coordinator = "127.0.0.1:{top}"
root-cert = "certs/ca.crt"
key = "keys/aggregator-{k}"
""")
    return top, sites


@pytest.mark.timeout(600)
def test_a_coordinator_two_aggregators_and_two_agents_each(tmp_path, procs, fedshield_bin):
    _, sites = setup_two_levels(tmp_path, rounds=3)
    procs.start("coordinator", [fedshield_bin, "coordinator", "start", "--config", "coordinator.toml"], cwd=tmp_path)
    wait_for(lambda: "enrolled aggregator-1.pub" in procs.log("coordinator"), 90, "the coordinator to enrol the keys")
    for k in range(2):
        procs.start(f"aggregator{k}", [fedshield_bin, "aggregator", "start", "--config", f"site-{k}.toml"], cwd=tmp_path)
    for k in range(2):
        wait_for(lambda k=k: "site ready" in procs.log(f"aggregator{k}") or procs.procs[f"aggregator{k}"].poll() is not None,
                 180, f"aggregator {k}'s site")
        assert procs.procs[f"aggregator{k}"].poll() is None, procs.log(f"aggregator{k}")[-3000:]
    for i in range(4):
        k = i // 2
        home = tmp_path / f"agent-home-{i}"
        home.mkdir()
        procs.start(f"agent{i}", [fedshield_bin, "agent", "start", "--coordinator", f"127.0.0.1:{sites[k]}",
                                  "--root-cert", f"certs-site-{k}/ca.crt", "--key", f"keys/client-{i}",
                                  "--data", f"data/client-{i}.npz"], cwd=tmp_path, env={"FLWR_HOME": str(home)})
    assert procs.wait("coordinator", timeout=420) == 0, (procs.log("coordinator")[-3000:]
                                                         + procs.log("aggregator0")[-3000:])
    rows = metrics_rows(tmp_path / "runs" / "top")
    assert [int(r["round"]) for r in rows] == [1, 2, 3]
    assert all(int(r["accepted"]) == 2 and int(r["rejected"]) == 0 for r in rows)  # the two sites, each round
    summary = json.loads((tmp_path / "runs" / "top" / SUMMARY).read_text())
    # Band: 4 clients behind 2 sites learn in 3 rounds (> 0.75) without a perfect score (leakage)
    assert 0.75 <= summary["final_test_accuracy"] <= 0.995
    for k in range(2):
        site_rows = metrics_rows(tmp_path / "runs" / f"site-{k}")
        assert [int(r["round"]) for r in site_rows] == [1, 2, 3]
        assert all(int(r["accepted"]) == 2 and float(r["weight_total"]) > 0 for r in site_rows)
        if k == 1:  # its clients sent 8-bit QSGD updates, the site a dense one up
            assert all(int(r["update_bytes_up"]) < int(metrics_rows(tmp_path / "runs" / "site-0")[0]["update_bytes_up"]) / 3
                       for r in site_rows)
    print("\ntwo-level deployment, seconds per round:", [round(float(r["round_time_s"]), 2) for r in rows])
    for k in range(2):  # an aggregator serves until stopped; SIGTERM stops everything it started
        tree = descendants(procs.procs[f"aggregator{k}"].pid)
        procs.stop(f"aggregator{k}")
        wait_for(lambda tree=tree: not [p for p in tree if running(p)], 30, f"aggregator {k}'s processes to stop")

