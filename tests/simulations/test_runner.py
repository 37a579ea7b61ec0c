"""simulations.runner: Ctrl-C stops a Flower-engine run whichever thread it lands on (ctrl_c_sets);
a Ray address no cluster answers at is one clear error before any round (check_ray_address), and a
cluster that stops answering mid-run ends the run with one (ClusterWatch, _cluster_lost); a Ray
instance the run starts takes only callers holding the run's token (local_ray_auth); a
finished run directory is returned without starting an engine (run_scenario)."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from coordinator import CoordinatorError
from simulations.runner import ClusterWatch, _cluster_lost, check_ray_address, ctrl_c_sets, local_ray_auth


@pytest.fixture
def quiet_sigint():
    """A Python-level SIGINT handler that counts instead of raising KeyboardInterrupt into pytest
    (the wakeup fd is written by the C handler for any Python-level handler)."""
    hits: list[int] = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_sigint_landing_on_a_worker_thread_sets_stop_while_main_is_blocked(quiet_sigint):
    """As under Flower's engine: the main thread waits, with no timeout, on a worker that runs until
    ``stop``; the signal goes to that worker, so the main thread's wait is never interrupted and
    only the watcher can end it. Without ctrl_c_sets the join below would wait out the worker's 20 s."""
    stop = threading.Event()
    woken: list[bool] = []  # stop.wait's result: True when set, False when its 20 s ran out
    worker = threading.Thread(target=lambda: woken.append(stop.wait(20)))
    with ctrl_c_sets(stop) as interrupted:
        worker.start()
        threading.Timer(0.3, signal.pthread_kill, (worker.ident, signal.SIGINT)).start()
        worker.join()
    assert stop.is_set() and interrupted() and woken == [True]
    assert signal.set_wakeup_fd(-1) == -1  # the previous wakeup fd (none) was restored


def test_a_sigterm_sets_stop_as_ctrl_c_does(quiet_sigint):
    """Whichever Python handler takes it (``fedshield simulate``'s, or Ray's sys.exit set in ray.init)."""
    stop = threading.Event()
    hits: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: hits.append(signum))
    try:
        with ctrl_c_sets(stop) as interrupted:
            signal.raise_signal(signal.SIGTERM)
            for _ in range(50):
                if stop.is_set():
                    break
                time.sleep(0.05)
        assert stop.is_set() and interrupted() and hits == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


def test_no_sigint_no_stop_and_other_signals_are_ignored(quiet_sigint):
    stop = threading.Event()
    old = signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        with ctrl_c_sets(stop) as interrupted:
            signal.raise_signal(signal.SIGUSR1)
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert not stop.is_set() and not interrupted()


def test_outside_the_main_thread_it_only_yields():
    got: list[bool] = []

    def run() -> None:
        with ctrl_c_sets(threading.Event()) as interrupted:
            got.append(interrupted())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert got == [False]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


@pytest.mark.parametrize("form", ["{}", "ray://{}"])
def test_an_unreachable_ray_address_is_one_error_before_any_round(form, monkeypatch):
    """Ray would retry such a GCS for ever while every round waited with no clients."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = form.format(f"127.0.0.1:{_closed_port()}")
    with pytest.raises(CoordinatorError, match=r"no Ray cluster answers at 127\.0\.0\.1:\d+ \(Connection refused\)") as exc:
        check_ray_address(address, timeout=2)
    assert "\n" not in str(exc.value)


def test_a_listening_address_passes_and_bad_forms_are_refused(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        check_ray_address(f"127.0.0.1:{srv.getsockname()[1]}", timeout=2)
    check_ray_address("local")  # Ray starts its own: nothing to reach
    for bad in ("nonsense", "127.0.0.1:port", ":6379"):
        with pytest.raises(CoordinatorError, match="must be host:port, ray://host:port or auto"):
            check_ray_address(bad)


def test_auto_follows_ray_address_from_the_environment(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{_closed_port()}")
    with pytest.raises(CoordinatorError, match="'auto': no Ray cluster answers at 127.0.0.1"):
        check_ray_address("auto", timeout=2)


def test_the_watch_stops_the_run_once_the_cluster_stops_answering():
    """While something answers at the address, nothing happens (a single missed probe is not
    enough); once nothing has for ``misses`` probes in a row, ``stop`` is set and ``lost`` says where."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    address = f"127.0.0.1:{srv.getsockname()[1]}"
    stop = threading.Event()
    with ClusterWatch(stop, address, interval=0.05, misses=3) as watch:
        assert not stop.wait(0.5) and watch.lost is None  # ~10 probes, all answered
        srv.close()
        assert stop.wait(10), "the watch must set stop once the address stops answering"
    assert watch.lost == f"{address} (Connection refused)"


