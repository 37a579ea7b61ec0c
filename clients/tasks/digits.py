"""scikit-learn's digits: 1,797 real 8x8 grey images of 10 digits, shipped in the wheel."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
from torch import nn

from .base import Dataset, Task

TEST_FRACTION = 0.2


def stratified_split(x: np.ndarray, y: np.ndarray, seed: int) -> tuple[Dataset, Dataset]:
    """A fixed, stratified train/test split (``TEST_FRACTION`` held out): the very indices of scikit-learn's
    ``train_test_split(x, y, test_size=TEST_FRACTION, stratify=y, random_state=seed)``, without importing
    sklearn (sklearn and scipy were ~70 MB of an agent's worker). tests/clients/test_tasks.py holds them equal."""
    train, test = _stratified_indices(np.asarray(y), seed)
    return Dataset(x[train], y[train]), Dataset(x[test], y[test])


def _stratified_indices(y: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    # sklearn 1.x StratifiedShuffleSplit._iter_indices, one split, the same draws from RandomState(seed)
    n_test = math.ceil(TEST_FRACTION * len(y))
    n_train = len(y) - n_test
    classes, y_indices, counts = np.unique(y, return_inverse=True, return_counts=True)
    if counts.min() < 2 or min(n_train, n_test) < len(classes):
        raise ValueError(f"a stratified split needs 2 examples of each class and {len(classes)} on each side")
    by_class = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = _approximate_mode(counts, n_train, rng)
    t_i = _approximate_mode(counts - n_i, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for i in range(len(classes)):  # per class, not per example
        members = by_class[i].take(rng.permutation(counts[i]), mode="clip")
        train.extend(members[: n_i[i]])
        test.extend(members[n_i[i]: n_i[i] + t_i[i]])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    # sklearn.utils.extmath._approximate_mode: floor the proportional share, hand out the rest by remainder
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    need = int(draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add = min(len(inds), need)
            floored[rng.choice(inds, size=add, replace=False)] += 1
            need -= add
            if need == 0:
                break
    return floored.astype(int)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``load_digits()`` gives them (pixels 0-16, labels), read from the file in its
    wheel without importing sklearn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the digits task needs scikit-learn installed (its wheel ships the data)")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    raw = np.loadtxt(path, delimiter=",")
    return raw[:, :-1], raw[:, -1].astype(int)


class DigitsTask(Task):
    name = "digits"
    input_dim = 64
    input_shape = (64,)
    target_shape = ()
    num_classes = 10

    def load_data(self) -> tuple[Dataset, Dataset]:
        pixels, labels = digits_arrays()
        x = (pixels / 16.0).astype(np.float32)
        y = labels.astype(np.int64)
        return stratified_split(x, y, self.spec.data_seed)

    def build_model(self) -> nn.Module:
        h = self.spec.hidden_units
        return nn.Sequential(nn.Linear(64, h), nn.ReLU(), nn.Linear(h, 10))
