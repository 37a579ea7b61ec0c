"""simulations.runner.ctrl_c_sets: Ctrl-C stops a Flower-engine run whichever thread it lands on."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from simulations.runner import ctrl_c_sets


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
