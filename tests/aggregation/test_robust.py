"""Aggregation rules: each equals a float64 reference, chunking and the codec path change
nothing, robust rules resist sign-flipped updates, and bad input raises AggregationError.

Tolerances (float32 results against float64 references, ``eps`` = float32 epsilon):
* mean / clipped mean: a running float32 sum, as in test_accumulator:
  ``|r - ref| <= 2 * (4 n eps * sum_i w_i|x_i| / sum_i w_i + eps |ref|)`` (clipped: x_i scaled first).
* median: the middle value(s) are selected exactly and averaged in float64, so the result is
  the float64 reference rounded once to float32: exact equality with ``ref.astype(float32)``.
* trimmed mean: a float32 sum of the kept values, then a division: as the mean with unit weights,
  ``<= 2 * (4 n eps * mean|kept| + eps |ref|)``.
* Krum: selection is exact on data whose scores are far apart; the result is a stored row.
"""

from __future__ import annotations

import copy

import math

import numpy as np
import pytest
import torch
from flwr.server.strategy.aggregate import aggregate_krum, aggregate_median, aggregate_trimmed_avg
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import aggregation.robust as robust
from aggregation import (
    AggregationError,
    Aggregator,
    WeightedAccumulator,
    available_aggregators,
    create_aggregator,
    register_aggregator,
)
from aggregation.codecs import create_codec

EPS = float(np.finfo(np.float32).eps)
RULES = {  # name -> parameters used by the contract tests
    "mean": {},
    "norm-bounded-mean": {"clip": 3.0},
    "median": {},
    "trimmed-mean": {"beta": 0.2},
    "krum": {"f": 1},
    "multi-krum": {"f": 1, "m": 3},
}
BUFFERED = ["median", "trimmed-mean", "krum", "multi-krum"]


def _make(name: str, numel: int, max_clients: int = 10, **extra) -> Aggregator:
    return create_aggregator(name, numel=numel, device="cpu", max_clients=max_clients, **{**RULES[name], **extra})


def _run(name: str, xs: np.ndarray, ws: list[float] | None = None, **extra) -> tuple[Aggregator, np.ndarray]:
    agg = _make(name, xs.shape[1], max(len(xs), 10), **extra)
    for i, x in enumerate(xs):
        agg.add_dense(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), 1.0 if ws is None else ws[i])
    out = agg.result()
    assert out.dtype == torch.float32 and out.shape == (xs.shape[1],) and out.device.type == "cpu"
    return agg, out.numpy()


def _data(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d)).astype(np.float32)


# ---------------------------------------------------------------- float64 references
def _ref_mean(xs, ws, clip=None):
    x = xs.astype(np.float64)
    if clip is not None:
        x = x * np.minimum(1.0, clip / np.maximum(np.linalg.norm(x, axis=1), 1e-300))[:, None]
    w = np.asarray(ws, np.float64)
    return (w[:, None] * x).sum(0) / w.sum(), (w[:, None] * np.abs(x)).sum(0) / w.sum()


def _ref_trimmed(xs, beta):
    n, k = len(xs), int(beta * len(xs))
    kept = np.sort(xs.astype(np.float64), axis=0)[k:n - k]
    return kept.mean(0), np.abs(kept).mean(0)


def _ref_krum_scores(xs, f):
    x = xs.astype(np.float64)
    n = len(x)
    d = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    return np.array([np.sort(np.delete(d[i], i))[: n - f - 2].sum() for i in range(n)])


UPDATES = st.integers(1, 9).flatmap(lambda n: st.integers(1, 24).flatmap(lambda d: st.tuples(
    hnp.arrays(np.float32, (n, d), elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)),
    st.lists(st.floats(1e-3, 1e3), min_size=n, max_size=n))))


@settings(max_examples=40, deadline=None)
@given(data=UPDATES, clip=st.sampled_from([None, 1e-2, 1.0, 1e3]))
def test_mean_and_clipped_mean_equal_float64_reference(data, clip):
    xs, ws = data
    name, extra = ("mean", {}) if clip is None else ("norm-bounded-mean", {"clip": clip})
    agg, out = _run(name, xs, ws, **extra)
    ref, scale = _ref_mean(xs, ws, clip)
    assert np.all(np.abs(out - ref) <= 2 * (4 * len(xs) * EPS * scale + EPS * np.abs(ref)) + 1e-30)
    assert agg.count == len(xs) and agg.total_weight == pytest.approx(sum(ws))


