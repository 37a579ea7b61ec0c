"""``coordinator start`` on bad input: one ConfigError / CoordinatorError (one CLI line), no traceback.

Paths in the config and the --run-dir flag, a ``flwr`` call that hangs, and TLS certificates that
fit together but would fail a client's checks (expired, not yet valid, a SubjectAltName without the
coordinator's host): those used to be a traceback, or a SuperLink that "never answered".
"""

from __future__ import annotations

import datetime as dt
import http.server
import os
import shutil
import ssl
import stat
import threading

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from clients import ConfigError
from coordinator import CoordinatorError
from coordinator.service import FEDERATION, Coordinator, load_coordinator_config, resolve_path
from coordinator.tls import check_server_certificate, connect_host
from privacy import CertificatePaths, init_certificates, new_node_key
from privacy.transport import CA_KEY, _name, _san
from simulations.cli import main

NO_USER = "~nosuchuser-fedshield-test"


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("fedshield: error: "), err
    assert not any("Traceback" in line for line in err), err
    return err[-1]


# -- paths -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("table, value, message", [
    ("run", "run-dir = 5", "run.run-dir must be a path (a string). Found 5."),
    ("run", "run-dir = [1]", "run.run-dir must be a path (a string). Found [1]."),
    ("run", r'run-dir = "a\u0000b"', r"run.run-dir must not contain a NUL character. Found 'a\x00b'."),
    ("run", f'run-dir = "{NO_USER}/r"', f"run.run-dir must start with an existing user's home directory. "
                                         f"Found '{NO_USER}/r': no user '{NO_USER[1:]}'."),
    ("coordinator", r'enrolled-keys = ["a\u0000b"]', "coordinator.enrolled-keys must hold paths without a NUL character"),
    ("coordinator", f'state-dir = "{NO_USER}/s"', f"coordinator.state-dir must start with an existing user's home "
                                                   f"directory. Found '{NO_USER}/s'"),
    ("coordinator", f'certs-dir = "{NO_USER}/c"\nenrolled-keys = ["k.pub"]',
     f"coordinator.certs-dir must start with an existing user's home directory. Found '{NO_USER}/c'"),
])
def test_bad_paths_in_the_config_are_one_line_naming_the_key(tmp_path, capsys, table, value, message):
    (tmp_path / "c.toml").write_text(f"[{table}]\n{value}\n" + ("[run]\nmin-nodes = 1\n" if table != "run" else ""))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml")]) == 2
    assert message in _one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["c.toml"], "no directory named '~user' or anything else is made"


def test_an_unknown_user_in_the_run_dir_flag_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.toml").write_text("[run]\nmin-nodes = 1\n")
    assert main(["coordinator", "start", "--config", "c.toml", "--insecure", "--run-dir", f"{NO_USER}/r"]) == 2
    assert _one_error_line(capsys) == (f"fedshield: error: --run-dir must start with an existing user's home directory. "
                                       f"Found '{NO_USER}/r': no user '{NO_USER[1:]}'.")
    assert sorted(os.listdir(tmp_path)) == ["c.toml"]


def test_long_bad_values_are_cut_in_the_message():
    with pytest.raises(ConfigError, match=r"Found '~x{78}\.\.\. \(1003 characters\): no user 'x{79}\.\.\. \(1002 characters\)\.$"):
        resolve_path("~" + "x" * 1000, "run.run-dir")
    with pytest.raises(ConfigError, match=r"run.run-dir must be a path \(a string\)\. Found 1{80}\.\.\. \(300 characters\)"):
        resolve_path(int("1" * 300), "run.run-dir")


