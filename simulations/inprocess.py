"""An in-process Grid: calls a ClientApp directly, one node after another.

The seed of fedshield's fast engine (see docs/architecture.md, "One round logic, three
backends"). The round logic runs on it unchanged; replies travel as Flower
``Message`` objects with the same records as over the network.
"""

from __future__ import annotations

import copy
import traceback
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from logging import WARNING

import torch
from flwr.app import ArrayRecord, Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.common.logger import log
from flwr.supercore.run import Run
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from aggregation.wire import tensor_to_array
from clients.client_app import RESIDUAL, app, keep_entries, kept_entries
from clients.protocol import MESSAGE_TYPE_TRAIN, record_of
from clients.secure import RESIDUAL as SECAGG_RESIDUAL

KEPT_STATE = (RESIDUAL, SECAGG_RESIDUAL)  # a node's Context records a resumed simulation restores

ClientFn = Callable[[Message, Context], Message]
_KEPT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32,
                torch.int64, torch.uint8, torch.bool)


def _plain(value: Any) -> bool:
    """A dense tensor in CPU memory (a checkpoint could hold meta, sparse or quantized ones, whose checks raise
    errors of their own)."""
    return (isinstance(value, torch.Tensor) and value.layout == torch.strided and value.device.type == "cpu"
            and not value.is_quantized)


def ensure_task_identity(run_id: int = 1) -> None:
    """Flower builds message metadata from TaskIdentity; set it when outside a Flower run."""
    try:
        TaskIdentity.run_id  # noqa: B018 - raises when unset
    except RuntimeError:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 1


_SHOWN: set[tuple[str, str]] = set()  # client errors logged with their traceback in this process


def call_client(client: ClientFn, msg: Message, ctx: Context) -> Message:
    """Run the client on its own copy of one message (as a transport would deliver it; clients may
    mutate what they receive); like Flower, a raising ClientApp becomes an error reply. fedshield's own
    ClientApp only reads a plain train message (as the batched engine relies on too): it gets the message
    itself (a copy was ~0.35 ms of a CNN client's overhead)."""
    own = client is app and msg.metadata.message_type == MESSAGE_TYPE_TRAIN
    try:
        return client(msg if own else copy.deepcopy(msg), ctx)
    except Exception as exc:  # noqa: BLE001 - the node's failure is the round's data, not the engine's crash
        key = (type(exc).__name__, str(exc)[:200])
        if key not in _SHOWN and len(_SHOWN) < 64:  # the first of each: with its traceback (the user's file:line)
            _SHOWN.add(key)
            log(WARNING, "[fedshield] node %d: client raised %r\n%s", ctx.node_id, exc,
                "".join(traceback.format_exception(exc)).rstrip())
        else:
            log(WARNING, "[fedshield] node %d: client raised %r", ctx.node_id, exc)
        return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(exc)[:500]), reply_to=msg)


class LazyContexts(dict):
    """Nodes 1001..1000+n and their Contexts, each made when first used: a population of a million holds only
    the clients that were sampled. ``in``, ``len`` and iteration cover every node (less those deleted: a node
    that left); ``items()`` and ``values()`` only those made so far (a resume saves the state of those)."""

    def __init__(self, num_nodes: int, make: Callable[[int], Context]) -> None:
        super().__init__()
        self._n, self._make, self._gone = num_nodes, make, set()

    def __contains__(self, node: object) -> bool:
        return isinstance(node, int) and 1001 <= node < 1001 + self._n and node not in self._gone

    def __missing__(self, node: int) -> Context:
        if node not in self:
            raise KeyError(node)
        ctx = self[node] = self._make(node)
        return ctx

    def __delitem__(self, node: int) -> None:
        if node not in self:
            raise KeyError(node)
        self._gone.add(node)
        self.pop(node, None)

    def __len__(self) -> int:
        return self._n - len(self._gone)

    def release_empty(self, nodes: Iterable[int]) -> None:
        """Forget the Contexts of ``nodes`` that are as made (no state kept, such as a residual or FedBN
        statistics, and their configs unchanged): one is made again, alike, when the node is next sampled. A run
        over a million clients held ~640 bytes for each client ever sampled."""
        for node in nodes:
            ctx = dict.get(self, node)
            if ctx is not None and len(ctx.state) == 0:
                fresh = self._make(node)
                if ctx.node_config == fresh.node_config and ctx.run_config == fresh.run_config:
                    dict.pop(self, node)

    def ids(self) -> range | list[int]:
        """Every node's id, ascending: a ``range`` while none has left."""
        ids = range(1001, 1001 + self._n)
        return ids if not self._gone else [n for n in ids if n not in self._gone]

    def __iter__(self):
        return iter(self.ids())


