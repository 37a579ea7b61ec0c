"""Shared fixtures: CPU only, quiet Flower, TaskIdentity for building messages."""

from __future__ import annotations

import os

os.environ.setdefault("FEDSHIELD_DEVICE", "cpu")
os.environ.setdefault("FEDSHIELD_TORCH_THREADS", "1")
if "FEDSHIELD_AGENT_STATE_DIR" not in os.environ:  # agents started by tests keep their ledgers here, not in ~
    import tempfile

    os.environ["FEDSHIELD_AGENT_STATE_DIR"] = tempfile.mkdtemp(prefix="fedshield-agent-state-")

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


def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``--dist loadgroup``): the tests that start real Flower processes (integration tests,
    two benchmark smoke runs) run one after another on one worker, with the machine's other core for the rest
    beside them; two of them at once on 2 cores would starve each other's process starts."""
    for item in items:
        if item.get_closest_marker("integration") or item.nodeid.endswith(_PROCESS_BENCHMARKS):
            item.add_marker(pytest.mark.xdist_group("processes"))
