"""IID and Dirichlet partitions: deterministic, disjoint, covering, and skewed as promised."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from clients import ConfigError
from clients.partition import dirichlet_partition, iid_partition

LABELS = np.repeat(np.arange(10), 200)  # 2000 samples, balanced over 10 classes
np.random.default_rng(0).shuffle(LABELS)


def _assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "parts must hold every index exactly once"
    assert np.array_equal(np.sort(allidx), np.arange(n))
    for p in parts:
        assert np.array_equal(p, np.sort(p))


def _mean_tv(parts: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean total-variation distance of each part's label distribution to the global one."""
    k = labels.max() + 1
    glob = np.bincount(labels, minlength=k) / len(labels)
    tvs = [0.5 * np.abs(np.bincount(labels[p], minlength=k) / len(p) - glob).sum() for p in parts if len(p)]
    return float(np.mean(tvs))


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_iid_is_deterministic_per_seed():
    assert _same(iid_partition(100, 7, seed=3), iid_partition(100, 7, seed=3))
    assert not _same(iid_partition(100, 7, seed=3), iid_partition(100, 7, seed=4))


def test_dirichlet_is_deterministic_per_seed():
    assert _same(dirichlet_partition(LABELS, 10, 0.5, seed=3), dirichlet_partition(LABELS, 10, 0.5, seed=3))
    assert not _same(dirichlet_partition(LABELS, 10, 0.5, seed=3), dirichlet_partition(LABELS, 10, 0.5, seed=4))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 500), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_iid_parts_are_disjoint_cover_and_balanced(n, data, seed):
    k = data.draw(st.integers(1, n))
    parts = iid_partition(n, k, seed)
    assert len(parts) == k
    _assert_disjoint_cover(parts, n)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 400), classes=st.integers(1, 12), alpha=st.floats(0.01, 100), seed=st.integers(0, 2**32 - 1),
       data=st.data())
def test_dirichlet_parts_are_disjoint_cover(n, classes, alpha, seed, data):
    k = data.draw(st.integers(1, min(n, 20)))
    labels = np.random.default_rng(seed).integers(0, classes, n)
    parts = dirichlet_partition(labels, k, alpha, seed, min_size=0)
    assert len(parts) == k
    _assert_disjoint_cover(parts, n)


@pytest.mark.parametrize("seed", range(5))
def test_small_alpha_gives_much_stronger_label_skew_than_iid(seed):
    iid = _mean_tv(iid_partition(len(LABELS), 10, seed), LABELS)
    skew = _mean_tv(dirichlet_partition(LABELS, 10, 0.1, seed), LABELS)
    mild = _mean_tv(dirichlet_partition(LABELS, 10, 100.0, seed), LABELS)
    # iid with 200 samples/part: expected TV ~ 0.08; Dirichlet(0.1): most parts hold 1-3 classes.
    assert iid < 0.2
    assert mild < 0.2
    assert skew > 0.5
    assert skew > 3 * iid


def test_min_size_is_honoured():
    labels = LABELS[:400]
    unconstrained = [min(len(p) for p in dirichlet_partition(labels, 10, 0.3, s, min_size=0)) for s in range(5)]
    assert min(unconstrained) < 10, "the bound must bind for this test to mean anything"
    for seed in range(5):
        parts = dirichlet_partition(labels, 10, 0.3, seed, min_size=10)
        assert min(len(p) for p in parts) >= 10
        _assert_disjoint_cover(parts, 400)


def test_impossible_min_size_raises_config_error():
    with pytest.raises(ConfigError, match=r"must leave every part >= 20 samples\. Found none in 5 draws"):
        dirichlet_partition(LABELS[:100], 4, 0.05, seed=0, min_size=20, max_tries=5)


@pytest.mark.parametrize("num_parts", [0, -1, 101])
def test_bad_num_parts_raises(num_parts):
    with pytest.raises(ConfigError, match=rf"num-partitions must be in \[1, 100\]\. Found {num_parts}\."):
        iid_partition(100, num_parts, 0)
    with pytest.raises(ConfigError, match=r"num-partitions must be in \[1, 50\] so that every part"):  # its one bound
        dirichlet_partition(LABELS[:100], num_parts, 0.5, 0)


@pytest.mark.parametrize("alpha", [0, 0.0, -1.0, math.nan])
def test_bad_alpha_raises(alpha):
    with pytest.raises(ConfigError, match=r"dirichlet-alpha must be > 0\. Found"):
        dirichlet_partition(LABELS, 10, alpha, 0)


def test_single_part_is_everything():
    assert np.array_equal(iid_partition(50, 1, 0)[0], np.arange(50))
    assert np.array_equal(dirichlet_partition(LABELS[:50], 1, 0.1, 0)[0], np.arange(50))


def _reference_dirichlet(labels, num_parts, alpha, seed, min_size=2, max_tries=1000):
    """The straightforward per-part loop the vectorized split must reproduce exactly."""
    rng = np.random.default_rng(seed)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in np.unique(labels)]
    for _ in range(max_tries):
        props = rng.dirichlet(np.full(num_parts, alpha), size=len(by_class))
        parts = [[] for _ in range(num_parts)]
        for idx, p in zip(by_class, props):
            for part, chunk in zip(parts, np.split(idx, (np.cumsum(p)[:-1] * len(idx)).astype(int))):
                part.append(chunk)
        out = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(p) for p in out) >= min_size:
            return out
    return None


@pytest.mark.parametrize("num_parts,alpha", [(3, 1.0), (20, 0.5), (100, 0.5), (200, 5.0)])
def test_dirichlet_split_equals_the_reference_loop(num_parts, alpha):
    labels = np.random.default_rng(0).integers(0, 10, 1437)
    want = _reference_dirichlet(labels, num_parts, alpha, 1)
    got = dirichlet_partition(labels, num_parts, alpha, 1)
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))


def test_an_impossible_split_fails_at_once_with_the_limit():
    labels = np.zeros(100, dtype=np.int64)
    with pytest.raises(ConfigError, match="num-partitions must be in \\[1, 50\\]"):
        dirichlet_partition(labels, 51, 0.5, 0)
