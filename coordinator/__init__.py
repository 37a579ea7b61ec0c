"""fedshield's coordinator: ServerApp, round workflows, checkpoints, service CLI."""

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