def test_a_path_that_cannot_be_resolved_is_one_error(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    try:
        resolved = resolve_path("loop/x", "coordinator.state-dir", tmp_path)
    except ConfigError as exc:  # Python < 3.13: resolve() raises on a symlink loop
        assert str(exc).startswith("coordinator.state-dir must be a path that can be resolved. Found 'loop/x': ")
    else:
        assert resolved.is_absolute()


def test_home_and_relative_paths_still_resolve(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_path("~/r", "run.run-dir") == tmp_path / "r"
    assert resolve_path("r", "run.run-dir", tmp_path / "base") == tmp_path / "base" / "r"
    conf = tmp_path / "c.toml"
    conf.write_text('[run]\nrun-dir = "~/runs/x"\n')
    assert load_coordinator_config(conf).run.server.run_dir == str(tmp_path / "runs" / "x")


# -- flwr CLI --------------------------------------------------------------------------------------
def test_a_flwr_call_that_hangs_is_one_error_naming_the_command_and_the_timeout(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "flwr"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "c.toml").write_text("[coordinator]\nhost = \"127.0.0.1\"\n[run]\nmin-nodes = 1\n")
    coord = Coordinator(load_coordinator_config(tmp_path / "c.toml"), insecure=True)
    with pytest.raises(CoordinatorError, match=r"^`flwr ls` must finish within 0\.5 s\. Found it still running"):
        coord._flwr("ls", FEDERATION, "--format", "json", timeout=0.5)
    with pytest.raises(CoordinatorError, match=r"^`flwr supernode register` must finish within 0\.5 s"):
        coord._flwr("supernode", "register", str(tmp_path / "k.pub"), FEDERATION, timeout=0.5)


# -- TLS certificates ------------------------------------------------------------------------------
def _resign(certs: CertificatePaths, *, sans=("localhost", "127.0.0.1"), start=None, end=None) -> None:
    """Replace ``init_certificates``' server certificate by one its CA signs with these SANs and validity."""
    ca_key = serialization.load_pem_private_key((certs.ca_cert.parent / CA_KEY).read_bytes(), None)
    ca = x509.load_pem_x509_certificate(certs.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(certs.server_key.read_bytes(), None)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("fedshield test server")).issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start or now - dt.timedelta(days=1)).not_valid_after(end or now + dt.timedelta(days=1)))
    if sans:
        cert = cert.add_extension(_san(sans), critical=False)
    certs.server_cert.write_bytes(cert.sign(ca_key, hashes.SHA384()).public_bytes(serialization.Encoding.PEM))


def _tls_config(tmp_path, host: str = "127.0.0.1", port: int = 9, days: int = 30, timeout: float = 60.0):
    certs = init_certificates(tmp_path / "certs", days=days)
    new_node_key(tmp_path / "keys" / "client-1")
    (tmp_path / "c.toml").write_text(f'[coordinator]\nhost = "{host}"\nport = {port}\nstart-timeout = {timeout}\n'
                                     'enrolled-keys = ["keys/client-1.pub"]\n[run]\nmin-nodes = 1\n')
    return certs


def test_the_certificates_init_makes_pass_for_loopback_hosts(tmp_path):
    certs = _tls_config(tmp_path)
    for host in ("127.0.0.1", "localhost", "LOCALHOST.", "0.0.0.0"):
        check_server_certificate(certs, host)
    assert connect_host("0.0.0.0") == "127.0.0.1" and connect_host("::") == "::1"


@pytest.mark.parametrize("case", ["expired", "not-yet-valid", "expired-ca"])
def test_a_certificate_outside_its_validity_period_is_one_line_naming_the_file(tmp_path, capsys, case):
    certs = _tls_config(tmp_path, days=0 if case == "expired-ca" else 30)  # days=0: expires as it is made
    now = dt.datetime.now(dt.timezone.utc)
    if case == "expired":
        _resign(certs, start=now - dt.timedelta(days=10), end=now - dt.timedelta(days=1))
    elif case == "not-yet-valid":
        _resign(certs, start=now + dt.timedelta(days=1), end=now + dt.timedelta(days=10))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml")]) == 2
    line = _one_error_line(capsys)
    path = certs.ca_cert if case == "expired-ca" else certs.server_cert
    assert line.startswith(f"fedshield: error: {path} must be a certificate that is valid now. Found it ")
    assert ("valid only from" if case == "not-yet-valid" else "expired on") in line
    assert not (tmp_path / "coordinator-state").exists(), "refused before anything starts"


