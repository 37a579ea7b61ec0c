"""The task interface: a model and a data set with a fixed held-out split."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import nn

from .._errors import ClientError
from ..config import TaskSpec
from ..partition import dirichlet_partition, iid_partition


@dataclass(frozen=True)
class Dataset:
    x: np.ndarray  # float32, (n, input_dim)
    y: np.ndarray  # int64, (n,)

    def __len__(self) -> int:
        return len(self.y)


class Task(ABC):
    """A learning task. Subclasses give the data and the model."""

    name: str
    input_dim: int
    num_classes: int

    def __init__(self, spec: TaskSpec) -> None:
        self.spec = spec

    @abstractmethod
    def _load(self) -> tuple[Dataset, Dataset]:
        """(train, test); the test split is fixed by ``spec.data_seed``."""

    @abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (parameters only; no buffers)."""

    def num_parameters(self) -> int:
        """The model's parameter count, from a model built on torch's meta device (allocating nothing: a
        message or config asking for a huge model is measured before anything of that size exists)."""
        with torch.device("meta"):
            return sum(p.numel() for p in self.build_model().parameters())

    @cached_property
    def _data(self) -> tuple[Dataset, Dataset]:
        return self._load()

    @property
    def train_set(self) -> Dataset:
        return self._data[0]

    @property
    def test_set(self) -> Dataset:
        return self._data[1]

    def partition(self, partition_id: int, num_partitions: int) -> Dataset:
        """Client ``partition_id``'s share of the training set (deterministic)."""
        if not 0 <= partition_id < num_partitions:
            raise ClientError(f"partition-id must be in [0, {num_partitions}). Found {partition_id}.")
        idx = self._partition_indices(num_partitions)[partition_id]
        return Dataset(self.train_set.x[idx], self.train_set.y[idx])

    def _partition_indices(self, num_partitions: int) -> list[np.ndarray]:
        cache = self.__dict__.setdefault("_parts", {})
        if num_partitions not in cache:
            seed = self.spec.data_seed + 1
            if self.spec.partitioning == "iid":
                cache[num_partitions] = iid_partition(len(self.train_set), num_partitions, seed)
            else:
                cache[num_partitions] = dirichlet_partition(
                    self.train_set.y, num_partitions, self.spec.dirichlet_alpha, seed
                )
        return cache[num_partitions]

    @classmethod
    def check_data(cls, data: Dataset, source: str) -> Dataset:
        """Validate a client's own data against the task's input and label space (a classmethod:
        the agent checks a data file against every task before it starts)."""
        x, y = data.x, data.y
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise ClientError(f"{source}: x must be numeric. Found dtype {x.dtype}.")
        if not np.issubdtype(y.dtype, np.integer):
            raise ClientError(f"{source}: y must hold integer labels. Found dtype {y.dtype}.")
        if x.ndim != 2 or x.shape[1] != cls.input_dim:
            raise ClientError(f"{source}: x must have shape (n, {cls.input_dim}) for task {cls.name}. Found {x.shape}.")
        if y.shape != (x.shape[0],) or len(y) == 0:
            raise ClientError(f"{source}: y must have shape ({x.shape[0]},) and n > 0. Found {y.shape}.")
        if y.min() < 0 or y.max() >= cls.num_classes:  # (integer dtype: checked above)
            raise ClientError(f"{source}: y must hold integer labels in [0, {cls.num_classes}). Found {y.dtype} {y.min()}..{y.max()}.")
        with np.errstate(over="ignore"):  # the overflow is the finding, refused next with its reason
            x32 = x.astype(np.float32, copy=False)  # what training sees: 1e39 in float64 is inf here
        if not np.isfinite(x32).all():
            raise ClientError(f"{source}: x must be finite as float32. Found NaN, inf or |x| > 3.4e38.")
        return Dataset(x32, y.astype(np.int64, copy=False))

    def init_weights(self, seed: int) -> torch.Tensor:
        """The initial global model as one flat float32 tensor (seeded)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.build_model()
        return torch.nn.utils.parameters_to_vector(model.parameters()).detach().float()
