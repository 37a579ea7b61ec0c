"""Run a scenario on Flower's simulation engine (Ray) or the in-process engine."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from coordinator import CoordinatorError, RunDirectory
from coordinator.rundir import finished_summary
from coordinator.progress import RoundProgress
from coordinator.server_app import make_server_app, make_workflow
from clients.ledger import PREFIX as LEDGER_PREFIX, STATE_DIR
from privacy import make_dir
from coordinator.workflow import RoundCallback

from .inprocess import InProcessGrid
from .virtual import VirtualClock, VirtualGrid, tiered_profiles
from .scenario import Scenario


def _backend_config(scn: Scenario) -> dict[str, Any]:
    init: dict[str, Any] = {"logging_level": logging.WARNING}
    if scn.sim.ray_num_cpus:
        init["num_cpus"] = scn.sim.ray_num_cpus
    if scn.sim.ray_address:
        init["address"] = scn.sim.ray_address
    return {
        "client_resources": {"num_cpus": scn.sim.client_cpus, "num_gpus": scn.sim.client_gpus},
        "init_args": init,
    }


def _not_for_our_users(record: logging.LogRecord) -> bool:
    """Drops Flower's notice that ``run_simulation`` (which ``fedshield simulate`` calls for its users)
    is deprecated: nothing a user of fedshield can act on. Everything else passes."""
    return "`run_simulation` function is deprecated" not in record.getMessage()


@contextlib.contextmanager
def ctrl_c_sets(stop: threading.Event) -> Iterator[Callable[[], bool]]:
    """Within the block, Ctrl-C (SIGINT) or SIGTERM sets ``stop`` at once, whichever thread the kernel hands
    the signal to; yields whether it came.

    Why: Python runs its SIGINT handler (KeyboardInterrupt) only in the main thread, and a main
    thread blocked on a lock is woken only if the signal lands on it. Under Flower's engine the
    main thread waits, without a timeout, for worker threads that run until the ServerApp ends,
    and the process has dozens of threads (Ray's, gRPC's, the workers): a Ctrl-C landing on one
    of them was seen only after every round had run (and then lost in Ray's shutdown). The C-level
    handler still writes the signal's number to Python's wakeup fd from any thread; a watcher
    thread reads it and sets ``stop``, which the ServerApp's clock checks (``StoppableClock``).
    Outside the main thread it only yields.
    """
    seen = threading.Event()
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread (no signals there), or not allowed here: the plain handler only
        os.close(r)
        os.close(w)
        yield seen.is_set
        return
    # SIGTERM (``kill``, a job scheduler) stops the run as Ctrl-C does where a Python handler takes it
    # (``fedshield simulate`` sets one; Ray's ``ray.init`` sets its own, sys.exit): Python's C-level
    # handler writes the signal to the wakeup fd whichever it is.

    def watch() -> None:
        while data := os.read(r, 64):  # b"" once the write end is closed
            if signal.SIGINT in data or signal.SIGTERM in data:
                seen.set()
                stop.set()

    watcher = threading.Thread(target=watch, name="fedshield-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield seen.is_set
    finally:
        signal.set_wakeup_fd(old)
        os.close(w)
        watcher.join(timeout=5)
        os.close(r)


_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")


@contextlib.contextmanager
def local_ray_auth(joining: bool) -> Iterator[bool]:
    """Within the block, a Ray instance this process starts takes only callers that hold a fresh
    random token (Ray's token authentication, ``RAY_AUTH_MODE=token``); yields whether it is on.

    Why: Ray (2.55, which flwr 1.42 pins) starts with authentication off, and its GCS, raylet and
    actors listen on every interface of the machine, not only 127.0.0.1 (``_node_ip_address`` does
    not change that): anyone who can reach those ports can submit code to run as this user. The
    token lives only in this process's environment, which Ray's processes inherit, and is never
    logged. Nothing changes when the run joins a cluster (``joining``: the cluster's own setting
    applies; README says how to turn it on there) or when ``RAY_AUTH_MODE`` is already set (the
    operator's choice). The environment and Ray's cached config are restored afterwards, so a later
    run in this process may join an unauthenticated cluster again.
    """
    if joining or "RAY_AUTH_MODE" in os.environ:
        yield False
        return
    try:  # Ray reads RAY_AUTH_MODE into its config once, at import: re-read it (as Ray's own tests do)
        from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode
    except ImportError:  # a Ray without token authentication
        yield False
        return

    def reread() -> None:
        AuthenticationTokenLoader.instance().reset_cache()
        Config.initialize("")

    saved = {k: os.environ.get(k) for k in _AUTH_VARS}
    os.environ["RAY_AUTH_MODE"], os.environ["RAY_AUTH_TOKEN"] = "token", secrets.token_hex(32)
    try:
        reread()
        yield get_authentication_mode() == AuthenticationMode.TOKEN
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        reread()


def _ray_hostport(address: str, what: str) -> str | None:
    """The ``host:port`` a Ray address (``host:port``, ``ray://host:port``, or ``auto``: ``RAY_ADDRESS``,
    else the cluster ``ray start`` left on this machine) points at; None where Ray starts its own."""
    if address.startswith("ray://"):
        hostport: str | None = address[len("ray://"):]
    else:
        from ray._private.services import get_ray_address_from_environment  # Ray's own reading ("auto", RAY_ADDRESS)

        try:
            hostport = get_ray_address_from_environment(address, None)
        except ConnectionError:
            raise CoordinatorError(f"{what} {address!r}: no running Ray cluster found on this machine. Start one "
                                   "with `ray start --head`, or give a cluster's host:port.") from None
        if hostport in (None, "local"):  # Ray starts one here
            return None
    host, sep, port = str(hostport).rpartition(":")
    if not (sep and host and port.isdigit()):
        raise CoordinatorError(f"{what} must be host:port, ray://host:port or auto. Found {address!r}.")
    return str(hostport)


def _unreachable(hostport: str, timeout: float) -> str | None:
    """Why nothing accepts a TCP connection at ``hostport`` within ``timeout`` s; None when something does."""
    host, _, port = hostport.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def check_ray_address(address: str, timeout: float = 5.0, what: str = "simulation.ray-address") -> str | None:
    """One clear error, before any round, when no Ray cluster answers at ``address`` (``host:port``,
    ``ray://host:port``, or ``auto``: ``RAY_ADDRESS``, else the cluster ``ray start`` left on this
    machine). Unchecked, Ray retries an unreachable GCS for ever while the ServerApp waits out
    every round with no clients, or ("auto" with no cluster) fails deep inside Flower's engine.
    Returns the ``host:port`` checked (None where Ray would start its own)."""
    hostport = _ray_hostport(address, what)
    if hostport is None:
        return None
    reason = _unreachable(hostport, timeout)
    if reason is not None:
        raise CoordinatorError(f"{what} {address!r}: no Ray cluster answers at {hostport} ({reason}). "
                               "Start one there with `ray start --head`, or leave ray-address out to run on a "
                               "Ray instance of this process's own.")
    return hostport


RAY_MISSING = ("simulation.engine 'flower' runs Flower's simulation engine on Ray, which this install lacks (fedshield's "
               "base install leaves Ray out, for edge devices): pip install 'fedshield[simulation]', or run with "
               "--engine inprocess or --engine virtual, which need no Ray.")
RAY_MISSING_SHARDS = ("simulation.batched-shards runs the batched training on Ray actors, which this install lacks: "
                      "pip install 'fedshield[simulation]', or set batched-shards = 0 to train in this process.")


def ray_installed() -> bool:
    """Whether Ray can be imported here (fedshield's ``simulation`` extra), without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or blocked install (``sys.modules["ray"] = None``)
        return False


def check_ray_cluster(scn: Scenario) -> str | None:
    """On Flower's engine, or the in-process engine's Ray shards (``batched-shards``): Ray installed
    (``RAY_MISSING`` otherwise), and the Ray cluster the run would join (``ray-address``, else
    ``RAY_ADDRESS``, which ``ray.init()`` follows when given no address) answering: ``check_ray_address``.
    Returns its ``host:port`` (None where the run starts a Ray instance of its own)."""
    shards = scn.sim.engine == "inprocess" and scn.sim.batched_shards > 0
    if scn.sim.engine != "flower" and not shards:
        return None
    if not ray_installed():
        raise CoordinatorError(RAY_MISSING_SHARDS if shards else RAY_MISSING)
    joining = "ray-address" if scn.sim.ray_address else "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else ""
    if joining and scn.sim.ray_num_cpus:  # Ray refuses num_cpus when joining: a traceback from inside Flower's engine
        raise CoordinatorError(f"simulation.ray-num-cpus must be 0 when the run joins a Ray cluster ({joining} is set: the "
                               f"cluster's own resources apply). Found {scn.sim.ray_num_cpus}.")
    if scn.sim.ray_address:
        return check_ray_address(scn.sim.ray_address)
    if os.environ.get("RAY_ADDRESS"):
        return check_ray_address(os.environ["RAY_ADDRESS"], what="RAY_ADDRESS (from the environment)")
    if not shards:
        check_local_resources(scn)
    elif scn.sim.ray_num_cpus > (os.cpu_count() or 1):
        raise CoordinatorError(f"simulation.ray-num-cpus must be <= this machine's {os.cpu_count() or 1} CPUs for a "
                               f"Ray instance of the run's own. Found {scn.sim.ray_num_cpus}.")
    return None


MAX_ACTORS_PER_CPU = 4  # client actors Flower's pool may start per CPU of a Ray instance of the run's own


def check_local_resources(scn: Scenario) -> None:
    """On a Ray instance of the run's own, one client actor must fit: ``client-cpus`` within the CPUs
    Ray gets (``ray-num-cpus``, else this machine's), ``client-gpus`` only where there is a GPU.
    Unchecked, Flower's engine logs an "ActorPool is empty" traceback per attempt and the run fails."""
    machine = os.cpu_count() or 1
    if scn.sim.ray_num_cpus > machine:
        raise CoordinatorError(f"simulation.ray-num-cpus must be <= this machine's {machine} CPUs for a Ray instance of "
                               f"the run's own (Flower starts one client actor per client-cpus of them: more would "
                               f"only take turns on the cores, each with its own process). Found {scn.sim.ray_num_cpus}.")
    cpus = scn.sim.ray_num_cpus or machine
    actors = int(cpus / scn.sim.client_cpus)  # Flower's pool: as many actors as fit the CPUs
    if actors > MAX_ACTORS_PER_CPU * cpus:
        raise CoordinatorError(f"simulation.client-cpus must be >= {1 / MAX_ACTORS_PER_CPU:g}: Flower would start "
                               f"{actors} client actors (processes) on {cpus} CPUs, at most {MAX_ACTORS_PER_CPU} per "
                               f"CPU run usefully. Found {scn.sim.client_cpus:g}.")
    if scn.sim.client_cpus > cpus:
        raise CoordinatorError(f"simulation.client-cpus must be <= the {cpus} CPUs Ray gets here "
                               f"({'ray-num-cpus' if scn.sim.ray_num_cpus else 'this machine'}): no client actor would "
                               f"fit. Found {scn.sim.client_cpus:g}.")
    if scn.sim.client_gpus > 0:
        import torch

        if not torch.cuda.is_available():
            raise CoordinatorError(f"simulation.client-gpus must be 0 on a machine without a CUDA GPU: no client actor "
                                   f"would fit. Found {scn.sim.client_gpus:g}.")


class ClusterWatch:
    """Ends a run on Flower's engine, through ``stop``, when its Ray cluster stops answering.

    Why: when the cluster's head (its GCS) goes away mid-run, every message to a client actor
    fails, Flower logs a traceback for each, and the ServerApp goes on asking; about a minute later
    Ray's core ends the whole process from its own thread (exit 1, no summary, no word on what
    happened or how to resume). The watch probes the GCS port (the cluster's ``host:port``, or
    once Ray is up the GCS of the instance Flower started) every ``interval`` s; after ``misses``
    failed probes in a row it records why in ``lost`` and sets ``stop``, and the run ends within
    one poll interval, with the rounds finished before saved (``run_flower_engine`` then raises one
    clear error).
    """

    def __init__(self, stop: threading.Event, hostport: str | None, interval: float = 2.0, misses: int = 3,
                 on_hang: Callable[[str], None] | None = None, grace: float = 20.0) -> None:
        self.stop, self.hostport, self.interval, self.misses = stop, hostport, interval, misses
        # a run still going ``grace`` s after the cluster was lost (a call or Ray's shutdown blocked on the dead GCS,
        # seen once under load) gets ``on_hang(lost)`` before Ray's core ends the process at 60 s with exit 1
        self.on_hang, self.grace = on_hang, grace
        self.lost: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fedshield-ray-watch", daemon=True)

    def __enter__(self) -> ClusterWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=self.interval + 1)

    def _address(self) -> str | None:
        if self.hostport is not None:
            return self.hostport
        try:
            import ray

            return ray.get_runtime_context().gcs_address if ray.is_initialized() else None
        except Exception:  # noqa: BLE001 - Ray starting or shutting down: nothing to probe yet (or any more)
            return None

    def _watch(self) -> None:
        missed = 0
        while not self._done.wait(self.interval):
            address = self._address()
            reason = _unreachable(address, self.interval) if address else None
            missed = missed + 1 if reason else 0
            if missed >= self.misses:
                self.lost = f"{address} ({reason})"
                self.stop.set()
                if not self._done.wait(self.grace) and self.on_hang is not None:
                    self.on_hang(self.lost)
                return


@contextlib.contextmanager
def _no_ray_sigterm_handler() -> Iterator[None]:
    """ray.init (called by Flower from the main thread) replaces the process's SIGTERM handler with its own,
    sys.exit(15): a SIGTERM then unwound the main thread past Flower's shutdown, and the interpreter's exit
    waited for ever on a Flower worker blocked in ray.get. Within the block Ray sets none, so a SIGTERM takes
    the handler ``fedshield simulate`` set (the KeyboardInterrupt of Ctrl-C), whose way out is clean."""
    import ray._private.utils as ray_utils

    real = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = real


@contextlib.contextmanager
def _ray_shutdown_after_its_calls(timeout: float = 15.0) -> Iterator[None]:
    """Flower's ``RayBackend.terminate`` (run from the main thread as the run stops) called ``ray.shutdown`` while
    Flower's worker threads could still be in ``process_message``, waiting on an actor; one that touched Ray after
    the shutdown made Ray's core worker end the whole process, exit status 1 ("The core worker has already been
    shutdown"), instead of the interrupted run's 130 (seen once in the suite, SIGTERM under load). Within the
    block, terminate refuses new messages, lets the calls in flight return (an actor's current client, or the
    actor's death under a SIGTERM to the group), up to ``timeout`` s, and only then shuts Ray down. A message
    handed over after that gets an error reply without touching Ray (not an exception: Flower's worker thread logs
    each one with its traceback, which a Ctrl-C'd run printed after "fedshield: interrupted")."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    calls = threading.Condition()
    state = {"inflight": 0, "closed": False}
    real_process, real_terminate = RayBackend.process_message, RayBackend.terminate

    def process_message(self, message, context):
        with calls:
            if state["closed"]:
                return Message(Error(code=ErrorCode.UNKNOWN, reason="the simulation is stopping"),
                               reply_to=message), context
            state["inflight"] += 1
        try:
            return real_process(self, message, context)
        finally:
            with calls:
                state["inflight"] -= 1
                calls.notify_all()

    def terminate(self) -> None:
        with calls:
            state["closed"] = True
            calls.wait_for(lambda: state["inflight"] == 0, timeout)
        real_terminate(self)

    RayBackend.process_message, RayBackend.terminate = process_message, terminate
    try:
        yield
    finally:
        RayBackend.process_message, RayBackend.terminate = real_process, real_terminate


def run_flower_engine(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The ServerApp and ClientApp under ``flwr.simulation.run_simulation``."""
    # Before Ray is imported (it reads this once): no native failure-signal handler in this process,
    # which on SIGTERM printed a stack dump and aborted before fedshield could stop the run cleanly.
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from flwr.simulation import run_simulation

    hostport = check_ray_cluster(scn)

    from clients.client_app import app as client_app

    # One torch thread per client actor: actors already fill the cores.
    os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")
    result: dict[str, Any] = {}
    stop = threading.Event()
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addFilter(_not_for_our_users)
    def hung(lost: str) -> None:  # the one line the CLI would print, then out: every finished round is saved
        print(f"fedshield: error: {_cluster_lost(lost, scn)}", file=sys.stderr, flush=True)
        os._exit(2)

    watch = ClusterWatch(stop, hostport, on_hang=hung)

    def quiet_once_stopped(record: logging.LogRecord) -> bool:
        # A stopped run's client actors die under the tasks they ran (a SIGTERM to the process group reaches
        # them too): Flower then logs an error and a traceback per task, ~56 lines before "interrupted".
        return not (stop.is_set() and record.levelno >= logging.ERROR)

    flwr_logger.addFilter(quiet_once_stopped)
    try:
        with ctrl_c_sets(stop) as interrupted, warnings.catch_warnings(), watch, local_ray_auth(hostport is not None), \
                _no_ray_sigterm_handler(), _ray_shutdown_after_its_calls():
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            try:
                run_simulation(
                    server_app=make_server_app(scn.run, on_round, result, stop=stop, sim_nodes=scn.sim.num_supernodes),
                    client_app=client_app,
                    num_supernodes=scn.sim.num_supernodes,
                    backend_config=_backend_config(scn),
                )
            except BaseException as exc:
                # Ctrl-C (or any failure) reaches only this thread: the ServerApp's thread would go on
                # running rounds with no clients (and the interpreter would wait for it at exit).
                stop.set()
                # The ServerApp's RunInterrupted, or whatever else the stop caused; or Ray's SIGTERM handler's
                # sys.exit(SIGTERM), which can reach this thread before the watcher has read the signal.
                if interrupted() or (isinstance(exc, SystemExit) and exc.code == signal.SIGTERM):
                    raise KeyboardInterrupt from None
                if not watch.lost:  # (a lost cluster is reported below, whatever the engine raised on its way out)
                    raise
            if interrupted():  # the KeyboardInterrupt itself may have been swallowed on the way out
                raise KeyboardInterrupt
    finally:
        flwr_logger.removeFilter(_not_for_our_users)
        flwr_logger.removeFilter(quiet_once_stopped)
    if watch.lost and not result:  # (a run that finished keeps its summary, whatever Ray's shutdown did after)
        raise _cluster_lost(watch.lost, scn)
    if not result:
        raise CoordinatorError("the simulation must end with a summary. Found none: the ServerApp failed (see the log above).")
    return result


def _cluster_lost(where: str, scn: Scenario) -> CoordinatorError:
    run_dir = scn.run.server.run_dir
    saved = RunDirectory(run_dir).load_checkpoint() if run_dir else None
    if not saved:
        return CoordinatorError(f"the Ray cluster stopped answering at {where} during the run, before any round "
                                "was saved. Run again once the cluster is back.")
    return CoordinatorError(f"the Ray cluster stopped answering at {where} during the run; rounds 1-{int(saved['round'])} "
                            f"are saved in {run_dir}. Once the cluster is back, run again with --run-dir {run_dir}: "
                            "the run resumes after the last saved round.")


def run_inprocess_engine(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The same workflow on an in-process Grid (no Ray): a round's clients trained together where the task allows
    (``simulation.batched``, the default), else one by one."""
    from clients.client_app import app as client_app

    from .batched_grid import BatchedGrid

    if scn.sim.batched_shards:
        return _run_sharded(scn, on_round)
    kind = BatchedGrid if scn.sim.batched else InProcessGrid
    if scn.sim.sites:  # edge aggregators: the coordinator's nodes are the sites, each with its clients' grid
        from .hierarchy import site_grid

        grid = site_grid(scn.site, scn.sim.num_supernodes, scn.sim.sites, scn.run.server.run_dir, _node_config(scn), kind)
    else:
        grid = kind(client_app, scn.sim.num_supernodes, _node_config(scn))
    return make_workflow(scn.run, grid, RunDirectory(scn.run.server.run_dir), on_round=on_round).run()


def _run_sharded(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The batched in-process engine with its training on ``batched-shards`` Ray actors: on a Ray instance this
    process starts (``ray-num-cpus``, token-authenticated as Flower's engine's is), or the cluster at
    ``ray-address``; shut down after the run."""
    from clients.client_app import app as client_app

    hostport = check_ray_cluster(scn)
    import ray

    from .ray_shards import ShardedBatchedGrid

    init: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False, "include_dashboard": False}
    if scn.sim.ray_address:
        init["address"] = scn.sim.ray_address
    if scn.sim.ray_num_cpus:  # (0 when joining a cluster: check_ray_cluster)
        init["num_cpus"] = scn.sim.ray_num_cpus
    with local_ray_auth(hostport is not None), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
        ray.init(**init)
        try:
            cpus = int(ray.cluster_resources().get("CPU", 0))
            if scn.sim.batched_shards > cpus:  # the actors past the CPUs would wait, unscheduled, for ever
                raise CoordinatorError(f"simulation.batched-shards must be <= the {cpus} CPUs of the Ray "
                                       f"{'cluster' if hostport else 'instance'} it runs on (one actor per CPU). "
                                       f"Found {scn.sim.batched_shards}.")
            grid = ShardedBatchedGrid(client_app, scn.sim.num_supernodes, _node_config(scn),
                                      shards=scn.sim.batched_shards)
            try:
                return make_workflow(scn.run, grid, RunDirectory(scn.run.server.run_dir), on_round=on_round).run()
            finally:
                grid.close()  # (a cluster the run joined keeps running: its CPUs back at once)
        finally:
            ray.shutdown()


def uses_local_dp(scn: Scenario) -> bool:
    """Whether the scenario's clients train by DP-SGD: asked by the coordinator, or by their edge aggregators."""
    return "local" in (scn.run.privacy.dp, scn.site.privacy.dp if scn.site is not None else "none")


def _node_config(scn: Scenario) -> Callable[[int], dict[str, Any]]:
    """Simulated node ``i``'s node config: its partition and, under local DP, a state directory in the
    run directory for its ledger (as an agent's --state-dir): the epsilon it spent outlives a resume."""
    n, local = scn.sim.num_supernodes, uses_local_dp(scn)
    ledgers = Path(scn.run.server.run_dir) / "clients"

    def config(i: int) -> dict[str, Any]:
        if not local:
            return {"partition-id": i, "num-partitions": n}
        make_dir(ledgers / f"partition-{i}", "a simulated client's state directory", CoordinatorError)
        return {"partition-id": i, "num-partitions": n, STATE_DIR: str(ledgers / f"partition-{i}")}
    return config


def run_virtual_engine(scn: Scenario, on_round: RoundCallback | None) -> dict[str, Any]:
    """The same workflow on the virtual clock: replies arrive at times drawn from device-profile tiers."""
    from clients.client_app import app as client_app

    clock = VirtualClock()
    profiles = tiered_profiles(scn.sim.num_supernodes, scn.tiers or None, seed=scn.run.server.seed)
    grid = VirtualGrid(client_app, scn.sim.num_supernodes, clock, profiles, _node_config(scn), seed=scn.run.server.seed)
    return make_workflow(scn.run, grid, RunDirectory(scn.run.server.run_dir), clock=clock, on_round=on_round).run()


def check_partitions(scn: Scenario) -> None:
    """The task's data must split into one partition per simulated client: one clear line naming
    ``simulation.num-supernodes`` otherwise (the split itself speaks of num-partitions)."""
    from clients import ConfigError
    from clients.config import renamed_key
    from clients.tasks import load_task

    task = load_task(scn.run.task)  # (a task that does not import or build says so in its own line)
    try:
        task.client_data(0, scn.sim.num_supernodes)
    except ConfigError as exc:
        raise ConfigError(renamed_key(str(exc), {"num-partitions": "simulation.num-supernodes"})
                          + f" Each simulated client gets one partition of task {scn.run.task.task!r}'s data.") from None


def check_local_dp_resume(scn: Scenario, run_dir: Path) -> None:
    """A local-DP run resumes only where its simulated clients' ledgers are: in the run directory, which
    the in-process and virtual engines keep them in. Flower's engine keeps them in memory, so a run
    resumed on it, or one that ran on it and is resumed on another engine (as the refusal had advised),
    started its clients' epsilon again at zero."""
    if scn.sim.engine == "flower":
        raise CoordinatorError(f"{run_dir} holds a local-DP run; on Flower's engine the simulated clients keep their "
                               "privacy ledgers in memory only, so a resumed run would start their epsilon again at "
                               "zero. Resume it with --engine inprocess or virtual if it ran on one of them (their "
                               "ledgers are in the run directory), or use another --run-dir.")
    if not any((run_dir / "clients").glob(f"partition-*/{LEDGER_PREFIX}*.json")):
        raise CoordinatorError(f"{run_dir} holds a local-DP run without its clients' privacy ledgers (it ran on Flower's "
                               "engine, which keeps them in memory only): resumed, their epsilon would start again at "
                               "zero. Use another --run-dir.")


def run_scenario(scn: Scenario, run_dir: str | Path, show_progress: bool = True) -> dict[str, Any]:
    """Run ``scn`` writing into ``run_dir`` (resuming if it holds a checkpoint); a run directory that already
    holds ``num-rounds`` rounds and its summary is returned as it is, without starting an engine."""
    run_dir = Path(run_dir).expanduser()
    scn = dataclasses.replace(scn, run=scn.run.replace(run_dir=str(run_dir.resolve())))
    start = RunDirectory(run_dir).load_checkpoint()
    done = int(start["round"]) if start else 0
    finished = finished_summary(run_dir, done, scn.run.server.num_rounds)
    if finished is not None:  # nothing to train, no engine to start
        return finished
    check_partitions(scn)
    if done and uses_local_dp(scn):
        check_local_dp_resume(scn, Path(run_dir))
    engine = {"flower": run_flower_engine, "inprocess": run_inprocess_engine, "virtual": run_virtual_engine}[scn.sim.engine]
    if not show_progress:
        return engine(scn, None)
    title = f"{scn.sim.name} ({scn.sim.engine})"
    with RoundProgress(scn.run.server.num_rounds, title, start=done) as prog:
        return engine(scn, prog.update)
