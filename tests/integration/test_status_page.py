"""The coordinator's status page during a real run: ``fedshield coordinator start --insecure`` with 2 agents,
the page and status.json polled over HTTP on 127.0.0.1 while rounds go by."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from coordinator.rundir import STATUS, SUMMARY, TENSORBOARD

from .procs import free_port, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _get(url: str) -> bytes | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read()
    except (urllib.error.URLError, OSError):
        return None


@pytest.mark.timeout(240)
def test_the_status_page_follows_a_deployed_run(tmp_path, procs, fedshield_bin):
    port = free_port()
    (tmp_path / "c.toml").write_text(f'[coordinator]\nhost = "127.0.0.1"\nport = {port}\n'
                                     '[run]\nrun-dir = "runs/live"\nnum-rounds = 3\nmin-nodes = 2\n'
                                     'wait-nodes-timeout = 120.0\nlocal-epochs = 1\n')
    procs.start("coordinator", [fedshield_bin, "coordinator", "start", "--config", "c.toml", "--insecure"], cwd=tmp_path,
                env={"FLWR_HOME": str(tmp_path / "flwr-home")})
    found: list[str] = []

    def announced() -> bool:
        found[:] = re.findall(r"status page on (http://127\.0\.0\.1:\d+/)", procs.log("coordinator"))
        return bool(found) or procs.procs["coordinator"].poll() is not None

    wait_for(announced, 60, "the coordinator to announce its status page")
    assert found, procs.log("coordinator")[-2000:]
    url = found[0]
    first = json.loads(_get(url + "status.json"))  # before any agent: starting, or waiting for nodes
    assert first["state"] in ("starting", "waiting-for-nodes") and first["num_rounds"] == 3
    for i in range(2):
        procs.start(f"agent{i}", [fedshield_bin, "agent", "start", "--coordinator", f"127.0.0.1:{port}", "--insecure",
                                  "--partition", f"{i}/2", "--state-dir", str(tmp_path / f"agent-state-{i}")],
                    cwd=tmp_path, env={"FLWR_HOME": str(tmp_path / f"agent-home-{i}")})

    seen: list[dict] = []

    def mid_run() -> bool:  # a round done, the run not over: the page shows it live
        body = _get(url + "status.json")
        if body:
            seen.append(json.loads(body))
        return bool(seen) and seen[-1].get("state") == "running" and seen[-1].get("round", 0) >= 1 \
            or procs.procs["coordinator"].poll() is not None

    wait_for(mid_run, 150, "a round to show on the status page", interval=0.3)
    live = seen[-1]
    assert live["state"] == "running" and 1 <= live["round"] < 3, live
    assert live["nodes_online"] == 2 and live["totals"]["accepted"] >= 2 and live["totals"]["bytes_up"] > 0
    page = _get(url).decode()
    assert "fedshield run" in page and "running" in page and "http-equiv=\"refresh\"" in page

    assert procs.wait("coordinator", timeout=150) == 0, procs.log("coordinator")[-3000:]
    assert _get(url + "status.json") is None  # the page went with the coordinator
    run_dir = tmp_path / "runs" / "live"
    final = json.loads((run_dir / STATUS).read_text())
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert final["state"] == "completed" and final["round"] == 3 and final["totals"]["rejected"] == 0
    assert final["last_round"]["test_accuracy"] == pytest.approx(summary["final_test_accuracy"])
    assert list((run_dir / TENSORBOARD).glob("events.out.tfevents.*"))
    rounds = sorted({s["round"] for s in seen if s.get("state") == "running"})
    print(f"\nstatus page saw rounds {rounds} while the run went on")