class InProcessGrid(Grid):
    """``num_nodes`` virtual nodes (ids 1001...) running ``client`` in this process.

    ``node_config(i)`` gives node i's node config (default: partition i of num_nodes).
    """

    ENGINE = "inprocess"  # what a checkpoint records (coordinator.workflow.engine_of)
    computes_replies_at_push = True  # the workflow's round-timeout then counts from after the push

    def __init__(self, client: ClientFn, num_nodes: int,
                 node_config: Callable[[int], dict[str, Any]] | None = None, run_id: int = 1) -> None:
        ensure_task_identity(run_id)
        self._client = client
        self._run = Run.create_empty(run_id)
        cfg = node_config or (lambda i: {"partition-id": i, "num-partitions": num_nodes})
        self.contexts = LazyContexts(num_nodes, lambda node: Context(
            run_id=run_id, node_id=node, node_config=cfg(node - 1001), state=RecordDict(), run_config={}))
        self._replies: dict[str, Message] = {}

    # -- resume ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Each node's error-feedback residuals (the part of its updates its codec, or SecAgg+'s
        shared-seed sparsification, has not sent yet) and the entries its model keeps (``layout.local``:
        batch counts, FedBN's statistics), all kept in its Context: a resumed run's clients go on from them,
        as the uninterrupted run's do. Nothing else of a node's state is kept (SecAgg+ keys are not: a resumed
        run sets its next round up afresh; a local-DP ledger lives in the node's state directory). The size is
        one model per node that has a residual, plus its kept entries."""
        kept: dict[str, dict[str, torch.Tensor]] = {}
        local: dict[str, dict[str, torch.Tensor]] = {}
        for node, ctx in self.contexts.items():  # (record_of: Flower's array_records view rebuilds a dict per call)
            for name in KEPT_STATE:
                rec = record_of(ctx.state, name, ArrayRecord)
                if rec is not None and "r" in rec:
                    kept.setdefault(name, {})[str(node)] = torch.from_numpy(rec["r"].numpy().copy())
            entries = kept_entries(ctx)
            if entries:
                local[str(node)] = {k: v.clone() for k, v in entries.items()}
        return {"client-state": kept, "kept-entries": local}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s residuals and kept entries (absent from earlier checkpoints; nodes this
        grid does not have are ignored; a residual of another length, or an entry of another size, is dropped
        by the client)."""
        for name, per_node in dict(state.get("client-state", {})).items():
            if name not in KEPT_STATE:
                raise ValueError(f"client state {name!r} is not one this engine keeps")
            for key, residual in dict(per_node).items():
                node = int(key)
                if not (_plain(residual) and residual.dtype == torch.float32 and residual.dim() == 1):
                    raise TypeError(f"node {node}'s {name} must be a 1-D float32 tensor")
                if not bool(torch.isfinite(residual).all()):  # every later update of the node would be refused
                    raise ValueError(f"node {node}'s {name} must be finite")
                if node in self.contexts:
                    self.contexts[node].state.array_records[name] = ArrayRecord({"r": tensor_to_array(residual)})
        for key, entries in dict(state.get("kept-entries", {})).items():
            node = int(key)
            entries = dict(entries)
            for name, value in entries.items():
                if not (isinstance(name, str) and _plain(value) and value.dim() == 1 and value.dtype in _KEPT_DTYPES):
                    raise TypeError(f"node {node}'s kept entry {name!r} must be a 1-D tensor of a real dtype")
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise ValueError(f"node {node}'s kept entry {name!r} must be finite")
            if node in self.contexts:
                keep_entries(self.contexts[node], entries)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        """The nodes, ascending: a ``range`` while none has left (a million ids are then not listed each round)."""
        return self.contexts.ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids, messages = [], list(messages)
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                continue
            msg.metadata.__dict__["_message_id"] = mid = uuid.uuid4().hex
            self._replies[mid] = call_client(self._client, msg, self.contexts[node])
            ids.append(mid)
        self.contexts.release_empty(m.metadata.dst_node_id for m in messages)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return [self._replies.pop(m) for m in list(message_ids) if m in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        return self.pull_messages(self.push_messages(messages))
