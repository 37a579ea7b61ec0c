"""fedshield's client side: ClientApp, local training, tasks, data, agent CLI."""

# The packages this one imports modules of, imported whole first: Flower's simulation loads the ServerApp and the
# ClientApp in two threads, and importing another package's submodule takes the submodule's import lock before the
# package's, the reverse of the thread that is importing the package: Python's deadlock detector then failed one
# of the apps (_DeadlockError on aggregation._errors, a run with no result). The package first never inverts.
from importlib import import_module as _import

_import("aggregation")

from ._errors import ClientError, ConfigError
from .config import TaskSpec, TrainSettings, build_config
from .protocol import TrainInstruction
from .tasks import Dataset, Task, get_task

__all__ = [
    "ClientError",
    "ConfigError",
    "Dataset",
    "Task",
    "TaskSpec",
    "TrainInstruction",
    "TrainSettings",
    "build_config",
    "get_task",
]
