"""The Flower internals the warm agent relies on (clients/flower_pins.py): a Flower upgrade that moves one
fails here by name, not as a hung or silently slow agent."""

from __future__ import annotations

import importlib
import inspect

import flwr
import pytest

from clients import flower_pins


def test_flower_is_the_pinned_version():
    assert flwr.__version__ == flower_pins.FLWR_VERSION, (
        f"clients/flower_pins.py is pinned to flwr {flower_pins.FLWR_VERSION}; found {flwr.__version__}: recheck "
        "every entry of PINNED and the sleeps it shortens, then update FLWR_VERSION")


@pytest.mark.parametrize("module, name", flower_pins.PINNED, ids=[f"{m}.{n}" for m, n in flower_pins.PINNED])
def test_each_pinned_internal_exists(module, name):
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} moved"


def test_the_supernode_sleeps_it_shortens_are_still_there():
    source = inspect.getsource(importlib.import_module("flwr.supernode.start_client_internal"))
    assert f"time.sleep({flower_pins.EMPTY_PULL_SLEEP:g})" in source, "the 3 s sleep after an empty pull moved"
    assert f"time.sleep({flower_pins.REPLY_POLL_SLEEP})" in source, "the 0.5 s wait for a reply moved"
    assert "pull_objects(" in source


def test_the_supernode_lines_the_agent_reads_are_still_logged_at_info():
    """The supervisor counts a node's answered messages by "Sent successfully" (served, then the coordinator gone:
    the agent's part of a run ended) and wakes the worker by "Received successfully"; it runs the node at INFO."""
    from clients import supervisor

    source = inspect.getsource(importlib.import_module("flwr.supernode.start_client_internal"))
    for text, pattern in (("Received successfully", supervisor._RECEIVED), ("Sent successfully", supervisor._SENT)):
        assert f'log(INFO, "{text}")' in source, f"Flower's {text!r} line moved"
        assert pattern.search(f"INFO :      {text}"), text


def test_a_supernode_on_port_0_writes_the_address_its_runtime_api_bound(tmp_path, monkeypatch):
    """The agent starts each SuperNode with ``--port 0``; Flower's own Runtime API server, started as
    ``flower_supernode`` starts it, then says where it listens (the worker reads it there)."""
    import socket
    import types

    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    monkeypatch.setattr(cli, "_start_supernode_http_api", cli._start_supernode_http_api)  # (put back after)
    store = importlib.import_module("flwr.supercore.object_store").ObjectStoreFactory()
    states = importlib.import_module("flwr.supernode.nodestate").NodeStateFactory(objectstore_factory=store)
    config = types.SimpleNamespace(host="127.0.0.1", port=9094, superexec_auth_secret=b"s" * 32,
                                   runtime_ssl_certfile=None, runtime_ssl_keyfile=None)  # (9094: Flower's default)
    path = tmp_path / "runtime"
    flower_pins.report_runtime_address(str(path), any_port=True)
    server, thread = cli._start_supernode_http_api(config, states)
    try:
        host, _, port = path.read_text().rpartition(":")
        assert host == "127.0.0.1" and int(port) not in (0, 9094) and not (tmp_path / "runtime.tmp").exists()
        assert config.port == int(port)  # (the address flower_supernode names the Runtime API by)
        socket.create_connection((host, int(port)), timeout=5).close()  # Flower's server listens there
    finally:
        server.should_exit = True
        thread.join(10)


def test_flowers_supernode_parser_refuses_port_0_and_the_agent_s_wrapper_drops_it(monkeypatch):
    """Why run_supernode takes ``--port 0`` off the command line it hands Flower (and binds port 0 itself)."""
    cli = importlib.import_module("flwr.supernode.cli.flower_supernode")
    with pytest.raises(SystemExit):
        cli._parse_args_run_supernode().parse_args(["--port", "0"])
    seen = {}
    monkeypatch.setattr(flower_pins, "slim_supernode", lambda: None)
    monkeypatch.setattr(flower_pins, "patch_supernode", lambda *a, **k: seen.update(k))
    monkeypatch.setattr(flower_pins, "report_runtime_address",
                        lambda path, any_port: seen.update(path=path, any_port=any_port))
    monkeypatch.setattr(cli, "flower_supernode", lambda: seen.update(argv=list(flower_pins.sys.argv)))
    monkeypatch.setattr(flower_pins.sys, "argv", flower_pins.sys.argv)
    for argv, path, any_port, left in [
            (["--runtime-file", "rt", "--received-file", "rc", "--insecure", "--port", "0", "--isolation",
              "process"], "rt", True, ["--insecure", "--isolation", "process"]),
            (["--insecure", "--port", "0"], "", True, ["--insecure"]),  # (bound to 0 without a file too)
            (["--runtime-file", "rt", "--port", "9101"], "rt", False, ["--port", "9101"]),
            (["--node-config", "port=0", "--port"], None, None, ["--node-config", "port=0", "--port"])]:
        seen.clear()
        flower_pins.run_supernode(argv)
        want = {"argv": ["flower-supernode", *left]} if path is None else \
            {"path": path, "any_port": any_port, "argv": ["flower-supernode", *left]}
        want.update(idle_poll=flower_pins.EMPTY_PULL_SLEEP, received_file="rc" if "rc" in argv else "")
        assert seen == want, argv


