"""Deployed rounds on 127.0.0.1: fedshield's coordinator and warm agents vs stock Flower 1.42 vs the simulation.

    python benchmarks/deployment.py [--agents 3,10] [--rounds 5] [--epochs 3] [--skip flower,simulate]
                                    [--json FILE]

The same task (the built-in digits MLP, 64-128-10), the same Dirichlet(0.5) partitions of its training set
(``fedshield data export``'s, seed 0), the same local training (``--epochs`` epochs of plain SGD, batch 16,
lr 0.1, no momentum, one torch thread per process) and the same rounds (every node in every round), for each
number of nodes N in ``--agents``, run one after another:

- simulate: ``simulations.simulate(engine="inprocess")`` in this process;
- fedshield deployed: ``fedshield coordinator start --config coordinator.toml`` (TLS, enrolled node keys) and
  N ``fedshield agent start`` processes (each a supervisor, a warm ClientApp worker and a SuperNode);
- Flower: stock ``flower-superlink --insecure`` and N stock ``flower-supernode --insecure`` processes running an
  app written into the temp dir (a ServerApp with the stock ``flwr.serverapp.strategy.FedAvg``, a torch ClientApp
  training the same MLP on the same partition files), submitted with ``flwr run APP bench --stream`` to the
  SuperLink's Control API (the federation ``bench`` in the CLI's own ``$FLWR_HOME/config.toml``).

Seconds per round: fedshield's from its run directory's metrics.csv (``wall_time_s`` differences: training, wire,
aggregation, central evaluation, checkpoint), Flower's from the timestamps its ServerApp writes in ``evaluate_fn``
(called before the first round and after each); each figure is the median of the rounds after the first. An
agent's RSS is the sum over its process tree (``fedshield agent`` and all its descendants, read from /proc every
0.2 s): "idle" once the run's last round is recorded (every node has answered) and the tree holds no process
serving a message (Flower's per-message ``flwr-clientapp``), "peak" the most seen during the run; the same for each
Flower SuperNode (the lines above the table also give node 0's idle tree by process, and its PSS: shared pages
counted once). For N >= 2, node 0 starts alone with ``--release-worker-after 5``: while the run waits for the others
it is joined and idle, and once its worker is released its tree is sampled ("worker released"); then the others
start, so fedshield's first round (from the ServerApp's start) includes that wait and node 0's worker starting
again. Goals from the issue, for N = 3: a deployed round >= 6x faster than Flower's and <= 1.5 s; for every N, an
idle agent <= 300 MB. Each process gets its own session and FLWR_HOME and is stopped by process group
(and every group its descendants started) at the end, also on failure or Ctrl-C; everything lives in one temp dir,
removed at the end.
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from clients.cli import free_port  # noqa: E402
from coordinator.service import stop_groups  # noqa: E402

CONTENDERS = ("simulate", "fedshield", "flower")
HIDDEN, BATCH, LR = 128, 16, 0.1  # the digits MLP's hidden width (TaskSpec's default) and SGD's settings
STALL = 300.0  # seconds without a round ending before a deployed run counts as failed
RELEASE_S = 5.0  # node 0's --release-worker-after: the run waits for the others while its worker is released
FLOWER_APP = "plainbench"
BIN = Path(sys.executable).parent  # the venv's console scripts: fedshield, flower-superlink, flwr
PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20
# A process's role in a node's tree, by its interpreter, flags and script (the first match). The supervisor's
# command line also holds the worker's and the SuperNode's, in its plan: it comes first.
ROLES = (("supervisor.py", "supervisor"), ("flwr-clientapp", "ClientApp"), ("clients.worker", "worker"),
         ("flower_pins.py", "SuperNode"), ("flower-supernode", "SuperNode"), ("flower-superexec", "SuperExec"))


# --- processes ----------------------------------------------------------------------------------------

def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (ppid at 1, pgid at 2, start time at 19), or None."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [], [pid]
    while todo:
        out.append(p := todo.pop())
        todo.extend(children.get(p, []))
    return out


def _statm_pages(pids: list[int]) -> tuple[int, int]:
    """Resident and file-backed resident pages of ``pids``, summed (/proc/PID/statm)."""
    resident = shared = 0
    for pid in pids:
        try:
            r, sh = (int(v) for v in open(f"/proc/{pid}/statm").read().split()[1:3])
        except (OSError, ValueError):
            continue  # gone meanwhile
        resident, shared = resident + r, shared + sh
    return resident, shared


def rss_mb(pids: list[int]) -> float:
    return _statm_pages(pids)[0] * PAGE_MB


def anon_mb(pids: list[int]) -> float:
    """Resident pages not backed by a file (heap, Python objects, torch's registries): what the processes cost
    on their own. The rest of RSS is shared libraries' pages, shared with any process that maps them and dropped
    by the kernel (then read back from disk) under memory pressure."""
    resident, shared = _statm_pages(pids)
    return (resident - shared) * PAGE_MB


def pss_mb(pids: list[int]) -> float:
    """Proportional set size: each shared page split among the processes that map it (RSS counts it in each)."""
    kb = 0
    for pid in pids:
        try:
            kb += next(int(line.split()[1]) for line in open(f"/proc/{pid}/smaps_rollup") if line.startswith("Pss:"))
        except (OSError, StopIteration, ValueError):
            pass
    return kb / 1024


def described(pids: list[int]) -> str:
    """A process tree's RSS by role, its PSS and what of it is not file-backed, in words."""
    roles = [role(p) for p in pids]
    parts = sorted(((r, rss_mb([p for p, q in zip(pids, roles) if q == r])) for r in set(roles)), key=lambda kv: -kv[1])
    return (" + ".join(f"{r} {mb:.0f}" for r, mb in parts if mb)
            + f" MB; PSS {pss_mb(pids):.0f} MB; not file-backed {anon_mb(pids):.0f} MB")


def role(pid: int) -> str:
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
    except OSError:
        argv = [""]
    head = " ".join(argv[:3])
    return next((name for key, name in ROLES if key in head), Path(argv[0]).name or "exited")


class Fleet:
    """Processes started in sessions of their own, each logged to a file. Their descendants (some start
    sessions of their own: an agent's worker and SuperNode, a SuperLink's ServerApp) are recorded whenever
    ``trees`` looks, and ``stop_all`` signals every such group still alive."""

    def __init__(self, work: Path, env: dict[str, str]) -> None:
        self.work, self.env = work, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: dict[int, str] = {}  # pid -> its start time (a pid reused later is not ours)
        self.lock = threading.Lock()

    def start(self, name: str, cmd: list[str], home: bool = True, **env: str) -> subprocess.Popen:
        if home:  # its own FLWR_HOME
            (flwr_home := self.work / "homes" / name).mkdir(parents=True, exist_ok=True)
            env["FLWR_HOME"] = str(flwr_home)
        with open(self.work / "logs" / f"{name}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=self.work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**self.env, **env})
        with self.lock:
            self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.work / "logs" / f"{name}.log").read_text(errors="replace")

    def trees(self, names: list[str]) -> dict[str, list[int]]:
        """Each named process's tree (empty once it ended); every live process's descendants are recorded."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit() and (fields := _stat(int(entry))) is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
        with self.lock:
            alive = {n: tree(p.pid, children) for n, p in self.procs.items() if p.poll() is None}
        for pids in alive.values():
            for pid in pids:
                if pid not in self.seen and (fields := _stat(pid)) is not None:
                    self.seen[pid] = fields[19]
        return {n: alive.get(n, []) for n in names}

    def stop_all(self, timeout: float = 10.0) -> None:
        """SIGTERM to every group, ``timeout`` s to end, then SIGKILL to the groups left."""
        self.trees([])
        groups = {p.pid for p in self.procs.values()}
        groups |= {int(f[2]) for pid, start in self.seen.items() if (f := _stat(pid)) and f[19] == start}
        stop_groups(groups, timeout, lambda: [proc.poll() for proc in self.procs.values()])
        for proc in self.procs.values():
            proc.wait()


class RssMonitor(threading.Thread):
    """Samples the named nodes' process trees every ``tick`` s while in its ``with`` block: each tree's peak
    RSS, and its idle RSS once ``rounds_done()`` reaches ``rounds`` and the tree serves no message."""

    def __init__(self, fleet: Fleet, nodes: list[str], rounds_done: Callable[[], int], rounds: int,
                 tick: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.fleet, self.nodes, self.rounds_done, self.rounds, self.tick = fleet, nodes, rounds_done, rounds, tick
        self.peak = {n: 0.0 for n in nodes}
        self.idle: dict[str, float] = {}
        self.parts: dict[str, str] = {}  # node -> its idle tree in words (``described``)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            finished = self.rounds_done() >= self.rounds
            for n, pids in self.fleet.trees(self.nodes).items():
                self.peak[n] = max(self.peak[n], mb := rss_mb(pids))
                if finished and pids and n not in self.idle and "ClientApp" not in [role(p) for p in pids]:
                    self.idle[n], self.parts[n] = mb, described(pids)
            self.done.wait(self.tick)

    def __enter__(self) -> RssMonitor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        """Waits up to 15 s for a node not sampled idle yet (a ClientApp still exiting), after the last round."""
        deadline = time.monotonic() + 15
        while len(self.idle) < len(self.nodes) and time.monotonic() < deadline and self.rounds_done() >= self.rounds:
            time.sleep(0.1)
        self.done.set()
        self.join()

    def figures(self) -> dict:
        """``idle`` and ``peak`` MB per node; ``parts``: the first node's idle tree by role and its PSS, in words."""
        return {"idle": [self.idle[n] for n in self.nodes if n in self.idle], "peak": list(self.peak.values()),
                "parts": self.parts.get(self.nodes[0], "")}


def _rows(path: Path) -> int:
    """Lines in ``path`` after the first (metrics.csv: rounds recorded; Flower's marks: rounds ended)."""
    try:
        return max(len(path.read_text().splitlines()) - 1, 0)
    except OSError:
        return 0


def wait_for(what: str, done: Callable[[], bool], fail: Callable[[], str | None], timeout: float = 1e9) -> None:
    """Until ``done()``; RuntimeError after ``timeout`` s, or at once when ``fail()`` gives a reason."""
    deadline = time.monotonic() + timeout
    while not done():
        why = fail()
        if why or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {why or f'not within {timeout:g} s'}")
        time.sleep(0.2)


def exited(fleet: Fleet, name: str) -> str | None:
    code = fleet.procs[name].poll()
    return None if code is None else f"{name} exited ({code}): {fleet.log(name)[-1500:]}"


def stalled(rounds_done: Callable[[], int]) -> Callable[[], str | None]:
    """A ``fail`` for wait_for: a reason once no round has ended for STALL seconds."""
    last = [time.monotonic(), rounds_done()]

    def check() -> str | None:
        if (now := rounds_done()) != last[1]:
            last[:] = [time.monotonic(), now]
        return f"no round ended for {STALL:g} s ({now} done)" if time.monotonic() - last[0] > STALL else None
    return check


# --- the three contenders -----------------------------------------------------------------------------

def wall_rounds(metrics: Path) -> list[float]:
    with open(metrics, newline="") as f:
        walls = [float(row["wall_time_s"]) for row in csv.DictReader(f)]
    return [b - a for a, b in zip([0.0, *walls], walls)]


def run_simulate(n: int, rounds: int, epochs: int, work: Path) -> dict:
    from simulations import simulate

    logging.getLogger("flwr").setLevel(logging.WARNING)  # (its progress lines)
    simulate("digits", run_dir=work / f"simulate-{n}", engine="inprocess", num_supernodes=n, num_rounds=rounds,
             min_nodes=n, local_epochs=epochs, batch_size=BATCH, lr=LR, momentum=0.0)
    return {"times": wall_rounds(work / f"simulate-{n}" / "metrics.csv")}


def prepare(work: Path, agents: list[int]) -> None:
    """What ``fedshield certs init``, ``keys new`` and ``data export`` write (their library calls: one process)."""
    from clients.cli import export_partitions
    from privacy import init_certificates, new_node_key

    init_certificates(work / "certs")
    for i in range(max(agents)):
        new_node_key(work / "keys" / f"client-{i}")
    for n in agents:
        export_partitions("digits", n, str(work / f"data-{n}"))


def run_fedshield(fleet: Fleet, n: int, rounds: int, epochs: int) -> dict:
    """A TLS deployment with n agents: seconds per round (``times``), MB per agent (``idle``, ``peak``, ``parts``)."""
    work, port = fleet.work, free_port()
    keys = ", ".join(f'"keys/client-{i}.pub"' for i in range(n))
    (work / f"coordinator-{n}.toml").write_text(f"""[coordinator]
host = "127.0.0.1"
port = {port}
enrolled-keys = [{keys}]
state-dir = "coordinator-state-{n}"
status-port = -1

[run]
run-dir = "runs/deploy-{n}"
num-rounds = {rounds}
min-nodes = {n}
wait-nodes-timeout = {STALL}
round-timeout = {STALL}
local-epochs = {epochs}
batch-size = {BATCH}
lr = {LR}
momentum = 0.0
""")
    coord = f"coordinator-{n}"
    fleet.start(coord, [str(BIN / "fedshield"), "coordinator", "start", "--config", f"coordinator-{n}.toml"])
    wait_for("the coordinator must enrol the keys", lambda: f"enrolled client-{n - 1}.pub" in fleet.log(coord),
             lambda: exited(fleet, coord), 120)
    names = [f"agent-{n}-{i}" for i in range(n)]
    released: dict = {}
    for i, name in enumerate(names):
        (state := work / "agent-state" / name).mkdir(parents=True)  # its local-DP ledger; TMPDIR: its secret
        fleet.start(name, [str(BIN / "fedshield"), "agent", "start", "--coordinator", f"127.0.0.1:{port}",
                           "--root-cert", "certs/ca.crt", "--key", f"keys/client-{i}", "--data",
                           f"data-{n}/client-{i}.npz", "--state-dir", str(state),
                           *(["--release-worker-after", str(RELEASE_S)] if i == 0 else [])], TMPDIR=str(state))
        if i == 0 and n > 1:  # the run waits for the others: node 0 joined and idle, until its worker is released
            released = released_idle(fleet, name, coord)
    metrics = work / "runs" / f"deploy-{n}" / "metrics.csv"
    with RssMonitor(fleet, names, lambda: _rows(metrics), rounds) as monitor:
        wait_for("the coordinator's run must end", lambda: fleet.procs[coord].poll() is not None,
                 stalled(lambda: _rows(metrics)))
    if fleet.procs[coord].returncode != 0 or _rows(metrics) != rounds:
        raise RuntimeError(f"the deployed run must complete. Found: {fleet.log(coord)[-2000:]}")
    return {"times": wall_rounds(metrics), **monitor.figures(), "released": released}


def released_idle(fleet: Fleet, name: str, coord: str) -> dict:
    """Node ``name``'s tree once its worker was released (joined, no message for RELEASE_S s): its RSS (``mb``) and
    by process, PSS and not file-backed (``parts``, in words)."""
    def gone() -> bool:
        roles = [role(p) for p in fleet.trees([name])[name]]
        return "stopped to free its memory" in fleet.log(name) and "SuperNode" in roles and "worker" not in roles

    wait_for(f"{name}'s worker must be released", gone, lambda: exited(fleet, name) or exited(fleet, coord), 120)
    pids = fleet.trees([name])[name]
    return {"mb": rss_mb(pids), "parts": described(pids)}


FLOWER_APP_SOURCE = '''"""Plain Flower 1.42: the digits MLP (64-h-10) trained with plain SGD on this node's partition
file, and a ServerApp running the stock FedAvg over every node each round, writing a timestamp before and after
each round."""
import time

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

clientapp = ClientApp()
serverapp = ServerApp()  # (one name each: `flwr run` looks for them in the source)


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(1)
    cfg = context.run_config
    with np.load(str(context.node_config["data-path"])) as data:
        x, y = torch.from_numpy(data["x"]).float(), torch.from_numpy(data["y"]).long()
    model = mlp(int(cfg["hidden-units"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]))
    model.train()
    for _ in range(int(cfg["local-epochs"])):
        for idx in torch.randperm(len(y)).split(int(cfg["batch-size"])):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(y)})})
    return Message(content, reply_to=msg)


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    n = int(cfg["num-nodes"])

    def mark(server_round: int, arrays: ArrayRecord) -> None:
        with open(str(cfg["marks-file"]), "a") as f:
            f.write(f"{server_round} {time.time()}\\n")

    torch.manual_seed(0)
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_evaluate_nodes=0,
                      min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(mlp(int(cfg["hidden-units"])).state_dict()),
                   num_rounds=int(cfg["num-rounds"]), evaluate_fn=mark)
'''


def write_flower_app(app_dir: Path, n: int, rounds: int, epochs: int, marks: Path) -> None:
    (app_dir / FLOWER_APP).mkdir(parents=True)
    (app_dir / FLOWER_APP / "__init__.py").write_text("")
    (app_dir / FLOWER_APP / "app.py").write_text(FLOWER_APP_SOURCE)
    (app_dir / "pyproject.toml").write_text(f"""[project]
name = "{FLOWER_APP}"
version = "1.0.0"
description = "stock Flower FedAvg on the digits MLP (benchmarks/deployment.py)"
license = "Apache-2.0"

[tool.flwr.app]
publisher = "fedshield-bench"

[tool.flwr.app.components]
serverapp = "{FLOWER_APP}.app:serverapp"
clientapp = "{FLOWER_APP}.app:clientapp"

[tool.flwr.app.config]
num-rounds = {rounds}
num-nodes = {n}
local-epochs = {epochs}
batch-size = {BATCH}
lr = {LR}
hidden-units = {HIDDEN}
marks-file = "{marks}"
""")


def run_flower(fleet: Fleet, n: int, rounds: int, epochs: int) -> dict:
    """Stock Flower with n SuperNodes: seconds per round (``times``), MB per SuperNode (``idle``, ``peak``,
    ``parts``)."""
    work, port, link = fleet.work, free_port(), f"superlink-{n}"
    app_dir, marks = work / f"flower-app-{n}", work / f"flower-marks-{n}.txt"
    write_flower_app(app_dir, n, rounds, epochs, marks)
    fleet.start(link, [str(BIN / "flower-superlink"), "--insecure", "--host", "127.0.0.1", "--port", str(port),
                       "--disable-runtime-dependency-installation"])  # (else it runs `uv sync`: no network here)
    wait_for("the SuperLink must answer", lambda: _healthy(port), lambda: exited(fleet, link), 60)
    names = [f"supernode-{n}-{i}" for i in range(n)]
    for i, name in enumerate(names):
        fleet.start(name, [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{port}", "--host",
                           "127.0.0.1", "--port", str(free_port()), "--node-config",
                           f"data-path='{work / f'data-{n}' / f'client-{i}.npz'}'"])
    (cli_home := work / "homes" / f"flwr-cli-{n}").mkdir(parents=True)
    (cli_home / "config.toml").write_text(f'[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
                                          f'address = "127.0.0.1:{port}"\ninsecure = true\n')
    run = fleet.start(f"flwr-run-{n}", [str(BIN / "flwr"), "run", str(app_dir), "bench", "--stream"], home=False,
                      FLWR_HOME=str(cli_home))
    with RssMonitor(fleet, names, lambda: _rows(marks), rounds) as monitor:  # marks: round 0, then one a round
        wait_for("`flwr run --stream` must end", lambda: run.poll() is not None, stalled(lambda: _rows(marks)))
    stamps = [float(line.split()[1]) for line in marks.read_text().splitlines()] if marks.is_file() else []
    if len(stamps) != rounds + 1:
        raise RuntimeError(f"its ServerApp must time {rounds} rounds. Found {max(len(stamps) - 1, 0)}: "
                           f"{fleet.log(f'flwr-run-{n}')[-1500:]}")
    return {"times": [b - a for a, b in zip(stamps, stamps[1:])], **monitor.figures()}


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


# --- the report ---------------------------------------------------------------------------------------

def median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def contend(name: str, n: int, work: Path, env: dict[str, str], a: argparse.Namespace) -> dict | None:
    """One contender's run with n nodes (``times``, and for the deployments ``idle``, ``peak``, ``parts``); None
    where Flower's failed (said in one line)."""
    if name == "simulate":
        res = run_simulate(n, a.rounds, a.epochs, work)
        print(f"# simulate inprocess, {n} clients: rounds {[round(t, 2) for t in res['times']]} s", flush=True)
        return res
    fleet, t0 = Fleet(work, env), time.perf_counter()
    try:
        res = (run_fedshield if name == "fedshield" else run_flower)(fleet, n, a.rounds, a.epochs)
    except RuntimeError as exc:
        if name == "fedshield":
            raise
        print(f"# flower, {n} nodes: failed, left out ({' '.join(str(exc).split())[:400]})", flush=True)
        return None
    finally:
        fleet.stop_all()
    print(f"# {name}, {n} nodes: rounds {[round(t, 2) for t in res['times']]} s; whole run "
          f"{time.perf_counter() - t0:.1f} s (process starts included); RSS MB per node: idle "
          f"{[round(m) for m in res['idle']]} (node 0: {res['parts']}), peak {[round(m) for m in res['peak']]}"
          + (f"; node 0 idle with its worker released, before the run: {res['released']['mb']:.0f} MB "
             f"({res['released']['parts']})" if res.get("released") else ""), flush=True)
    return res


def report(rep, n: int, res: dict[str, dict]) -> None:
    sec = {k: median_after_first(v["times"]) for k, v in res.items()}
    sim, ours, flower = sec.get("simulate"), sec.get("fedshield"), sec.get("flower")
    goal = n == 3  # the round goals are for 3 agents
    if sim is not None:
        rep.add(f"simulate inprocess, {n} clients: s per round", sim, "s")
    if flower is not None:
        rep.add(f"Flower 1.42 deployed, {n} nodes: s per round", flower, "s")
        rep.add(f"Flower 1.42 deployed, {n} nodes: first round", res["flower"]["times"][0], "s")
    if ours is None:
        return
    rep.add(f"fedshield deployed, {n} agents: first round", res["fedshield"]["times"][0], "s")
    rep.add(f"fedshield deployed, {n} agents: s per round (ratio = ours / simulate)", ours, "s",
            "simulate inprocess s per round" if sim else "", sim, "<= 1.5 s" if goal else "",
            (ours <= 1.5) if goal else None, ratio=ours / sim if sim else None)
    if flower is not None:
        r = flower / ours
        rep.add(f"fedshield vs Flower deployed, {n}: s per round (ratio = Flower / ours)", ours, "s",
                "Flower 1.42 s per round", flower, ">= 6x faster" if goal else "", (r >= 6) if goal else None, ratio=r)
    theirs = res.get("flower", {})
    for kind in ("idle", "peak"):
        mine, base = max(res["fedshield"][kind], default=0.0), max(theirs.get(kind, []), default=0.0) or None
        target, met = ("<= 300 MB", mine <= 300) if kind == "idle" else ("", None)
        rep.add(f"fedshield agent RSS {kind}{', worker warm' if kind == 'idle' else ''}, {n} agents (the largest)",
                mine, "MB", f"Flower SuperNode RSS {kind} (the largest)" if base else "", base, target, met,
                ratio=mine / base if base else None)
    if released := res["fedshield"].get("released"):
        base = max(theirs.get("idle", []), default=0.0) or None
        rep.add(f"fedshield agent RSS idle, worker released (--release-worker-after), node 0 of {n}",
                released["mb"], "MB", "Flower SuperNode RSS idle (the largest)" if base else "", base, "<= 300 MB",
                released["mb"] <= 300, ratio=released["mb"] / base if base else None)


def parse_agents(text: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        agents = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        agents = []
    if not agents or not all(1 <= n <= 64 for n in agents):
        p.error(f"--agents must be a comma-separated list of node counts in [1, 64]. Found {text!r}.")
    return agents


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--agents", default="3,10", help="node counts, comma-separated (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per run (the first is left out of the medians)")
    p.add_argument("--epochs", type=int, default=3, help="local epochs per round (default: %(default)s)")
    p.add_argument("--skip", default="", help="comma-separated contenders not to run: simulate, flower")
    p.add_argument("--json")
    a = p.parse_args()
    agents = parse_agents(a.agents, p)
    if a.rounds < 2 or a.epochs < 1:
        p.error(f"--rounds must be >= 2 and --epochs >= 1. Found {a.rounds}, {a.epochs}.")
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    if skip - {"simulate", "flower"}:
        p.error(f"--skip takes simulate and flower. Found {sorted(skip - {'simulate', 'flower'})}.")

    os.environ["FEDSHIELD_TORCH_THREADS"] = "1"
    os.environ.setdefault("FEDSHIELD_DEVICE", "cpu")  # as Flower's contender
    env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally blocks: every process stopped
    import torch

    torch.set_num_threads(1)
    from simulations import bench as _report

    print(f"# torch {torch.__version__}, 1 torch thread per process, {os.cpu_count()} CPUs; digits MLP 64-{HIDDEN}-10; "
          f"{a.rounds} rounds, every node each round; {a.epochs} local epoch(s) of SGD, batch {BATCH}, lr {LR}; "
          f"nodes {agents}", flush=True)
    results: dict[int, dict[str, dict]] = {n: {} for n in agents}
    work = Path(tempfile.mkdtemp(prefix="fedshield-deployment-"))
    try:
        (work / "logs").mkdir()
        prepare(work, agents)
        for n in agents:
            for name in (c for c in CONTENDERS if c not in skip):
                if (res := contend(name, n, work, env, a)) is not None:
                    results[n][name] = res
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in sorted(skip):
        print(f"# {name}: skipped (skipped by --skip)", flush=True)

    rep = _report.Report("deployment")
    for n in agents:
        report(rep, n, results[n])
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