def test_a_run_that_does_not_end_after_its_cluster_is_lost_is_ended_with_its_line(monkeypatch):
    """Stop set, and the run still going ``grace`` s later (blocked on the dead cluster): ``on_hang`` gets where
    the cluster was lost (the runner prints the one line and exits 2 before Ray's core ends it with 1); a run
    that ends in time never gets it."""
    import simulations.runner as runner

    monkeypatch.setattr(runner, "_unreachable", lambda hostport, timeout: "Connection refused")
    for ends_in_time in (False, True):
        stop, hung = threading.Event(), []
        with ClusterWatch(stop, "127.0.0.1:1", interval=0.01, misses=2, on_hang=hung.append, grace=0.3) as watch:
            assert stop.wait(5)
            if not ends_in_time:
                time.sleep(1.0)
        time.sleep(0.4)
        assert hung == ([] if ends_in_time else [watch.lost]) and watch.lost == "127.0.0.1:1 (Connection refused)"


def test_the_watch_forgives_a_probe_missed_now_and_then(monkeypatch):
    import simulations.runner as runner

    answers = iter(["Connection refused", None, "Connection refused", "Connection refused", None] * 20)
    monkeypatch.setattr(runner, "_unreachable", lambda hostport, timeout: next(answers, None))
    stop = threading.Event()
    with ClusterWatch(stop, "127.0.0.1:1", interval=0.01, misses=3) as watch:
        time.sleep(0.5)
    assert not stop.is_set() and watch.lost is None


def test_without_an_address_the_watch_probes_the_gcs_of_the_ray_it_started(monkeypatch):
    """No ray-address: Flower's engine starts Ray in this process; once it is up, its GCS is probed
    (and until then, or after it is shut down, nothing is)."""
    import ray

    probed: list[str] = []
    monkeypatch.setattr("simulations.runner._unreachable", lambda hostport, timeout: probed.append(hostport) or None)
    up = {"now": False}
    monkeypatch.setattr(ray, "is_initialized", lambda: up["now"])
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: type("Ctx", (), {"gcs_address": "127.0.0.1:6379"})())
    stop = threading.Event()
    with ClusterWatch(stop, None, interval=0.02, misses=2):
        time.sleep(0.2)
        assert probed == []
        up["now"] = True
        time.sleep(0.2)
    assert probed and set(probed) == {"127.0.0.1:6379"} and not stop.is_set()


def test_a_lost_cluster_is_one_line_that_says_what_is_saved_and_how_to_resume(tmp_path):
    import torch

    from coordinator import RunConfig, RunDirectory
    from simulations.scenario import Scenario, SimulationSettings

    scn = Scenario(sim=SimulationSettings(name="t", num_supernodes=3),
                   run=RunConfig.from_mapping({"num-rounds": 9, "min-nodes": 3, "task": "digits",
                                               "run-dir": str(tmp_path / "run")}))
    msg = str(_cluster_lost("127.0.0.1:6379 (Connection refused)", scn))
    assert msg.startswith("the Ray cluster stopped answering at 127.0.0.1:6379 (Connection refused) during the run, "
                          "before any round was saved") and "\n" not in msg
    RunDirectory(tmp_path / "run").save_checkpoint({"round": 4, "version": 4, "weights": torch.zeros(3), "optimizer": {},
                                                    "history": [], "rejections": {}, "fingerprint": {}})
    msg = str(_cluster_lost("127.0.0.1:6379 (Connection refused)", scn))
    assert f"rounds 1-4 are saved in {tmp_path / 'run'}" in msg and f"--run-dir {tmp_path / 'run'}" in msg
    assert "\n" not in msg