def test_patched_sleeps_are_short_and_others_unchanged(monkeypatch):
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    monkeypatch.setattr(sci, "time", sci.time)
    monkeypatch.setattr(sci, "pull_objects", sci.pull_objects)
    slept = []
    monkeypatch.setattr(flower_pins.time, "sleep", slept.append)
    flower_pins.patch_supernode(0.2)
    for s in (3, 0.5, 7):
        sci.time.sleep(s)
    assert slept == [0.2, 0.01, 7]
    assert sci.pull_objects.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}
    assert sci.time.time is flower_pins.time.time


def test_the_runtime_api_method_the_secret_protects():
    source = inspect.getsource(importlib.import_module("flwr.supercore.superexec.run_superexec"))
    assert repr(flower_pins.AUTH_METHOD)[1:-1] in source


def test_the_serverapp_grid_retries_reply_objects_from_20_ms(monkeypatch):
    grid = importlib.import_module("flwr.superlink.grid.http_grid")
    monkeypatch.setattr(grid, "pull_objects", grid.pull_objects)
    monkeypatch.setattr(grid, "inflate_object_from_contents", grid.inflate_object_from_contents)
    flower_pins.patch_grid()
    flower_pins.patch_grid()  # idempotent: one partial, not one wrapped in another
    assert grid.pull_objects.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}
    assert not isinstance(grid.pull_objects.func, type(grid.pull_objects))
    assert grid.inflate_object_from_contents.__wrapped__ is importlib.import_module(
        "flwr.supercore.inflatable.inflatable_utils").inflate_object_from_contents  # one guard, not two