@pytest.mark.parametrize("host, sans, covered", [
    ("127.0.0.1", ("localhost",), False),
    ("127.0.0.1", ("127.0.0.2", "localhost"), False),
    ("127.0.0.1", ("127.0.0.1",), True),
    ("0.0.0.0", ("localhost",), False),  # listen on all: the coordinator itself connects on 127.0.0.1
    ("localhost", ("127.0.0.1",), False),
    ("node.example.org", ("*.example.org",), True),
    ("a.node.example.org", ("*.example.org",), False),  # a wildcard covers one label only
    ("node.example.org", ("other.example.org",), False),
    ("Node.Example.org", ("node.example.org",), True),
    ("127.0.0.1", (), False),  # no SubjectAltName at all
])
def test_the_san_must_cover_the_host(tmp_path, host, sans, covered):
    certs = _tls_config(tmp_path)
    _resign(certs, sans=sans)
    if covered:
        check_server_certificate(certs, host)
        return
    with pytest.raises(ConfigError, match=f"^{certs.server_cert} must name the coordinator host "):
        check_server_certificate(certs, host)


def test_a_wrong_san_is_one_cli_line_with_the_fix(tmp_path, capsys):
    certs = _tls_config(tmp_path)
    _resign(certs, sans=("localhost",))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml")]) == 2
    assert _one_error_line(capsys) == (
        f"fedshield: error: {certs.server_cert} must name the coordinator host 127.0.0.1 in its SubjectAltName, which "
        "TLS clients check. Found 'DNS:localhost'; run `fedshield certs init DIR --force --san 127.0.0.1` to make one "
        "that does.")


class _Quiet(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_waiting_for_a_superlink_that_fails_verification_names_the_tls_error(tmp_path):
    """A served certificate the check did not see (replaced after it, say): the wait used to end
    with only "Found no answer"."""
    served = tmp_path / "served"
    server = http.server.HTTPServer(("127.0.0.1", 0), _Quiet)
    certs = _tls_config(tmp_path, port=server.server_address[1], timeout=0.5)
    coord = Coordinator(load_coordinator_config(tmp_path / "c.toml"), insecure=False)
    shutil.copytree(tmp_path / "certs", served)
    _resign(CertificatePaths.in_dir(served), sans=("localhost",))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(served / "server.crt", served / "server.key")
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(CoordinatorError) as err:
            coord._wait_healthy()
    finally:
        server.shutdown()
        server.server_close()
    message = str(err.value)
    assert message.startswith(f"the SuperLink must answer on https://127.0.0.1:{server.server_address[1]}/health within "
                              "0.5 s. Found no answer; the last TLS error was: ")
    assert "IP address mismatch" in message and str(certs.server_cert) in message


def test_more_min_nodes_than_enrolled_keys_is_refused_before_anything_starts(tmp_path, capsys):
    """Only enrolled nodes can join under TLS: min-nodes = 2 with one key (listed twice) waited out
    wait-nodes-timeout with a SuperLink up, then failed."""
    _tls_config(tmp_path)
    text = (tmp_path / "c.toml").read_text().replace('["keys/client-1.pub"]', '["keys/client-1.pub", "keys/client-1.pub"]')
    (tmp_path / "c.toml").write_text(text.replace("min-nodes = 1", "min-nodes = 2"))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml")]) == 2
    assert _one_error_line(capsys) == ("fedshield: error: run.min-nodes must be <= the 1 enrolled client key(s) (only "
                                       "enrolled nodes can join: no round could start). Found 2.")
    assert not (tmp_path / "coordinator-state").exists(), "refused before anything starts"


@pytest.mark.parametrize("rule", ['aggregator = "median"'])
def test_fedbuff_taking_one_update_per_node_needs_buffer_size_enrolled_keys(tmp_path, capsys, rule):
    """A release under a robust rule takes buffer-size distinct nodes: with fewer enrolled
    keys the run stalled after agents had trained, then failed (stall timeout: 420 s by default)."""
    _tls_config(tmp_path)
    with (tmp_path / "c.toml").open("a") as f:
        f.write(f'workflow = "fedbuff"\nbuffer-size = 2\n{rule}\n')
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("fedshield: error: run.buffer-size must be <= the 1 enrolled client key(s) (a FedBuff "
                           "release under ") and line.endswith("Found 2."), line
    assert not (tmp_path / "coordinator-state").exists(), "refused before anything starts"


# -- found before the SuperLink starts (a review: each was found by the ServerApp, after agents joined) ----------
def _coordinator_error(tmp_path, capsys, monkeypatch, *extra: str) -> str:
    started = []
    monkeypatch.setattr(Coordinator, "start_superlink", lambda self: started.append(1))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), *extra]) == 2
    assert not started, "refused before the SuperLink starts"
    return _one_error_line(capsys)