def test_a_ray_the_run_starts_takes_a_fresh_token_and_everything_is_restored_after(monkeypatch):
    """(That the Ray instance then refuses a caller without the token: tests/integration/test_simulate.py.)"""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    tokens = []
    for _ in range(2):
        with local_ray_auth(joining=False) as on:
            assert on and get_authentication_mode() == AuthenticationMode.TOKEN
            assert os.environ["RAY_AUTH_MODE"] == "token"
            tokens.append(os.environ["RAY_AUTH_TOKEN"])
        assert "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ
        assert get_authentication_mode() == AuthenticationMode.DISABLED  # a later run may join an open cluster
    assert len(set(tokens)) == 2 and all(len(t) == 64 for t in tokens)  # fresh per run, 256 bits

    with local_ray_auth(joining=True) as on:  # a cluster's own setting applies
        assert not on and "RAY_AUTH_MODE" not in os.environ
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the operator's explicit choice
    with local_ray_auth(joining=False) as on:
        assert not on and os.environ["RAY_AUTH_MODE"] == "disabled" and "RAY_AUTH_TOKEN" not in os.environ


def test_a_finished_run_directory_is_returned_without_starting_an_engine(tmp_path, monkeypatch):
    import simulations.runner as runner
    from coordinator import RunConfig
    from simulations.scenario import Scenario, SimulationSettings

    scn = Scenario(sim=SimulationSettings(name="t", engine="inprocess", num_supernodes=3),
                   run=RunConfig.from_mapping({"num-rounds": 1, "min-nodes": 3, "task": "digits", "seed": 0}))
    first = runner.run_scenario(scn, tmp_path / "run", show_progress=False)
    started: list[str] = []
    monkeypatch.setattr(runner, "run_inprocess_engine", lambda *a: started.append("engine") or {})
    again = runner.run_scenario(scn, tmp_path / "run", show_progress=False)
    assert started == [] and again["final_test_accuracy"] == first["final_test_accuracy"]
    more = dataclasses.replace(scn, run=scn.run.replace(num_rounds=2))
    runner.run_scenario(more, tmp_path / "run", show_progress=False)  # rounds left: the engine runs
    assert started == ["engine"]