def test_a_reply_the_serverapp_grid_cannot_inflate_is_an_error_reply_to_its_message(monkeypatch):
    """A float in an Array's declared shape (Flower's constructor refuses it; the SuperLink checks only heads):
    an error reply to the message it answers, not an exception out of the grid's pull of every reply."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    from simulations.inprocess import ensure_task_identity

    ensure_task_identity()
    grid = importlib.import_module("flwr.superlink.grid.http_grid")
    monkeypatch.setattr(grid, "inflate_object_from_contents", grid.inflate_object_from_contents)
    flower_pins.patch_grid()
    ins = Message(RecordDict({"config": ConfigRecord({"a": 1})}), dst_node_id=5, message_type="train", group_id="7")
    ins.metadata.__dict__["_message_id"] = "the-instruction"
    reply = Message(RecordDict({"arrays": ArrayRecord({"d": Array(np.zeros(3, np.float32))})}), reply_to=ins)
    contents = {oid: o.deflate() for oid, o in get_all_nested_objects(reply).items()}
    good = grid.inflate_object_from_contents(reply.object_id, dict(contents))
    assert not good.has_error() and good.content["arrays"]["d"].shape == (3,)
    for oid, body in contents.items():
        contents[oid] = body.replace(b'"shape": [3]', b'"shape": [3.0]')
    got = grid.inflate_object_from_contents(reply.object_id, contents)
    assert got.has_error() and got.error.code == flower_pins.UNREADABLE_REPLY
    assert "could not be read (TypeError" in got.error.reason
    assert (got.metadata.reply_to_message_id, got.metadata.group_id) == ("the-instruction", "7")


def test_the_worker_pulls_message_objects_from_20_ms(monkeypatch):
    run = importlib.import_module("flwr.supernode.runtime.run_clientapp")
    monkeypatch.setattr(run, "pull_and_inflate_object_from_tree", run.pull_and_inflate_object_from_tree)
    flower_pins.patch_worker()
    flower_pins.patch_worker()
    assert run.pull_and_inflate_object_from_tree.keywords == {"initial_backoff": 0.02, "backoff_cap": 1.0}
    source = inspect.getsource(run.pull_task_input)
    assert "pull_and_inflate_object_from_tree(" in source  # resolved from the module at call time


def test_an_idle_node_backs_off_to_its_idle_interval_and_is_quick_again_once_a_message_comes(monkeypatch):
    """At a fixed 0.2 s, 1,000 idle agents asked the SuperLink 5,000 times a second."""
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    for name in ("time", "pull_objects", "_pull_and_store_message"):
        monkeypatch.setattr(sci, name, getattr(sci, name))
    arrivals = iter([None] * 15 + [7] + [None] * 2)  # what each pull got: nothing, or a message of run 7
    now, slept = [0.0], []

    def pull(**kw):
        now[0] += 0.8  # a pull's round trip
        return next(arrivals)

    def sleep(s):
        slept.append(s)
        now[0] += s

    monkeypatch.setattr(sci, "_pull_and_store_message", pull)
    monkeypatch.setattr(flower_pins.time, "sleep", sleep)
    flower_pins.patch_supernode(0.2, idle_poll=3.0, clock=lambda: now[0])
    for _ in range(18):  # start_client_internal's loop: a pull, then its 3 s sleep when nothing came
        if sci._pull_and_store_message(state=None) is None:
            sci.time.sleep(3)
        else:
            now[0] += 1.0  # the message's round
            slept.append("message")
    # quick for the first 10 s, then doubling to the idle interval; quick again after a message
    assert slept == [0.2] * 10 + [0.4, 0.8, 1.6, 3.0, 3.0, "message", 0.2, 0.2]


def test_each_stored_message_writes_when_it_came_for_the_agent(tmp_path, monkeypatch):
    """A released worker is started again by this time (clients.supervisor), so not by a log line that
    FLWR_LOG_LEVEL can silence; an empty pull writes nothing."""
    import time

    sci = importlib.import_module("flwr.supernode.start_client_internal")
    for name in ("time", "pull_objects", "_pull_and_store_message"):
        monkeypatch.setattr(sci, name, getattr(sci, name))
    arrivals = iter([None, 7])
    monkeypatch.setattr(sci, "_pull_and_store_message", lambda **kw: next(arrivals))
    received = tmp_path / "received"
    flower_pins.patch_supernode(0.2, received_file=str(received))
    assert sci._pull_and_store_message(state=None) is None and not received.exists()
    before = time.monotonic()
    assert sci._pull_and_store_message(state=None) == 7
    assert before <= float(received.read_text()) <= time.monotonic()
    assert [p.name for p in tmp_path.iterdir()] == ["received"]  # (written whole: no temp file left)


def test_without_an_idle_interval_the_node_keeps_its_poll_interval(monkeypatch):
    sci = importlib.import_module("flwr.supernode.start_client_internal")
    for name in ("time", "pull_objects", "_pull_and_store_message"):
        monkeypatch.setattr(sci, name, getattr(sci, name))
    now = [0.0]
    polls = flower_pins.patch_supernode(0.5, clock=lambda: now[0])
    now[0] = 1000.0
    assert [polls.empty() for _ in range(3)] == [0.5, 0.5, 0.5]


def test_the_supernode_leaves_sqlalchemy_unloaded_until_a_sql_store_is_built(tmp_path):
    """The agent's SuperNode (memory store) imports neither sqlalchemy nor alembic (~37 MB); a SqlObjectStore,
    were one asked for, is still the real one, and the memory store is what a node gets by default."""
    import subprocess
    import sys
    from pathlib import Path

    code = f"""
import sys
sys.path.insert(0, {str(Path(flower_pins.__file__).parent)!r})
import flower_pins
flower_pins.slim_supernode()
import flwr.supernode.cli.flower_supernode, flwr.supernode.start_client_internal
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
from flwr.supernode.nodestate import NodeStateFactory
heavy = lambda: sorted({{m.split('.')[0] for m in sys.modules}} & {{'sqlalchemy', 'alembic'}})
assert heavy() == [], heavy()
assert isinstance(ObjectStoreFactory().store(), InMemoryObjectStore)
NodeStateFactory(objectstore_factory=ObjectStoreFactory()).state()
assert heavy() == [], heavy()
store = ObjectStoreFactory({str(tmp_path / "objects.db")!r}).store()
from flwr.supercore.object_store.sql_object_store import SqlObjectStore
assert type(store) is SqlObjectStore and heavy() == ["alembic", "sqlalchemy"], (type(store), heavy())
print("ok")
"""
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_task_heartbeat_the_worker_mirrors_is_unchanged_but_for_its_sigint():
    """clients.worker.task_heartbeat is Flower's make_task_heartbeat_fn_http without the SIGINT that ends a
    one-message ClientApp process (and so killed the warm worker): if Flower's changes, recheck the mirror."""
    source = inspect.getsource(importlib.import_module("flwr.supercore.heartbeat").make_task_heartbeat_fn_http)
    for part in ("res = client.SendTaskHeartbeat(req)", "except httpx.TransportError:\n            return False",
                 "httpx.codes.SERVICE_UNAVAILABLE", "httpx.codes.GATEWAY_TIMEOUT", "if not res.success:\n"
                 "            signal.raise_signal(signal.SIGINT)"):
        assert part in source, f"Flower's task heartbeat changed near {part!r}"


