"""Staleness functions: known values, 1 at s = 0, non-increasing, always in (0, 1], bad input raises."""

from __future__ import annotations

import copy

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import aggregation.staleness as staleness
from aggregation import (
    AggregationError,
    StalenessFunction,
    available_staleness_functions,
    create_staleness,
    register_staleness,
)

FUNCTIONS = st.one_of(
    st.just(("constant", {})),
    st.builds(lambda a: ("polynomial", {"a": a}), st.floats(0, 50)),
    st.builds(lambda a, b: ("hinge", {"a": a, "b": b}), st.floats(1e-6, 1e6), st.floats(0, 100)),
)


@pytest.mark.parametrize(("name", "params", "values"), [
    ("constant", {}, {0: 1.0, 1: 1.0, 10**6: 1.0}),
    ("polynomial", {}, {0: 1.0, 3: 0.5, 8: 1 / 3}),  # a = 0.5 by default
    ("polynomial", {"a": 1.0}, {0: 1.0, 1: 0.5, 9: 0.1}),
    ("polynomial", {"a": 0.0}, {0: 1.0, 10**9: 1.0}),
    ("hinge", {}, {0: 1.0, 4: 1.0, 5: 1 / 11, 6: 1 / 21}),  # a = 10, b = 4 by default
    ("hinge", {"a": 0.5, "b": 0}, {0: 1.0, 1: 1 / 1.5, 4: 1 / 3}),
    ("hinge", {"a": 2.0, "b": 2.5}, {2: 1.0, 3: 0.5, 5: 1 / 6}),
])
def test_known_values(name, params, values):
    fn = create_staleness(name, **params)
    assert isinstance(fn, StalenessFunction) and fn.name == name
    for s, expected in values.items():
        assert fn(s) == pytest.approx(expected, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(spec=FUNCTIONS, steps=st.lists(st.integers(0, 10**4), min_size=1, max_size=20))
def test_one_at_zero_non_increasing_and_in_unit_interval(spec, steps):
    fn = create_staleness(spec[0], **spec[1])
    assert fn(0) == 1.0
    s, prev = 0, 1.0
    for step in steps:
        s += step
        value = fn(s)
        assert 0.0 < value <= prev <= 1.0
        prev = value


@pytest.mark.parametrize(("name", "params"), [("polynomial", {"a": 1e6}), ("hinge", {"a": 1e300, "b": 0}),
                                              ("polynomial", {"a": 2.0}), ("hinge", {"a": 1.0, "b": 1.0})])
def test_never_zero_even_far_out(name, params):
    fn = create_staleness(name, **params)
    for s in (10**6, 10**300, 10**400):
        assert 0.0 < fn(s) <= 1.0
    assert fn(10**400) <= fn(10**300) <= fn(10**6)


def test_numpy_integers_are_accepted():
    assert create_staleness("polynomial", a=1.0)(np.int64(3)) == 0.25


@pytest.mark.parametrize("s", [-1, -(10**9), 1.0, 0.5, math.nan, True, None, "1", np.float64(2.0)])
def test_bad_staleness_raises(s):
    for name in available_staleness_functions():
        with pytest.raises(AggregationError, match=r"staleness must be an int >= 0\. Found"):
            create_staleness(name)(s)


@pytest.mark.parametrize(("name", "params", "match"), [
    ("polynomial", {"a": -0.5}, r"staleness a must be finite and >= 0\. Found -0.5"),
    ("polynomial", {"a": math.inf}, "a must be finite"),
    ("polynomial", {"a": math.nan}, "a must be finite"),
    ("polynomial", {"a": True}, "a must be finite"),
    ("polynomial", {"a": "1"}, "a must be finite"),
    ("hinge", {"a": 0.0}, r"staleness a must be finite and > 0\. Found 0.0"),
    ("hinge", {"a": -1.0}, "a must be finite and > 0"),
    ("hinge", {"b": -1.0}, r"staleness b must be finite and >= 0\. Found -1.0"),
    ("hinge", {"b": math.inf}, "b must be finite"),
    ("hinge", {"c": 1.0}, "parameters must be known"),
    ("constant", {"a": 1.0}, "parameters must be known"),
    ("exponential", {}, r"staleness function must be one of \['constant', 'hinge', 'polynomial'\]"),
])
def test_bad_parameters_raise(name, params, match):
    with pytest.raises(AggregationError, match=match):
        create_staleness(name, **params)


def test_registry_refuses_duplicates(monkeypatch):
    assert available_staleness_functions() == ["constant", "hinge", "polynomial"]
    monkeypatch.setattr(staleness, "_REGISTRY", copy.copy(staleness._REGISTRY))
    with pytest.raises(AggregationError, match=r"must be unique\. Found 'hinge' registered twice"):
        register_staleness("hinge")(staleness.Hinge)
    with pytest.raises(TypeError):
        StalenessFunction()  # type: ignore[abstract]
