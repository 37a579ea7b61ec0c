"""The client agent: ``fedshield agent start`` runs a Flower SuperNode and a warm fedshield ClientApp worker.

Every input is checked before the SuperNode starts, so a missing certificate,
a bad key, a bad data path or an unreachable coordinator is one clear line and
a non-zero exit. Failures the SuperLink reports later (an unregistered key)
are translated from Flower's exit codes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import secrets
import signal
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from ._errors import ClientError
from .config import TaskSpec, build_config, renamed_key, resolve_path
from .data import check_split, load_npz, save_npz
from .flower_pins import EMPTY_PULL_SLEEP as IDLE_POLL
from .flower_pins import write_atomically
from .supervisor import NODE_FILE, RECEIVED, RUNTIME, SECRET, Plan, start_process, stop_group
from .tasks import Task, load_task
from .tasks.inputs import names_shown

# Flower exit codes (flwr.supercore.exit.ExitCode) a device owner may meet, in words.
def export_partitions(task: str, num_partitions: int, out: str, partitioning: str = "dirichlet",
                      alpha: float = 0.5, seed: int = 0) -> list[Path]:
    """Write partitions of a task's training set as ``client-K.npz`` (x, y) files.

    Everything is checked and split before anything is created, and a failure while writing removes what
    this call made, so a bad input never leaves an empty (or half-filled new) directory behind.
    """
    if num_partitions < 1:
        raise ClientError(f"--num-partitions must be >= 1. Found {num_partitions}.")
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ClientError(f"--out must be a directory. Found a file at {out_dir}.")
    flags = {"task": "--task", "partitioning": "--partitioning", "dirichlet-alpha": "--alpha", "data-seed": "--seed",
             "num-partitions": "--num-partitions"}
    try:
        spec = build_config(TaskSpec, {"task": task, "partitioning": partitioning, "dirichlet-alpha": alpha, "data-seed": seed})
        t = load_task(spec)
        parts = [t.client_data(k, num_partitions) for k in range(num_partitions)]  # raises on a bad split, nothing made yet
        if type(t).client_data is not Task.client_data:  # a task's own split: each part checked, as an agent will
            parts = [t.check_data(part, f"task {task!r} partition {k}") for k, part in enumerate(parts)]
    except ClientError as exc:  # named as the command's flags, not as the scenario keys they fill
        raise ClientError(renamed_key(str(exc), flags)) from None
    created = missing_ancestor(out_dir)
    paths: list[Path] = []
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for k, part in enumerate(parts):
            path = out_dir / f"client-{k}.npz"
            paths.append(path)
            save_npz(path, part, spec)
    except OSError as exc:
        _undo_export(paths, created, out_dir)
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(out_dir) else ""
        raise ClientError(f"--out {out_dir} must be a writable directory. Found: {exc.strerror or exc}{where}.") from None
    return paths


def missing_ancestor(path: Path) -> Path | None:
    """The topmost of ``path`` and its parents that does not exist yet (what ``mkdir -p`` would create)."""
    top = None
    for p in (path, *path.parents):
        if p.exists():
            break
        top = p
    return top


def _undo_export(paths: list[Path], created: Path | None, out_dir: Path) -> None:
    """Remove what a failed export made: its files when the directory is new, then the new (empty) directories."""
    if created is None:
        return  # an existing directory: its older files were overwritten, nothing to restore
    for path in paths:
        path.unlink(missing_ok=True)
    for d in (out_dir, *out_dir.parents):
        try:
            d.rmdir()  # only empty ones go
        except OSError:
            break
        if d == created:
            break


_DIGITS = re.compile(r"[0-9]{1,7}")  # ASCII only: str.isdigit() takes "²", which int() refuses


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not _DIGITS.fullmatch(port) or not 0 < int(port) < 65536:
        raise ClientError(f"--coordinator must be HOST:PORT. Found {text!r}.")
    return host.strip("[]"), int(port)


def host_port(host: str, port: int) -> str:
    """``HOST:PORT``, an IPv6 address in brackets (``parse_address`` takes them off)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_reachable(host: str, port: int, timeout: float = 5.0) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except (OSError, UnicodeError) as exc:  # UnicodeError: a host name with an empty or over-long label
        raise ClientError(f"coordinator must be reachable at {host_port(host, port)}. Found: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}.") from None


