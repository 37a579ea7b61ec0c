"""The warm agent's ClientApp worker (clients/worker.py) on its own; the whole agent is in tests/integration."""

from __future__ import annotations

import socket

import pytest

from clients import worker as worker_mod


class _Stop(BaseException):
    """Ends Worker.run's loop in the test."""


def _worker(tmp_path, monkeypatch):
    """A Worker on ``tmp_path`` as its state dir, whose Runtime API clients are records of their address."""
    (tmp_path / "secret").write_bytes(b"s" * 32)
    w = worker_mod.Worker(tmp_path, 0.01)
    monkeypatch.setattr(w, "_client", lambda token=None: type("Client", (), {
        "address": w.runtime, "closed": False, "close": lambda self: setattr(self, "closed", True)})())
    return w


def _listener():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.timeout(60)
def test_the_worker_follows_its_agent_s_supernode_to_the_port_a_new_one_binds(tmp_path, monkeypatch):
    """Under --rejoin each SuperNode binds a port of its own (``--port 0``) and writes its address to the state
    dir; a worker whose node went away waits for the next one's address, then asks it for tasks."""
    import threading

    w = _worker(tmp_path, monkeypatch)
    (first, at_first), (second, at_second) = _listener(), _listener()
    (tmp_path / "runtime").write_text(at_first)
    calls, tokens, clients = [], iter([RuntimeError("the node went away"), "t1", None]), []

    def acquire():
        calls.append(w.client.address)
        clients.append(w.client)
        answer = next(tokens, None)
        if isinstance(answer, Exception):  # the node is gone: its address with it, the next one on another port
            (tmp_path / "runtime").unlink()
            threading.Timer(0.2, lambda: (tmp_path / "runtime").write_text(at_second)).start()
            raise answer
        if answer is None and calls.count(at_second) > 1:
            raise _Stop
        return answer

    served = []
    monkeypatch.setattr(w, "acquire", acquire)
    monkeypatch.setattr(w, "serve", lambda token: served.append((token, w.client.address)))
    monkeypatch.setattr(worker_mod.signal, "sigtimedwait", lambda sigs, timeout: None)
    with pytest.raises(_Stop):
        w.run()
    assert (tmp_path / "ready").exists()
    assert calls[0] == at_first and calls[1] == at_second and served == [("t1", at_second)] and w.runtime == at_second
    assert clients[0].closed and not clients[-1].closed  # the dead node's client closed, the new one's in use
    first.close()
    second.close()


@pytest.mark.timeout(60)
def test_a_call_to_a_supernode_that_went_away_fails_once_its_address_is_gone(tmp_path):
    """Flower's Runtime API client, with the worker's retries: refused calls went on for ever; once the agent
    removed the node's address (the node ended), the call fails and the worker waits for the next node."""
    import threading

    import httpx

    (tmp_path / "secret").write_bytes(b"s" * 32)
    w = worker_mod.Worker(tmp_path, 0.01)
    closed, address = _listener()
    closed.close()  # nothing listens there any more: the node is gone
    (tmp_path / "runtime").write_text(address)
    w.runtime, w.client = address, None
    w.client = w._client()
    threading.Timer(1.0, (tmp_path / "runtime").unlink).start()  # the agent notices a moment later
    with pytest.raises(httpx.TransportError):
        w.acquire()
    assert w.moved()


def test_the_worker_s_runtime_calls_give_up_once_its_supernode_moved():
    """Flower retries a refused Runtime API call for ever: against a node that is gone (its address removed, or
    a new one's written) the call now fails, and the worker moves on to the new node."""
    import httpx

    moved = [False]
    invoker = worker_mod.retries(lambda: moved[0])
    refused = httpx.ConnectError("refused")
    assert invoker.should_giveup(refused) is False  # the same node restarting its server: waited for
    moved[0] = True
    assert invoker.should_giveup(refused) is True


