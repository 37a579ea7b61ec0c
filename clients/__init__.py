"""fedshield's client side: ClientApp, local training, tasks, data, agent CLI."""

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
