"""A recommender: matrix factorisation of generated ratings, each client holding its own users' ratings.

Users and items have hidden tastes (rank 4); a rating is 3.5 plus a user's and an item's bias plus their tastes'
dot product, plus noise, clipped to [1, 5]. The model learns an embedding and a bias per user and per item, with
sparse gradients (a batch touches a few rows of each table), by the default loop (SGD with momentum), and reports
its own metrics (rmse, mae) instead of an accuracy. Each simulated client holds the ratings of its own users
(``client_data``), as each device would. Run it: fedshield simulate examples/scenarios/recommender.toml
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (n, 2) user and item ids
        u, i = x[:, 0], x[:, 1]
        return 3.5 + (self.users(u) * self.items(i)).sum(1) + self.user_bias(u)[:, 0] + self.item_bias(i)[:, 0]


class Recommender(Task):
    num_classes = None  # a regression: no labels, no accuracy
    x_dtype, y_dtype = "int64", "float32"
    input_shape, target_shape = (2,), ()

    def build_model(self) -> nn.Module:
        return Factorisation()

    def load_data(self) -> tuple[Dataset, Dataset]:
        rng = np.random.default_rng(1234)  # the tastes are fixed; which ratings are seen is seeded
        tastes_u, tastes_i = rng.normal(0, 0.6, (USERS, RANK)), rng.normal(0, 0.6, (ITEMS, RANK))
        bias_u, bias_i = rng.normal(0, 0.3, USERS), rng.normal(0, 0.3, ITEMS)
        seen = np.random.default_rng(self.spec.data_seed)
        x = np.stack([seen.integers(0, USERS, RATINGS), seen.integers(0, ITEMS, RATINGS)], 1)
        y = 3.5 + bias_u[x[:, 0]] + bias_i[x[:, 1]] + (tastes_u[x[:, 0]] * tastes_i[x[:, 1]]).sum(1)
        y = np.clip(y + seen.normal(0, 0.25, RATINGS), 1, 5).astype(np.float32)
        cut = int(RATINGS * 0.9)
        return Dataset(x[:cut], y[:cut]), Dataset(x[cut:], y[cut:])

    def client_data(self, partition_id: int, num_partitions: int) -> Dataset:
        if not 0 <= partition_id < num_partitions <= USERS:  # each client holds one user at least
            raise ConfigError(f"partitions must number 1 to {USERS} (the users), and the id lie below them. Found "
                              f"partition {partition_id} of {num_partitions}.")
        train = self.train_set  # a client's users: those whose id falls to it
        mine = train.x[:, 0] % num_partitions == partition_id
        return Dataset(train.x[mine], train.y[mine])

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    def metrics(self, output: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        err = output - target
        return {"rmse": float(err.pow(2).mean().sqrt()), "mae": float(err.abs().mean())}