def test_a_message_lost_with_its_supernode_leaves_the_worker_serving(tmp_path, capsys, monkeypatch):
    """The node went away mid-message (the coordinator stopped; --rejoin starts a new node): the worker said so and
    died before, and the agent paid a torch import for a new one (flaky in the resume test); now it goes on."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    w = _worker(tmp_path, monkeypatch)
    (tmp_path / "runtime").write_text(f"127.0.0.1:{listening.getsockname()[1]}")
    tokens, served = iter(["t1", "t2"]), []

    def acquire():
        token = next(tokens, None)
        if token is None:
            raise _Stop
        return token

    def serve(token):
        served.append(token)
        if token == "t1":
            raise ConnectionError("the SuperNode is gone")

    monkeypatch.setattr(w, "acquire", acquire)
    monkeypatch.setattr(w, "serve", serve)
    with pytest.raises(_Stop):
        w.run()
    listening.close()
    assert served == ["t1", "t2"]
    assert ("lost the message it was handling: its SuperNode stopped answering (ConnectionError: the SuperNode is "
            "gone); waiting for the next.") in capsys.readouterr().err


def test_an_idle_worker_releases_its_memory_once_no_message_came_for_its_release_time(tmp_path, capsys,
                                                                                       monkeypatch):
    """--release-worker-after: each message restarts the count; once idle that long, the worker writes when it
    last asked for a task (a message stored after it starts a new worker: clients.supervisor) and returns."""
    listening, address = _listener()
    w = _worker(tmp_path, monkeypatch)
    w.release_after = 5.0
    (tmp_path / "runtime").write_text(address)
    now = [100.0]
    answers = iter([None, None, "t1", None, None, None, None, "never asked for"])  # idle 2 s apart
    asked = []

    def acquire():
        asked.append(now[0])
        return next(answers)

    monkeypatch.setattr(worker_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(w, "acquire", acquire)
    monkeypatch.setattr(w, "serve", lambda token: None)
    monkeypatch.setattr(worker_mod.signal, "sigtimedwait", lambda sigs, timeout: now.__setitem__(0, now[0] + 2.0))
    dispositions = []  # (the supervisor's wake-up may reach it as it exits: CI saw it die of SIGUSR1 there)
    monkeypatch.setattr(worker_mod.signal, "signal", lambda sig, handler: dispositions.append(
        (sig, handler, (tmp_path / "released").exists())))
    w.run()  # returns: released
    listening.close()
    assert asked == [100, 102, 104, 104, 106, 108, 110]  # after t1 at once; at 110 idle for 6 s: released
    assert float((tmp_path / "released").read_text()) == asked[-1]
    assert dispositions == [(worker_mod.signal.SIGUSR1, worker_mod.signal.SIG_IGN, False)]  # before it says so
    assert "no message for 5 s: the ClientApp worker stopped to free its memory" in capsys.readouterr().err


def test_the_task_heartbeat_never_interrupts_the_worker(monkeypatch):
    """Flower's raised SIGINT when the node said the task was gone (a node restarted under --rejoin): the warm
    worker died with exit 130 (CI, the resume test). Ours reports it to HeartbeatSender and nothing else."""
    import signal

    import httpx

    raised = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    request = httpx.Request("POST", "http://127.0.0.1/heartbeat")

    def status(code):
        return httpx.HTTPStatusError("no", request=request, response=httpx.Response(code, request=request))

    class Client:
        def __init__(self, answer):
            self.answer = answer

        def SendTaskHeartbeat(self, req):  # noqa: N802  (Flower's method name)
            if isinstance(self.answer, Exception):
                raise self.answer
            return self.answer

    gone = type("Res", (), {"success": False})()
    alive = type("Res", (), {"success": True})()
    outcomes = [worker_mod.task_heartbeat(Client(a))() for a in
                (alive, gone, status(401), status(503), status(504), httpx.ConnectError("refused"))]
    assert outcomes == [True, True, True, False, False, False] and raised == []