def test_a_client_actor_that_cannot_fit_on_the_runs_own_ray_is_one_error(monkeypatch):
    """Flower's engine used to log an 'ActorPool is empty' traceback per attempt, then fail."""
    import torch

    from coordinator import RunConfig
    from simulations.runner import check_local_resources
    from simulations.scenario import Scenario, SimulationSettings

    def scn(**sim):
        return Scenario(sim=SimulationSettings(name="t", num_supernodes=3, **sim), run=RunConfig.from_mapping({}))

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CoordinatorError, match=r"client-cpus must be <= the 2 CPUs Ray gets here \(this machine\)"):
        check_local_resources(scn(client_cpus=64.0))
    with pytest.raises(CoordinatorError, match=r"client-cpus must be <= the 1 CPUs Ray gets here \(ray-num-cpus\)"):
        check_local_resources(scn(client_cpus=1.5, ray_num_cpus=1))
    with pytest.raises(CoordinatorError, match="client-gpus must be 0 on a machine without a CUDA GPU"):
        check_local_resources(scn(client_gpus=1.0))
    check_local_resources(scn(client_cpus=2.0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check_local_resources(scn(client_gpus=0.5))
    # Flower starts CPUs / client-cpus actors, whatever the client count: 0.001 started 2000 processes on 2 CPUs
    # (the run hung); ray-num-cpus = 64 on 2 cores ran 64 actors in turns (137 s for a 15 s run)
    with pytest.raises(CoordinatorError, match=r"client-cpus must be >= 0.25: Flower would start 2000 client actors"):
        check_local_resources(scn(client_cpus=0.001))
    with pytest.raises(CoordinatorError, match=r"ray-num-cpus must be <= this machine's 2 CPUs"):
        check_local_resources(scn(ray_num_cpus=64))
    check_local_resources(scn(client_cpus=0.25))


@pytest.mark.parametrize("engine", ["inprocess", "virtual"])
def test_a_resumed_local_dp_simulation_goes_on_with_the_clients_epsilon(tmp_path, engine):
    """The simulated clients' ledgers lived in their in-memory node state only: after a resume their
    epsilon started again from the first round's (3.44, 3.44 instead of 3.44, 4.22)."""
    import csv

    import simulations.runner as runner
    from coordinator import RunConfig
    from simulations.scenario import Scenario, SimulationSettings

    def scn(rounds):
        run = RunConfig.from_mapping({"num-rounds": rounds, "min-nodes": 2, "task": "digits", "seed": 0, "local-epochs": 1,
                                      "dp": "local", "local-noise-multiplier": 1.0})
        return Scenario(sim=SimulationSettings(name="t", engine=engine, num_supernodes=3), run=run)

    def eps(d):
        return [float(r["local_epsilon_max"]) for r in csv.DictReader(open(d / "metrics.csv"))]

    runner.run_scenario(scn(2), tmp_path / "straight", show_progress=False)
    runner.run_scenario(scn(1), tmp_path / "resumed", show_progress=False)
    runner.run_scenario(scn(2), tmp_path / "resumed", show_progress=False)
    assert eps(tmp_path / "straight")[0] < eps(tmp_path / "straight")[1]
    assert eps(tmp_path / "resumed") == pytest.approx(eps(tmp_path / "straight"), rel=1e-12)
    ledgers = list((tmp_path / "resumed" / "clients").glob("partition-*/local-dp-ledger-*.json"))
    assert len(ledgers) == 3 if engine == "inprocess" else 1 <= len(ledgers) <= 3  # (virtual: a node may be offline)


def test_a_local_dp_run_is_not_resumed_on_flowers_engine(tmp_path):
    import simulations.runner as runner
    from coordinator import RunConfig
    from simulations.scenario import Scenario, SimulationSettings

    run = RunConfig.from_mapping({"num-rounds": 1, "min-nodes": 2, "task": "digits", "seed": 0, "local-epochs": 1,
                                  "dp": "local", "local-noise-multiplier": 1.0})
    runner.run_scenario(Scenario(sim=SimulationSettings(name="t", engine="inprocess", num_supernodes=3), run=run),
                        tmp_path / "r", show_progress=False)
    flower = Scenario(sim=SimulationSettings(name="t", engine="flower", num_supernodes=3), run=run.replace(num_rounds=2))
    with pytest.raises(CoordinatorError, match="start their epsilon again at zero. Resume it with --engine inprocess"):
        runner.run_scenario(flower, tmp_path / "r", show_progress=False)
    assert (tmp_path / "r" / "checkpoint.pt").is_file()


def test_a_local_dp_run_without_its_ledgers_is_not_resumed_on_any_engine(tmp_path):
    """As a run that ran on Flower's engine (ledgers in memory only) is left: the refusal above advised
    --engine inprocess, which then resumed with every client's epsilon back at zero (8.98, 8.98 instead
    of 8.98, 12.66: a README walkthrough)."""
    import shutil

    import simulations.runner as runner
    from coordinator import RunConfig
    from simulations.scenario import Scenario, SimulationSettings

    run = RunConfig.from_mapping({"num-rounds": 1, "min-nodes": 2, "task": "digits", "seed": 0, "local-epochs": 1,
                                  "dp": "local", "local-noise-multiplier": 1.0})
    runner.run_scenario(Scenario(sim=SimulationSettings(name="t", engine="inprocess", num_supernodes=3), run=run),
                        tmp_path / "r", show_progress=False)
    shutil.rmtree(tmp_path / "r" / "clients")
    for engine in ("inprocess", "virtual"):
        later = Scenario(sim=SimulationSettings(name="t", engine=engine, num_supernodes=3), run=run.replace(num_rounds=2))
        with pytest.raises(CoordinatorError, match="holds a local-DP run without its clients' privacy ledgers"):
            runner.run_scenario(later, tmp_path / "r", show_progress=False)


@pytest.mark.parametrize(("raised", "becomes"), [(SystemExit(signal.SIGTERM), KeyboardInterrupt),
                                                 (SystemExit(3), SystemExit)])
def test_rays_sigterm_exit_is_an_interrupt_even_before_the_watcher_saw_the_signal(monkeypatch, raised, becomes):
    """Ray's handler (set in ray.init) is sys.exit(SIGTERM): its SystemExit could reach the main thread
    before the watcher thread had read the signal, and the run ended with status 15 and no message."""
    import flwr.simulation

    import simulations.runner as runner
    from coordinator import RunConfig
    from simulations.scenario import Scenario, SimulationSettings

    def exits(**kwargs):
        raise raised

    monkeypatch.setattr(flwr.simulation, "run_simulation", exits)
    scn = Scenario(sim=SimulationSettings(name="t", engine="flower", num_supernodes=2),
                   run=RunConfig.from_mapping({"num-rounds": 1, "min-nodes": 2}))
    with pytest.raises(becomes):
        runner.run_flower_engine(scn, None)


def test_ray_num_cpus_is_refused_when_the_run_joins_a_cluster(monkeypatch):
    """Ray refuses num_cpus when connecting to a cluster: it was a traceback from inside Flower's engine (a review)."""
    from coordinator import CoordinatorError, RunConfig
    from simulations.runner import check_ray_cluster
    from simulations.scenario import Scenario, SimulationSettings

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    sim = SimulationSettings(name="t", num_supernodes=3, engine="flower", ray_num_cpus=2, ray_address="127.0.0.1:1")
    with pytest.raises(CoordinatorError, match=r"ray-num-cpus must be 0 when the run joins a Ray cluster \(ray-address"):
        check_ray_cluster(Scenario(sim=sim, run=RunConfig.from_mapping({})))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    sim = SimulationSettings(name="t", num_supernodes=3, engine="flower", ray_num_cpus=2)
    with pytest.raises(CoordinatorError, match=r"joins a Ray cluster \(RAY_ADDRESS is set"):
        check_ray_cluster(Scenario(sim=sim, run=RunConfig.from_mapping({})))


def test_flowers_engine_without_ray_is_one_line_before_a_run_dir_is_made(tmp_path, monkeypatch, capsys):
    from simulations.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # as on a base install: `import ray` fails
    assert main(["simulate", "--engine", "flower", "--rounds", "1", "--run-dir", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedshield: error: simulation.engine 'flower'"), err
    assert "pip install 'fedshield[simulation]'" in err[0] and "--engine inprocess" in err[0]
    assert not (tmp_path / "r").exists()


_NO_RAY = """
import sys
sys.modules["ray"] = None  # `import ray` raises ImportError, as where the simulation extra is not installed
import importlib.metadata as md
for ep in md.entry_points(group="console_scripts"):  # what flower-supernode and flower-superlink load
    if ep.name in ("flower-supernode", "flower-superlink"):
        ep.load()
import clients.client_app, clients.cli, coordinator.server_app, coordinator.service
from simulations.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(300)
def test_the_agent_the_coordinator_and_the_inprocess_engine_need_no_ray(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _NO_RAY, "simulate", "--engine", "inprocess", "--rounds", "1",
                           "--set", "simulation.num-supernodes=3", "--set", "run.min-nodes=3",
                           "--run-dir", str(tmp_path / "r"), "--quiet"],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after 1 rounds" in proc.stdout and (tmp_path / "r" / "summary.json").is_file()


def test_ray_shards_are_checked_before_a_run_dir_is_made(tmp_path, monkeypatch, capsys):
    """batched-shards takes Flower's engine's checks: Ray installed, ray-num-cpus within the machine, a cluster's
    ray-num-cpus refused (Ray refuses num_cpus when joining)."""
    from coordinator import CoordinatorError, RunConfig
    from simulations.cli import main
    from simulations.runner import check_ray_cluster
    from simulations.scenario import Scenario, SimulationSettings

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    run = RunConfig.from_mapping({})
    over = SimulationSettings(name="t", num_supernodes=3, engine="inprocess", batched_shards=2,
                              ray_num_cpus=(os.cpu_count() or 1) + 1)
    with pytest.raises(CoordinatorError, match="ray-num-cpus must be <= this machine's"):
        check_ray_cluster(Scenario(sim=over, run=run))
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    joining = SimulationSettings(name="t", num_supernodes=3, engine="inprocess", batched_shards=2, ray_num_cpus=2)
    with pytest.raises(CoordinatorError, match=r"joins a Ray cluster \(RAY_ADDRESS is set"):
        check_ray_cluster(Scenario(sim=joining, run=run))
    monkeypatch.delenv("RAY_ADDRESS")
    monkeypatch.setitem(sys.modules, "ray", None)  # as on a base install: `import ray` fails
    assert main(["simulate", "--engine", "inprocess", "--set", "simulation.batched-shards=2", "--rounds", "1",
                 "--run-dir", str(tmp_path / "r"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedshield: error: simulation.batched-shards runs"), err
    assert "pip install 'fedshield[simulation]'" in err[0] and not (tmp_path / "r").exists()


def test_ray_is_shut_down_only_after_the_calls_in_flight_return_and_later_messages_touch_no_ray(monkeypatch):
    """A Flower worker thread still waiting on an actor when the run stops: Ray's shutdown waits for it (a call
    into Ray after the shutdown ended the process, exit 1); a message handed over after that is refused."""
    import ray
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    from flwr.app import Message, RecordDict

    from simulations.runner import _ray_shutdown_after_its_calls

    events: list[str] = []
    release = threading.Event()

    class Pool:
        def submit(self, fn, job):
            events.append("submit")
            return "future"

        def fetch_result_and_return_actor_to_pool(self, future):
            release.wait(10)
            events.append("fetched")
            return "reply", "context"

        def terminate_all_actors(self):
            events.append("actors terminated")

    monkeypatch.setattr(ray, "shutdown", lambda: events.append("ray shutdown"))
    backend = RayBackend.__new__(RayBackend)
    backend.pool, backend.app_fn = Pool(), lambda: None
    context = SimpleNamespace(node_config={"partition-id": 0})
    with _ray_shutdown_after_its_calls(timeout=10):
        worker = threading.Thread(target=backend.process_message, args=(object(), context))
        worker.start()
        while "submit" not in events:
            time.sleep(0.01)
        stopper = threading.Thread(target=backend.terminate)
        stopper.start()
        stopper.join(0.3)
        assert stopper.is_alive() and "ray shutdown" not in events  # waiting on the call in flight
        release.set()
        stopper.join(10)
        worker.join(10)
        late = Message(RecordDict(), dst_node_id=7, message_type="train")
        late.metadata.__dict__["_message_id"] = "m1"
        reply, same = backend.process_message(late, context)  # an error reply, no exception (Flower logs those)
        assert same is context and reply.has_error() and reply.error.reason == "the simulation is stopping"
        assert reply.metadata.reply_to_message_id == "m1"
    assert events == ["submit", "fetched", "actors terminated", "ray shutdown"]
    assert RayBackend.process_message.__qualname__ == "RayBackend.process_message"  # Flower's own again
    assert RayBackend.terminate.__qualname__ == "RayBackend.terminate"