def bind_probe(host: str, port: int) -> None:
    """Bind ``host:port`` and let it go again: raises socket.gaierror (no such host) or OSError as a
    server's bind would. SO_REUSEADDR: a port left in TIME_WAIT by an earlier run counts as free; one
    that a socket listens on does not (no SO_REUSEPORT, so a gRPC server's shared port is refused too)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a benchmark's coordinator; bound later, so another bind may take it first
    (the agent's own SuperNodes bind port 0 instead)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_task(args: argparse.Namespace):
    """The task ``--task`` names, loaded (import, data, model: one line if any fails), and its node-config
    value; (None, 'builtin') without --task: the node then trains only the built-in tasks."""
    name = getattr(args, "task", None)
    if not name:
        return None, "builtin"
    from .config import BUILTIN_TASKS

    if name not in BUILTIN_TASKS and ".py:" in name:  # a file: its absolute path, so the ClientApp finds it
        where, _, attr = name.rpartition(":")
        name = f"{resolve_path(where, '--task')}:{attr}"
    try:
        task = load_task(build_config(TaskSpec, {"task": name}, ""), data=not getattr(args, "data", None))
    except ClientError as exc:
        raise ClientError(renamed_key(str(exc), {"task": "--task"})) from None
    return task, name


def _check_node_data(task: Task | None, data, source: str) -> None:
    """``data`` fits the node's own task (its checks, and its named inputs' names against the model's forward), or
    a built-in one (an agent without --task)."""
    if task is None:
        _check_builtin(data, source)
        return
    task.check_data(data, source)
    if misfit := task.inputs_misfit(data.x):
        raise ClientError(f"{source}: its named inputs must fit the task's model. Found {misfit}.")


def _check_builtin(data, source: str) -> None:
    """``data`` fits a built-in task (an agent without --task); else the ClientApp would fail once training starts."""
    if isinstance(data.x, dict):
        raise ClientError(f"{source.split(' ')[0]} holds named inputs ({names_shown(sorted(data.x))}): the built-in "
                          "tasks take one array x (n, features); give the task it was made for with --task.")
    if data.x.ndim != 2 or data.y.ndim != 1 or len(data.x) != len(data.y) or len(data.y) == 0:
        raise ClientError(f"{source.split(' ')[0]} must hold x (n, features) and y (n,) with n > 0. Found "
                          f"x{data.x.shape} y{data.y.shape}.")
    from .tasks import check_any_task

    check_any_task(data, source)


def _data_config(args: argparse.Namespace) -> str:
    if bool(args.data) == bool(args.partition):
        raise ClientError("exactly one of --data PATH.npz or --partition ID/N must be given. Found "
                          + ("both." if args.data else "neither."))
    task, task_name = _own_task(args)
    own = f" task={_literal_path(task_name, '--task')}"
    if args.data:
        data = load_npz(args.data)
        _check_node_data(task, data, f"--data {args.data}")
        if task is not None:  # (the task is this node's whatever the run's data-seed: only its name is checked here)
            check_split(args.data, task.spec, fields=("task",), against="in --task")
        out = f"data-path={_literal_path(Path(args.data).resolve(), '--data')}" + own
        eval_path = getattr(args, "eval_data", None)
        if eval_path:
            held = load_npz(eval_path)
            _check_node_data(task, held, f"--eval-data {eval_path}")
            out += f" eval-data-path={_literal_path(Path(eval_path).resolve(), '--eval-data')}"
        return out
    if getattr(args, "eval_data", None):
        raise ClientError("--eval-data goes with --data (a --partition node evaluates on its share of the task's "
                          "test set). Found --eval-data with --partition.")
    pid, sep, num = args.partition.partition("/")
    if not (sep and _DIGITS.fullmatch(pid) and _DIGITS.fullmatch(num) and 0 <= int(pid) < int(num) <= 1_000_000):
        raise ClientError(f"--partition must be ID/N with 0 <= ID < N <= 1000000. Found {args.partition!r}.")
    from .tasks import max_partitions

    most = len(task.train_set) if task is not None else max_partitions()
    if int(num) > most:
        raise ClientError(f"--partition N must be <= {most}, the most partitions "
                          f"{'the task' if task is not None else 'any task'}'s training data can be split "
                          f"into (one example each at least). Found {args.partition!r}.")
    return f"partition-id={int(pid)} num-partitions={int(num)}" + own


def _ledger_config(args: argparse.Namespace) -> str:
    """The node-config entries of the device's local-DP ledger and its owner's limits (``clients.ledger``)."""
    from privacy import make_dir

    from .ledger import MAX_EPSILON, MIN_NOISE, STATE_DIR, STATE_DIR_ENV

    out = ""
    for flag, key, value in (("--min-local-noise", MIN_NOISE, getattr(args, "min_local_noise", 0.0)),
                             ("--max-local-epsilon", MAX_EPSILON, getattr(args, "max_local_epsilon", 0.0))):
        if not (math.isfinite(value) and value >= 0):
            raise ClientError(f"{flag} must be a finite number >= 0 (0: none). Found {value!r}.")
        if value > 0:
            out += f" {key}={float(value)}"
    given, env = getattr(args, "state_dir", None), os.environ.get(STATE_DIR_ENV, "")
    flag = "--state-dir" if given or not env.strip() else f"${STATE_DIR_ENV}"  # errors name where the path came from
    state = resolve_path(given or env.strip() or "~/.fedshield/agent", flag)
    value = _literal_path(state, flag)
    make_dir(state, flag, ClientError)
    return out + f" {STATE_DIR}={value}"


def _literal_path(path: Path | str, flag: str) -> str:
    """``path`` as a TOML literal string for Flower's node config, which reads values as TOML: a basic
    string ("...") would end at a '"' in the path and turn "\\b" into a backspace; a literal one has no
    escapes, and cannot hold a "'" or a line break (refused)."""
    text = str(path)
    if "'" in text or any(c in text for c in "\n\r"):
        raise ClientError(f"{flag} must be a path without ' or line breaks (Flower's node config cannot carry "
                          f"them). Found {text!r}.")
    return f"'{text}'"


def _check_environment() -> None:
    """The environment each ClientApp process reads (the training device, torch's thread count) is
    checked once here: a bad value otherwise failed every round inside the node, far from the cause."""
    from aggregation import AggregationError, get_device

    from .client_app import torch_threads

    try:
        get_device()
    except AggregationError as exc:
        raise ClientError(str(exc)) from None  # (names FEDSHIELD_DEVICE, the training device's variable)
    torch_threads()


def supernode_command(args: argparse.Namespace) -> list[str]:
    """Validate the agent's inputs and build the ``flower-supernode`` command line."""
    from privacy import check_ca_certificate, check_node_private_key

    host, port = parse_address(args.coordinator)
    _check_environment()
    cmd = [shutil.which("flower-supernode") or "flower-supernode", "--superlink", host_port(host, port)]
    if args.insecure:
        print("fedshield agent: WARNING: --insecure: no TLS, updates travel in clear text and the node is not "
              "authenticated. Use only for local tests.", file=sys.stderr)
        unused = [flag for flag, value in (("--root-cert", args.root_cert), ("--key", args.key)) if value]
        if unused:
            print(f"fedshield agent: WARNING: --insecure: {' and '.join(unused)} not used.", file=sys.stderr)
        cmd.append("--insecure")
    else:
        if not args.root_cert:
            raise ClientError("--root-cert must be given (the coordinator's ca.crt) unless --insecure. Found none.")
        if not args.key:
            raise ClientError("--key must be given (from `fedshield keys new DIR/NAME`) unless --insecure. Found none.")
        cmd += ["--root-certificates", str(check_ca_certificate(args.root_cert).resolve()),
                "--auth-supernode-private-key", str(check_node_private_key(args.key).resolve())]
    site = getattr(args, "site_socket", None)
    node_config = "aggregator=1" if site else _data_config(args)  # an aggregator's site has the data
    link = getattr(args, "link_mbps", 0.0) or 0.0
    if link:
        if not (math.isfinite(link) and link > 0):
            raise ClientError(f"--link-mbps must be a finite number of Mbit/s > 0. Found {link!r}.")
        node_config += f" link-mbps={float(link)}"
    node_config += "" if site else _ledger_config(args)
    cmd += ["--node-config", node_config]
    if args.port:  # checked here: Flower would print its usage, or a traceback for a port in use
        if not 0 < args.port < 65536:
            raise ClientError(f"--port must be in [1, 65535] (0: each node binds a free one). Found {args.port}.")
        try:
            bind_probe("127.0.0.1", args.port)
        except OSError as exc:
            raise ClientError(f"--port {args.port} must be free on 127.0.0.1. Found: {exc.strerror or exc}.") from None
    cmd += ["--host", "127.0.0.1", "--port", str(args.port or 0)]  # 0: the kernel picks it as the node binds
    if args.max_retries < 0:
        raise ClientError(f"--max-retries must be >= 0. Found {args.max_retries}.")
    cmd += ["--max-retries", str(args.max_retries), "--max-wait-time", "30"]
    try:
        check_reachable(host, port)
    except ClientError as exc:
        if not getattr(args, "rejoin", False):
            raise
        print(f"fedshield agent: {exc} The node joins once it is (--rejoin).", file=sys.stderr)
    return cmd


def new_state_dir() -> str:
    """The agent's state dir (0700): the Runtime API secret, the node's config for its worker, the message in
    flight."""
    from privacy import make_dir

    state_dir = tempfile.mkdtemp(prefix="fedshield-agent-")
    make_dir(Path(state_dir), "the agent's state", ClientError)
    secret = Path(state_dir) / SECRET
    secret.write_bytes(secrets.token_bytes(32))
    secret.chmod(0o600)
    return state_dir


def worker_command(state_dir: str, task: str = "") -> list[str]:
    """The ClientApp worker's command line; ``task``: the class it imports while the agent checks its inputs."""
    return [sys.executable, "-m", "clients.worker", "--state-dir", state_dir, *(["--task", task] if task else [])]


def _early_task(args: argparse.Namespace) -> str:
    """``--task`` as the worker will import it, if it can be told without checking anything ('' otherwise)."""
    from .config import BUILTIN_TASKS

    name = getattr(args, "task", None) or ""
    if name and name not in BUILTIN_TASKS and ".py:" in name:
        where, _, attr = name.rpartition(":")
        path = Path(where).expanduser().resolve()
        name = f"{path}:{attr}" if path.is_file() else ""
    return name


def agent_plan(args: argparse.Namespace, state_dir: str | None = None, task: str = "") -> Plan:
    """The agent's processes: the SuperNode (Flower's, waits shortened, process isolation: it starts no
    ClientApp itself) and the warm ClientApp worker that serves its messages over the Runtime API. The
    worker's node config goes to ``state_dir`` (a worker started early waits for it), where each SuperNode the
    agent starts writes its Runtime API's address once it listens."""
    poll, task_timeout = getattr(args, "poll_interval", 0.2), getattr(args, "task_timeout", 1800.0)
    idle = getattr(args, "idle_poll_interval", None)
    idle = max(IDLE_POLL, poll) if idle is None else idle
    if not (math.isfinite(poll) and 0.01 <= poll <= 60):
        raise ClientError(f"--poll-interval must be in [0.01, 60] seconds. Found {poll!r}.")
    if not (math.isfinite(idle) and poll <= idle <= 600):
        raise ClientError(f"--idle-poll-interval must be in [--poll-interval, 600] seconds. Found {idle!r} (with "
                          f"--poll-interval {poll!r}).")
    if not (math.isfinite(task_timeout) and task_timeout > 0):
        raise ClientError(f"--task-timeout must be a finite number of seconds > 0. Found {task_timeout!r}.")
    release = getattr(args, "release_worker_after", 0.0)
    if not (math.isfinite(release) and release >= 0):
        raise ClientError(f"--release-worker-after must be a finite number of seconds >= 0 (0: never). Found "
                          f"{release!r}.")
    supernode = supernode_command(args)  # (it probes the coordinator: after the checks of plain values)
    state_dir = state_dir or new_state_dir()
    node_config = supernode[supernode.index("--node-config") + 1]
    write_atomically(str(Path(state_dir) / NODE_FILE), json.dumps({
        "node-config": node_config, "release-after": release, "site-socket": getattr(args, "site_socket", None) or ""}))
    node = [sys.executable, "-P", str(Path(__file__).with_name("flower_pins.py")), "supernode",
            "--poll-interval", str(poll), "--idle-poll-interval", str(idle), "--runtime-file",
            str(Path(state_dir) / RUNTIME), "--received-file", str(Path(state_dir) / RECEIVED), *supernode[1:],
            "--isolation", "process",
            "--superexec-auth-secret-file", str(Path(state_dir) / SECRET)]
    root_cert = supernode[supernode.index("--root-certificates") + 1] if "--root-certificates" in supernode else ""
    return Plan(supernode=node, worker=worker_command(state_dir, task), state_dir=state_dir,
                task_timeout=float(task_timeout), coordinator=supernode[supernode.index("--superlink") + 1],
                root_cert=root_cert, rejoin=bool(getattr(args, "rejoin", False)))


def start_agent(args: argparse.Namespace) -> int:
    """Start the ClientApp worker (its imports overlap the checks), check every input, then become the
    supervisor (``clients.supervisor``, no torch): it adopts the worker and starts the SuperNode once the
    worker is warm, until the SuperNode ends or a signal. A failed check stops the worker, removes its state."""
    state_dir = new_state_dir()
    task = _early_task(args)
    worker = start_process(worker_command(state_dir, task))
    try:
        plan = agent_plan(args, state_dir, task)
    except BaseException:
        stop_group(worker, signal.SIGKILL)
        worker.wait()
        shutil.rmtree(state_dir, ignore_errors=True)
        raise
    plan.worker_pid = worker.pid
    print(f"fedshield agent: connecting to {args.coordinator} "
          f"({'insecure' if args.insecure else 'TLS + node authentication'})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    script = str(Path(__file__).with_name("supervisor.py"))
    os.execv(sys.executable, [sys.executable, "-P", script, json.dumps(dataclasses.asdict(plan))])
    return 1  # not reached
