"""coordinator.superlink: Flower's SuperLink with its Control and Runtime APIs closed to other hosts.

Flower 1.42 serves Fleet, Control and Runtime on one port, and its Control API authenticates no one:
from anywhere that reached the port, ``flwr supernode register`` admitted a key of the caller's and
``flwr run`` executed the caller's ServerApp on the coordinator (a review's demonstration)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from starlette.testclient import TestClient

from coordinator import superlink
from coordinator.superlink import REFUSED, from_this_host, public_paths
from tests.integration.procs import free_port

ELSEWHERE = ("203.0.113.9", 40000)  # TEST-NET-3: no host of ours


@pytest.fixture(scope="module")
def app():
    superlink.install()
    from flwr.superlink.main import create_app

    return create_app()


def _post(client: TestClient, path: str):
    return client.post(path, content=b"", headers={"content-type": "application/protobuf"})


@pytest.mark.parametrize("path", ["/v1/control/list-runs", "/v1/control/start-run", "/v1/control/register-supernode",
                                  "/v1/runtime/acquire-task", "/v1/fleet/../control/list-runs", "/v1/fleet/", "/docs",
                                  "/openapi.json", "/nonexistent"])
def test_another_host_is_refused_everything_but_the_fleet_api(app, path):
    with TestClient(app, client=ELSEWHERE) as c:
        for r in (_post(c, path), c.get(path)):
            assert r.status_code == 403 and r.content == REFUSED, (path, r.status_code)


def test_another_host_reaches_the_fleet_api_and_health(app):
    assert {"/v1/fleet/pull-messages", "/v1/fleet/push-messages", "/v1/fleet/register-node", "/health"} <= public_paths()
    assert not any(p.startswith(("/v1/control", "/v1/runtime")) for p in public_paths())
    with TestClient(app, client=ELSEWHERE) as c:
        assert c.get("/health").status_code == 200
        for path in sorted(public_paths() - {"/health"}):
            r = _post(c, path)  # an empty request: Flower's own answer (4xx/5xx), not the guard's
            assert r.content != REFUSED, path


def test_this_host_reaches_the_control_api(app):
    with TestClient(app, client=("127.0.0.1", 40000)) as c:
        r = _post(c, "/v1/control/list-runs")
        assert r.status_code != 403 and r.content != REFUSED


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP"])
def test_a_forwarded_request_from_this_host_is_refused_too(app, header):
    """A reverse proxy on this host connects from this host: what it forwards comes from elsewhere."""
    with TestClient(app, client=("127.0.0.1", 40000)) as c:
        r = c.post("/v1/control/list-runs", content=b"", headers={"content-type": "application/protobuf",
                                                                   header: "for=198.51.100.7"})
        assert r.status_code == 403 and r.content == REFUSED
        assert c.get("/health", headers={header: "198.51.100.7"}).status_code == 200


@pytest.mark.parametrize(("client", "server", "local"), [
    (("127.0.0.1", 1), ("127.0.0.1", 9), True),
    (("::1", 1), ("::1", 9), True),
    (("::ffff:127.0.0.1", 1), ("::ffff:127.0.0.1", 9), True),
    (("10.1.2.3", 1), ("10.1.2.3", 9), True),  # a connection to this host's own address from itself
    (("10.1.2.4", 1), ("10.1.2.3", 9), False),
    (("0.0.0.0", 1), ("0.0.0.0", 9), False),
    (("testclient", 1), ("testserver", 80), False),
    (None, ("10.1.2.3", 9), False),
    (("10.1.2.3", 1), None, False),
])
def test_from_this_host(client, server, local):
    assert from_this_host({"type": "http", "client": client, "server": server}) is local


@pytest.mark.timeout(120)
def test_the_coordinators_superlink_process_runs_behind_the_guard(tmp_path):
    """The real process the coordinator starts (``superlink.command``), seen from a
    'remote' peer: loopback counts as remote under the test-only (stricter) switch. Two settings of
    its environment that reopened the Control API (a review's demonstrations) are neutralised:
    uvicorn trusting X-Forwarded-For from $FORWARDED_ALLOW_IPS ("*": any peer could claim 127.0.0.1),
    and Flower's switch for its older gRPC Control API (a second listener, unguarded)."""
    port, grpc_control = free_port(), free_port()
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr"), "FEDSHIELD_SUPERLINK_LOOPBACK_IS_REMOTE": "1",
           "FORWARDED_ALLOW_IPS": "*", "FLWR_INTERNAL_GRPC_CONTROL_API": "1"}
    log = tmp_path / "superlink.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(superlink.command("--insecure", "--host", "127.0.0.1", "--port", str(port),
                                                  "--control-api-address", f"127.0.0.1:{grpc_control}",
                                                  "--disable-runtime-dependency-installation"),
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            try:
                health = urllib.request.Request(base + "/health", headers={"X-Forwarded-For": "198.51.100.7"})
                assert urllib.request.urlopen(health, timeout=2).status == 200
                break
            except (urllib.error.URLError, ConnectionError):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
        req = urllib.request.Request(base + "/v1/control/list-runs", data=b"", method="POST",
                                     headers={"content-type": "application/protobuf", "X-Forwarded-For": "198.51.100.7"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == 403 and err.value.read() == REFUSED
        req = urllib.request.Request(base + "/v1/fleet/get-run", data=b"", method="POST",
                                     headers={"content-type": "application/protobuf"})
        try:
            body = urllib.request.urlopen(req, timeout=5).read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
        assert body != REFUSED
        with socket.socket() as s:  # no gRPC Control API beside the guarded port
            assert s.connect_ex(("127.0.0.1", grpc_control)) != 0
        maps = open(f"/proc/{proc.pid}/maps").read()  # the shared libraries the process has loaded
    finally:  # the whole session's group (the SuperLink's children too), by its pid
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    text = log.read_text()
    assert "FLWR_INTERNAL_GRPC_CONTROL_API ignored" in text
    assert "libtorch" not in maps, "the SuperLink's process loaded the coordinator package (and torch with it)"
    # The refused request is in the access log (a successful /health is not) under the socket's peer, not the header's
    assert "/v1/control/list-runs" in text and "198.51.100.7" not in text


async def _read_all(scope, receive, send):
    """A stand-in for Flower's Fleet handlers: read the whole body into memory, answer its length."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(len(body)).encode()})


def test_a_remote_peer_s_body_is_capped_before_flower_reads_it(monkeypatch):
    """Flower reads a Fleet request's body whole, before node authentication: 400 MB from a peer without
    credentials took 400 MB of the coordinator (a review). Past the cap: 413, told before the body is read
    when it says its length, and cut off when it does not (chunked)."""
    monkeypatch.setenv(superlink.MAX_BODY_ENV, str(1 << 20))
    guard = superlink.LocalControlOnly(_read_all)
    path, big = "/v1/fleet/push-messages", b"x" * ((1 << 20) + 1)
    c = TestClient(guard, client=ELSEWHERE)  # (no lifespan: the stand-in app serves only http)
    assert c.post(path, content=b"x" * 1000).content == b"1000"
    assert c.post(path, content=big).status_code == 413
    assert c.post(path, content=iter([big[:600_000], big[600_000:]])).status_code == 413  # no content-length
    local = TestClient(guard, client=("127.0.0.1", 40000))  # this host's own calls are not capped
    assert local.post(path, content=big).content == str(len(big)).encode()


def test_the_superlink_does_not_import_from_the_working_directory(tmp_path):
    """``python -c`` put the working directory first on sys.path: a uvicorn.py where the operator typed the
    command ran inside the SuperLink, which holds the server key (a review)."""
    (tmp_path / "uvicorn.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\nraise SystemExit(3)\n")
    out = subprocess.run(superlink.command("--help"), cwd=tmp_path, capture_output=True, timeout=120,
                         env={**os.environ, "FLWR_HOME": str(tmp_path / "flwr")})
    assert not (tmp_path / "ran").exists() and out.returncode == 0, out.stderr[-2000:]
