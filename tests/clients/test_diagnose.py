"""clients.supervisor.diagnose_connection: when the SuperNode gave up (Flower's exit code 305, no refusal code),
the agent says the cause it sees instead of five possible ones (a review: "check the address, that it runs, its
certificate, that this node's public key is enrolled, and that both or neither run --insecure").

Real sockets on 127.0.0.1: a closed port, a TLS server (this CA, another CA, a name its certificate lacks), a
plaintext HTTP server."""

from __future__ import annotations

import http.server
import shutil
import socket
import ssl
import threading

import numpy as np
import pytest

from clients import supervisor
from clients.supervisor import Plan, Watched, diagnose_connection
from tests.integration.procs import free_port


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from privacy.transport import init_certificates

    d = tmp_path_factory.mktemp("certs")
    return init_certificates(d / "ours"), init_certificates(d / "other")


class _Server:
    """Accepts connections in a thread: completes a TLS handshake with ``context`` (then closes), or, without
    one, answers plain HTTP."""

    def __init__(self, context: ssl.SSLContext | None, host: str = "127.0.0.1") -> None:
        self.context = context
        if context is None:
            self.httpd = http.server.HTTPServer((host, 0), http.server.SimpleHTTPRequestHandler)
            self.httpd.RequestHandlerClass.log_message = lambda *a: None
            self.port = self.httpd.server_address[1]
            self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        else:
            self.sock = socket.create_server((host, 0))
            self.port = self.sock.getsockname()[1]
            self.thread = threading.Thread(target=self._serve_tls, daemon=True)
        self.thread.start()

    def _serve_tls(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            try:
                with self.context.wrap_socket(conn, server_side=True):
                    pass
            except (ssl.SSLError, OSError):
                conn.close()

    def close(self) -> None:
        if self.context is None:
            self.httpd.shutdown()
            self.httpd.server_close()
        else:
            self.sock.close()


@pytest.fixture
def tls_server(certs):
    ours, _ = certs
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(ours.server_cert, ours.server_key)
    servers = []

    def start(host: str = "127.0.0.1") -> int:
        servers.append(_Server(ctx, host))
        return servers[-1].port

    yield start
    for s in servers:
        s.close()


@pytest.fixture
def plain_server():
    s = _Server(None)
    yield s.port
    s.close()


def test_nothing_listening_is_connection_refused():
    line = diagnose_connection(f"127.0.0.1:{free_port()}", "")
    assert line.startswith("could not connect to the coordinator at 127.0.0.1:") and "connection refused" in line


def test_a_coordinator_certificate_from_another_ca_is_named(tls_server, certs):
    _, other = certs
    port = tls_server()
    line = diagnose_connection(f"127.0.0.1:{port}", str(other.ca_cert))
    assert line == (f"the coordinator's certificate (at 127.0.0.1:{port}) is not trusted by --root-cert "
                    f"{other.ca_cert} (CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate): give the "
                    "coordinator's ca.crt")


def test_a_certificate_without_the_address_the_agent_dials_is_named(tls_server, certs):
    ours, _ = certs
    port = tls_server("127.0.0.2")  # (Linux: all of 127/8 is this host) an address not in the certificate
    line = diagnose_connection(f"127.0.0.2:{port}", str(ours.ca_cert))
    assert "does not name 127.0.0.2" in line and "--san 127.0.0.2" in line


def test_tls_that_works_leaves_the_enrolment(tls_server, certs):
    ours, _ = certs
    line = diagnose_connection(f"127.0.0.1:{tls_server()}", str(ours.ca_cert))
    assert "its certificate trusted by --root-cert, so it refused this node" in line and "enrolled-keys" in line


def test_an_insecure_agent_at_a_tls_coordinator(tls_server):
    line = diagnose_connection(f"127.0.0.1:{tls_server()}", "")
    assert "runs TLS and this agent --insecure" in line


def test_a_tls_agent_at_a_plaintext_coordinator(plain_server, certs):
    ours, _ = certs
    line = diagnose_connection(f"127.0.0.1:{plain_server}", str(ours.ca_cert))
    assert line == (f"the coordinator at 127.0.0.1:{plain_server} speaks no TLS (it runs --insecure?): run both with "
                    "TLS, or both with --insecure (tests only)")
    assert diagnose_connection(f"127.0.0.1:{plain_server}", "") is None  # both plaintext: nothing found wrong


def test_something_that_answers_neither_http_nor_tls(certs):
    ours, _ = certs
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def serve():  # says something that is neither
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert "answers neither HTTP nor TLS" in diagnose_connection(f"127.0.0.1:{port}", "")
        assert diagnose_connection(f"127.0.0.1:{port}", str(ours.ca_cert)).startswith(
            f"the TLS handshake with the coordinator at 127.0.0.1:{port} failed (")
    finally:
        srv.close()


def test_the_agent_s_last_line_is_the_cause_it_saw(capsys):
    plan = Plan(supernode=[], worker=[], state_dir="", coordinator=f"127.0.0.1:{free_port()}")
    assert supervisor._ended(Watched(exit_code=305), 1, plan) == 1
    line = capsys.readouterr().err.strip()
    assert line.startswith("fedshield: error: agent stopped (Flower exit code 305): could not connect to the "
                           "coordinator at 127.0.0.1:") and "connection refused" in line
    # a refusal code in the SuperNode's log says it already: no probe
    assert supervisor._ended(Watched(exit_code=305, refusal=2004), 1, plan) == 1
    assert "this node's key is not enrolled" in capsys.readouterr().err
    # a plan without the address (an older one): the list of causes, as before
    assert supervisor._ended(Watched(exit_code=305), 1, Plan(supernode=[], worker=[], state_dir="")) == 1
    assert "could not connect to the coordinator: check the address" in capsys.readouterr().err


def test_the_agent_s_plan_carries_the_address_and_the_ca(tmp_path, monkeypatch, certs):
    from clients import cli
    from privacy.transport import new_node_key
    from simulations.cli import build_parser

    ours, _ = certs
    monkeypatch.setattr(cli, "check_reachable", lambda host, port: None)
    np.savez(tmp_path / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    args = build_parser().parse_args(["agent", "start", "--coordinator", "127.0.0.1:9092", "--insecure",
                                      "--data", str(tmp_path / "d.npz")])
    plan = cli.agent_plan(args)
    shutil.rmtree(plan.state_dir)
    assert (plan.coordinator, plan.root_cert) == ("127.0.0.1:9092", "")
    new_node_key(tmp_path / "node")
    args = build_parser().parse_args(["agent", "start", "--coordinator", "127.0.0.1:9092", "--root-cert",
                                      str(ours.ca_cert), "--key", str(tmp_path / "node"),
                                      "--data", str(tmp_path / "d.npz")])
    plan = cli.agent_plan(args)
    shutil.rmtree(plan.state_dir)
    assert (plan.coordinator, plan.root_cert) == ("127.0.0.1:9092", str(ours.ca_cert.resolve()))
