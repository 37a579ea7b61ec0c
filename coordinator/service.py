"""``fedshield coordinator start``: a real Flower SuperLink running fedshield's ServerApp.

Steps: validate the config and every file it names; start Flower's SuperLink (``coordinator.superlink``)
(TLS and node authentication on unless ``--insecure``); register the enrolled
client keys; submit the ServerApp as a run with ``flwr run --stream``; stream
its log; stop everything it started, also on failure or Ctrl-C.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import tomli_w

from aggregation import get_device, kernels
from aggregation._errors import shown_key
from clients.cli import bind_probe, host_port
from clients import flower_pins
from clients.supervisor import die_with_parent
from clients.config import ConfigError, build_config, check, parse_toml, resolve_path, resolve_task
from privacy import CertificatePaths, check_public_key, make_dir

from ._errors import CoordinatorError
from .config import RunConfig
from .progress import result_text
from .live import announce_start, mark_ended
from .rundir import LOCK_WAIT_S, SUMMARY, check_run_dir, finished_summary, lock_run_dir, unlock_run_dir
from .status import StatusServer
from .workflow import check_resumable
from . import superlink
from .tls import check_server_certificate, connect_host

FEDERATION = "fedshield"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclasses.dataclass(frozen=True)
class ServiceSettings:
    """The ``[coordinator]`` table. Relative paths are relative to the config file."""

    host: str = "127.0.0.1"
    port: int = 9092
    certs_dir: str = "certs"
    enrolled_keys: tuple[str, ...] = ()
    state_dir: str = "coordinator-state"
    start_timeout: float = 60.0
    status_port: int = 0  # the status page on 127.0.0.1: 0 a free port (printed at start), -1 none


    def __post_init__(self) -> None:
        check(bool(self.host), "host", "be a host name or IP", self.host)
        check(0 < self.port < 65536, "port", "be in [1, 65535]", self.port)
        keys = self.enrolled_keys
        check(isinstance(keys, list | tuple) and all(isinstance(k, str) and k for k in keys),
              "enrolled-keys", "be a list of public key paths", keys)
        check(all("\0" not in k for k in keys), "enrolled-keys", "hold paths without a NUL character", keys)
        object.__setattr__(self, "enrolled_keys", tuple(keys))
        check(self.start_timeout > 0, "start-timeout", "be > 0 seconds", self.start_timeout)
        check(-1 <= self.status_port < 65536, "status-port", "be in [1, 65535], 0 (a free port) or -1 (no status page)",
              self.status_port)


@dataclasses.dataclass(frozen=True)
class CoordinatorFile:
    service: ServiceSettings
    run: RunConfig
    base: Path

    def path(self, p: str, key: str = "path") -> Path:
        """``p`` (the value of ``key``) expanded and made absolute: a relative path is relative to the config file."""
        return resolve_path(p, key, self.base)


def load_coordinator_config(path: str | os.PathLike, run_dir: str | None = None,
                            tables: tuple[str, ...] = ()) -> CoordinatorFile:
    """``[coordinator]`` and ``[run]`` of the file at ``path`` (and ``tables`` left to the caller), checked."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--config must be an existing TOML file. Found {str(p)!r} "
                          f"({'a directory' if p.is_dir() else 'no such file'}).")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {str(p)!r} must be UTF-8 text (TOML). Found byte 0x{exc.object[exc.start]:02x} at "
                          f"offset {exc.start}.") from None
    data = parse_toml(text, str(p))
    unknown = sorted(set(data) - {"coordinator", "run", *tables})
    if unknown:
        known = ", ".join(f"[{t}]" for t in ("coordinator", "run", *tables))
        raise ConfigError(f"{p}: [{shown_key(unknown[0])}] is not a known table. Known tables: {known}.")
    service = build_config(ServiceSettings, data.get("coordinator", {}), "coordinator")
    run_map = data.get("run", {})
    if not isinstance(run_map, dict):
        raise ConfigError(f"[run] must be a table. Found {type(run_map).__name__}.")
    run_map = dict(run_map)
    base = p.parent.resolve()
    if "task" in run_map:  # a task file: relative to the config's own directory
        run_map["task"] = resolve_task(run_map["task"], base)
    if run_dir:  # the --run-dir flag: relative to where the command runs, like simulate's (the CLI refuses '')
        run_map["run-dir"] = str(resolve_path(run_dir, "--run-dir"))
    given = run_map.get("run-dir", "")
    check(isinstance(given, str), "run.run-dir", "be a path (a string)", given)
    run_map["run-dir"] = str(resolve_path(given or "runs/coordinator", "run.run-dir", base))
    return CoordinatorFile(service=service, run=RunConfig.from_mapping(run_map), base=base)


