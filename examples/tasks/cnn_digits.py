"""A user's task in ~20 lines: a CNN with BatchNorm on scikit-learn's digits as 1x8x8 images.

Run it:  fedshield simulate examples/scenarios/cnn-digits.toml
"""

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from clients import Dataset, Task


class CnnDigits(Task):
    num_classes = 10  # labels are checked against it; loss (cross-entropy) and accuracy are the defaults

    def build_model(self) -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
        )

    def load_data(self) -> tuple[Dataset, Dataset]:
        digits = load_digits()
        x = (digits.images / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8)
        xtr, xte, ytr, yte = train_test_split(x, digits.target, test_size=0.2, stratify=digits.target,
                                              random_state=self.spec.data_seed)
        return Dataset(xtr, ytr), Dataset(xte, yte)


class CnnDigitsFedBN(CnnDigits):
    """The same CNN with its BatchNorm statistics kept on each client (FedBN, Li et al. 2021)."""

    federate_buffers = False
