"""The coordinator at scale: one process emulates N enrolled nodes against ``fedshield coordinator start``.

    python benchmarks/node_emulator.py --nodes 1000 --per-round 100 --rounds 5 --json /tmp/emu.json
    python benchmarks/node_emulator.py --nodes 10000 --per-round 100 --rounds 5 --max-wall 1200   # the stretch

What runs, all on 127.0.0.1, in one temp dir (removed after; ``--keep`` keeps it, with the coordinator's logs):

- a deployment made as a user makes it: ``fedshield certs init certs``; N node keys written by fedshield's own
  ``fedshield keys new`` code (``privacy.transport.new_node_key``, in this process: N CLI processes would take
  minutes); a ``coordinator.toml`` enrolling every ``.pub`` (``enrolled-keys`` takes a list of files, no glob)
  with ``clients-per-round = min-nodes = --per-round``, ``partitioning = "sample"`` (each node draws
  ``client-examples`` digits: a population of any size), one local epoch, ``round-timeout = --round-timeout``;
- ``fedshield coordinator start --config coordinator.toml``: Flower's SuperLink behind fedshield's guard, TLS and
  node authentication on, the keys registered, the ServerApp submitted as a run;
- ONE emulator (threads in this process) holding the N identities. Each speaks Flower 1.42's Fleet API as a
  SuperNode does (``flwr/supernode/fleet_http_connection.py``, ``start_client_internal.py``), with Flower's own
  ``FleetHttpClient`` and interceptors (``NodeAuthHttpInterceptor`` signs each request with the node's private
  key, ``RuntimeVersionHttpInterceptor``): ActivateNode once the coordinator says the key is enrolled,
  SendNodeHeartbeat every (30 - 5) x U(0.7, 0.9) s (Flower's HeartbeatSender), PullMessages every ``--poll-s``
  (Flower's SuperNode: 3 s after an empty pull), then for a message GetRun and GetFab (a node's first message of
  the run), PullObject for each object of its tree and ConfirmMessageReceived (``pull_and_inflate_object_from_tree``),
  fedshield's ClientApp (``clients.client_app.app``: real local training on the node's ``partition-id``, the reply
  encoded as an agent's is; warmed up once before the run, as an agent's worker is), PushMessages and PushObject
  for the objects the SuperLink asks for, and the next pull at once. Unlike N SuperNodes (N processes, each with
  its own connection pool and heartbeat thread), the identities share one ``httpx.Client`` and ``--workers``
  threads driven by one timer heap: ``--workers`` bounds the requests the emulated fleet has in flight (N real
  SuperNodes: up to 2N, a poll and a heartbeat each). When the SuperLink is slower than the fleet asks, the
  difference queues in the emulator (its timers run late: printed) instead of at the SuperLink; with
  ``--workers 400`` it queues at the SuperLink, as N real nodes would make it.
- Replies wait ``--delay-ms`` (the median of a log-normal with ``--delay-sigma``) from the message's receipt;
  ``--dropout`` of the train messages are dropped by their node: ``--dropout-mode leave`` (the node deactivates,
  as a stopped SuperNode does, and rejoins after ~``--rejoin-s``: the SuperLink answers the ServerApp at once
  with a node-unavailable error reply), ``vanish`` (it stops talking: the SuperLink notices when its heartbeat
  patience, 2 x 30 s, runs out: such a round took 49-60 s) or ``silent`` (it stays online and never replies:
  the round waits out ``round-timeout``).

What it prints: per round, from the run directory's metrics.csv (nodes online, selected, replies, accepted,
rejected, late, round time) and from the emulator (messages received, dropped, replied; when the first and the
last node received its message, after the round's start; the slowest node's time from receipt to its reply's
last object); the SuperLink's, the SuperExec's, the ServerApp's, the coordinator's and the emulator's RSS (at the
end of the rounds and peak) and CPU seconds (utime + stime from /proc every 0.5 s; in total, while the keys were
registered, during the rounds); the refusals (rejected replies by rule, from metrics.csv, and the reasons in the
coordinator's log); the Fleet API calls the emulator made (count, rate, latency, errors by phase), the SuperLink's
CPU per request and the nodes one core of it serves at this poll interval; the machine's load. ``--json FILE``
writes the figures.

What it found on a shared 2-core machine (load average ~5 from other work; figures vary with it):

- Key registration: the coordinator ran one ``flwr supernode register`` process per key, ~2 s each (1,000 keys:
  33 min before the ServerApp was submitted); it now registers them in one process
  (``clients.flower_pins.register_keys``): 1,000 keys in ~13 s, 10,000 in ~55 s (the SuperLink's start included).
- 1,000 nodes, 100 a round, ``--workers 32``: the run completes, every dropout one error-reply refusal and nothing
  else refused. Session 19: ~100 s a round (85-107 s), the SuperLink at ~5.6 ms of CPU per Fleet request; the
  ServerApp pulled each reply one request at a time, so rounds ran past ``round-timeout`` (60 s). Session 22, on
  one machine: 5.1 ms a request and rounds of 62-81 s with the SuperLink as it was; then Flower's middleware
  that acts on another API stepped around and the rest of its BaseHTTPMiddlewares run as plain ASGI, uvloop's
  loop with asyncio's TLS layer, P-256 node keys: 1.75 ms a request, 457 requests/s, rounds of 9-11 s, no
  reply late. uvloop's own TLS layer would be cheaper still but reports no failed handshake. At 1,000 nodes polling
  every 3 s the SuperLink is still ~80% busy, most of it answering empty polls.
- 1,000 nodes with ``--workers 400``: the SuperLink's queue passed Flower's 5 s heartbeat call timeout (requests
  took ~10 s), nodes were declared unavailable (their train messages answered with node-unavailable errors:
  0 accepted), and the SuperLink ended the run itself when the ServerApp's task heartbeat did not come through
  ("No heartbeat received from the task"): the coordinator exited 2 in round 2-4.
- 10,000 nodes (session 19): keys (15 s to make, 55 s to register) and memory were fine (SuperLink ~200 MB, emulator
  ~480 MB), but it stopped at the heartbeats: 10,000 nodes need ~500 heartbeats/s at Flower's 30 s interval (and
  ~3,300 polls/s at its 3 s poll), the SuperLink served ~200 requests/s, so nodes fell past their 60 s heartbeat
  patience, every train message was answered "node unavailable" and no round aggregated. Session 22, at 1.3 ms a
  request: the run completes, rounds of 46-54 s, 279/300 accepted (the rest dropouts), SuperLink 187 MB; the
  emulator's 32 connections held the nodes' polls to the ~650 requests/s the SuperLink served (its timers ran up
  to 28 s late), which 10,000 real SuperNodes at a 3 s poll (~3,700/s) would not do.

Every process started runs in a session of its own and is stopped by process group (with every group its
descendants started) at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import collections
import csv
import heapq
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")  # the emulated ClientApps: one torch thread (read at import)
from clients.cli import free_port  # noqa: E402
from coordinator.service import descendants, stop_groups  # noqa: E402

BIN = Path(sys.executable).parent  # the venv's console scripts: fedshield, flwr
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
TICK_S = os.sysconf("SC_CLK_TCK")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
REJECT_LINE = re.compile(r"rejected reply from node \d+ \(([^)]+)\)")
DEADLINE_LINE = re.compile(r"deadline of .* passed with (\d+) replies missing")
ENROLLED_LINE = re.compile(r"fedshield coordinator: enrolled (\S+)\.pub")
RUN_DIR = "runs/emu"


# --- processes ----------------------------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (ppid 1, pgid 2, utime 11, stime 12, start 19), or None."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * PAGE_MB
    except (OSError, IndexError, ValueError):
        return 0.0


# A process's role under the coordinator, by its command line (the first match).
ROLES = (("flwr-serverapp", "ServerApp"), ("flower-superexec", "SuperExec"), ("superlink.py", "SuperLink"),
         ("flwr supernode register", "flwr CLI"), ("flwr run", "flwr CLI"), ("flwr ls", "flwr CLI"),
         ("coordinator start", "coordinator"))
REPORTED = ("SuperLink", "ServerApp", "SuperExec", "coordinator", "emulator")


def role_of(pid: int) -> str:
    cmd = _cmdline(pid)
    return next((name for key, name in ROLES if key in cmd), "other")


class Monitor(threading.Thread):
    """Every ``tick`` s: each process under the coordinator by role (RSS summed over the role's live processes, CPU
    seconds summed over every process the role ever had) and this process (the emulator); the process groups
    seen, for the clean-up."""

    def __init__(self, root: subprocess.Popen, tick: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root, self.tick = root, tick
        self.known: dict[tuple[int, str], str] = {}  # (pid, start time) -> role
        self.cpu: dict[tuple[int, str], float] = {}  # (pid, start time) -> last CPU seconds seen
        self.groups: set[int] = {root.pid}
        self.samples: list[tuple[float, dict[str, tuple[float, float]]]] = []
        self.first_seen: dict[str, float] = {}
        self.done = threading.Event()
        self.lock = threading.Lock()

    def sample(self) -> None:
        now = time.monotonic()
        pids = [self.root.pid, *descendants(self.root.pid)] if self.root.poll() is None else []
        rss: collections.Counter[str] = collections.Counter()
        with self.lock:
            for pid in pids:
                fields = _stat(pid)
                if fields is None:
                    continue
                key = (pid, fields[19])
                if key not in self.known:
                    self.known[key] = role_of(pid)
                    self.groups.add(int(fields[2]))
                role = self.known[key]
                self.first_seen.setdefault(role, now)
                self.cpu[key] = (int(fields[11]) + int(fields[12])) / TICK_S
                rss[role] += _rss_mb(pid)
            cpu: collections.Counter[str] = collections.Counter()
            for key, seconds in self.cpu.items():
                cpu[self.known[key]] += seconds
            me = _stat(os.getpid())
            rss["emulator"] = _rss_mb(os.getpid())
            cpu["emulator"] = (int(me[11]) + int(me[12])) / TICK_S if me else 0.0
            self.samples.append((now, {r: (rss[r], cpu[r]) for r in set(rss) | set(cpu)}))

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.tick)

    def stop(self) -> None:
        self.done.set()
        if self.is_alive():
            self.join()
        self.sample()

    def at(self, t: float, role: str) -> tuple[float, float]:
        """(RSS MB, CPU s) of ``role`` at the last sample at or before ``t`` (the first sample if none)."""
        with self.lock:
            best = self.samples[0][1] if self.samples else {}
            for ts, values in self.samples:
                if ts > t:
                    break
                best = values
            return best.get(role, (0.0, 0.0))

    def peak(self, role: str, t0: float = -math.inf, t1: float = math.inf) -> float:
        with self.lock:
            return max((v[role][0] for ts, v in self.samples if t0 <= ts <= t1 and role in v), default=0.0)

    def stop_groups(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL, to every process group seen under the coordinator (never this process's)."""
        try:
            self.sample()
        except Exception:  # noqa: BLE001 - the clean-up goes on
            pass
        stop_groups(set(self.groups), timeout, self.root.poll)
        try:
            self.root.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


