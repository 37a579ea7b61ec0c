"""A run stopped from outside (Ctrl-C on Flower's simulation engine, whose ServerApp runs in a thread)."""

from __future__ import annotations

import threading

import pytest

from clients.client_app import app
from coordinator import RunConfig, RunDirectory
from coordinator.rundir import CHECKPOINT, SUMMARY
from coordinator.server_app import make_server_app
from coordinator.workflow import RunInterrupted, StoppableClock, SyncWorkflow
from simulations.inprocess import InProcessGrid


class SilentGrid(InProcessGrid):
    """Nodes that take the round's messages and never answer (clients gone, as after Ctrl-C)."""

    def pull_messages(self, message_ids):
        return []


def _cfg(tmp_path, **kw) -> RunConfig:
    return RunConfig.from_mapping({"num-rounds": 3, "min-nodes": 2, "round-timeout": 300.0, "poll-interval": 0.01,
                                   "task": "digits", "run-dir": str(tmp_path / "run"), **kw})


def test_stoppable_clock_sleeps_until_stopped_then_raises():
    stop = threading.Event()
    clock = StoppableClock(stop)
    clock.sleep(0.001)
    stop.set()
    with pytest.raises(RunInterrupted, match="interrupted"):
        clock.sleep(60.0)


@pytest.mark.parametrize("secure", [False, True])
def test_a_stopped_run_ends_within_a_poll_and_saves_nothing_more(tmp_path, secure):
    kw = {"secure-aggregation": "secagg+", "secagg-clip": 10.0, "min-nodes": 3} if secure else {}
    class Recording(StoppableClock):  # the waits the run asks for: none as long as the round timeout
        asked: list[float] = []

        def sleep(self, seconds: float) -> None:
            self.asked.append(seconds)
            super().sleep(seconds)

    stop = threading.Event()
    clock = Recording(stop)
    wf = SyncWorkflow(_cfg(tmp_path, **kw), SilentGrid(app, 3), RunDirectory(tmp_path / "run"), clock=clock)
    threading.Timer(0.3, stop.set).start()
    with pytest.raises(RunInterrupted):
        wf.run()
    assert stop.is_set() and clock.asked and max(clock.asked) <= 1.0, "it must poll, not wait out the round timeout"
    assert wf.round == 0 and not (tmp_path / "run" / CHECKPOINT).exists() and not (tmp_path / "run" / SUMMARY).exists()


def test_server_app_takes_the_stop_event(tmp_path):
    from flwr.app import Context, RecordDict

    stop = threading.Event()
    stop.set()
    server_app = make_server_app(_cfg(tmp_path), stop=stop)
    ctx = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(RunInterrupted):
        server_app(SilentGrid(app, 3), ctx)