def _flwr_env(home: Path) -> dict[str, str]:
    env = os.environ.copy()
    env.update({"FLWR_HOME": str(home), "FLWR_DISABLE_UPDATE_CHECK": "1",
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1", "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2"})
    return env


def write_app_dir(app_dir: Path, run: RunConfig, serverapp: str = "coordinator.server_app:app",
                  extra: dict[str, Any] | None = None) -> Path:
    """A Flower app directory whose pyproject points at the installed fedshield apps (``serverapp``: an edge
    aggregator's site app instead; ``extra``: run config keys beside the run's)."""
    app_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "project": {"name": "fedshield-app", "version": "0.1.0", "description": "fedshield coordinator run",
                    "license": "Apache-2.0"},
        "tool": {"flwr": {"app": {
            "publisher": "fedshield",
            "components": {"serverapp": serverapp, "clientapp": "clients.client_app:app"},
            "config": {**run.to_mapping(), **(extra or {})},
        }}},
    }
    (app_dir / "pyproject.toml").write_text(tomli_w.dumps(doc))
    return app_dir


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc (Linux; empty elsewhere)."""
    out: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        out.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return out


def descendants(pid: int) -> list[int]:
    children, out, todo = _children_map(), [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def tree_groups(pid: int) -> set[int]:
    """The process groups of ``pid`` (a session leader we started) and of everything it started, but this process's:
    Flower's superexec, the SuperNode and the workers each run in a session of their own."""
    return ({pid} | {g for g in map(_pgid, descendants(pid)) if g}) - {os.getpgrp()}


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_groups(groups: set[int], timeout: float, reap=lambda: None) -> None:
    """SIGTERM to each live process group (never this process's), up to ``timeout`` s for them to end
    (``reap()`` each tick: a zombie child keeps its group alive), then SIGKILL to those left, 5 s more."""
    groups = set(groups) - {os.getpgrp()}
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        groups = {g for g in groups if group_alive(g)}  # (a group gone a while could be another's by now)
        for g in groups:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(group_alive(g) for g in groups):
            reap()
            time.sleep(0.1)


def _signal_groups(groups: set[int], sig: int) -> None:
    for g in groups:
        try:
            os.killpg(g, sig)
        except ProcessLookupError:
            pass


class Coordinator:
    """Owns the SuperLink and the ``flwr`` CLI calls of one ``coordinator start``."""

    def __init__(self, cfg: CoordinatorFile, insecure: bool) -> None:
        self.cfg, self.insecure = cfg, insecure
        get_device(cfg.run.server.device, key="run.device")  # the ServerApp's device (or FEDSHIELD_DEVICE) exists here, before anything starts
        kernels.enabled()  # and FEDSHIELD_KERNELS is one it knows (else found at the first aggregation, agents trained)
        s = cfg.service
        self.state = cfg.path(s.state_dir, "coordinator.state-dir")
        self.address = host_port(s.host, s.port)  # where the SuperLink listens
        self.connect_address = host_port(connect_host(s.host), s.port)  # where this coordinator reaches it
        self.certs: CertificatePaths | None = None
        self.keys: list[Path] = []
        self.stopping = threading.Event()  # set by stop(): what the run's stream says after it is not echoed
        if not insecure:
            self.certs = CertificatePaths.in_dir(cfg.path(s.certs_dir, "coordinator.certs-dir")).check()
            check_server_certificate(self.certs, s.host)
            if not s.enrolled_keys:
                raise ConfigError("coordinator.enrolled-keys must list at least one client public key (TLS with "
                                  "node authentication admits only enrolled keys). Found none.")
            self.keys = [check_public_key(cfg.path(k, "coordinator.enrolled-keys")) for k in s.enrolled_keys]
            # Only enrolled nodes can join: a round needing more of them would wait out wait-nodes-timeout, then fail.
            # (Keys listed twice count once.)
            enrolled = len({k.read_bytes().split()[1] for k in self.keys})  # (checked OpenSSH: type, key, comment)
            need = cfg.run.server.min_nodes
            if need > enrolled:
                raise ConfigError(f"run.min-nodes must be <= the {enrolled} enrolled client key(s) (only enrolled nodes "
                                  f"can join: no round could start). Found {need}.")
            why = cfg.run.release_short_of_nodes(enrolled)
            if why:
                raise ConfigError(f"run.buffer-size must be <= the {enrolled} enrolled client key(s) (a FedBuff release "
                                  f"{why} takes one update from each of buffer-size nodes). Found "
                                  f"{cfg.run.asynchrony.buffer_size}.")
        run = cfg.run
        if run.privacy.dp == "central" and run.asynchrony.workflow == "sync" and not run.privacy.dp_expected_clients:
            # The public count a round's noised sum is divided by: the expected sample of the enrolled clients
            # (only they can join). Under --insecure anyone can: the operator must say how many to expect.
            if insecure:
                raise ConfigError("run.dp-expected-clients must be set under dp = 'central' with --insecure (any node "
                                  "may join, so the population is not known: set fraction-train x the number of "
                                  "clients you expect). Found 0.")
            privacy = dataclasses.replace(run.privacy, dp_expected_clients=run.dp_divisor(enrolled))
            self.cfg = cfg = dataclasses.replace(cfg, run=dataclasses.replace(run, privacy=privacy))
        self.superlink: subprocess.Popen | None = None
        self.log_path = self.state / "superlink.log"

    # -- processes -----------------------------------------------------------
    def check_port_free(self) -> None:
        """The SuperLink's port must be free: otherwise its bind fails while the health check (and the
        run) would reach whatever already listens there, such as another coordinator's SuperLink."""
        s = self.cfg.service
        try:
            bind_probe(s.host, s.port)
        except socket.gaierror as exc:
            raise ConfigError(f"coordinator.host must resolve to an address. Found {s.host!r}: {exc.strerror}.") from None
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CoordinatorError(f"coordinator.port {s.port} on {s.host} must be free. Found it in use "
                                       "(another coordinator or SuperLink?): stop that or pick another port.") from None
            raise CoordinatorError(f"coordinator.host:port {s.host}:{s.port} must be bindable. Found: "
                                   f"{exc.strerror}.") from None

    def start_superlink(self) -> None:
        self.check_port_free()  # before anything is made on disk
        make_dir(self.state, "coordinator.state-dir", ConfigError)
        s = self.cfg.service
        # In-memory SuperLink state: a restarted coordinator starts a fresh link (the run itself
        # resumes from the run directory's checkpoint); agents then start again and re-join.
        # Flower's SuperLink behind fedshield's guard: the Control and Runtime APIs answer only this host
        # (coordinator.superlink: on Flower's own, anyone reaching the port could register keys and submit runs).
        cmd = superlink.command("--host", s.host, "--port", str(s.port), "--disable-runtime-dependency-installation")
        if self.insecure:
            cmd.append("--insecure")
        else:
            assert self.certs is not None
            cmd += ["--ssl-ca-certfile", str(self.certs.ca_cert), "--ssl-certfile", str(self.certs.server_cert),
                    "--ssl-keyfile", str(self.certs.server_key), "--enable-supernode-auth"]
        log = open(self.log_path, "ab")  # noqa: SIM115 - closed with the process
        env = {**_flwr_env(self.state / "superlink-home"), superlink.MAX_BODY_ENV: str(self.max_body())}
        # SIGTERM when this process dies, even by SIGKILL (Linux): a killed coordinator left its SuperLink serving,
        # and the ServerApp training and writing the run directory, unsupervised
        self.superlink = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                          preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        self._wait_healthy()

    def max_body(self) -> int:
        """The most a remote peer's request may carry: the largest reply this run takes (the model in float32,
        dense's size, or max-update-mb if smaller) and 16 MiB for the message around it (a SecAgg+ stage's shares
        at 1 KiB a node included)."""
        from clients.tasks import get_task

        numel = get_task(self.cfg.run.task).num_parameters(self.cfg.run.private_model)
        update = min(int(self.cfg.run.server.max_update_mb * 2**20), 4 * numel + 1024)
        return update + (16 << 20)

    def _wait_healthy(self) -> None:
        """Until the SuperLink answers its health check, or ``start-timeout``: then a CoordinatorError
        that, with TLS, quotes the last certificate verification error seen (a certificate the
        SuperLink serves that does not fit the CA or the host)."""
        url = f"{'http' if self.insecure else 'https'}://{self.connect_address}/health"
        ctx = None if self.insecure else ssl.create_default_context(cafile=str(self.certs.ca_cert))  # type: ignore[union-attr]
        deadline = time.monotonic() + self.cfg.service.start_timeout
        tls_error = ""
        while True:  # at least one try, however short the timeout
            if self.superlink is not None and self.superlink.poll() is not None:
                raise CoordinatorError(f"the SuperLink must start. Found it exited with code {self.superlink.returncode}: "
                                       f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
                    healthy = resp.status == 200
            except OSError as exc:  # urllib wraps an SSL error in a URLError's reason
                healthy = False
                reason = getattr(exc, "reason", exc)
                if isinstance(reason, ssl.SSLError):
                    tls_error = getattr(reason, "verify_message", None) or reason.reason or str(reason)
            if healthy:  # and it is ours: a SuperLink that failed to bind exits within moments
                time.sleep(0.5)
                if self.superlink is None or self.superlink.poll() is None:
                    return
                continue  # it exited: said at the top of the loop
            if time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        found = f"no answer; the last TLS error was: {tls_error} (the certificate in {self.certs.server_cert})" \
            if tls_error and self.certs is not None else "no answer"
        raise CoordinatorError(f"the SuperLink must answer on {url} within {self.cfg.service.start_timeout} s. Found {found}.")

    def _log_tail(self, lines: int = 3) -> str:
        """The SuperLink log's telling lines (an error or errno line if there is one, else its last
        lines), without colour codes, and where the whole log is."""
        try:
            text = [_ANSI.sub("", line).strip() for line in self.log_path.read_text(errors="replace").splitlines()]
        except OSError:
            return "(no log)"
        text = [line for line in text if line]
        telling = [line for line in text if "Errno" in line or "ERROR" in line or "rror:" in line]
        return " | ".join((telling or text)[-lines:]) + f" (full log: {self.log_path})"

    def stop(self) -> None:
        """Stop the SuperLink's process group and every group its descendants started (Flower's superexec runs
        the ServerApp, flwr-serverapp, in a session of its own: stopping the SuperLink's group alone left it
        running for 20-30 s, its parent gone)."""
        if self.superlink is None or self.superlink.poll() is not None:
            return
        self.stopping.set()  # (`flwr run --stream` then reports its SuperLink unavailable: Flower's red box)
        groups = tree_groups(self.superlink.pid)
        _signal_groups(groups, signal.SIGTERM)
        try:
            self.superlink.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(group_alive(g) for g in groups - {self.superlink.pid}):
            time.sleep(0.2)
        # SIGKILL only to groups that still have members (a group gone for seconds could be another's by now)
        _signal_groups({g for g in groups if group_alive(g)}, signal.SIGKILL)
        self.superlink.wait()

    # -- flwr CLI --------------------------------------------------------------
    @property
    def cli_home(self) -> Path:
        return self.state / "cli-home"

    def write_cli_config(self) -> None:
        conn: dict[str, Any] = {"address": self.connect_address}
        if self.insecure:
            conn["insecure"] = True
        else:
            conn["root-certificates"] = str(self.certs.ca_cert)  # type: ignore[union-attr]
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": FEDERATION, FEDERATION: conn}}))

    def _flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """``flwr ARGS`` against this SuperLink; a CoordinatorError naming the command if it cannot
        start or is still running after ``timeout`` seconds (then it is killed)."""
        name = " ".join(["flwr", *(a for a in args[:2] if a.isalpha() and a != FEDERATION)])
        try:
            return subprocess.run(["flwr", *args], capture_output=True, text=True, timeout=timeout,
                                  env=_flwr_env(self.cli_home))
        except subprocess.TimeoutExpired:
            raise CoordinatorError(f"`{name}` must finish within {timeout:g} s. Found it still running (stopped it); is "
                                   f"the SuperLink at {self.connect_address} stuck? See {self.log_path}.") from None
        except OSError as exc:
            raise CoordinatorError(f"`{name}` must start. Found: {exc.strerror or exc} (is Flower installed in this "
                                   "environment?).") from None

    def register_keys(self) -> None:
        """``flwr supernode register`` for every enrolled key, in one process (clients/flower_pins.py)."""
        if not self.keys:
            return
        timeout = 60 + 0.5 * len(self.keys)
        cmd = [sys.executable, "-P", str(Path(flower_pins.__file__)), "register", FEDERATION, *map(str, self.keys)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_flwr_env(self.cli_home))
        except subprocess.TimeoutExpired:
            raise CoordinatorError(f"registering the {len(self.keys)} enrolled keys must finish within {timeout:g} s. "
                                   f"Found it still running (stopped it); is the SuperLink at {self.connect_address} "
                                   f"stuck? See {self.log_path}.") from None
        results = {}
        for line in out.stdout.splitlines():
            try:
                record = json.loads(line)
                results[record["key"]] = record
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        for key in self.keys:
            result = results.get(str(key), {"success": False,
                                            "error-message": (out.stderr or out.stdout).strip()[-300:]})
            if not result.get("success") and "already in use" not in str(result.get("error-message", "")):
                raise CoordinatorError(f"enrolled key {key.name} must register with the SuperLink. "
                                       f"Found: {result.get('error-message')}")
            print(f"fedshield coordinator: enrolled {key.name}", file=sys.stderr)

    def submit_and_stream(self, app_dir: Path) -> int:
        proc = subprocess.Popen(["flwr", "run", str(app_dir), FEDERATION, "--stream"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=_flwr_env(self.cli_home), start_new_session=True,
                                preexec_fn=die_with_parent if sys.platform.startswith("linux") else None)
        try:
            assert proc.stdout is not None
            colour = sys.stdout.isatty()  # a log file gets no colour codes
            for line in proc.stdout:
                if not self.stopping.is_set():
                    sys.stdout.write(line if colour else _ANSI.sub("", line))
                    sys.stdout.flush()
            return proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()

    def run_status(self) -> tuple[str, str]:
        out = self._flwr("ls", FEDERATION, "--format", "json")
        try:
            runs = json.loads(out.stdout[out.stdout.find("{"):]).get("runs", [])
        except (json.JSONDecodeError, ValueError):
            return "unknown", out.stdout.strip()[-300:]
        if not runs:
            return "unknown", "no run listed"
        last = max(runs, key=lambda r: str(r.get("pending-at", "")))
        return str(last.get("status", "unknown")), str(last.get("status-details", ""))


def start_coordinator(config: str, insecure: bool = False, run_dir: str | None = None) -> int:
    cfg = load_coordinator_config(config, run_dir)
    if insecure:
        print("fedshield coordinator: WARNING: --insecure: no TLS and no node authentication; any process that can "
              "reach the port can join and read the model. Use only for local tests.", file=sys.stderr)
    coord = Coordinator(cfg, insecure)
    cfg = coord.cfg  # with the settings it derives (dp-expected-clients)
    run_path = Path(cfg.run.server.run_dir)
    ckpt = None
    if cfg.run.server.run_dir:  # a file in the way, a bad checkpoint or another run's: before the SuperLink starts
        _, ckpt = check_run_dir(run_path, "run-dir")
        if ckpt is not None:
            check_resumable(cfg.run, ckpt, run_path, None, "flower")  # as the ServerApp would, once agents had joined
            done, wanted = int(ckpt["round"]), cfg.run.server.num_rounds
            if (finished := finished_summary(run_path, done, wanted)) is not None:  # no SuperLink, no agents needed
                if finished.get("failure"):
                    raise CoordinatorError(f"the run must train. Found: {finished['failure']}; results in {run_path}")
                print(f"fedshield coordinator: {run_path} already holds {done} rounds (>= run.num-rounds = {wanted}); "
                      "nothing trained, its results are unchanged. Raise run.num-rounds to train more, or give another "
                      "run-dir.", file=sys.stderr)
                return 0
    coord.check_port_free()  # (start_superlink checks again) before the banner says it is starting there
    if cfg.run.server.run_dir:  # not in use by another run (its ServerApp holds the lock): probed before anything starts;
        # the ServerApp of a coordinator killed a moment ago lets go within seconds: waited for, a little
        lock_run_dir(run_path, "run-dir", wait=LOCK_WAIT_S, on_wait=lambda pid: print(
            f"fedshield coordinator: run-dir {run_path} is held by process {pid} (the ServerApp of a coordinator "
            f"stopped a moment ago lets go within seconds); waiting up to {LOCK_WAIT_S:.0f} s", file=sys.stderr))
    port = cfg.service.status_port
    server = StatusServer(run_path, port) if port >= 0 else None  # (bound now: a port in use is refused here)
    print(f"fedshield coordinator: SuperLink on {coord.address} ({'INSECURE' if insecure else 'TLS + node authentication'}), "
          f"run directory {run_path}", file=sys.stderr)
    if server is not None:
        print(f"fedshield coordinator: status page on {server.url} (JSON: {server.url}status.json)", file=sys.stderr)
    ended = ("stopped", "the coordinator stopped before the run ended")

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        announce_start(run_path, cfg.run, resumed=ckpt is not None)  # status.json: "starting", not a session before's
        if server is not None:
            server.start()
        coord.start_superlink()
        coord.write_cli_config()
        if not insecure:
            coord.register_keys()
        app_dir = write_app_dir(coord.state / "app", cfg.run)
        started = time.time()
        unlock_run_dir(run_path)  # the ServerApp takes it: its process outlives this one's if this is killed
        coord.submit_and_stream(app_dir)
        status, details = coord.run_status()
        summary = run_path / SUMMARY
        if "completed" in status and summary.is_file() and summary.stat().st_mtime >= started:
            result = json.loads(summary.read_text())
            if result.get("failure"):
                raise CoordinatorError(f"the run must train. Found: {result['failure']}; results in {run_path}")
            print(f"fedshield coordinator: run completed: {result_text(result)} after "
                  f"{result['rounds']} rounds; results in {run_path}")
            return 0
        raise CoordinatorError(f"the run must complete. Found status {status!r}: {details or 'see the log above'}")
    except KeyboardInterrupt:
        ended = ("interrupted", "the coordinator was interrupted")
        raise
    except Exception as exc:
        ended = ("failed", str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__)
        raise
    finally:
        coord.stop()
        if server is not None:
            server.stop()
        mark_ended(run_path, *ended)  # the ServerApp stopped without saying so (killed, or never started)