# --- the deployment -----------------------------------------------------------------------------------

def setup_deployment(work: Path, a: argparse.Namespace) -> tuple[int, list[str]]:
    """Certificates, N node keys and coordinator.toml in ``work``, as a user makes them; (port, key names)."""
    from privacy.transport import new_node_key

    subprocess.run([str(BIN / "fedshield"), "certs", "init", "certs"], cwd=work, check=True, capture_output=True,
                   text=True)
    names = [f"client-{k}" for k in range(a.nodes)]
    for name in names:  # what `fedshield keys new keys/client-K` writes (ECDSA P-384, OpenSSH), without N processes
        new_node_key(work / "keys" / name)
    port = free_port()
    keys = ",\n  ".join(f'"keys/{n}.pub"' for n in names)
    (work / "coordinator.toml").write_text(f"""
[coordinator]
host = "127.0.0.1"
port = {port}
status-port = -1
enrolled-keys = [
  {keys},
]

[run]
run-dir = "{RUN_DIR}"
num-rounds = {a.rounds}
min-nodes = {a.per_round}
clients-per-round = {a.per_round}
wait-nodes-timeout = {a.wait_nodes_timeout}
round-timeout = {a.round_timeout}
partitioning = "sample"
client-examples = 20
local-epochs = 1
""")
    return port, names


# --- the emulator -------------------------------------------------------------------------------------

