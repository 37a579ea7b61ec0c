"""fedshield's aggregation core: flat-tensor updates on CPU or GPU.

Imports nothing else of fedshield's.
"""

from ._errors import AggregationError
from .accumulator import WeightedAccumulator
from .device import get_device
from .optimizers import (
    FedAvg,
    ServerOptimizer,
    available_server_optimizers,
    create_server_optimizer,
    register_server_optimizer,
)
from .wire import array_to_tensor, tensor_to_array

__all__ = [
    "AggregationError",
    "FedAvg",
    "ServerOptimizer",
    "WeightedAccumulator",
    "array_to_tensor",
    "available_server_optimizers",
    "create_server_optimizer",
    "get_device",
    "register_server_optimizer",
    "tensor_to_array",
]