def test_flowers_runtime_retries_still_end_the_process_on_a_401_and_the_worker_s_do_not(monkeypatch):
    """Flower's HTTP retry invoker sends its own process SIGINT on a 401 (and sleeps for the exit): the warm
    worker's (clients.worker.retries) gives the call up instead. If Flower's stops doing so, recheck the override."""
    import os

    import httpx

    from clients import worker

    source = inspect.getsource(importlib.import_module("flwr.supercore.retry.http_retry"))
    assert "if status_code == httpx.codes.UNAUTHORIZED:" in source and "os.kill(os.getpid(), signal.SIGINT)" in source
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    request = httpx.Request("POST", "http://127.0.0.1/x")
    unauthorized = httpx.HTTPStatusError("401", request=request, response=httpx.Response(401, request=request))
    assert worker.retries().should_giveup(unauthorized) is True and killed == []
    refused = httpx.ConnectError("refused")
    assert worker.retries().should_giveup(refused) is False  # the rest as Flower's: a node restarting is waited for


def test_a_reply_whose_own_metadata_disagrees_with_the_superlinks_is_refused_as_the_checked_message(monkeypatch):
    """The ServerApp's grid read a reply's sender and the message it answers from the reply's own object, which
    its sender writes, not from what the SuperLink checked: node 7 could answer node 8's message as node 8. A
    reply whose object disagrees becomes an error reply to the message the SuperLink stored it for."""
    import numpy as np
    from flwr.app import Message, MetricRecord, RecordDict
    from flwr.common.serde import message_to_proto
    from flwr.proto.message_pb2 import PullObjectResponse
    from flwr.proto.runtime_pb2 import PullAppMessagesResponse
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    from simulations.inprocess import ensure_task_identity

    ensure_task_identity()
    grid = importlib.import_module("flwr.superlink.grid.http_grid")
    monkeypatch.setattr(grid.HttpGrid, "pull_messages", grid.HttpGrid.pull_messages)
    monkeypatch.setattr(grid, "inflate_object_from_contents", grid.inflate_object_from_contents)
    flower_pins.patch_grid()
    flower_pins.patch_grid()  # idempotent

    def reply(src: int, answers: str) -> Message:
        ins = Message(RecordDict({}), dst_node_id=src, message_type="train", group_id="1")
        ins.metadata.__dict__["_message_id"] = answers
        return Message(RecordDict({"metrics": MetricRecord({"v": float(np.float32(src))})}), reply_to=ins)

    objects, protos, trees = {}, [], []
    # (what the sender wrote, what the SuperLink checked: sender and message answered)
    for written, checked in ((reply(7, "ins-7"), (7, "ins-7")), (reply(8, "ins-8"), (7, "ins-7b"))):
        nested = get_all_nested_objects(written)
        objects.update({oid: o.deflate() for oid, o in nested.items()})
        proto = message_to_proto(written)
        proto.metadata.message_id = list(nested)[-1]
        proto.metadata.src_node_id, proto.metadata.reply_to_message_id = checked
        proto.ClearField("content")
        protos.append(proto)
        trees.append(get_object_tree(written))

    class Runtime:
        def PullMessages(self, request):  # noqa: N802  (Flower's names)
            return PullAppMessagesResponse(messages_list=protos, message_object_trees=trees)

        def PullObject(self, request):  # noqa: N802
            return PullObjectResponse(object_found=True, object_available=True,
                                      object_content=objects[request.object_id])

        def ConfirmMessageReceived(self, request):  # noqa: N802
            return None

    g = object.__new__(grid.HttpGrid)
    g._client, g._run = Runtime(), importlib.import_module("flwr.supercore.run").Run.create_empty(5)
    g.node = importlib.import_module("flwr.proto.node_pb2").Node(node_id=0)
    honest, forged = g.pull_messages(["a", "b"])
    assert not honest.has_error() and (honest.metadata.src_node_id, honest.metadata.reply_to_message_id) == (7, "ins-7")
    assert forged.has_error() and forged.error.code == flower_pins.UNREADABLE_REPLY
    assert "sent by node 7 as node 8" in forged.error.reason
    assert (forged.metadata.src_node_id, forged.metadata.reply_to_message_id) == (7, "ins-7b")
    assert forged.metadata.message_id == protos[1].metadata.message_id
    assert "PullMessages" not in vars(g._client)  # the recording hook is gone after the pull
