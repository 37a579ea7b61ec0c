"""Server optimizers: the registry contract and FedAvg's step."""

from __future__ import annotations

import copy

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aggregation.optimizers as optimizers
from aggregation import (
    AggregationError,
    FedAvg,
    ServerOptimizer,
    available_server_optimizers,
    create_server_optimizer,
    register_server_optimizer,
)


@pytest.fixture
def registry(monkeypatch):
    """A private copy of the registry, so tests may register names freely."""
    reg = copy.copy(optimizers._REGISTRY)
    monkeypatch.setattr(optimizers, "_REGISTRY", reg)
    return reg


def test_fedavg_is_registered_and_created_by_name():
    assert "fedavg" in available_server_optimizers()
    assert available_server_optimizers() == sorted(available_server_optimizers())
    opt = create_server_optimizer("fedavg", lr=0.5)
    assert isinstance(opt, FedAvg) and isinstance(opt, ServerOptimizer)
    assert opt.lr == 0.5


def test_unknown_name_error_lists_the_known_names():
    with pytest.raises(AggregationError) as info:
        create_server_optimizer("fedadamw")
    msg = str(info.value)
    assert "'fedadamw'" in msg
    for name in available_server_optimizers():
        assert repr(name) in msg


def test_registering_a_name_twice_raises(registry):
    @register_server_optimizer("test-only")
    class One(FedAvg):
        pass

    assert registry["test-only"] is One
    with pytest.raises(AggregationError, match=r"must be unique\. Found 'test-only' registered twice"):

        @register_server_optimizer("test-only")
        class Two(FedAvg):
            pass

    assert registry["test-only"] is One
    with pytest.raises(AggregationError, match="registered twice"):
        register_server_optimizer("fedavg")(FedAvg)


def test_registered_class_is_created_with_kwargs(registry):
    @register_server_optimizer("test-scaled")
    class Scaled(ServerOptimizer):
        def __init__(self, factor: float = 1.0) -> None:
            self.factor = factor

        def step(self, weights, delta):
            return weights + self.factor * delta

    assert "test-scaled" in available_server_optimizers()
    opt = create_server_optimizer("test-scaled", factor=3.0)
    assert isinstance(opt, Scaled) and opt.factor == 3.0
    assert opt.state_dict() == {}
    opt.load_state_dict({})


def test_server_optimizer_is_abstract():
    with pytest.raises(TypeError):
        ServerOptimizer()  # type: ignore[abstract]


@settings(max_examples=50, deadline=None)
@given(
    data=st.integers(1, 40).flatmap(
        lambda n: st.tuples(
            hnp.arrays(np.float32, n, elements=st.floats(-1e3, 1e3, width=32)),
            hnp.arrays(np.float32, n, elements=st.floats(-1e3, 1e3, width=32)),
        )
    ),
    lr=st.floats(1e-3, 10.0),
)
def test_fedavg_step_is_w_plus_lr_delta(data, lr):
    w, d = data
    ref = w.astype(np.float64) + lr * d.astype(np.float64)
    out = FedAvg(lr=lr).step(torch.from_numpy(w.copy()), torch.from_numpy(d.copy()))
    assert out.dtype == torch.float32 and out.shape == (len(w),)
    # float32: rounding of lr, lr*delta and the sum, each <= eps relative
    eps = np.finfo(np.float32).eps
    tol = 4 * eps * (np.abs(w) + lr * np.abs(d)) + 1e-30
    assert (np.abs(out.double().numpy() - ref) <= tol).all()


def test_fedavg_default_lr_is_one_and_delta_dtype_follows_weights():
    w = torch.tensor([1.0, 2.0, 3.0])
    d = torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64)
    out = FedAvg().step(w, d)
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([1.5, 1.0, 3.25]))
    assert torch.equal(d, torch.tensor([0.5, -1.0, 0.25], dtype=torch.float64))  # delta untouched


def test_fedavg_ignores_unknown_kwargs_and_has_empty_state():
    opt = FedAvg(lr=2.0, momentum=0.9)
    assert opt.lr == 2.0
    assert opt.state_dict() == {}


@pytest.mark.parametrize("lr", [0, 0.0, -1.0, -1e-9, math.nan, "1", None])
def test_fedavg_rejects_bad_lr(lr):
    with pytest.raises(AggregationError, match=r"server-lr must be > 0\. Found"):
        FedAvg(lr=lr)
    with pytest.raises(AggregationError, match=r"server-lr must be > 0\. Found"):
        create_server_optimizer("fedavg", lr=lr)


def test_fedavg_rejects_infinite_lr():
    with pytest.raises(AggregationError, match="server-lr"):
        FedAvg(lr=math.inf)