class CallStats:
    """Fleet API calls the emulator made: per RPC, count, HTTP errors by status, transport errors, latency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=400_000))
        self.errors: collections.deque = collections.deque(maxlen=100_000)  # (t, rpc, what)
        self.events: collections.Counter[str] = collections.Counter()

    def intercept(self, context: Any, call_next: Any) -> Any:  # a Flower ProtobufClientInterceptor
        rpc = context.rpc_method.rsplit("/", 1)[-1]
        t0 = time.monotonic()
        try:
            response = call_next(context)
        except Exception as exc:
            with self.lock:
                self.errors.append((time.monotonic(), rpc, type(exc).__name__))
            raise
        t1 = time.monotonic()
        with self.lock:
            self.calls[rpc].append((t1, t1 - t0))
            if response.status_code >= 400:
                self.errors.append((t1, rpc, f"HTTP {response.status_code}"))
        return response

    def event(self, what: str) -> None:
        with self.lock:
            self.events[what] += 1

    def window(self, t0: float, t1: float) -> tuple[dict[str, list[float]], collections.Counter]:
        with self.lock:
            calls = {rpc: [lat for t, lat in d if t0 <= t <= t1] for rpc, d in self.calls.items()}
            errors = collections.Counter((rpc, what) for t, rpc, what in self.errors if t0 <= t <= t1)
        return calls, errors


class Scheduler:
    """One timer heap and a pool of worker threads: ``at(delay, fn, *args)`` runs ``fn`` on a worker after ``delay``
    seconds. ``lags``: how late each call started (a saturated emulator falls behind its own timers)."""

    def __init__(self, workers: int) -> None:
        self.heap: list[tuple[float, int, Any, tuple]] = []
        self.cond = threading.Condition()
        self.seq = itertools.count()
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="node")
        self.stopped = False
        self.lags: collections.deque = collections.deque(maxlen=400_000)  # (t, lag s)
        self.failures: collections.Counter[str] = collections.Counter()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="timers")
        self.thread.start()

    def at(self, delay: float, fn: Any, *args: Any) -> None:
        with self.cond:
            heapq.heappush(self.heap, (time.monotonic() + max(0.0, delay), next(self.seq), fn, args))
            self.cond.notify()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.stopped and (not self.heap or self.heap[0][0] > time.monotonic()):
                    self.cond.wait(None if not self.heap else self.heap[0][0] - time.monotonic())
                if self.stopped:
                    return
                due, _, fn, args = heapq.heappop(self.heap)
            try:
                self.pool.submit(self._run, due, fn, args)
            except RuntimeError:  # shut down meanwhile
                return

    def _run(self, due: float, fn: Any, args: tuple) -> None:
        start = time.monotonic()
        self.lags.append((start, start - due))
        if self.stopped:
            return
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - counted; one node's failure must not stop the others
            self.failures[f"{getattr(fn, '__name__', fn)}: {type(exc).__name__}"] += 1

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class Identity:
    index: int
    name: str
    public_bytes: bytes
    client: Any  # a FleetHttpClient on the shared connection pool, signing with this node's key
    node: Any = None  # flwr.proto.node_pb2.Node once activated
    online: bool = False
    epoch: int = 0  # bumped at each (re)activation and dropout: a chain of timers from an older epoch ends
    activate_tries: int = 0
    hb_backoff: float = 0.0
    contexts: dict[int, Any] = field(default_factory=dict)  # run id -> Context (Context.state kept across rounds)


@dataclass
class RoundTrace:
    received: int = 0
    dropped: int = 0
    replied: int = 0
    errors: int = 0
    slowest_s: float = 0.0  # receipt to the reply's last object, the slowest node of the round
    first_receipt: float = math.inf
    last_receipt: float = 0.0
    last_reply: float = 0.0


class Emulator:
    """N node identities speaking the Fleet API as Flower 1.42's SuperNode does (see the module docstring)."""

    def __init__(self, address: str, ca_file: Path, key_files: dict[str, Path], a: argparse.Namespace) -> None:
        import httpx
        from cryptography.hazmat.primitives.serialization import load_ssh_private_key
        from flwr.supercore.interceptors.http.runtime_version import RuntimeVersionHttpInterceptor
        from flwr.supercore.primitives.asymmetric import public_key_to_bytes
        from flwr.supernode.fleet_http_client import FleetHttpClient
        from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

        class SharedFleetClient(FleetHttpClient):
            """Flower's Fleet client, on one httpx.Client shared by every identity (ProtobufClient.__init__
            makes one pool per client: 1,000 pools, 1,000 TLS sessions). Sets the attributes flwr 1.42's
            ProtobufClient.__init__ sets (``_base_url``, ``_interceptors``, ``_retry_invoker``, ``_client``)."""

            def __init__(self, base_url: str, interceptors: list[Any], http: Any) -> None:  # noqa: D107
                self._base_url, self._interceptors = base_url.rstrip("/"), tuple(interceptors)
                self._retry_invoker, self._client = None, http

            def close(self) -> None:
                pass  # the shared pool is closed once, by the emulator

        self.a = a
        self.rng = random.Random(a.seed)
        self.rng_lock = threading.Lock()
        self.stats = CallStats()
        ctx = ssl.create_default_context(cafile=str(ca_file))
        self.http = httpx.Client(verify=ctx, timeout=30.0, follow_redirects=True,
                                 limits=httpx.Limits(max_connections=a.workers, max_keepalive_connections=a.workers))
        version = RuntimeVersionHttpInterceptor(component_name="SuperNode")
        self.ids: dict[str, Identity] = {}
        for k, (name, path) in enumerate(key_files.items()):
            key = load_ssh_private_key(path.read_bytes(), None)  # as flower-supernode --auth-supernode-private-key
            client = SharedFleetClient(f"https://{address}", [self.stats, version,
                                                              NodeAuthHttpInterceptor(key, key.public_key())], self.http)
            self.ids[name] = Identity(k, name, public_key_to_bytes(key.public_key()), client)
        self.workers = a.workers
        self.sched = Scheduler(a.workers)
        self.app_lock = threading.Lock()  # the ClientApp runs one message at a time (its caches are not locked)
        self.lock = threading.Lock()
        self.online = 0
        self.rounds: dict[str, RoundTrace] = collections.defaultdict(RoundTrace)
        self._fused: dict[str, Any] = {}

    # -- helpers -------------------------------------------------------------------------------------
    def uniform(self, lo: float, hi: float) -> float:
        with self.rng_lock:
            return self.rng.uniform(lo, hi)

    def chance(self, p: float) -> bool:
        with self.rng_lock:
            return self.rng.random() < p

    def delay_s(self) -> float:
        if self.a.delay_ms <= 0:
            return 0.0
        with self.rng_lock:
            return self.a.delay_ms / 1e3 * math.exp(self.rng.gauss(0.0, self.a.delay_sigma))

    def _set_online(self, ident: Identity, online: bool) -> None:
        with self.lock:
            if ident.online != online:
                self.online += 1 if online else -1
            ident.online = online

    # -- lifecycle -----------------------------------------------------------------------------------
    def enrolled(self, name: str) -> None:
        """The coordinator registered ``name``'s key: the node may activate now."""
        if name in self.ids:
            self.sched.at(0.0, self.activate, self.ids[name])

    def activate(self, ident: Identity) -> None:
        import httpx
        from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL
        from flwr.proto.fleet_pb2 import ActivateNodeRequest
        from flwr.proto.node_pb2 import Node

        try:
            res = ident.client.ActivateNode(ActivateNodeRequest(public_key=ident.public_bytes,
                                                                heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL))
        except httpx.HTTPError:
            ident.activate_tries += 1
            self.stats.event("activate retried")
            self.sched.at(min(2.0 ** ident.activate_tries, 20.0) * self.uniform(0.8, 1.2), self.activate, ident)
            return
        ident.node, ident.activate_tries, ident.hb_backoff = Node(node_id=res.node_id), 0, 0.0
        with self.lock:
            ident.epoch += 1
        self._set_online(ident, True)
        self.sched.at(0.0, self.heartbeat, ident, ident.epoch)  # Flower's HeartbeatSender: one at once
        self.sched.at(self.uniform(0.0, self.a.poll_s), self.poll, ident, ident.epoch)

    def heartbeat(self, ident: Identity, epoch: int) -> None:
        import httpx
        from flwr.common.constant import HEARTBEAT_CALL_TIMEOUT, HEARTBEAT_DEFAULT_INTERVAL
        from flwr.proto.heartbeat_pb2 import SendNodeHeartbeatRequest

        if ident.epoch != epoch:
            return
        try:
            res = ident.client.SendNodeHeartbeat(SendNodeHeartbeatRequest(
                node=ident.node, heartbeat_interval=HEARTBEAT_DEFAULT_INTERVAL))
            ok = res.success
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code == 401:  # Flower's SuperNode stops here (SIGINT); this node activates again
                self.stats.event("heartbeat refused (401): re-activating")
                self._leave(ident, epoch, deactivate=False, rejoin_s=5.0)
                return
            ok = False
        except (httpx.TransportError, RuntimeError):  # (RuntimeError: the shared pool closed at the end)
            ok = False
        if not ok:  # Flower: retried with exponential backoff up to 20 s
            self.stats.event("heartbeat retried")
            ident.hb_backoff = min(20.0, max(1.0, ident.hb_backoff * 2))
            self.sched.at(ident.hb_backoff, self.heartbeat, ident, epoch)
            return
        ident.hb_backoff = 0.0
        interval = (HEARTBEAT_DEFAULT_INTERVAL - HEARTBEAT_CALL_TIMEOUT) * self.uniform(0.7, 0.9)
        self.sched.at(interval, self.heartbeat, ident, epoch)

    def poll(self, ident: Identity, epoch: int) -> None:
        from flwr.common.serde import message_from_proto
        from flwr.proto.fleet_pb2 import PullMessagesRequest

        if ident.epoch != epoch:
            return
        try:
            res = ident.client.PullMessages(PullMessagesRequest(node=ident.node))
        except Exception:  # noqa: BLE001 - counted by CallStats; Flower's retry invoker tries again
            self.sched.at(self.a.poll_s, self.poll, ident, epoch)
            return
        if not res.messages_list:
            self.sched.at(self.a.poll_s, self.poll, ident, epoch)
            return
        try:
            self.receive(ident, epoch, message_from_proto(res.messages_list[0]), res.message_object_trees[0])
        except Exception as exc:  # noqa: BLE001 - as Flower's SuperNode: the message is lost, the node goes on
            self.stats.event(f"message lost ({type(exc).__name__})")
            self.sched.at(self.a.poll_s, self.poll, ident, epoch)

    def _context(self, ident: Identity, run_id: int) -> Any:
        """The node's Context for a run: GetRun and GetFab on its first message of the run (as a SuperNode)."""
        from flwr.app import Context, RecordDict
        from flwr.common.config import get_fused_config_from_fab
        from flwr.common.serde import fab_from_proto, run_from_proto
        from flwr.proto.fab_pb2 import GetFabRequest
        from flwr.proto.run_pb2 import GetRunRequest

        if run_id not in ident.contexts:
            run = run_from_proto(ident.client.GetRun(GetRunRequest(node=ident.node, run_id=run_id)).run)
            fab = fab_from_proto(ident.client.GetFab(GetFabRequest(node=ident.node, hash_str=run.fab_hash,
                                                                   run_id=run_id)).fab)
            if fab.hash_str not in self._fused:
                self._fused[fab.hash_str] = get_fused_config_from_fab(fab.content, run)
            ident.contexts[run_id] = Context(
                run_id=run_id, node_id=ident.node.node_id, state=RecordDict(), run_config=self._fused[fab.hash_str],
                node_config={"partition-id": ident.index, "num-partitions": self.a.nodes})
        return ident.contexts[run_id]

    def receive(self, ident: Identity, epoch: int, message: Any, tree: Any) -> None:
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode
        from flwr.supercore.inflatable.inflatable_protobuf_utils import (make_confirm_message_received_fn_protobuf,
                                                                         make_pull_object_fn_protobuf)
        from flwr.supercore.inflatable.inflatable_utils import pull_and_inflate_object_from_tree

        from clients.client_app import app

        received = time.monotonic()
        group = message.metadata.group_id
        is_train = message.metadata.message_type.startswith("train")
        with self.lock:
            self.rounds[group].received += 1
            self.rounds[group].first_receipt = min(self.rounds[group].first_receipt, received)
            self.rounds[group].last_receipt = max(self.rounds[group].last_receipt, received)
        run_id = message.metadata.run_id
        context = self._context(ident, run_id)
        if is_train and self.a.dropout > 0 and self.chance(self.a.dropout):
            with self.lock:
                self.rounds[group].dropped += 1
            self.stats.event(f"dropout ({self.a.dropout_mode})")
            if self.a.dropout_mode == "silent":  # online, never replies: the round waits out round-timeout
                self.sched.at(self.a.poll_s, self.poll, ident, epoch)
            else:
                self._leave(ident, epoch, deactivate=self.a.dropout_mode == "leave",
                            rejoin_s=self.a.rejoin_s * self.uniform(0.5, 1.5))
            return
        full = pull_and_inflate_object_from_tree(
            tree, make_pull_object_fn_protobuf(ident.client.PullObject, ident.node, run_id),
            make_confirm_message_received_fn_protobuf(ident.client.ConfirmMessageReceived, ident.node, run_id),
            return_type=Message)
        full.metadata.__dict__["_message_id"] = tree.object_id  # (as Flower's run_clientapp sets it)
        t0 = time.perf_counter()
        with self.app_lock:
            try:
                reply = app(message=full, context=context)
            except Exception as exc:  # noqa: BLE001 - as flwr-clientapp: an error reply, the node goes on
                reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc).__name__}: {exc}"),
                                reply_to=full)
        runtime = time.perf_counter() - t0
        if reply.has_error():
            with self.lock:
                self.rounds[group].errors += 1
        wait = max(0.0, received + self.delay_s() - time.monotonic())
        self.sched.at(wait, self.push, ident, epoch, reply, runtime, group, received)

    def push(self, ident: Identity, epoch: int, reply: Any, runtime: float, group: str, received: float) -> None:
        from flwr.app.message import remove_content_from_message
        from flwr.common.serde import message_to_proto
        from flwr.proto.fleet_pb2 import PushMessagesRequest
        from flwr.supercore.inflatable.inflatable_object import (get_all_nested_objects, get_object_tree,
                                                                 no_object_id_recompute)
        from flwr.supercore.inflatable.inflatable_protobuf_utils import make_push_object_fn_protobuf
        from flwr.supercore.inflatable.inflatable_utils import push_objects

        if ident.epoch != epoch:
            return
        reply.metadata.__dict__["_message_id"] = reply.object_id
        try:
            with no_object_id_recompute():
                tree = get_object_tree(reply)
                res = ident.client.PushMessages(PushMessagesRequest(
                    node=ident.node, messages_list=[message_to_proto(remove_content_from_message(reply))],
                    message_object_trees=[tree], clientapp_runtime_list=[runtime]))
                push_objects(get_all_nested_objects(reply), make_push_object_fn_protobuf(
                    ident.client.PushObject, ident.node, reply.metadata.run_id, res.session_id),
                    object_ids_to_push=set(res.objects_to_push))
        except Exception:  # noqa: BLE001 - counted by CallStats; Flower's SuperNode logs it and goes on
            self.stats.event("reply not delivered")
        else:
            done = time.monotonic()
            with self.lock:
                r = self.rounds[group]
                r.replied += 1
                r.slowest_s = max(r.slowest_s, done - received)
                r.last_reply = max(r.last_reply, done)
        self.sched.at(0.0, self.poll, ident, epoch)  # Flower's SuperNode pulls again at once after a push

    def _leave(self, ident: Identity, epoch: int, deactivate: bool, rejoin_s: float) -> None:
        from flwr.proto.fleet_pb2 import DeactivateNodeRequest

        with self.lock:
            if ident.epoch != epoch:
                return
            ident.epoch += 1  # the heartbeat and poll chains end
        self._set_online(ident, False)
        if deactivate:
            try:
                ident.client.DeactivateNode(DeactivateNodeRequest(node_id=ident.node.node_id))
            except Exception:  # noqa: BLE001 - Flower ignores this too
                pass
        self.sched.at(rejoin_s, self.activate, ident)

    def warm_up(self, config: Path) -> float:
        """One train message through fedshield's ClientApp before the run, built as the ServerApp builds it from
        the same ``[run]`` table: the task's import, data and the device profile are then loaded, as in an agent's
        warm worker, not charged to the first round. Seconds it took."""
        import tomllib

        from flwr.app import ArrayRecord, ConfigRecord, Context, Message, Metadata, RecordDict

        from aggregation import tensor_to_array
        from clients.client_app import app
        from clients.protocol import ARRAYS, CODEC, CONFIG, MESSAGE_TYPE_TRAIN, WEIGHTS, TrainInstruction
        from clients.tasks import load_task
        from coordinator.config import RunConfig

        t0 = time.perf_counter()
        cfg = RunConfig.from_mapping(tomllib.loads(config.read_text())["run"])
        task = load_task(cfg.task)
        instr = TrainInstruction(round=1, version=0, seed=cfg.server.seed, task=cfg.task, train=cfg.train)
        content = RecordDict({ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(task.init_weights(cfg.server.seed))}),
                              CONFIG: instr.to_record(), CODEC: ConfigRecord(cfg.aggregation.make_codec().config())})
        msg = Message(content=content, metadata=Metadata(  # (Message(dst_node_id=...) wants a ServerApp's identity)
            run_id=0, message_id="", src_node_id=0, dst_node_id=1, reply_to_message_id="", group_id="warm-up",
            created_at=time.time(), ttl=3600.0, message_type=MESSAGE_TYPE_TRAIN))
        msg.metadata.__dict__["_message_id"] = msg.object_id
        reply = app(message=msg, context=Context(run_id=0, node_id=1, node_config={"partition-id": 0, "num-partitions":
                                                 self.a.nodes}, state=RecordDict(), run_config={}))
        if reply.has_error():
            raise RuntimeError(f"the warm-up train message was refused: {reply.error.reason}")
        return time.perf_counter() - t0

    def stop(self) -> None:
        self.sched.stop()
        self.http.close()