@settings(max_examples=40, deadline=None)
@given(data=UPDATES)
def test_median_is_numpy_median_rounded_once(data):
    xs, _ = data
    _, out = _run("median", xs)
    ref = np.median(xs.astype(np.float64), axis=0)
    assert np.array_equal(out, ref.astype(np.float32))
    assert np.array_equal(out, aggregate_median([([x], 1) for x in xs])[0].astype(np.float32))


def test_median_of_an_even_count_averages_the_two_middle_values():
    xs = np.array([[1.0, -4.0], [2.0, 0.0], [3.0, 1.0], [10.0, 7.0]], np.float32)
    _, out = _run("median", xs)
    assert out.tolist() == [2.5, 0.5]  # torch.median would give the lower ones: [2.0, 0.0]


@settings(max_examples=40, deadline=None)
@given(data=UPDATES, beta=st.sampled_from([0.0, 0.1, 0.2, 0.25, 0.34, 0.49]))
def test_trimmed_mean_equals_float64_reference(data, beta):
    xs, _ = data
    _, out = _run("trimmed-mean", xs, beta=beta)
    ref, mag = _ref_trimmed(xs, beta)
    assert np.all(np.abs(out - ref) <= 2 * (4 * len(xs) * EPS * mag + EPS * np.abs(ref)) + 1e-30)
    flower = aggregate_trimmed_avg([([x], 1) for x in xs], beta)[0]
    assert np.allclose(out, flower, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("n", "beta", "dropped"),
                         [(10, 0.1, 1), (10, 0.19, 1), (10, 0.2, 2), (3, 0.3, 0), (5, 0.4, 2)])
def test_trimmed_mean_drops_floor_beta_n_from_each_end(n, beta, dropped):
    xs = np.arange(n, dtype=np.float32)[:, None] ** 3  # distinct, skewed: each k gives another mean
    _, out = _run("trimmed-mean", xs, beta=beta)
    assert out[0] == pytest.approx(xs[dropped:n - dropped, 0].mean())


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("f", [0, 1, 2])
def test_krum_and_multi_krum_select_like_float64_reference(seed, f):
    xs = _data(9, 33, seed) * np.linspace(0.5, 3.0, 9, dtype=np.float32)[:, None]  # spread scores apart
    ws = [float(w) for w in np.random.default_rng(seed).integers(1, 50, size=9)]
    scores = _ref_krum_scores(xs, f)
    order = np.argsort(scores, kind="stable")
    agg, out = _run("krum", xs, ws, f=f)
    assert agg.selected == [order[0]] and np.array_equal(out, xs[order[0]])
    assert np.allclose(agg.scores().numpy(), scores, rtol=1e-9)
    flower = aggregate_krum([([x], int(w)) for x, w in zip(xs, ws, strict=True)], f, 0)[0]
    assert np.array_equal(out, flower)
    m = 9 - f
    for keep in range(1, m + 1):
        agg, out = _run("multi-krum", xs, ws, f=f, m=keep)
        chosen = sorted(order[:keep].tolist())
        assert agg.selected == chosen
        ref, scale = _ref_mean(xs[chosen], [ws[i] for i in chosen])
        assert np.all(np.abs(out - ref) <= 2 * (4 * 9 * EPS * scale + EPS * np.abs(ref)))
        flower = aggregate_krum([([x], int(w)) for x, w in zip(xs, ws, strict=True)], f, keep)[0]
        assert np.allclose(out, flower, rtol=1e-5, atol=1e-6)


def test_krum_picks_an_honest_update_among_far_outliers():
    rng = np.random.default_rng(7)
    honest = (1.0 + 0.05 * rng.normal(size=(7, 50))).astype(np.float32)
    outliers = np.full((2, 50), 40.0, np.float32)  # colluding: identical to each other
    xs = np.concatenate([outliers[:1], honest[:4], outliers[1:], honest[4:]])  # outliers at rows 0 and 5
    agg, out = _run("krum", xs, f=2)
    assert agg.selected[0] not in (0, 5)
    assert any(np.array_equal(out, h) for h in honest)
    agg, out = _run("multi-krum", xs, f=2, m=7)
    assert agg.selected == [1, 2, 3, 4, 6, 7, 8]
    assert np.allclose(out, honest.astype(np.float64).mean(0), rtol=1e-6)