def test_a_run_dir_of_another_configuration_is_refused_before_the_superlink_starts(tmp_path, capsys, monkeypatch):
    from coordinator import RunConfig, RunDirectory
    from coordinator.workflow import run_fingerprint

    _tls_config(tmp_path)
    numel = 64 * 128 + 128 + 128 * 10 + 10  # the digits MLP's
    old = RunConfig.from_mapping({"min-nodes": 1, "lr": 0.2})
    row = {"round": 1, "test_accuracy": 0.5, "test_loss": 1.0, "round_time_s": 1.0, "bytes_down": 1, "bytes_up": 1}
    RunDirectory(tmp_path / "r").save_checkpoint({"round": 1, "version": 1, "weights": torch.zeros(numel), "history": [
        row], "optimizer": {}, "rejections": {}, "fingerprint": run_fingerprint(old, numel, None, "flower")})
    line = _coordinator_error(tmp_path, capsys, monkeypatch, "--run-dir", str(tmp_path / "r"))
    assert "must hold a checkpoint of this configuration to resume. Found lr = 0.2 there, 0.1 now" in line


def test_a_finished_run_dir_says_so_and_starts_nothing(tmp_path, capsys, monkeypatch):
    """Restarted on a run directory that holds all its rounds, the coordinator said "resuming at round 11", waited
    for agents and ended the run at once. Now one line says nothing is left to train, and nothing starts."""
    import json

    from coordinator import RunConfig, RunDirectory
    from coordinator.rundir import SUMMARY
    from coordinator.workflow import run_fingerprint

    _tls_config(tmp_path)
    numel = 64 * 128 + 128 + 128 * 10 + 10
    cfg = RunConfig.from_mapping({"min-nodes": 1})
    row = {"round": 1, "test_accuracy": 0.5, "test_loss": 1.0, "round_time_s": 1.0, "bytes_down": 1, "bytes_up": 1}
    rounds = cfg.server.num_rounds
    RunDirectory(tmp_path / "r").save_checkpoint({"round": rounds, "version": rounds, "weights": torch.zeros(numel),
                                                  "history": [row], "optimizer": {}, "rejections": {},
                                                  "fingerprint": run_fingerprint(cfg, numel, None, "flower")})
    (tmp_path / "r" / SUMMARY).write_text(json.dumps({"rounds": rounds, "final_test_accuracy": 0.5}))
    started = []
    monkeypatch.setattr(Coordinator, "start_superlink", lambda self: started.append(1))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert not started and f"already holds {rounds} rounds (>= run.num-rounds = {rounds}); nothing trained" in err
    # a failed run's result is told again, nothing started; a summary from before the last rounds (stopped before
    # it was rewritten): resumed, to write it
    (tmp_path / "r" / SUMMARY).write_text(json.dumps({"rounds": rounds, "failure": "no updates"}))
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "r")]) == 2
    assert not started and _one_error_line(capsys).startswith("fedshield: error: the run must train. Found: no updates")
    (tmp_path / "r" / SUMMARY).write_text(json.dumps({"rounds": rounds - 1, "final_test_accuracy": 0.5}))

    def start(self):
        raise CoordinatorError("started")
    monkeypatch.setattr(Coordinator, "start_superlink", start)
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "r")]) == 2
    assert _one_error_line(capsys) == "fedshield: error: started"


def test_a_run_dir_that_cannot_be_made_is_refused_before_the_superlink_starts(tmp_path, capsys, monkeypatch):
    _tls_config(tmp_path)
    line = _coordinator_error(tmp_path, capsys, monkeypatch, "--run-dir", "/proc/fedshield-no-such/run")
    assert "run-dir /proc/fedshield-no-such/run must be creatable" in line


