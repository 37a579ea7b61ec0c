"""Every Flower internal the warm agent relies on, pinned to flwr 1.42 in this one module.

The agent's SuperNode is stock Flower with its waits shortened (a 3 s sleep after an empty pull, 0.5 s
polls for a reply, object-pull retries from 1 s), and its ClientApp worker speaks the SuperNode's Runtime
API directly (acquire a task, pull its input, push the reply and the context) so that one process serves
every message. tests/clients/test_flower_pins.py fails by name when an upgrade moves any of these.

Runs as a script (``python flower_pins.py supernode ARGS``): it imports only the standard library and
flwr, never this package (whose import loads torch).
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
import types
from typing import Any

FLWR_VERSION = "1.42.0"

# (module, attribute): what this module reads or replaces; the test imports each.
PINNED = (
    ("flwr.supernode.start_client_internal", "time"),
    ("flwr.supernode.start_client_internal", "pull_objects"),
    ("flwr.supernode.start_client_internal", "_pull_and_store_message"),
    ("flwr.supernode.cli.flower_supernode", "flower_supernode"),
    ("flwr.supernode.cli.flower_supernode", "_start_supernode_http_api"),
    ("flwr.superlink.grid.http_grid", "pull_objects"),
    ("flwr.superlink.grid.http_grid", "inflate_object_from_contents"),
    ("flwr.superlink.grid.http_grid", "HttpGrid"),
    ("flwr.app.message.message", "make_message"),
    ("flwr.supercore.inflatable.inflatable_object", "get_object_body"),
    ("flwr.common.serde_utils", "metadata_from_proto"),
    ("flwr.supernode.runtime.run_clientapp", "pull_and_inflate_object_from_tree"),
    ("flwr.supercore.runtime", "RuntimeHttpClient"),
    ("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor"),
    ("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor"),
    ("flwr.supercore.interceptors", "SuperExecAuthHttpInterceptor"),
    ("flwr.supercore.retry", "make_simple_http_retry_invoker"),
    ("flwr.supercore.heartbeat", "HeartbeatSender"),
    ("flwr.supercore.heartbeat", "make_task_heartbeat_fn_http"),  # (what worker.task_heartbeat mirrors)
    ("flwr.proto.runtime_pb2", "SendTaskHeartbeatRequest"),
    ("flwr.supercore.constant", "TaskType"),
    ("flwr.proto.runtime_pb2", "AcquireTaskRequest"),
    ("flwr.proto.message_pb2", "Message"),
    ("flwr.supernode.runtime.run_clientapp", "pull_task_input"),
    ("flwr.supernode.runtime.run_clientapp", "push_message"),
    ("flwr.supernode.runtime.run_clientapp", "push_task_output"),
    ("flwr.common.constant", "SubStatus"),
    ("flwr.common.constant", "ErrorCode"),
    ("flwr.common.serde", "message_to_proto"),
    ("flwr.common.serde", "message_from_proto"),
    ("flwr.app.message", "remove_content_from_message"),
    ("flwr.common.config", "get_fab_config"),
    ("flwr.cli.flower_config", "read_superlink_connection"),
    ("flwr.cli.utils", "init_http_client_from_connection"),
    ("flwr.cli.utils", "flwr_cli_exc_handler"),
    ("flwr.proto.control_pb2", "RegisterNodeRequest"),
    ("flwr.supercore.primitives.asymmetric", "public_key_to_bytes"),
    ("flwr.supercore.object_store.sql_object_store", "SqlObjectStore"),
    ("flwr.supercore.object_store.object_store_factory", "SqlObjectStore"),
)
# The sleeps in start_client_internal (Flower 1.42) that a round waits on, by their length in seconds.
EMPTY_PULL_SLEEP = 3.0      # after a pull from the SuperLink found no message
REPLY_POLL_SLEEP = 0.5      # while the ClientApp's reply (or its objects) is not in the node's store yet
AUTH_METHOD = "/flwr.proto.Runtime/AcquireTask"  # what the SuperExec secret protects on the Runtime API


def pinned(module: str, name: str):
    return getattr(importlib.import_module(module), name)


IDLE_AFTER = 10.0  # seconds without a message after which a node's polls back off towards its idle interval


class Polls:
    """The wait after an empty pull: ``active`` while a message came in the last ``idle_after`` seconds (a node in a
    running round asks often), then doubling up to ``idle`` (an unselected node of a large federation asks as
    Flower's SuperNode does, every 3 s: at 0.2 s, 1,000 of them would ask the SuperLink 5,000 times a second)."""

    def __init__(self, active: float, idle: float, idle_after: float = IDLE_AFTER, clock=time.monotonic) -> None:
        self.active, self.idle, self.idle_after, self.clock = active, max(idle, active), idle_after, clock
        self.last, self.wait = clock(), active

    def message(self) -> None:
        self.last, self.wait = self.clock(), self.active

    def empty(self) -> float:
        if self.clock() - self.last >= self.idle_after:
            self.wait = min(self.idle, self.wait * 2)
        return self.wait


def patch_supernode(poll_interval: float, reply_poll: float = 0.01, pull_backoff: float = 0.02,
                    idle_poll: float | None = None, clock=time.monotonic, received_file: str = "") -> Polls:
    """Shorten the SuperNode's waits: an empty pull waits ``poll_interval`` (Flower: 3 s), backing off to
    ``idle_poll`` once idle (:class:`Polls`; None: never), the wait for the worker's reply polls every
    ``reply_poll`` (0.5 s), an object not there yet is retried from ``pull_backoff`` (1 s). Once each message is
    stored (its task created), ``received_file`` gets the time (``time.monotonic()``, one clock for every process
    on the host): the agent starts a released worker by it (``clients.supervisor``), whatever the log level."""
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    real = time.sleep
    polls = Polls(poll_interval, poll_interval if idle_poll is None else idle_poll, clock=clock)
    table = {REPLY_POLL_SLEEP: lambda: reply_poll, EMPTY_PULL_SLEEP: polls.empty}

    def sleep(seconds: float) -> None:
        wait = table.get(float(seconds))
        real(seconds if wait is None else wait())

    pull = pinned("flwr.supernode.start_client_internal", "_pull_and_store_message")

    def pulled(*args, **kwargs):
        run_id = pull(*args, **kwargs)
        if run_id is not None:  # a message came: the node is in a round
            polls.message()
            if received_file:
                write_atomically(received_file, repr(time.monotonic()))
        return run_id

    sci.time = types.SimpleNamespace(**{**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")},
                                        "sleep": sleep})
    sci.pull_objects = functools.partial(pinned("flwr.supernode.start_client_internal", "pull_objects"),
                                         initial_backoff=pull_backoff, backoff_cap=1.0)
    sci._pull_and_store_message = pulled
    return polls


UNREADABLE_REPLY = 9001  # the error code of a reply whose objects Flower could not inflate (none of Flower's codes)


def _unreadable_reply(head: bytes | None, exc: Exception):
    """An error reply standing in for a reply Flower could not inflate, as a reply to the message its own
    object names (its metadata, as Flower would have read it from ``head``), so that the round refuses it and goes
    on."""
    from flwr.app import Error, Message, Metadata

    reason = f"the reply's objects could not be read ({type(exc).__name__}: {str(exc)[:200]})"
    try:
        proto = pinned("flwr.proto.message_pb2", "Message").FromString(
            pinned("flwr.supercore.inflatable.inflatable_object", "get_object_body")(head, Message))
        metadata = pinned("flwr.common.serde_utils", "metadata_from_proto")(proto.metadata)
    except Exception:  # noqa: BLE001  (the message object itself: a reply to nothing, counted as unknown)
        metadata = Metadata(run_id=0, message_id="", src_node_id=0, dst_node_id=0, reply_to_message_id="",
                            group_id="", created_at=0.0, ttl=0.0, message_type="train")
    return pinned("flwr.app.message.message", "make_message")(
        metadata=metadata, error=Error(code=UNREADABLE_REPLY, reason=reason))


def patch_grid(pull_backoff: float = 0.02) -> None:
    """The ServerApp's grid retries a reply whose objects are still uploading from ``pull_backoff`` (Flower:
    1 s, doubling), not a second after the node sent it; and a reply it cannot inflate (an Array whose JSON
    body Flower's constructor refuses: the SuperLink checks only objects' heads) becomes an error reply to
    its message, where Flower's one loop over a pull raised and lost every reply of it. Idempotent."""
    grid = importlib.import_module("flwr.superlink.grid.http_grid")
    if not isinstance(grid.pull_objects, functools.partial):
        grid.pull_objects = functools.partial(grid.pull_objects, initial_backoff=pull_backoff, backoff_cap=1.0)
    real = grid.inflate_object_from_contents
    if not getattr(real, "fedshield_guarded", False):
        @functools.wraps(real)
        def inflate(object_id: str, contents: dict, *args, **kwargs):
            head = contents.get(object_id)  # (the message's own object, a few hundred bytes: Flower pops what it reads)
            try:
                return real(object_id, contents, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (whatever a client's bytes make Flower raise)
                return _unreadable_reply(head, exc)

        inflate.fedshield_guarded = True
        grid.inflate_object_from_contents = inflate
    real_pull = grid.HttpGrid.pull_messages
    if not getattr(real_pull, "fedshield_guarded", False):
        @functools.wraps(real_pull)
        def pull_messages(self, message_ids):
            checked: dict[str, Any] = {}  # message id -> the metadata the SuperLink stored (and checked) for it
            client = self._runtime_client
            ask = client.PullMessages

            def recording(request):
                res = ask(request)
                checked.update((m.metadata.message_id, m.metadata) for m in res.messages_list)
                return res

            client.PullMessages = recording
            try:
                replies = list(real_pull(self, message_ids))
            finally:
                del client.PullMessages
            return [_as_checked(m, checked.get(m.metadata.message_id)) for m in replies]

        pull_messages.fedshield_guarded = True
        grid.HttpGrid.pull_messages = pull_messages


_CHECKED_FIELDS = ("run_id", "src_node_id", "dst_node_id", "reply_to_message_id", "group_id", "message_type")


def _as_checked(message, proto):
    """``message`` as pulled, when the metadata its own object carries (what Flower's inflate reads, and the sender
    wrote) agrees with what the SuperLink checked (``proto``: the sender authenticated, the message it answers);
    else an error reply to the message the SuperLink stored it for (a node answering another's message as that node,
    or a reply Flower could not read)."""
    if proto is None:  # (Flower's own error replies: an object pull that failed, made from the checked metadata)
        return message
    from flwr.app import Error

    want = pinned("flwr.common.serde_utils", "metadata_from_proto")(proto)
    if all(getattr(message.metadata, f) == getattr(want, f) for f in _CHECKED_FIELDS):
        return message
    error = message.error if message.has_error() and message.error.code == UNREADABLE_REPLY else Error(
        code=UNREADABLE_REPLY, reason="the reply's own metadata disagrees with what the SuperLink checked "
                                      f"(sent by node {proto.src_node_id} as node {message.metadata.src_node_id})")
    out = pinned("flwr.app.message.message", "make_message")(metadata=want, error=error)
    out.metadata.__dict__["_message_id"] = proto.message_id
    return out


def patch_worker(pull_backoff: float = 0.02) -> None:
    """The worker pulls a message's objects from its SuperNode, which may still be downloading them when the
    task is acquired: retried from ``pull_backoff`` (Flower: 1 s, the most of a round). Idempotent."""
    run = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    if not isinstance(run.pull_and_inflate_object_from_tree, functools.partial):
        run.pull_and_inflate_object_from_tree = functools.partial(
            run.pull_and_inflate_object_from_tree, initial_backoff=pull_backoff, backoff_cap=1.0)


def register_keys(connection: str, paths: list[str]) -> None:
    """``flwr supernode register KEY CONNECTION`` for every key in one process (one Control API client), each
    result one JSON line as the CLI's ``--format json`` prints it: a process per key took ~2 s of CPU each,
    half an hour for 1,000 enrolled nodes. The connection comes from ``$FLWR_HOME``'s config, as for the CLI."""
    import json

    import click
    from cryptography.hazmat.primitives import serialization

    client = pinned("flwr.cli.utils", "init_http_client_from_connection")(
        pinned("flwr.cli.flower_config", "read_superlink_connection")(connection))
    request = pinned("flwr.proto.control_pb2", "RegisterNodeRequest")
    to_bytes = pinned("flwr.supercore.primitives.asymmetric", "public_key_to_bytes")
    try:
        for path in paths:
            try:
                with open(path, "rb") as f:
                    key = to_bytes(serialization.load_ssh_public_key(f.read()))
                with pinned("flwr.cli.utils", "flwr_cli_exc_handler")():
                    node_id = client.RegisterNode(request=request(public_key=key)).node_id
                out = {"success": bool(node_id), "node-id": node_id} if node_id else {
                    "success": False, "error-message": "SuperNode couldn't be registered."}
            except (click.ClickException, ValueError, OSError) as exc:
                out = {"success": False, "error-message": exc.format_message()
                       if isinstance(exc, click.ClickException) else str(exc)}
            print(json.dumps({"key": path, **out}), flush=True)
    finally:
        client.close()


SQL_STORE = "flwr.supercore.object_store.sql_object_store"


def slim_supernode() -> None:
    """Before the SuperNode's Flower imports: sqlalchemy and alembic (~37 MB of its ~134 MB RSS) stay unloaded
    until used. The node's objects live in memory (Flower's default; the agent gives no ``--database``), yet
    ``ObjectStoreFactory``'s module imports ``SqlObjectStore``, whose module imports both: that module is a
    stand-in until a SqlObjectStore is built, which imports the real one first."""
    if SQL_STORE not in sys.modules:
        stand_in = types.ModuleType(SQL_STORE, "a stand-in until a SqlObjectStore is built (clients.flower_pins)")

        class SqlObjectStore:
            def __new__(cls, *args, **kwargs):
                if sys.modules.get(SQL_STORE) is stand_in:
                    del sys.modules[SQL_STORE]
                real = importlib.import_module(SQL_STORE).SqlObjectStore
                sys.modules["flwr.supercore.object_store.object_store_factory"].SqlObjectStore = real
                return real(*args, **kwargs)

        stand_in.SqlObjectStore = SqlObjectStore
        sys.modules[SQL_STORE] = stand_in


def write_atomically(path: str, text: str) -> None:
    """``text`` in ``path``, which a reader sees whole or not at all."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def report_runtime_address(path: str, any_port: bool = False) -> None:
    """Once the SuperNode's Runtime API listens, write its ``127.0.0.1:PORT`` to ``path`` (atomically; '': none).
    With ``any_port`` (the agent's ``--port 0``, which Flower's parser refuses) the kernel picks the port as it
    binds: a port picked beforehand and bound later (at each restart under --rejoin, minutes apart) could be
    taken meanwhile, and a bind error ended the agent."""
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    start = pinned("flwr.supernode.cli.flower_supernode", "_start_supernode_http_api")

    def started(config, state_factory):
        if any_port:
            config.port = 0
        server, thread = start(config, state_factory)
        try:
            host, port = server.servers[0].sockets[0].getsockname()[:2]  # (the agent binds 127.0.0.1 only)
            config.port = port  # (what flower_supernode names the Runtime API by from here on)
            if path:
                write_atomically(path, f"{host}:{port}")
        except BaseException:  # the server's thread would keep a node nobody can reach alive: stop it
            server.should_exit = True
            thread.join(10)
            raise
        return server, thread

    cli._start_supernode_http_api = started


def run_supernode(argv: list[str]) -> None:
    """``flower-supernode`` with the waits shortened; ``--poll-interval S``, ``--idle-poll-interval S``,
    ``--runtime-file PATH`` and ``--received-file PATH`` (ours) come first in argv."""
    ours = {"--poll-interval": "0.2", "--idle-poll-interval": str(EMPTY_PULL_SLEEP), "--runtime-file": "",
            "--received-file": ""}
    while argv[:1] and argv[0] in ours:
        ours[argv[0]], argv = argv[1], argv[2:]
    poll, idle = float(ours["--poll-interval"]), float(ours["--idle-poll-interval"])
    runtime_file = ours["--runtime-file"]
    # --port 0 (the agent's; Flower's parser takes 1-65535): its default stands in, and report_runtime_address binds 0
    at = argv.index("--port") if "--port" in argv[:-1] else -1
    any_port = at >= 0 and argv[at + 1] == "0"
    if any_port:
        argv = argv[:at] + argv[at + 2:]
    slim_supernode()
    patch_supernode(poll, idle_poll=idle, received_file=ours["--received-file"])
    if runtime_file or any_port:
        report_runtime_address(runtime_file, any_port)
    sys.argv = ["flower-supernode", *argv]
    pinned("flwr.supernode.cli.flower_supernode", "flower_supernode")()


if __name__ == "__main__":
    if sys.argv[1:2] == ["supernode"]:
        run_supernode(sys.argv[2:])
    elif sys.argv[1:2] == ["register"] and len(sys.argv) >= 3:
        register_keys(sys.argv[2], sys.argv[3:])
    else:
        sys.exit("usage: python flower_pins.py supernode [--poll-interval S] [--idle-poll-interval S] "
                 "FLOWER-SUPERNODE-ARGS... | "
                 "register CONNECTION PUBLIC-KEY...")