# --- the run ------------------------------------------------------------------------------------------

class CoordinatorLog:
    """The coordinator's stdout (the run's log, streamed by ``flwr run --stream``) and stderr, each line timed,
    to files; what the benchmark needs from them: enrolled keys, rounds, refusals."""

    def __init__(self, proc: subprocess.Popen, work: Path, on_enrolled: Any) -> None:
        self.proc, self.on_enrolled = proc, on_enrolled
        self.enrolled: list[tuple[float, str]] = []
        self.reasons: collections.Counter[str] = collections.Counter()
        self.deadlines = 0
        self.tail: collections.deque = collections.deque(maxlen=60)
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._read, args=(s, work / f"coordinator.{n}.log"), daemon=True)
                        for s, n in ((proc.stdout, "out"), (proc.stderr, "err"))]
        for t in self.threads:
            t.start()

    def _read(self, stream: Any, path: Path) -> None:
        with open(path, "w") as out:
            for raw in stream:
                now = time.monotonic()
                line = ANSI.sub("", raw.rstrip("\n"))
                out.write(f"{now:.3f} {line}\n")
                enrolled = ENROLLED_LINE.search(line)
                with self.lock:
                    self.tail.append(line)
                    if enrolled:
                        self.enrolled.append((now, enrolled.group(1)))
                    elif m := REJECT_LINE.search(line):
                        self.reasons[m.group(1)] += 1
                    elif DEADLINE_LINE.search(line):
                        self.deadlines += 1
                if enrolled:
                    self.on_enrolled(enrolled.group(1))

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=10)