def test_a_bad_kernels_variable_is_refused_before_the_superlink_starts(tmp_path, capsys, monkeypatch):
    _tls_config(tmp_path)
    monkeypatch.setenv("FEDSHIELD_KERNELS", "bogus")
    assert "FEDSHIELD_KERNELS must be 'auto', 'numba' or 'torch'. Found 'bogus'" in _coordinator_error(
        tmp_path, capsys, monkeypatch)


@pytest.mark.parametrize("value, found", [("9" * 5000, "Exceeds the limit"), ("[" * 3000, "nested too deep")])
def test_toml_that_python_cannot_read_is_one_line(tmp_path, capsys, value, found):
    """tomllib raises ValueError past 4300 digits and RecursionError for deep arrays, besides TOMLDecodeError."""
    (tmp_path / "c.toml").write_text(f"[run]\nlr = {value}\n")
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml")]) == 2
    line = _one_error_line(capsys)
    assert "must be valid TOML" in line and found in line and len(line) < 400


def test_a_key_or_certificate_that_is_not_a_regular_file_says_what_it_is(tmp_path, capsys):
    """/dev/null was "Found no file at /dev/null" (and for a key: run `fedshield keys new /dev/null`)."""
    assert main(["agent", "start", "--coordinator", "127.0.0.1:9", "--root-cert", "/dev/null", "--key", "/dev/null",
                 "--partition", "0/2"]) == 2
    assert "must be a regular file. Found a character device at /dev/null" in _one_error_line(capsys)


def test_central_dp_divides_by_the_enrolled_keys_and_needs_a_count_under_insecure(tmp_path, capsys, monkeypatch):
    """A central-DP round divides its noised sum by a public count: coordinator start takes fraction-train x the
    enrolled keys (only they can join); under --insecure anyone can join, so the count must be given."""

    _tls_config(tmp_path)
    new_node_key(tmp_path / "keys" / "client-2")
    text = (tmp_path / "c.toml").read_text().replace('["keys/client-1.pub"]', '["keys/client-1.pub", "keys/client-2.pub"]')
    (tmp_path / "c.toml").write_text(text + 'dp = "central"\ndp-noise-multiplier = 1.0\n')
    coord = Coordinator(load_coordinator_config(tmp_path / "c.toml"), insecure=False)
    assert coord.cfg.run.privacy.dp_expected_clients == 2
    line = _coordinator_error(tmp_path, capsys, monkeypatch, "--insecure")
    assert line.startswith("fedshield: error: run.dp-expected-clients must be set under dp = 'central' with --insecure")
    (tmp_path / "c.toml").write_text(text + 'dp = "central"\ndp-noise-multiplier = 1.0\ndp-expected-clients = 5\n')
    assert Coordinator(load_coordinator_config(tmp_path / "c.toml"), insecure=True).cfg.run.privacy.dp_expected_clients == 5


def test_a_run_dir_another_coordinator_holds_is_refused_before_the_superlink_starts(tmp_path, capsys, monkeypatch):
    import subprocess
    import sys

    _tls_config(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; from coordinator.rundir import lock_run_dir; "
                               f"lock_run_dir({str(tmp_path / 'r')!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    monkeypatch.setattr("coordinator.service.LOCK_WAIT_S", 0.5)  # (30 s: a killed coordinator's ServerApp lets go)
    started = []
    monkeypatch.setattr(Coordinator, "start_superlink", lambda self: started.append(1))
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), "--run-dir", str(tmp_path / "r")]) == 2
        assert not started, "refused before the SuperLink starts"
        err = capsys.readouterr().err.strip().splitlines()
        assert [line for line in err if "waiting up to 0 s" in line and f"held by process {holder.pid}" in line]
        assert err[-1].startswith("fedshield: error: ") and not any("Traceback" in line for line in err), err
        assert f"run-dir {tmp_path / 'r'} must not be in use by another run. Found it held by process {holder.pid}" in err[-1]
    finally:
        holder.kill()
        holder.wait()
