"""scikit-learn's digits: 1,797 real 8x8 grey images of 10 digits, shipped in the wheel."""

from __future__ import annotations

import numpy as np
from torch import nn

from .base import Dataset, Task

TEST_FRACTION = 0.2


def stratified_split(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[Dataset, Dataset]:
    """A fixed, stratified train/test split (``TEST_FRACTION`` held out)."""
    from sklearn.model_selection import train_test_split

    xtr, xte, ytr, yte = train_test_split(x, y, test_size=TEST_FRACTION, stratify=y, random_state=seed)
    return Dataset(xtr, ytr), Dataset(xte, yte)


class DigitsTask(Task):
    name = "digits"
    input_dim = 64
    input_shape = (64,)
    target_shape = ()
    num_classes = 10

    def load_data(self) -> tuple[Dataset, Dataset]:
        from sklearn.datasets import load_digits

        raw = load_digits()
        x = (raw.data / 16.0).astype(np.float32)
        y = raw.target.astype(np.int64)
        return stratified_split(x, y, self.spec.data_seed)

    def build_model(self) -> nn.Module:
        h = self.spec.hidden_units
        return nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
