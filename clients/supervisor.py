"""The warm agent's supervisor: the process ``fedshield agent start`` becomes once its inputs are checked.

It holds no torch (the agent execs into this script, standard library only): it starts the ClientApp
worker (``clients.worker``), waits until it is warm, then starts the SuperNode, echoes the SuperNode's
log, restarts a worker that died or hung (its message gets an error reply), and stops both on
SIGINT/SIGTERM or when the SuperNode ends, saying why in one line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# The agent's state dir: the worker writes READY, INFLIGHT and RELEASED, the agent SECRET and NODE_FILE
# (clients.worker, cli), the SuperNode RUNTIME (its Runtime API's address, once it listens:
# clients.flower_pins.report_runtime_address) and RECEIVED (when it last stored a message: patch_supernode)
READY, INFLIGHT, NODE_FILE, SECRET, RUNTIME = "ready", "inflight", "node.json", "secret", "runtime"
RELEASED, RECEIVED = "released", "received"

# Flower's own lines: its console prefix ("ERROR :     ", with colours or a timestamp), then the
# message; an exit's message starts with its whole "Exit Code: N" line. Text that merely contains
# these words (an error quoting a coordinator's value, in a ClientApp's traceback) is not one.
_FATAL = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[\d\-:, ]*:\s+"
                    r"(?:Exit Code: (\d+)\s*$|Giving up reconnection\b)")
_REFUSAL = re.compile(r"\[code: (\d+)\]")  # a SuperLink's refusal, in the line of the failure it ended
# fedshield's own ClientApp lines (a refusal's reason quotes the coordinator's values): never Flower's exit or refusal
_OURS = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)[\d\-:, ]*:\s+\[fedshield\]")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")  # a line's level, as Flower's console writes it
_LEVELS = {"DEBUG": 10, "INFO": 20, "WARNING": 30, "WARN": 30, "ERROR": 40, "CRITICAL": 50}
# Exit codes of a ClientApp process (a ClientApp that raised: 800; one that lost its SuperNode: 250): the
# node stays in the run (a bad message must not take it out).
_TASK_CODES = range(250, 300), range(800, 900)
# SuperLink refusal codes (in the SuperNode's log) in words.
_REFUSALS = {
    2001: "the coordinator requires node authentication: give --key with an enrolled key",
    2004: "this node's key is not enrolled at the coordinator: add its .pub file to the coordinator's enrolled-keys",
}
_EXIT_REASONS = {
    302: "the node key could not be read as an ECDSA OpenSSH private key",
    303: "node authentication needs TLS: drop --insecure",
    305: "could not connect to the coordinator: check the address, that it runs, its certificate (--root-cert), "
         "that this node's public key is enrolled in the coordinator's config, and that both or neither run "
         "--insecure",
    600: "the coordinator address is not a valid HOST:PORT",
    603: "the root certificate is not a valid PEM certificate",
    604: "a path given to the SuperNode does not exist",
}
# The node's own plumbing, which fedshield sets up on 127.0.0.1 and a device's owner cannot act on: the
# Runtime API server the worker talks to (uvicorn's and FastAPI's start and stop lines) and the secret
# that guards it (Flower calls it experimental). Not echoed.
_PLUMBING = re.compile(r"^(?:INFO:\s+(?:Started server process|Waiting for application (?:startup|shutdown)\.|"
                       r"Application (?:startup|shutdown) complete\.|Uvicorn running on |Shutting down$|"
                       r"Finished server process)|(?:INFO|WARNING)[\d\-:, ]*:\s+(?:FastAPI lifespan: |"
                       r"EXPERIMENTAL: SuperExec authentication))")
# uvicorn's line when the node's Runtime API cannot bind a --port the user gave (the default binds a free one)
_BIND = re.compile(r"error while attempting to bind on address \('([^']*)', (\d+)\): address already in use")
_SENT = re.compile(r"Sent successfully")
_RECEIVED = re.compile(r"Received successfully")
_GIVE_UP = re.compile(r"^WARNING[\d\-:, ]*:\s+Giving up reconnection\b")
_RETRY = re.compile(r"^(?:WARNING)[\d\-:, ]*:\s+Connection attempt failed, retrying in ")
# Flower's SuperNode can end with Python's "Exception ignored in: <module 'threading'...>" and a
# traceback of its own SystemExit(0): noise, not a failure; it is not echoed.
_IGNORED_START, _IGNORED_END = "Exception ignored in: <module 'threading'", "SystemExit:"
MAX_BACKOFF = 30.0  # seconds between restarts of a worker that keeps dying
REJOIN_FIRST, REJOIN_MAX = 1.0, 60.0  # seconds before a --rejoin agent's node tries again: doubling up to the max
HEALTHY = 60.0  # seconds a worker must live for its death to count as a first one again


@dataclasses.dataclass
class Watched:
    """What the SuperNode's log said: Flower's exit code, a SuperLink refusal code, messages answered."""

    exit_code: int | None = None
    refusal: int | None = None
    served: int = 0
    taken: str = ""  # HOST:PORT the node's Runtime API could not bind (taken by another process)


@dataclasses.dataclass
class Plan:
    """What the agent runs: the SuperNode's and the worker's command lines, and how it watches the worker."""

    supernode: list[str]
    worker: list[str]
    state_dir: str
    task_timeout: float = 1800.0  # a message handled longer than this: the worker hangs, it is restarted
    tick: float = 0.2
    coordinator: str = ""  # HOST:PORT, and the CA file ("": --insecure): to tell why a connection failed
    root_cert: str = ""
    worker_pid: int = 0  # a worker the agent started before it exec'd into this supervisor: adopted
    rejoin: bool = False  # --rejoin: a node the coordinator refused or lost is started again, the worker kept warm


def _watch(proc: subprocess.Popen, quiet: threading.Event | None = None, on_message=None) -> Watched:
    """Echo the SuperNode's log (less Flower's shutdown noise and the node's plumbing); return what it said.

    A SuperNode that gave up may hang on its helper threads: once a fatal line is
    seen, the process group gets a few seconds to exit and is then stopped. Once
    ``quiet`` is set (the agent was interrupted), what the group says as it stops is not echoed.
    """
    seen = Watched()
    assert proc.stdout is not None
    stopping = skipping = traceback = waiting = ended = False
    colour = sys.stderr.isatty()  # a log file gets no colour codes
    shown = _shown_level()
    for line in proc.stdout:
        text = _ANSI.sub("", line)
        level = _LEVEL.match(text)
        if line.startswith(_IGNORED_START):
            skipping = True
        retry = _RETRY.match(text)
        if retry and waiting:
            continue  # one line for the whole wait, not one per attempt
        waiting = (waiting or bool(retry)) and "Connection successful" not in text
        if retry:
            line = text = "fedshield agent: waiting for the coordinator (it is not up, or refused: trying again)\n"
        # a node that served gave up on a coordinator gone after its run: the agent says so in its own line, so
        # Flower's "Giving up reconnection" and the refused connection after it are not echoed (another error is:
        # the only clue to a network fault)
        gave_up = bool(seen.served and _GIVE_UP.match(text))
        hide = gave_up or (ended and bool(level) and level.group(1) == "ERROR" and "Connection refused" in text)
        ended = gave_up  # (the next line, if an ERROR, is its connection error)
        if not skipping and not hide and not (quiet is not None and quiet.is_set()) and not _PLUMBING.match(text) \
                and not (level and _LEVELS[level.group(1)] < shown):
            sys.stderr.write(line if colour else text)
        elif line.startswith(_IGNORED_END):
            skipping = False
        if text.startswith("Traceback (most recent call last):"):  # a ClientApp's error: its frames and
            traceback = True                                       # its exception line quote message text
            continue
        if traceback:
            traceback = text[:1].isspace()  # the first line not indented is the exception's: skipped too
            continue
        seen.served += bool(_SENT.search(text))
        if bound := _BIND.search(text):
            seen.taken = f"{bound.group(1)}:{bound.group(2)}"
        if on_message is not None and _RECEIVED.search(text):
            on_message()  # the worker asks for the task now, not at its next idle poll
        if _OURS.match(text):
            continue
        m, refused = _FATAL.match(text), _REFUSAL.search(text)
        if m and m.group(1) and any(int(m.group(1)) in codes for codes in _TASK_CODES):
            continue
        if m or refused:
            seen.exit_code = int(m.group(1)) if m and m.group(1) else (seen.exit_code or 305)
            seen.refusal = int(refused.group(1)) if refused else seen.refusal
            if not stopping:
                stopping = True
                timer = threading.Timer(5.0, stop_group, (proc,))
                timer.daemon = True
                timer.start()
    proc.wait()
    return seen


def _shown_level() -> int:
    """The least level of the SuperNode's lines echoed: the user's ``FLWR_LOG_LEVEL``. The node itself always logs
    INFO (``node_env``): this process counts its "Sent successfully" lines (a node that served and then lost its
    coordinator ended its part in a run; one that never served could not connect) and wakes the worker by its
    "Received successfully"."""
    return _LEVELS.get(os.environ.get("FLWR_LOG_LEVEL", "").strip().upper(), 0)


def node_env() -> dict[str, str]:
    """The SuperNode's environment beyond this process's: INFO at least, whatever ``FLWR_LOG_LEVEL`` asks."""
    return {"FLWR_LOG_LEVEL": "INFO"} if _shown_level() > _LEVELS["INFO"] else {}


def _messages(n: int) -> str:
    return f"{n} message{'' if n == 1 else 's'}"


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def die_with_parent() -> None:
    """In a child's process (Linux; the agent's SuperNode and worker, the coordinator's SuperLink): get
    SIGTERM if the process that started it dies, even by SIGKILL."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _say(text: str) -> None:
    print(f"fedshield agent: {text}", file=sys.stderr, flush=True)