@pytest.mark.parametrize("name", BUFFERED)
def test_chunked_equals_unchunked(name):
    xs = _data(8, 101, 3)  # 101 columns: chunks of 7 leave a short tail
    ws = [1.0 + i for i in range(8)]
    small = _run(name, xs, ws, chunk_size=7)
    large = _run(name, xs, ws, chunk_size=10**6)
    default = _run(name, xs, ws)
    assert small[0].chunk_size == 7 and large[0].chunk_size == 101
    assert np.array_equal(small[1], large[1]) and np.array_equal(small[1], default[1])


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_adding_through_the_dense_codec_equals_add_dense(name, dtype):
    xs = torch.from_numpy(_data(7, 64, 5))
    codec = create_codec("dense", dtype=dtype)
    via_codec, dense = _make(name, 64), _make(name, 64)
    for i, x in enumerate(xs):
        enc, _ = codec.encode(x)
        parsed = codec.parse(enc.arrays, enc.header, 64, 10**6)
        via_codec.add(codec, parsed, 1.0 + i)
        dense.add_dense(x.to(getattr(torch, dtype)), 1.0 + i)  # what the codec delivers
    if name == "norm-bounded-mean":  # the codec's norm (float32) and add_dense's (float64) differ in the last bits
        assert torch.allclose(via_codec.result(), dense.result(), rtol=0, atol=1e-6)
    else:
        assert torch.equal(via_codec.result(), dense.result())


def test_mean_equals_weighted_accumulator_exactly():
    xs, ws = torch.from_numpy(_data(6, 40, 1)), [0.5, 2.0, 3.0, 1.0, 7.5, 0.25]
    agg, acc = _make("mean", 40), WeightedAccumulator(40)
    for x, w in zip(xs, ws, strict=True):
        agg.add_dense(x, w)
        acc.add(x, w)
    assert torch.equal(agg.result(), acc.mean())


