"""fedshield's coordinator: ServerApp, round workflows, checkpoints, service CLI."""

from ._errors import CoordinatorError
from .async_workflow import BufferedAsyncWorkflow
from .config import RunConfig, ServerSettings
from .rundir import RunDirectory
from .validation import RejectedReply, RoundExpectation, validate_reply
from .workflow import Clock, SyncWorkflow, WallClock

__all__ = [
    "BufferedAsyncWorkflow",
    "Clock",
    "CoordinatorError",
    "RejectedReply",
    "RoundExpectation",
    "RunConfig",
    "RunDirectory",
    "ServerSettings",
    "SyncWorkflow",
    "WallClock",
    "validate_reply",
]
