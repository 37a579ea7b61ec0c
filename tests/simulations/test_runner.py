"""simulations.runner: Ctrl-C stops a Flower-engine run whichever thread it lands on (ctrl_c_sets);
a Ray address no cluster answers at is one clear error before any round (check_ray_address); a
finished run directory is returned without starting an engine (run_scenario)."""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
import time

import pytest

from coordinator import CoordinatorError
from simulations.runner import check_ray_address, ctrl_c_sets


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
    worker = threading.Thread(target=stop.wait, args=(20,))
    with ctrl_c_sets(stop) as interrupted:
        worker.start()
        threading.Timer(0.3, signal.pthread_kill, (worker.ident, signal.SIGINT)).start()
        started = time.monotonic()
        worker.join()
        waited = time.monotonic() - started
    assert stop.is_set() and interrupted()
    assert waited < 15  # not a timing claim: the alternative is the worker's 20 s timeout
    assert signal.set_wakeup_fd(-1) == -1  # the previous wakeup fd (none) was restored


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
