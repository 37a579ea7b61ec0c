"""clients/secure.py: the node's side of SecAgg+ (its per-round state in Context.state)."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict

from clients.protocol import SECAGG
from clients.secure import STATE, run_secagg_stage
from privacy.secagg.protocol import SecAggParams
from simulations.inprocess import ensure_task_identity


def _setup(ctx: Context, rnd: int, nodes: list[int]) -> None:
    params = SecAggParams.create(rnd, nodes, degree=len(nodes) - 1, threshold=len(nodes) // 2 + 1, bits=32, clip=1.0,
                                 dim=10)
    setup = ConfigRecord({"stage": "setup", **params.to_fields(), "numel": 9, "sparse-ratio": 1.0,
                          "subset-seed": bytes(32), "weighting": "uniform", "max-weight": 1})
    run_secagg_stage(Message(RecordDict({SECAGG: setup}), dst_node_id=nodes[0], message_type="train.secagg",
                             group_id=str(rnd)), ctx)


def _rounds_held(ctx: Context) -> list[int]:
    return sorted(int(k.rsplit(":", 1)[1]) for k in ctx.state if k.startswith(STATE + ":"))


def test_a_node_holds_two_rounds_of_secrets_at_most_whatever_order_setups_come_in():
    """Setups sent in descending round order (40, 39, ...) were all kept: a coordinator could grow every node's
    state, copied between the SuperNode and its ClientApp on each message, without bound (review helper-59)."""
    ensure_task_identity()
    nodes = list(range(1001, 1021))
    ctx = Context(run_id=1, node_id=nodes[0], node_config={}, state=RecordDict(), run_config={})
    for rnd in range(40, 0, -1):
        _setup(ctx, rnd, nodes)
        assert len(_rounds_held(ctx)) <= 2, _rounds_held(ctx)
    assert _rounds_held(ctx) == [1]
    for rnd in (2, 3):  # ascending, as an honest run's: each round's setup forgets the rounds before it
        _setup(ctx, rnd, nodes)
    assert _rounds_held(ctx) == [3]
