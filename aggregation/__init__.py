"""fedshield's aggregation core: flat-tensor updates on CPU or GPU.

Imports nothing else of fedshield's.
"""

from ._errors import AggregationError, UpdateRejected
from .accumulator import WeightedAccumulator
from .device import get_device
from .optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
    available_server_optimizers,
    create_server_optimizer,
    register_server_optimizer,
)
from .robust import Aggregator, available_aggregators, create_aggregator, register_aggregator
from . import kernels
from .staleness import StalenessFunction, available_staleness_functions, create_staleness, register_staleness
from .wire import array_to_tensor, tensor_to_array

__all__ = [
    "AggregationError",
    "Aggregator",
    "FedAdagrad",
    "FedAdam",
    "FedAvg",
    "FedAvgM",
    "FedYogi",
    "ServerOptimizer",
    "StalenessFunction",
    "UpdateRejected",
    "WeightedAccumulator",
    "array_to_tensor",
    "available_aggregators",
    "available_server_optimizers",
    "available_staleness_functions",
    "create_aggregator",
    "create_server_optimizer",
    "create_staleness",
    "get_device",
    "kernels",
    "register_aggregator",
    "register_server_optimizer",
    "register_staleness",
    "tensor_to_array",
]
