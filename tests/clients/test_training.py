"""Local training: load_flat copies, SGD learns, evaluate is exact."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from torch import nn

from aggregation import array_to_tensor, tensor_to_array
from clients import TaskSpec, TrainSettings
from clients.tasks import Dataset, DigitsTask
from clients.training import evaluate, flat_params, load_flat, train_local


@pytest.fixture(scope="module")
def task():
    return DigitsTask(TaskSpec(partitioning="iid"))


def _model(task, seed=0):
    model = task.build_model()
    load_flat(model, task.init_weights(seed))
    return model


def test_load_flat_sets_parameters_in_order(task):
    model = task.build_model()
    flat = torch.arange(task.init_weights(0).numel(), dtype=torch.float32)
    load_flat(model, flat)
    assert torch.equal(flat_params(model), flat)
    first = next(model.parameters())
    assert torch.equal(first.reshape(-1), flat[: first.numel()])


def test_load_flat_copies_the_source(task):
    model = task.build_model()
    flat = task.init_weights(1)
    original = flat.clone()
    load_flat(model, flat)
    flat.add_(1.0)
    assert torch.equal(flat_params(model), original)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.0)
    assert not torch.equal(flat, torch.zeros_like(flat)), "model writes must not reach the source"


def test_load_flat_from_received_bytes_never_writes_into_them(task):
    weights = task.init_weights(2)
    array = tensor_to_array(weights)
    view = array_to_tensor(array, "float32", weights.numel())  # torch.frombuffer over the bytes
    digest = hashlib.sha256(array.data).digest()
    model = task.build_model()
    load_flat(model, view)
    assert torch.equal(flat_params(model), weights)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(5.0)
    assert hashlib.sha256(array.data).digest() == digest
    assert torch.equal(view, weights)


def test_load_flat_from_raw_frombuffer(task):
    weights = task.init_weights(3)
    raw = weights.numpy().tobytes()
    view = torch.frombuffer(bytearray(raw), dtype=torch.float32)
    model = task.build_model()
    load_flat(model, view)
    view.zero_()
    assert torch.equal(flat_params(model), weights)


@pytest.mark.parametrize("delta", [-1, 1])
def test_load_flat_rejects_wrong_length(task, delta):
    n = task.init_weights(0).numel()
    with pytest.raises(ValueError, match=f"must have {n} elements. Found {n + delta}"):
        load_flat(task.build_model(), torch.zeros(n + delta))


def test_train_local_lowers_loss(task):
    data = task.partition(0, 5)
    model = _model(task)
    acc0, loss0 = evaluate(model, data)
    out = train_local(model, data, TrainSettings(local_epochs=3, batch_size=16, lr=0.1, momentum=0.9),
                      torch.Generator().manual_seed(0))
    acc1, loss1 = evaluate(model, data)
    assert set(out) == {"train-loss", "train-time-s"}
    assert np.isfinite(out["train-loss"]) and out["train-loss"] > 0
    assert loss1 < 0.5 * loss0
    assert acc1 > 0.85 and acc1 > acc0
    # generalises to the held-out split, too
    assert evaluate(model, task.test_set)[0] > 0.7


def test_train_local_is_deterministic_given_generator(task):
    data = task.partition(1, 5)
    settings = TrainSettings(local_epochs=1, batch_size=32, lr=0.05, momentum=0.5)
    a, b = _model(task, 4), _model(task, 4)
    la = train_local(a, data, settings, torch.Generator().manual_seed(9))["train-loss"]
    lb = train_local(b, data, settings, torch.Generator().manual_seed(9))["train-loss"]
    assert la == lb
    assert torch.equal(flat_params(a), flat_params(b))
    c = _model(task, 4)
    train_local(c, data, settings, torch.Generator().manual_seed(10))
    assert not torch.equal(flat_params(a), flat_params(c))


def test_evaluate_accuracy_in_unit_interval(task):
    acc, loss = evaluate(_model(task), task.test_set)
    assert 0.0 <= acc <= 1.0
    assert loss > 0 and np.isfinite(loss)


@pytest.mark.parametrize("batch_size", [1, 7, 1024])
def test_evaluate_is_exact_for_a_constant_classifier(batch_size):
    y = np.array([3, 3, 1, 3, 0, 9, 3], dtype=np.int64)
    data = Dataset(np.random.default_rng(0).random((7, 4)).astype(np.float32), y)
    model = nn.Linear(4, 10)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
        model.bias[3] = 2.0
    acc, loss = evaluate(model, data, batch_size=batch_size)
    assert acc == pytest.approx(4 / 7)
    logits = torch.zeros(7, 10)
    logits[:, 3] = 2.0
    ref = nn.functional.cross_entropy(logits, torch.from_numpy(y)).item()
    assert loss == pytest.approx(ref, rel=1e-6)