def _attacked(scale: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(11)
    honest = (1.0 + 0.1 * rng.normal(size=(8, 200))).astype(np.float32)
    flipped = (-scale * honest[:2]).astype(np.float32)  # 20%: sign-flipped and scaled
    return np.concatenate([honest[:4], flipped, honest[4:]]), honest.astype(np.float64).mean(0)


@pytest.mark.parametrize("name", ["median", "trimmed-mean", "krum", "multi-krum"])
def test_robust_rules_survive_sign_flipped_scaled_updates(name):
    params = {"multi-krum": {"f": 2, "m": 6}, "krum": {"f": 2}}.get(name, {})
    for scale in (10.0, 1e4):
        xs, honest_mean = _attacked(scale)
        _, out = _run(name, xs, **params)
        assert np.linalg.norm(out - honest_mean) <= 0.1 * np.linalg.norm(honest_mean), scale


def test_mean_is_ruined_and_clipped_mean_is_bounded_by_the_clip():
    for scale in (10.0, 1e4):
        xs, honest_mean = _attacked(scale)
        hm = np.linalg.norm(honest_mean)
        _, out = _run("mean", xs)
        assert np.linalg.norm(out - honest_mean) > 0.5 * hm
        clip = float(np.linalg.norm(xs[[0, 1, 2, 3, 6, 7, 8, 9]], axis=1).max())  # no honest update is clipped
        _, out = _run("norm-bounded-mean", xs, clip=clip)
        assert np.linalg.norm(out - honest_mean) <= 0.2 * (hm + clip) * (1 + 1e-5)  # f/n (|mean_h| + clip)


# ---------------------------------------------------------------- storage, state, errors
@pytest.mark.parametrize("name", list(RULES))
def test_storage_is_stated_and_bounded(name):
    small, big = _make(name, 2**21, max_clients=5), _make(name, 2**22, max_clients=5)
    rows = 1 if name in ("mean", "norm-bounded-mean") else 5
    assert small.peak_bytes == 4 * rows * 2**21 and big.peak_bytes == 4 * rows * 2**22
    if name in BUFFERED:  # what result() needs besides its output does not grow with the model
        assert small.work_bytes - 4 * 2**21 == big.work_bytes - 4 * 2**22 > 0


@pytest.mark.parametrize("name", list(RULES))
def test_result_leaves_state_and_reset_starts_over(name):
    xs = torch.from_numpy(_data(5, 16, 2))
    agg = _make(name, 16)
    with pytest.raises(AggregationError, match="needs at least one accepted update. Found none"):
        agg.result()
    for x in xs:
        agg.add_dense(x, 2.0)
    first = agg.result()
    expected = first.clone()
    first.add_(100.0)  # the result is a new tensor: changing it changes nothing stored
    assert torch.equal(agg.result(), expected)
    agg.reset()
    assert agg.count == 0 and agg.total_weight == 0.0
    with pytest.raises(AggregationError, match="Found none"):
        agg.result()
    for x in xs:
        agg.add_dense(x, 2.0)
    assert torch.equal(agg.result(), expected)


@pytest.mark.parametrize("name", list(RULES))
def test_too_many_updates_and_bad_input_are_refused_without_changing_state(name):
    xs = torch.from_numpy(_data(5, 16, 4))
    agg = _make(name, 16, max_clients=5)
    for x in xs[:4]:
        agg.add_dense(x, 1.0)
    for weight in (0.0, -1.0, math.nan, math.inf, True, "1", 1e-47, 1e39):  # 0 and inf in a float32 sum
        with pytest.raises(AggregationError, match=r"weight must be finite and in \[1e-30, 1e\+38\]"):
            agg.add_dense(xs[4], weight)
    for bad in (torch.zeros(15), torch.zeros(4, 4), torch.zeros(16, dtype=torch.int64), [0.0] * 16):
        with pytest.raises(AggregationError):
            agg.add_dense(bad, 1.0)
    for poison in (math.nan, math.inf, -math.inf):
        x = xs[4].clone()
        x[3] = poison
        with pytest.raises(AggregationError, match="must be finite"):
            agg.add_dense(x, 1.0)
    assert agg.count == 4 and agg.total_weight == 4.0
    agg.add_dense(xs[4], 1.0)
    with pytest.raises(AggregationError, match=r"number at most max-clients=5\. Found 6"):
        agg.add_dense(xs[0], 1.0)
    fresh = _make(name, 16, max_clients=5)
    for x in xs:
        fresh.add_dense(x, 1.0)
    assert torch.equal(agg.result(), fresh.result())


def test_krum_needs_more_than_2f_plus_2_updates():
    with pytest.raises(AggregationError, match=r"max-clients must be > 2f \+ 2 = 6 for krum with f=2\. Found 6"):
        create_aggregator("krum", numel=4, device="cpu", max_clients=6, f=2)
    agg = create_aggregator("krum", numel=4, device="cpu", max_clients=9, f=2)
    for i in range(6):
        agg.add_dense(torch.full((4,), float(i)), 1.0)
    assert agg.min_updates == 7
    with pytest.raises(AggregationError, match=r"krum needs at least 7 accepted updates\. Found 6"):
        agg.result()
    agg.add_dense(torch.zeros(4), 1.0)
    agg.result()
    multi = create_aggregator("multi-krum", numel=4, device="cpu", max_clients=9, f=2, m=6)
    for i in range(7):
        multi.add_dense(torch.full((4,), float(i)), 1.0)
    assert multi.min_updates == 8  # m + f
    with pytest.raises(AggregationError, match=r"multi-krum needs at least 8 accepted updates\. Found 7"):
        multi.result()
    multi.add_dense(torch.zeros(4), 1.0)
    assert multi.result().shape == (4,)


@pytest.mark.parametrize(("name", "params", "match"), [
    ("norm-bounded-mean", {"clip": 0.0}, "clip must be finite and > 0"),
    ("norm-bounded-mean", {"clip": -1.0}, "clip must"),
    ("norm-bounded-mean", {"clip": math.nan}, "clip must"),
    ("norm-bounded-mean", {"clip": math.inf}, "clip must"),
    ("norm-bounded-mean", {}, "parameters must be known"),
    ("trimmed-mean", {"beta": 0.5}, r"beta must be in \[0, 0.5\)"),
    ("trimmed-mean", {"beta": -0.1}, "beta must"),
    ("trimmed-mean", {"beta": math.nan}, "beta must"),
    ("krum", {"f": -1}, "f must be an int >= 0"),
    ("krum", {"f": 1.0}, "f must be an int"),
    ("multi-krum", {"f": 1, "m": 0}, r"m must be an int in \[1, max-clients - f = 9\]"),
    ("multi-krum", {"f": 1, "m": 10}, "m must"),
    ("median", {"chunk_size": 0}, "chunk-size must be an int > 0"),
    ("median", {"chunk_size": 2.0}, "chunk-size must"),
    ("median", {"beta": 0.1}, "parameters must be known"),
    ("mean", {"clip": 1.0}, "parameters must be known"),
    ("nope", {}, "aggregator must be one of"),
])
def test_bad_parameters_raise(name, params, match):
    with pytest.raises(AggregationError, match=match):
        create_aggregator(name, numel=8, device="cpu", max_clients=10, **params)


@pytest.mark.parametrize(("numel", "max_clients", "match"), [(0, 10, "numel must"), (8, 0, "max-clients must"),
                                                             (8.0, 10, "numel must"), (8, True, "max-clients must")])
def test_bad_sizes_raise(numel, max_clients, match):
    for name in RULES:
        with pytest.raises(AggregationError, match=match):
            create_aggregator(name, numel=numel, device="cpu", max_clients=max_clients, **RULES[name])


def test_registry_lists_sorted_names_and_refuses_duplicates(monkeypatch):
    assert available_aggregators() == sorted(RULES)
    monkeypatch.setattr(robust, "_REGISTRY", copy.copy(robust._REGISTRY))
    with pytest.raises(AggregationError, match=r"must be unique\. Found 'median' registered twice"):
        register_aggregator("median")(robust.Median)
    with pytest.raises(TypeError):
        Aggregator(4, "cpu", 2)  # type: ignore[abstract]


def test_norm_bounded_mean_clips_an_update_whose_factor_is_below_the_smallest_weight():
    """weight * clip / norm went to the accumulator as a weight, under its 1e-30 floor: AggregationError, and the
    rest of the batch was dropped with the first updates counted (a review)."""
    from aggregation.codecs import create_codec

    codec = create_codec("dense")
    xs = [torch.full((8,), 1e17), torch.full((8,), 0.5e-13), torch.full((8,), -1e17)]
    parsed = [codec.parse(dict(e.arrays), e.header, 8, 1 << 20) for e in (codec.encode(x)[0] for x in xs)]
    agg = create_aggregator("norm-bounded-mean", 8, "cpu", 3, clip=1e-13)
    results = agg.add_checked_many(codec, parsed, [1.0, 1.0, 1.0])
    assert not any(isinstance(r, Exception) for r in results) and agg.count == 3
    ref = sum(x.double() * min(1.0, 1e-13 / float(x.double().norm())) for x in xs) / 3
    torch.testing.assert_close(agg.result().double(), ref, rtol=1e-5, atol=0)


# ---------------------------------------------------------------- edges that mutations of robust.py got past
def test_median_averages_middle_values_near_float32_max_in_float64():
    """Their float32 sum overflows (3.2e38 + 3.3e38 > 3.4e38): the midpoint is taken in float64."""
    xs = np.array([[-1.0], [3.2e38], [3.3e38], [3.4e38]], np.float32)
    _, out = _run("median", xs)
    assert np.isfinite(out).all()
    assert out[0] == np.float32((np.float64(xs[1, 0]) + np.float64(xs[2, 0])) / 2)


@pytest.mark.parametrize(("n", "beta", "dropped"), [(100, 0.29, 28), (100, 0.07, 7), (10, 0.3, 3)])
def test_trimmed_mean_drops_int_of_the_float_product(n, beta, dropped):
    """k = int(beta * n) in float, scipy's and Flower's: 0.29 * 100 is 28.999999999999996, so 28, not 29."""
    xs = np.arange(n, dtype=np.float32)[:, None] ** 3
    _, out = _run("trimmed-mean", xs, beta=beta)
    assert int(beta * n) == dropped
    assert out[0] == pytest.approx(xs[dropped:n - dropped, 0].astype(np.float64).mean(), rel=1e-6)


def _tied() -> tuple[np.ndarray, list[float]]:
    """Rows 2 .. 18 of 20 are 3 e_2 .. 3 e_18: every distance between them is 18, exactly, so with f = 2 each
    scores 16 * 18; rows 0, 1 and 19 are far outliers on axes of their own. On CPU torch's unstable sort keeps
    ties in order up to 16 values, not beyond: there its first index of these scores is not the earliest."""
    xs = np.zeros((20, 20), np.float32)
    xs[0, 0], xs[1, 1], xs[19, 19] = 100.0, -100.0, 100.0
    for i in range(2, 19):
        xs[i, i] = 3.0
    return xs, [float(1 + i % 7) for i in range(20)]


def test_krum_and_multi_krum_break_tied_scores_by_arrival_order():
    xs, ws = _tied()
    agg, out = _run("krum", xs, ws, f=2)
    scores = agg.scores().numpy()
    assert np.array_equal(scores[2:19], np.full(17, 16 * 18.0)) and min(scores[[0, 1, 19]]) > 16 * 18
    assert agg.selected == [2] and np.array_equal(out, xs[2])
    for m in (1, 5, 17):
        agg, out = _run("multi-krum", xs, ws, f=2, m=m)
        assert agg.selected == list(range(2, m + 2))
        ref, _ = _ref_mean(xs[2:m + 2], ws[2:m + 2])
        np.testing.assert_allclose(out, ref, rtol=4 * EPS, atol=0)


def test_krum_scores_called_directly_refuse_too_few_updates():
    agg = create_aggregator("krum", numel=4, device="cpu", max_clients=9, f=2)
    for i in range(6):
        agg.add_dense(torch.full((4,), float(i)), 1.0)
    with pytest.raises(AggregationError, match=r"krum update count must be > 2f \+ 2 = 6 \(f=2\)\. Found 6"):
        agg.scores()
    agg.add_dense(torch.zeros(4), 1.0)
    assert agg.scores().shape == (7,)


@pytest.mark.parametrize("over", [1e-5, 1e-3, 0.5])
def test_norm_bounded_mean_scales_an_update_just_over_the_clip_to_the_clip(over):
    """A norm (1 + over) times the clip comes out at the clip, to float32 rounding: the float64 reference."""
    x = torch.from_numpy(_data(1, 64, 9)[0])
    norm = float(torch.linalg.vector_norm(x, dtype=torch.float64))
    clip = norm / (1.0 + over)
    agg = create_aggregator("norm-bounded-mean", numel=64, device="cpu", max_clients=2, clip=clip)
    agg.add_dense(x, 2.5)
    out = agg.result().double()
    ref = x.double() * (clip / norm)
    torch.testing.assert_close(out, ref, rtol=4 * EPS, atol=0)
    assert abs(float(out.norm()) - clip) <= 4 * EPS * clip
    at_clip = create_aggregator("norm-bounded-mean", numel=64, device="cpu", max_clients=2, clip=norm)
    at_clip.add_dense(x, 1.0)  # a norm equal to the clip: unchanged
    assert torch.equal(at_clip.result(), x)


def test_krum_distances_that_round_below_zero_count_as_zero():
    """|a|^2 + |b|^2 - 2 a.b in float64 for rows (4096, 45 * 2**-20) and (4096, 46 * 2**-20): each a sum of
    two exact products, rounded once, whatever the BLAS, gives -2**-27 for a true 2**-40. Clamped to 0 it ties
    with the exact 0 between rows 0 and 1, and the tie goes to row 0; a negative distance would win it."""
    lo = 2.0**-20
    xs = np.array([[4096.0, 0.0], [4096.0, 0.0], [4096.0, 45 * lo], [4096.0, 46 * lo]], np.float32)
    sq = xs.astype(np.float64) ** 2
    assert (sq[2].sum() + sq[3].sum()) - 2 * (4096.0**2 + 45 * 46 * lo * lo) < 0  # what the Gram matrix gives
    agg, out = _run("krum", xs, f=0)
    assert (agg.scores().numpy() >= 0).all()
    assert agg.selected == [0] and np.array_equal(out, xs[0])
    agg, _ = _run("multi-krum", xs, f=0, m=2)
    assert agg.selected == [0, 1]
