"""SecAgg+ through the real service: a TLS SuperLink, 5 SuperNodes, one killed after it shared its keys.

The killed node's pairwise masks are already in its neighbours' inputs; the
coordinator rebuilds its mask key from the survivors' shares, and the global
model must equal the initial model plus the survivors' plain weighted mean.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from flwr.app import Context, Message, RecordDict

from coordinator.rundir import MODEL, SUMMARY

from .procs import wait_for
from .deploy import metrics_rows, setup_deployment, start_agent, start_coordinator

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODES = 5


def _expected_weights(tmp_path, survivors: list[int]) -> torch.Tensor:
    """Initial model + the survivors' weighted mean update, computed here in the test process."""
    from clients.client_app import local_update
    from clients.config import TaskSpec, TrainSettings
    from clients.protocol import ARRAYS, CONFIG, WEIGHTS, TrainInstruction
    from clients.tasks import get_task
    from aggregation import tensor_to_array
    from flwr.app import ArrayRecord

    w0 = get_task(TaskSpec()).init_weights(0)
    instr = TrainInstruction(round=1, version=0, seed=0, task=TaskSpec(), train=TrainSettings())
    msg = Message(RecordDict({ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(w0)}), CONFIG: instr.to_record()}),
                  dst_node_id=1, message_type="train")
    total, weight = torch.zeros_like(w0, dtype=torch.float64), 0
    for i in survivors:
        ctx = Context(run_id=1, node_id=1, node_config={"data-path": str((tmp_path / "data" / f"client-{i}.npz").resolve())},
                      state=RecordDict(), run_config={})
        delta, metrics, _ = local_update(msg, ctx)
        total += delta.double() * metrics["num-examples"]
        weight += metrics["num-examples"]
    return w0 + (total / weight).float()


@pytest.mark.timeout(420)
def test_secagg_round_survives_a_supernode_killed_after_sharing_keys(tmp_path, procs, fedshield_bin):
    port = setup_deployment(tmp_path, fedshield_bin, num_rounds=1, keys=NODES, nodes=NODES, extra="\n".join([
        'secure-aggregation = "secagg+"', "secagg-clip = 10.0", "secagg-stage-timeout = 60.0", ""]))
    start_coordinator(procs, tmp_path, fedshield_bin, "coordinator")
    for i in range(NODES):
        start_agent(procs, tmp_path, fedshield_bin, port, i)
    victim = f"agent{NODES - 1}"
    # Its second reply is the share-keys stage (the first is setup); the next stage's message
    # reaches it only after every node has shared keys and its next poll (3 s), so kill it now.
    wait_for(lambda: procs.log(victim).count("Sent successfully") >= 2, 240, "the victim's share-keys reply", 0.05)
    pid = procs.procs[victim].pid
    supernode = int(open(f"/proc/{pid}/task/{pid}/children").read().split()[0])  # the agent's one child
    os.killpg(supernode, signal.SIGKILL)  # the SuperNode and its ClientApp process, without warning
    assert procs.wait("coordinator", timeout=300) == 0, procs.log("coordinator")[-3000:]

    log = procs.log("coordinator")
    assert f"secagg share-keys: {NODES} of {NODES} nodes in" in log
    assert f"secagg masked-input: {NODES - 1} of {NODES} nodes in" in log
    run_dir = tmp_path / "runs" / "deploy"
    row = metrics_rows(run_dir)[0]
    assert int(row["secagg_survivors"]) == NODES - 1 and int(row["secagg_dropped"]) == 1, row
    assert not row["secagg_failure"]
    summary = json.loads((run_dir / SUMMARY).read_text())
    assert summary["secure_aggregation"] == "secagg+" and summary["secagg_failed_rounds"] == 0
    state = torch.load(run_dir / MODEL, weights_only=True)
    got = torch.cat([v.reshape(-1) for v in state.values()])
    want = _expected_weights(tmp_path, list(range(NODES - 1)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    print(f"\nSecAgg+ deployment, one round with {NODES} nodes and one killed: {float(row['round_time_s']):.1f} s")