def start_process(cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
    """A child in a session of its own that gets SIGTERM if this process dies; ``env``: beyond this process's."""
    return subprocess.Popen(cmd, env={**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1", **(env or {})},
                            start_new_session=True,
                            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None, **kw)


class Adopted:
    """A child this process inherited across exec (the worker the agent started): Popen's poll and wait."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode, self._lock = pid, None, threading.Lock()

    def poll(self) -> int | None:
        with self._lock:  # (the log watcher's thread asks too)
            return self._poll()

    def _poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped elsewhere: gone
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.02)
        return self.returncode


def _status(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"


def _read_time(path: str) -> float | None:
    """The ``time.monotonic()`` a process wrote to ``path`` (None: none written)."""
    try:
        with open(path) as f:
            return float(f.read())
    except (OSError, ValueError):
        return None


class Workers:
    """The one ClientApp worker: started, restarted when it dies or hangs (never two at once), and started again
    for the next message after it released its memory (``--release-worker-after``)."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.proc, self.deaths, self.started_at = plan, None, 0, 0.0
        self.ready_path = os.path.join(plan.state_dir, READY)
        self.inflight = os.path.join(plan.state_dir, INFLIGHT)
        self.released_path = os.path.join(plan.state_dir, RELEASED)
        self.received_path = os.path.join(plan.state_dir, RECEIVED)
        self.next_start = 0.0
        self.released_at: float | None = None  # when a released worker last asked for a task (None: not released)

    def start(self) -> None:
        if self.plan.worker_pid:  # the first worker, started by the agent before it exec'd into this process
            self.proc, self.started_at, self.plan.worker_pid = Adopted(self.plan.worker_pid), time.monotonic(), 0
            return
        for stale in (self.ready_path, self.released_path):
            try:
                os.unlink(stale)
            except FileNotFoundError:
                pass
        self.proc, self.started_at = start_process(self.plan.worker), time.monotonic()

    def ready(self) -> bool:
        return os.path.exists(self.ready_path)

    def check(self) -> None:
        """Restart a worker that died, or kill one whose message has taken longer than ``task_timeout``."""
        now = time.monotonic()
        if self.proc is None:
            if self.released_at is not None:  # a message its last request for a task did not see: start it
                if (_read_time(self.received_path) or float("-inf")) > self.released_at:
                    _say("a message came: starting the ClientApp worker again.")
                    self.released_at = None
                    self.start()
            elif now >= self.next_start:
                self.start()
            return
        code = self.proc.poll()
        if code is None:
            if now - self.started_at > HEALTHY:
                self.deaths = 0  # alive a while: its next death restarts it at once
            started = _inflight_started(self.inflight, self.proc.pid)
            if started is not None and time.time() - started > self.plan.task_timeout:
                _mark_inflight(self.inflight, f"the ClientApp worker took more than {self.plan.task_timeout:g} s "
                                              "on this message and was restarted")
                _say(f"the ClientApp worker has handled one message for more than {self.plan.task_timeout:g} s "
                     "(--task-timeout): stopping it; the message gets an error reply and a new worker starts.")
                stop_group(self.proc, signal.SIGKILL)
                self.proc.wait()
                self.proc, self.deaths, self.next_start = None, 0, now
            return
        if code == 0 and (released := _read_time(self.released_path)) is not None:  # idle, it freed its memory
            os.unlink(self.released_path)
            self.proc, self.released_at = None, released
            return self.check()
        _mark_inflight(self.inflight, f"the ClientApp worker died ({_status(code)}) on this message")
        self.deaths += 1
        delay = min(MAX_BACKOFF, 2.0 ** (self.deaths - 1) - 1.0)
        _say(f"the ClientApp worker died ({_status(code)}); "
             + (f"restarting it in {delay:g} s." if delay else "restarting it."))
        self.proc, self.next_start = None, now + delay

    def wake(self) -> None:
        """SIGUSR1: a message came, ask for it now. Only to a READY worker: one still starting (its imports take
        seconds) has no handler yet, and SIGUSR1's default action would end it."""
        proc = self.proc
        if proc is not None and proc.poll() is None and self.ready():
            try:
                os.kill(proc.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc, sig)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                stop_group(self.proc, signal.SIGKILL)
                self.proc.wait()


def _inflight_started(path: str, pid: int) -> float | None:
    """When worker ``pid`` started the message it holds (None: it holds none; a dead predecessor's is not its)."""
    try:
        with open(path) as f:
            record = json.load(f)
        return float(record["started"]) if record.get("pid") == pid else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _mark_inflight(path: str, reason: str) -> None:
    """Tell the next worker why the message it finds in flight was lost."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return
    record["reason"] = reason
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def supervise(plan: Plan) -> int:
    """Run the agent until its SuperNode ends or a signal comes; return the exit status."""
    stopped_by: list[int] = []
    quiet = threading.Event()
    workers = Workers(plan)
    node: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        # SIGTERM to each group whatever came in: SIGINT made the ClientApp running at that moment print a
        # KeyboardInterrupt traceback; a second signal (a process hangs on its way out): SIGKILL
        sig = signal.SIGKILL if stopped_by else signal.SIGTERM
        for proc in (node, workers.proc):
            if proc is not None:
                stop_group(proc, sig)
        stopped_by.append(signum)
        quiet.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    try:
        workers.start()
        while not workers.ready():  # the node joins the federation once its ClientApp can serve at once
            if stopped_by:
                return _stopped(stopped_by, 0)
            code = workers.proc.poll()
            if code is not None:
                print(f"fedshield: error: agent stopped: its ClientApp worker could not start ({_status(code)}; "
                      "see its error above).", file=sys.stderr)
                return 1
            time.sleep(plan.tick / 4)
        served, failures, said = 0, 0, ""
        address = Path(plan.state_dir) / RUNTIME  # (each node writes it once it listens: clients.flower_pins)
        while True:
            node = start_process(plan.supernode, node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
            seen: list[Watched] = []
            watcher = threading.Thread(target=lambda proc, out: out.append(_watch(proc, quiet, workers.wake)),
                                       args=(node, seen), daemon=True)
            watcher.start()
            while watcher.is_alive():
                if not stopped_by:
                    workers.check()
                watcher.join(plan.tick)
            watched = seen[0] if seen else Watched()
            address.unlink(missing_ok=True)  # (good for that node only: its worker waits for the next one's)
            served += watched.served
            if stopped_by:
                return _stopped(stopped_by, served)
            if not (plan.rejoin and watched.exit_code == 305):  # (305: refused, or the coordinator lost)
                return _ended(dataclasses.replace(watched, served=served), node.returncode, plan)
            failures = 0 if watched.served else failures + 1
            delay = min(REJOIN_MAX, REJOIN_FIRST * 2.0 ** max(0, failures - 1))
            reason = _rejoin_reason(watched, plan)
            if reason != said:  # once per cause, not once per attempt
                _say(f"{reason}; trying again every {REJOIN_MAX:g} s at most (--rejoin).")
                said = reason
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not stopped_by:
                workers.check()  # (the warm worker stays; one that dies is restarted meanwhile)
                time.sleep(min(plan.tick, max(0.0, deadline - time.monotonic())))
            if stopped_by:
                return _stopped(stopped_by, served)
    finally:
        if node is not None:
            stop_group(node)
        workers.stop()
        shutil.rmtree(plan.state_dir, ignore_errors=True)


def _rejoin_reason(seen: Watched, plan: Plan) -> str:
    """Why a --rejoin agent's node ended, in words, for the line it prints before it tries again."""
    if seen.served:
        return f"{_gone(seen.served)}; waiting for it to come back"
    if seen.refusal in _REFUSALS:
        return f"the coordinator refused this node: {_REFUSALS[seen.refusal]}"
    cause = diagnose_connection(plan.coordinator, plan.root_cert) if plan.coordinator else None
    return cause or "could not join the coordinator (see the SuperNode's lines above)"


def _gone(served: int) -> str:
    return (f"the coordinator went away after this node answered {_messages(served)} (its run ended, or it was "
            "stopped or restarted)")


def _stopped(stopped_by: list[int], served: int) -> int:
    """Ctrl-C: 130, as fedshield simulate; SIGTERM (a service manager's stop): 0."""
    _say(f"{'interrupted' if stopped_by[0] == signal.SIGINT else 'stopped'}; the node left the federation after "
         f"answering {_messages(served)}.")
    return 130 if stopped_by[0] == signal.SIGINT else 0


PROBE_TIMEOUT = 5.0  # seconds for each step of diagnose_connection


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return (host, int(port)) if host and port.isdigit() else None


def _speaks_plain_http(host: str, port: int, timeout: float) -> bool:
    import socket

    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
            return s.recv(5) == b"HTTP/"
    except OSError:
        return False


def diagnose_connection(coordinator: str, root_cert: str, timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why this host cannot join the coordinator at ``coordinator`` (HOST:PORT), in words, from what it sees now:
    the TCP connection (refused, timed out, unreachable), then TLS with ``root_cert`` as Flower's SuperNode does it
    (that CA only, the host's name checked; "": the agent runs --insecure). None: nothing found wrong."""
    import socket
    import ssl

    where = _host_port(coordinator)
    if where is None:
        return None
    host, port = where
    at = f"the coordinator at {coordinator}"
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return (f"could not connect to {at}: connection refused (nothing listens there: is the coordinator running, "
                "and is the port right?)")
    except TimeoutError:
        return (f"could not connect to {at}: no answer within {timeout:g} s (is the address right? a firewall "
                "in between?)")
    except socket.gaierror as exc:
        return f"could not connect to {at}: {host} does not resolve ({exc.strerror or exc})"
    except OSError as exc:
        return f"could not connect to {at}: {exc.strerror or exc} (is the address right?)"
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # as the SuperNode's: the given CA only, the host's name checked
    try:
        if root_cert:
            ctx.load_verify_locations(cafile=root_cert)
        else:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # (only: does it speak TLS at all?)
    except (OSError, ValueError):
        return None  # (the agent checked the file before it started)
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            pass
    except ssl.SSLCertVerificationError as exc:
        detail = f"CERTIFICATE_VERIFY_FAILED: {exc.verify_message}"
        if exc.verify_code in (62, 64):  # X509_V_ERR_HOSTNAME_MISMATCH, X509_V_ERR_IP_ADDRESS_MISMATCH
            return (f"the coordinator's certificate (at {coordinator}) does not name {host} ({detail}): connect "
                    f"with a name it has, or make it with `fedshield certs init DIR --san {host}`")
        return (f"the coordinator's certificate (at {coordinator}) is not trusted by --root-cert {root_cert} "
                f"({detail}): give the coordinator's ca.crt")
    except (ssl.SSLError, ConnectionError, TimeoutError, OSError) as exc:
        if _speaks_plain_http(host, port, timeout):
            return None if not root_cert else (f"{at} speaks no TLS (it runs --insecure?): run both with TLS, "
                                               "or both with --insecure (tests only)")
        if not root_cert:
            return f"{at} accepts connections but answers neither HTTP nor TLS (is it the coordinator's port?)"
        if isinstance(exc, TimeoutError):
            return f"{at} accepts connections but completed no TLS handshake within {timeout:g} s"
        return f"the TLS handshake with {at} failed ({getattr(exc, 'reason', None) or exc})"
    if not root_cert:
        return f"{at} runs TLS and this agent --insecure: give --root-cert (the coordinator's ca.crt) and --key instead"
    return (f"{at} is reachable and its certificate trusted by --root-cert, so it refused this node (see the "
            "SuperNode's lines above): is this node's public key (its --key's .pub) in the coordinator's "
            "enrolled-keys?")


def _ended(seen: Watched, returncode: int, plan: Plan | None = None) -> int:
    flwr_code, refusal = seen.exit_code, seen.refusal
    if flwr_code is None and returncode in (0, -signal.SIGTERM, -signal.SIGINT):
        return 0
    if flwr_code == 305 and refusal is None and seen.served:
        # Connected, answered the coordinator, then lost it: a coordinator stops its SuperLink when its
        # run ends, so this is how an agent's part in a finished run ends (or the coordinator stopped).
        _say(f"{_gone(seen.served)}; agent stopped.")
        return 0
    if seen.taken:
        port = seen.taken.rpartition(":")[2]
        reason = (f"its Runtime API port {seen.taken} is taken by another process (--port {port}: leave it out and "
                  "each node binds a free one)")
    elif refusal in _REFUSALS:
        reason = _REFUSALS[refusal]
    elif flwr_code == 305 and refusal is None and plan is not None and plan.coordinator and \
            (seen_cause := diagnose_connection(plan.coordinator, plan.root_cert)):
        reason = seen_cause  # the cause this host sees, instead of five possible ones
    else:
        reason = _EXIT_REASONS.get(flwr_code or 0, f"see the SuperNode's log above (exit status {returncode})")
    print(f"fedshield: error: agent stopped (Flower exit code {flwr_code}): {reason}.", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(supervise(Plan(**json.loads(sys.argv[1]))))
