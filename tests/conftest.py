"""Shared fixtures: CPU only, quiet Flower, TaskIdentity for building messages."""

from __future__ import annotations

import os

os.environ.setdefault("FEDSHIELD_DEVICE", "cpu")
os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")
if "FEDSHIELD_AGENT_STATE_DIR" not in os.environ:  # agents started by tests keep their ledgers here, not in ~
    import atexit
    import shutil
    import tempfile

    os.environ["FEDSHIELD_AGENT_STATE_DIR"] = tempfile.mkdtemp(prefix="fedshield-agent-state-")
    # removed when the run that made it ends (the xdist workers inherit it): runs left one each in /tmp
    atexit.register(shutil.rmtree, os.environ["FEDSHIELD_AGENT_STATE_DIR"], True)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# A loaded 2-core CI machine makes generation slow; that is not a failure of the code under test.
settings.register_profile("fedshield", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                 HealthCheck.data_too_large])
settings.load_profile("fedshield")


@pytest.fixture(autouse=True, scope="session")
def _poison_fresh_sums() -> None:
    """Fresh CPU sums start as NaN: every path must zero one before adding into it."""
    from aggregation import accumulator

    accumulator.POISON_FRESH = True


@pytest.fixture(autouse=True, scope="session")
def _task_identity() -> None:
    from simulations.inprocess import ensure_task_identity

    ensure_task_identity()


# benchmark smoke runs that start Flower processes (a coordinator, agents, a SuperLink); the others are one
# Python process each, as a unit test is
_PROCESS_BENCHMARKS = ("[deployment]", "[node_emulator]", "test_simulation_scale_times_flowers_ray_engine_on_the_same_clients")


def _cost(item: pytest.Item) -> int:
    """0: slow (tens of seconds to minutes), 1: starts real processes, 2: the rest."""
    if item.get_closest_marker("slow"):
        return 0
    return 1 if item.get_closest_marker("integration") or item.nodeid.endswith(_PROCESS_BENCHMARKS) else 2


def pytest_collection_modifyitems(config, items) -> None:
    """The longest tests first, so that the two pytest-xdist workers (``--dist load --maxschedchunk 1``: one test at a time to whichever is free) end together
    instead of one finishing a long test alone. Two process-starting tests may run at once: their waits are
    sized for that (pytest-xdist's ``loadgroup``, which would keep them apart, is a no-op under pytest 9.2,
    and one after another they would take ~15 minutes)."""
    items.sort(key=_cost)  # stable: file order within each class


@pytest.fixture(autouse=True)
def _flower_log_level():
    """Each test starts with Flower's logger at the level it had: ``fedshield simulate`` run in process quiets it to
    WARNING, and a test after it in the same worker then missed the INFO lines it checks (which tests share a
    worker changes with the suite)."""
    import logging

    logger = logging.getLogger("flwr")
    level = logger.level
    yield
    logger.setLevel(level)
