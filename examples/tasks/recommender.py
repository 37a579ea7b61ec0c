"""A recommender: matrix factorisation of generated ratings, each client holding its own users' ratings.

Users and items have hidden tastes (rank 4); a rating is 3.5 plus a user's and an item's bias plus their tastes'
dot product, plus noise, clipped to [1, 5]. The model learns an embedding and a bias per user and per item, with
sparse gradients (a batch touches a few rows of each table), by the default loop (SGD with momentum), and reports
its own metrics (rmse, mae) instead of an accuracy. Its inputs are named (``Dataset.x`` a dict: a rating's user and
item ids), which the model's forward takes as keyword arguments. Each simulated client holds the ratings of its own
users (``client_data``), as each device would. Run it: fedshield simulate examples/scenarios/recommender.toml
"""

import numpy as np
import torch
from torch import nn

from clients import ConfigError, Dataset, Task

USERS, ITEMS, RANK, DIM, RATINGS = 400, 200, 4, 8, 24_000


class Factorisation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users, self.items = nn.Embedding(USERS, DIM, sparse=True), nn.Embedding(ITEMS, DIM, sparse=True)
        self.user_bias, self.item_bias = nn.Embedding(USERS, 1, sparse=True), nn.Embedding(ITEMS, 1, sparse=True)
        for table in (self.users, self.items):
            nn.init.normal_(table.weight, 0.0, 0.1)
        for bias in (self.user_bias, self.item_bias):
            nn.init.zeros_(bias.weight)

    def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:  # (n,) ids each: the named inputs
        return (3.5 + (self.users(user) * self.items(item)).sum(1) + self.user_bias(user)[:, 0]
                + self.item_bias(item)[:, 0])


class Recommender(Task):
    num_classes = None  # a regression: no labels, no accuracy
    y_dtype = "float32"  # (named inputs are cast by kind: the ids to int64)
    input_shape, target_shape = {"user": (), "item": ()}, ()

    def build_model(self) -> nn.Module:
        return Factorisation()

    def load_data(self) -> tuple[Dataset, Dataset]:
        rng = np.random.default_rng(1234)  # the tastes are fixed; which ratings are seen is seeded
        tastes_u, tastes_i = rng.normal(0, 0.6, (USERS, RANK)), rng.normal(0, 0.6, (ITEMS, RANK))
        bias_u, bias_i = rng.normal(0, 0.3, USERS), rng.normal(0, 0.3, ITEMS)
        seen = np.random.default_rng(self.spec.data_seed)
        u, i = seen.integers(0, USERS, RATINGS), seen.integers(0, ITEMS, RATINGS)
        y = 3.5 + bias_u[u] + bias_i[i] + (tastes_u[u] * tastes_i[i]).sum(1)
        y = np.clip(y + seen.normal(0, 0.25, RATINGS), 1, 5).astype(np.float32)
        cut = int(RATINGS * 0.9)
        ratings = Dataset({"user": u, "item": i}, y)
        return ratings.take(slice(0, cut)), ratings.take(slice(cut, None))

    def client_data(self, partition_id: int, num_partitions: int) -> Dataset:
        if not 0 <= partition_id < num_partitions <= USERS:  # each client holds one user at least
            raise ConfigError(f"partitions must number 1 to {USERS} (the users), and the id lie below them. Found "
                              f"partition {partition_id} of {num_partitions}.")
        train = self.train_set  # a client's users: those whose id falls to it
        return train.take(train.x["user"] % num_partitions == partition_id)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        err = output - target
        return {"rmse": float(err.pow(2).mean().sqrt()), "mae": float(err.abs().mean())}