def flwr_cli_floor(repeat: int = 3) -> float:
    """Median seconds of ``flwr --version``: what each ``flwr`` process costs before it does anything."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([str(BIN / "flwr"), "--version"], capture_output=True, check=False,
                       env={**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1"})
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_rows(path: Path) -> list[dict[str, str]]:
    try:
        with open(path, newline="") as fh:
            return list(csv.DictReader(fh))
    except OSError:
        return []


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    t_setup = time.monotonic()
    port, names = setup_deployment(work, a)
    setup_s = time.monotonic() - t_setup
    cli_floor_s = flwr_cli_floor()
    print(f"# deployment in {work}: {a.nodes} keys and certificates made in {setup_s:.1f} s; SuperLink on "
          f"127.0.0.1:{port}", flush=True)
    emu = Emulator(f"127.0.0.1:{port}", work / "certs" / "ca.crt",
                   {n: work / "keys" / n for n in names}, a)
    print(f"# emulator: {a.nodes} identities loaded; fedshield's ClientApp warmed up in "
          f"{emu.warm_up(work / 'coordinator.toml'):.1f} s", flush=True)
    env = {**os.environ, "FLWR_HOME": str(work / "flwr-home"), "PYTHONUNBUFFERED": "1"}
    t_start = time.monotonic()
    proc = subprocess.Popen([str(BIN / "fedshield"), "coordinator", "start", "--config", "coordinator.toml"],
                            cwd=work, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                            start_new_session=True, env=env)
    mon = Monitor(proc)
    mon.start()
    log = CoordinatorLog(proc, work, emu.enrolled)
    result: dict[str, Any] = {"stopped": None}
    online: list[tuple[float, int]] = []  # (t, identities online), every 0.25 s
    loads: list[tuple[float, float]] = []  # (t, the machine's 1-minute load average): others' work shares the cores
    # when each round's row appeared in metrics.csv (the ServerApp writes it as the round ends; its log line reaches
    # this process through `flwr run --stream`, i.e. through the SuperLink, late when the SuperLink is busy)
    metrics, seen_mtime, round_end = work / RUN_DIR / "metrics.csv", 0.0, {}
    try:
        deadline = t_start + a.max_wall
        last_note = 0.0
        while proc.poll() is None:
            now = time.monotonic()
            if now > deadline:
                with log.lock:
                    done = len(log.enrolled)
                result["stopped"] = (f"--max-wall {a.max_wall:g} s reached: {done}/{a.nodes} keys registered, "
                                     f"{len(round_end)}/{a.rounds} rounds done")
                break
            online.append((now, emu.online))
            loads.append((now, os.getloadavg()[0]))
            try:
                mtime = metrics.stat().st_mtime
            except OSError:
                mtime = seen_mtime
            if mtime != seen_mtime:
                seen_mtime = mtime
                for row in read_rows(metrics):
                    round_end.setdefault(int(row["round"]), now)
            if now - last_note > a.progress_s:
                last_note = now
                lags = [lag for t, lag in list(emu.sched.lags)[-5000:]]
                print(f"# t+{now - t_start:6.0f} s: {len(log.enrolled)}/{a.nodes} keys registered, {emu.online} nodes "
                      f"online, {len(round_end)}/{a.rounds} rounds; emulator timer lag p95 {pct(lags, 0.95):.2f} s",
                      flush=True)
            time.sleep(0.25)
    finally:
        t_end = time.monotonic()
        mon.sample()
        calls, errors = emu.stats.window(t_start, t_end)
        emu.stop()
        mon.stop_groups()
        mon.stop()
        log.join()
    result.update(code=proc.returncode, t_start=t_start, t_end=t_end, setup_s=setup_s, emu=emu, mon=mon, log=log,
                  rows=read_rows(work / RUN_DIR / "metrics.csv"), online=online, loads=loads, round_end=round_end, calls=calls,
                  errors=errors, cli_floor_s=cli_floor_s)
    return result


# --- the report ---------------------------------------------------------------------------------------

def report(a: argparse.Namespace, res: dict[str, Any]) -> None:
    from simulations.bench import Report

    emu, mon, log, rows = res["emu"], res["mon"], res["log"], res["rows"]
    t_start, t_end = res["t_start"], res["t_end"]
    enrolled = log.enrolled
    reg0 = mon.first_seen.get("SuperLink", t_start)
    reg1 = enrolled[-1][0] if enrolled else t_end
    # the rounds: from the first round's start (its end less its round time) to the last round's end
    ends = {int(r["round"]): res["round_end"].get(int(r["round"])) for r in rows}
    first = min(ends) if ends else None
    r0 = (ends[first] - float(rows[0]["round_time_s"])) if first is not None and ends[first] else None
    r1 = max((t for t in ends.values() if t), default=None)

    print()
    print(f"## {a.nodes} emulated nodes, {a.per_round} asked per round, {a.rounds} rounds; reply delay log-normal "
          f"median {a.delay_ms:g} ms sigma {a.delay_sigma:g}; dropout {a.dropout:g} ({a.dropout_mode}); poll every "
          f"{a.poll_s:g} s; {a.workers} emulator threads")
    if res["stopped"]:
        print(f"## STOPPED: {res['stopped']}")
    elif res["code"] != 0:
        print(f"## the coordinator exited with code {res['code']}; its last lines:")
        for line in list(log.tail)[-15:]:
            print(f"##   {line}")
    n_keys = len(enrolled)
    reg_s = (enrolled[-1][0] - reg0) if enrolled else float("nan")  # from the SuperLink's start
    per_key = reg_s / n_keys if n_keys else float("nan")  # (the keys are registered in one batch: no gaps between)
    print(f"key registration by the coordinator: {n_keys}/{a.nodes} keys enrolled {reg_s:.1f} s after its SuperLink "
          f"started ({per_key * 1e3:.1f} ms a key, the SuperLink's start included; a `flwr` process, "
          f"`flwr --version`, takes {res['cli_floor_s'] * 1e3:.0f} ms here)")

    print()
    print("metrics.csv: online, sel(ected), repl(ies), acc(epted), rej(ected), late, round s; the emulator: recv "
          "(messages received), drop(ped), sent (replies), first/last recv (s after the round's start: the train "
          "messages' way through the SuperLink to their nodes), slowest (s from a node's receipt to its reply's last "
          "object)")
    print(f"{'round':>5} {'online':>6} {'sel':>5} {'repl':>5} {'acc':>5} {'rej':>4} {'late':>4} {'round s':>8} "
          f"{'recv':>5} {'drop':>5} {'sent':>5} {'1st recv':>8} {'last recv':>9} {'slowest':>8}  rejected by rule")
    for r in rows:
        tr = emu.rounds.get(r["round"], RoundTrace())
        end = ends.get(int(r["round"]))
        start = end - float(r["round_time_s"]) if end else None
        first_s = tr.first_receipt - start if start is not None and tr.received else float("nan")
        last_s = tr.last_receipt - start if start is not None and tr.received else float("nan")
        print(f"{r['round']:>5} {r['nodes_online']:>6} {r['selected']:>5} {r['replies']:>5} {r['accepted']:>5} "
              f"{r['rejected']:>4} {r['late']:>4} {float(r['round_time_s']):8.2f} {tr.received:>5} {tr.dropped:>5} "
              f"{tr.replied:>5} {first_s:8.1f} {last_s:9.1f} {tr.slowest_s:8.2f}  {r['rejected_by_rule']}")

    def cpu_between(role: str, t0: float, t1: float) -> float:
        return mon.at(t1, role)[1] - mon.at(t0, role)[1]

    print()
    print(f"{'process':<12} {'RSS end MB':>10} {'RSS peak MB':>11} {'CPU s total':>11} {'CPU s keys':>10} "
          f"{'CPU s rounds':>12} {'CPU % rounds':>12}")
    last = mon.samples[-1][0] if mon.samples else t_end
    end_sample = r1 if r1 is not None else last
    procs: dict[str, dict[str, float]] = {}
    for role in REPORTED:
        rss_end, cpu_total = mon.at(end_sample, role)
        cpu_total = max(cpu_total, mon.at(last, role)[1])
        keys_cpu = cpu_between(role, reg0, reg1)
        rounds_cpu = cpu_between(role, r0, r1) if r0 is not None and r1 is not None else float("nan")
        share = rounds_cpu / (r1 - r0) * 100 if r0 is not None and r1 is not None and r1 > r0 else float("nan")
        procs[role] = {"rss_end": rss_end, "rss_peak": mon.peak(role), "cpu": cpu_total, "cpu_rounds": rounds_cpu,
                       "share": share}
        print(f"{role:<12} {rss_end:10.0f} {procs[role]['rss_peak']:11.0f} {cpu_total:11.1f} {keys_cpu:10.1f} "
              f"{rounds_cpu:12.1f} {share:12.0f}")

    print()
    rejected_total = sum(int(r["rejected"] or 0) for r in rows)
    by_rule: collections.Counter[str] = collections.Counter()
    for r in rows:
        by_rule.update(json.loads(r["rejected_by_rule"] or "{}"))
    print(f"refusals: {rejected_total} rejected replies in metrics.csv {dict(by_rule)}; reasons in the coordinator's "
          f"log {dict(log.reasons)}; {log.deadlines} round(s) closed at round-timeout")
    print(f"emulator: {emu.online} of {a.nodes} identities online at the end; events {dict(emu.stats.events)}; "
          f"timer failures {dict(emu.sched.failures)}")

    print()
    win = (r0, r1) if r0 is not None and r1 is not None else (t_start, t_end)
    calls_r, errors_r = emu.stats.window(*win)
    span = max(win[1] - win[0], 1e-9)
    print(f"Fleet API calls by the emulator ({'during the rounds' if r0 is not None else 'over the whole run'}, "
          f"{span:.0f} s): rpc, calls, per s, latency p50 / p95 / max ms, errors")
    for rpc in sorted(calls_r, key=lambda k: -len(calls_r[k])):
        lat = calls_r[rpc]
        errs = {what: n for (name, what), n in errors_r.items() if name == rpc}
        if lat or errs:
            print(f"  {rpc:<24} {len(lat):>8} {len(lat) / span:8.1f} {pct(lat, 0.5) * 1e3:8.1f} "
                  f"{pct(lat, 0.95) * 1e3:8.1f} {max(lat, default=float('nan')) * 1e3:8.1f}  {errs or ''}")
    phases = (("key registration", t_start, reg1), ("rounds", *win), ("after the last round (the SuperLink stopping)",
                                                                        win[1], t_end))
    for what, t0, t1 in phases:
        _, errs = emu.stats.window(t0, t1)
        if errs:
            print(f"  errors during {what}: {dict((f'{rpc} {kind}', n) for (rpc, kind), n in errs.items())}")
    lags = [lag for t, lag in emu.sched.lags if win[0] <= t <= win[1]]
    print(f"emulator timer lag during the rounds: p50 {pct(lags, 0.5) * 1e3:.0f} ms, p95 {pct(lags, 0.95) * 1e3:.0f} "
          f"ms, max {max(lags, default=float('nan')):.2f} s (large: every one of the {emu.workers} worker threads was "
          "busy, most waiting on the SuperLink: the nodes' requests queued in the emulator, not at the SuperLink)")
    during = [n for t, n in res["online"] if win[0] <= t <= win[1]] or [emu.online]
    mean_online = statistics.fmean(during)
    asked = mean_online / a.poll_s
    pulls = len(calls_r.get("PullMessages", [])) / span
    load = [v for t, v in res["loads"] if win[0] <= t <= win[1]]
    print(f"machine: {os.cpu_count()} cores, 1-minute load average {statistics.fmean(load) if load else float('nan'):.1f} "
          "on average during the rounds (everything running on it, this benchmark's processes included)")
    print(f"pull rate: {pulls:.0f}/s served; {mean_online:.0f} nodes online on average polling every {a.poll_s:g} s "
          f"ask for at most ~{asked:.0f}/s (less while they hold a message)")
    served = sum(len(v) for v in calls_r.values())
    sl_cpu = procs["SuperLink"]["cpu_rounds"]
    per_request = sl_cpu / served if served and math.isfinite(sl_cpu) else float("nan")
    per_node = 1 / a.poll_s + 1 / (25 * 0.8)  # a node's pulls and heartbeats a second
    capacity = 1 / per_request / per_node if per_request > 0 else float("nan")
    print(f"SuperLink: {served / span:.0f} Fleet requests/s served during the rounds at {per_request * 1e3:.1f} ms of its "
          f"CPU each (the ServerApp's Runtime API calls and the log stream included): a core of it serves ~{capacity:.0f} "
          f"nodes polling every {a.poll_s:g} s")

    print()
    rep = Report("node_emulator")

    def fig(name: str, value: float, unit: str, baseline: str = "", baseline_value: float | None = None,
            **kw: Any) -> Any:
        if baseline_value is not None and not value:  # no ratio to a value of 0: the baseline said in words
            baseline, baseline_value = f"{baseline}: {baseline_value:g}", None
        return rep.add(name, value, unit, baseline, baseline_value, **kw)

    times = [float(r["round_time_s"]) for r in rows]
    slowest = [emu.rounds[r["round"]].slowest_s for r in rows if r["round"] in emu.rounds]
    tag = f"{a.nodes} nodes, {a.per_round}/round"
    if times:
        floor = statistics.median(slowest) if slowest else None
        fig(f"{tag}: median round time", statistics.median(times), "s",
                "slowest emulated node's reply, median s", floor or None, target="informational")
        fig(f"{tag}: slowest round", max(times), "s", "round-timeout", a.round_timeout,
                target="< round-timeout", met=max(times) < a.round_timeout)
        fig(f"{tag}: nodes online in round 1", float(rows[0]["nodes_online"]), "nodes", "nodes emulated",
                float(a.nodes), target="all", met=int(rows[0]["nodes_online"]) == a.nodes)
        accepted = sum(int(r["accepted"]) for r in rows)
        asked_n = sum(int(r["selected"]) for r in rows)
        fig(f"{tag}: updates accepted", float(accepted), "upd", "nodes asked over the rounds", float(asked_n),
                target="~ 1 - dropout of those asked")
        fig(f"{tag}: rejected replies", float(rejected_total), "rep", "dropouts emulated",
                float(sum(emu.rounds[r["round"]].dropped for r in rows if r["round"] in emu.rounds)),
                target="dropouts only (no valid update refused)", met=set(by_rule) <= {"error-reply"})
    if n_keys:
        fig(f"{tag}: key registration per key", per_key * 1e3, "ms", "a `flwr` process (`flwr --version`), ms",
                res["cli_floor_s"] * 1e3, target="< a flwr process (it was one `flwr supernode register` per key)",
                met=per_key < res["cli_floor_s"])
        fig(f"{tag}: key registration, all keys (from the SuperLink's start)", reg_s, "s", "", None,
                target="informational")
    for role in ("SuperLink", "ServerApp"):
        p = procs[role]
        fig(f"{tag}: {role} RSS peak", p["rss_peak"], "MB", f"{role} RSS at the end of the rounds, MB",
                p["rss_end"] or None, target="informational")
        fig(f"{tag}: {role} CPU s over the run", p["cpu"], "s", "", None, target="informational")
        if math.isfinite(p["share"]):
            fig(f"{tag}: {role} CPU during the rounds", p["share"], "%", "one core, %", 100.0,
                    target="< 100% (one process, mostly one thread at a time: a core is its ceiling)",
                    met=p["share"] < 100)
    if math.isfinite(procs["emulator"]["share"]):
        fig(f"{tag}: emulator CPU during the rounds", procs["emulator"]["share"], "%", "", None,
                target="informational (it shares this machine with the coordinator)")
    fig(f"{tag}: pulls served per s during the rounds", pulls, "1/s", "asked at most by the online nodes, 1/s",
            asked, target="informational (near 1: every online node's polls were served)")
    if math.isfinite(per_request):
        fig(f"{tag}: SuperLink CPU per Fleet request", per_request * 1e3, "ms", "", None,
                target="informational (its CPU during the rounds / the emulator's requests then)")
        fig(f"{tag}: nodes one SuperLink core serves at this poll interval", capacity, "nodes", "nodes emulated",
                float(a.nodes), target=">= nodes emulated", met=capacity >= a.nodes)
    fig(f"{tag}: emulator timer lag p95", pct(lags, 0.95) * 1e3 if lags else 0.0, "ms", "poll interval, ms",
            a.poll_s * 1e3, target="< poll interval (the emulator kept up)",
            met=(pct(lags, 0.95) < a.poll_s) if lags else None)
    rep.write_json(a.json)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=1000, help="node identities emulated (each an enrolled key)")
    p.add_argument("--per-round", type=int, default=100, help="nodes asked each round (clients-per-round, min-nodes)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--delay-ms", type=float, default=200.0, help="median reply delay from receipt (log-normal)")
    p.add_argument("--delay-sigma", type=float, default=0.5, help="sigma of the log-normal delay")
    p.add_argument("--dropout", type=float, default=0.05, help="fraction of train messages a node drops")
    p.add_argument("--dropout-mode", choices=("leave", "vanish", "silent"), default="leave")
    p.add_argument("--rejoin-s", type=float, default=30.0, help="a dropped node comes back after about this long")
    p.add_argument("--poll-s", type=float, default=3.0, help="seconds between empty pulls (Flower's SuperNode: 3; "
                   "fedshield agent's --poll-interval: 0.2)")
    p.add_argument("--workers", type=int, default=32, help="emulator threads and TLS connections: the most requests "
                   "the emulated fleet has in flight (N SuperNodes: up to 2N, a poll and a heartbeat each)")
    p.add_argument("--round-timeout", type=float, default=60.0)
    p.add_argument("--wait-nodes-timeout", type=float, default=600.0)
    p.add_argument("--max-wall", type=float, default=0.0,
                   help="stop after this many seconds (0: 600 + 4 s a key + 3 round-timeouts a round)")
    p.add_argument("--progress-s", type=float, default=60.0, help="seconds between progress lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, run directory)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    if a.nodes < 1 or not 1 <= a.per_round <= a.nodes:
        p.error("--per-round must be in [1, --nodes]")
    if not 0 <= a.dropout < 1:
        p.error("--dropout must be in [0, 1)")
    if a.poll_s <= 0 or a.workers < 1:
        p.error("--poll-s must be > 0 and --workers >= 1")
    a.workers = min(a.workers, a.nodes)
    a.max_wall = a.max_wall or 600 + 4 * a.nodes + 3 * a.round_timeout * a.rounds

    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)  # the emulated ClientApps' per-message log lines
    import torch

    torch.set_num_threads(1)

    def on_term(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix="fedshield-emu-"))
    try:
        res = run(a, work)
        report(a, res)
        if a.keep:
            print(f"# kept {work}")
        ok = res["code"] == 0 and not res["stopped"]
        return 0 if ok or res["stopped"] else 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
