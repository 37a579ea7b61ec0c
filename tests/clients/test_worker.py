"""The warm agent's ClientApp worker (clients/worker.py) on its own; the whole agent is in tests/integration."""

from __future__ import annotations

import socket

import pytest

from clients import worker as worker_mod


class _Stop(BaseException):
    """Ends Worker.run's loop in the test."""


def test_a_message_lost_with_its_supernode_leaves_the_worker_serving(tmp_path, capsys, monkeypatch):
    """The node went away mid-message (the coordinator stopped; --rejoin starts a new node): the worker said so and
    died before, and the agent paid a torch import for a new one (flaky in the resume test); now it goes on."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    w = worker_mod.Worker.__new__(worker_mod.Worker)
    w.runtime, w.dir, w.poll = f"127.0.0.1:{listening.getsockname()[1]}", tmp_path, 0.01
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
