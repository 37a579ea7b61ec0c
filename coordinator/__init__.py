"""fedshield's coordinator: ServerApp, round workflows, checkpoints, service CLI."""

# The packages this one imports modules of, imported whole first (see clients/__init__.py: two threads importing
# the apps at once must take the packages' import locks in one order).
from importlib import import_module as _import

for _package in ("aggregation", "clients", "privacy"):
    _import(_package)

from ._errors import CoordinatorError
from .async_workflow import BufferedAsyncWorkflow
from .config import RunConfig, ServerSettings
from .profiles import ProfileRegistry, select_fast_fair, select_uniform
from .rundir import RunDirectory
from .validation import RejectedReply, RoundExpectation, validate_reply
from .workflow import Clock, SyncWorkflow, WallClock

__all__ = [
    "BufferedAsyncWorkflow",
    "Clock",
    "CoordinatorError",
    "ProfileRegistry",
    "RejectedReply",
    "RoundExpectation",
    "RunConfig",
    "RunDirectory",
    "ServerSettings",
    "SyncWorkflow",
    "WallClock",
    "select_fast_fair",
    "select_uniform",
    "validate_reply",
]
