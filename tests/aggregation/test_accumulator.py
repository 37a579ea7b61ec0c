"""WeightedAccumulator: equals a float64 reference weighted mean; rejects bad input.

Tolerance (stated once, used below). The accumulator adds ``w_i * x_i`` into a
running sum of dtype ``D`` and divides by ``sum_i w_i`` (a Python float). Each
add rounds at most three times (weight cast, product, sum), each with relative
error ``eps(D)``, so elementwise

    |mean - ref| <= 4 * count * eps(D) * (sum_i w_i |x_i|) / (sum_i w_i) + eps(D) * |ref|

We assert with a factor 2 of headroom over that bound (``_bound``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aggregation import AggregationError, WeightedAccumulator


def _reference(updates: np.ndarray, weights: list[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    return (w[:, None] * updates.astype(np.float64)).sum(0) / w.sum()


def _bound(updates: np.ndarray, weights: list[float], dtype: torch.dtype) -> np.ndarray:
    eps = torch.finfo(dtype).eps
    w = np.asarray(weights, dtype=np.float64)
    scale = (w[:, None] * np.abs(updates.astype(np.float64))).sum(0) / w.sum()
    ref = _reference(updates, weights)
    return 2 * (4 * len(weights) * eps * scale + eps * np.abs(ref)) + 1e-30


@st.composite
def _updates_and_weights(draw):
    count = draw(st.integers(1, 8))
    numel = draw(st.integers(1, 48))
    updates = draw(
        hnp.arrays(np.float32, (count, numel), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False))
    )
    weights = draw(st.lists(st.floats(1e-3, 1e4, allow_nan=False, allow_infinity=False), min_size=count,
                            max_size=count))
    return updates, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@settings(max_examples=60, deadline=None)
@given(data=_updates_and_weights())
def test_mean_equals_float64_reference(dtype, data):
    updates, weights = data
    acc = WeightedAccumulator(updates.shape[1], dtype=dtype)
    for row, w in zip(updates, weights, strict=True):
        acc.add(torch.from_numpy(row.copy()), w)
    out = acc.mean()
    assert out.dtype == dtype
    assert out.shape == (updates.shape[1],)
    assert acc.count == len(weights)
    assert acc.total_weight == pytest.approx(sum(weights), rel=1e-12)
    err = np.abs(out.double().numpy() - _reference(updates, weights))
    assert (err <= _bound(updates, weights, dtype)).all(), err.max()


def test_mean_is_weighted_not_plain():
    acc = WeightedAccumulator(2, dtype=torch.float64)
    acc.add(torch.tensor([1.0, 0.0]), 3.0)
    acc.add(torch.tensor([0.0, 1.0]), 1.0)
    assert torch.equal(acc.mean(), torch.tensor([0.75, 0.25], dtype=torch.float64))


def test_single_update_mean_is_that_update():
    x = torch.tensor([1.5, -2.0, 3.25])
    acc = WeightedAccumulator(3)
    acc.add(x, 7.0)
    assert torch.equal(acc.mean(), x)


def test_add_does_not_modify_update_and_mean_is_a_new_tensor():
    x = torch.tensor([1.0, 2.0, 3.0])
    before = x.clone()
    acc = WeightedAccumulator(3)
    acc.add(x, 2.0)
    assert torch.equal(x, before)
    m = acc.mean()
    m.fill_(100.0)
    assert torch.equal(acc.mean(), before)


def test_other_input_dtypes_are_converted_to_accumulation_dtype():
    acc = WeightedAccumulator(3, dtype=torch.float32)
    acc.add(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), 1.0)
    acc.add(torch.tensor([3, 2, 1], dtype=torch.int64), 1.0)
    assert acc.mean().dtype == torch.float32
    assert torch.equal(acc.mean(), torch.tensor([2.0, 2.0, 2.0]))


def test_float64_option_keeps_precision_float32_would_lose():
    # 1 + 2**-30 is not representable in float32 but is in float64.
    acc = WeightedAccumulator(1, dtype=torch.float64)
    acc.add(torch.tensor([1.0 + 2.0**-30], dtype=torch.float64), 1.0)
    assert acc.mean().dtype == torch.float64
    assert acc.mean().item() == 1.0 + 2.0**-30
    assert acc.device == torch.device("cpu")


@pytest.mark.parametrize("shape", [(4,), (6,), (2, 5), (10, 1), (1, 5), ()])
def test_rejects_wrong_shape(shape):
    acc = WeightedAccumulator(5)
    with pytest.raises(AggregationError, match=r"update must be 1-D of length 5\. Found shape"):
        acc.add(torch.zeros(shape), 1.0)
    assert acc.count == 0 and acc.total_weight == 0.0


@pytest.mark.parametrize("weight", [0.0, -0.0, -1.0, -1e-300, 1e-45, 1e39, math.nan, math.inf, -math.inf])
def test_rejects_non_positive_or_non_finite_weight(weight):
    acc = WeightedAccumulator(3)
    acc.add(torch.ones(3), 1.0)
    with pytest.raises(AggregationError, match=r"weight must be finite and in \[1e-30, 1e\+38\]\. Found"):
        acc.add(torch.full((3,), 5.0), weight)
    # a rejected update leaves no trace
    assert acc.count == 1 and acc.total_weight == 1.0
    assert torch.equal(acc.mean(), torch.ones(3))


def test_mean_with_nothing_added_raises():
    with pytest.raises(AggregationError, match="at least one accepted update"):
        WeightedAccumulator(3).mean()


@pytest.mark.parametrize("numel", [0, -1])
def test_rejects_non_positive_numel(numel):
    with pytest.raises(AggregationError, match=r"numel must be > 0\. Found"):
        WeightedAccumulator(numel)


def test_reset_forgets_everything():
    acc = WeightedAccumulator(2, dtype=torch.float64)
    acc.add(torch.tensor([100.0, 100.0]), 5.0)
    acc.reset()
    assert acc.count == 0 and acc.total_weight == 0.0
    with pytest.raises(AggregationError):
        acc.mean()
    acc.add(torch.tensor([1.0, 3.0]), 1.0)
    acc.add(torch.tensor([3.0, 1.0]), 1.0)
    assert torch.equal(acc.mean(), torch.tensor([2.0, 2.0], dtype=torch.float64))
    assert acc.count == 2 and acc.total_weight == 2.0
