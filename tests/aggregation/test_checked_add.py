"""The fused norm check + add (``add_checked`` / ``add_into_checked``) and the other fast paths.

* An accepted update: the same result as the two-pass form (``codec.norm``, then ``add``) to
  float32 rounding (the fused forms only change the order of the same float32 operations per
  element: tolerance ``rtol=atol=1e-6`` on O(1) data), and the same norm (``rel=1e-5``: a norm
  from float32 block dots or row norms instead of one reduction).
* A rejected update: the same rule as the two-pass check; the count and weights are unchanged;
  buffered rules and the streaming sum are bit-identical (one update at a time decides before it
  writes; batches: tests/aggregation/test_kernels.py).
Small ``BLOCK`` sizes (monkeypatched) make every multi-block path run on small models.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import aggregation.codecs.dense as dense_mod
import aggregation.codecs.qsgd as qsgd_mod
import aggregation.robust as robust
from aggregation import AggregationError, UpdateRejected, WeightedAccumulator, create_aggregator
from aggregation.codecs import create_codec

from .helpers import sent

EPS = float(torch.finfo(torch.float32).eps)
NUMEL = 1000  # not a multiple of the patched blocks: every path has a short last block
CODECS = [
    {"codec": "dense"},
    {"codec": "dense", "dtype": "float16"},
    {"codec": "topk", "ratio": 0.1},
    {"codec": "topk", "ratio": 0.1, "value_dtype": "float16"},
    {"codec": "qsgd", "bits": 8, "chunk": 64},
    {"codec": "qsgd", "bits": 4, "chunk": 64},
    {"codec": "qsgd", "bits": 2, "chunk": 128},
    {"codec": "sign"},
]
IDS = ["-".join(str(v) for v in c.values()) for c in CODECS]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(dense_mod, "BLOCK", 96)
    monkeypatch.setattr(qsgd_mod, "BLOCK", 256)
    monkeypatch.setattr(robust, "_SORT_BYTES", 4 * 7 * 13)


def _codec(config):
    return create_codec(config["codec"], **{k: v for k, v in config.items() if k != "codec"})


def _parsed(codec, x: torch.Tensor, seed: int = 0):
    enc = sent(codec, x, torch.Generator().manual_seed(seed))
    return codec.parse(enc.arrays, enc.header, x.numel(), 10**9)


def _dense_parsed(x: torch.Tensor):
    return _parsed(create_codec("dense"), x)


def _xs(n: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) for _ in range(n)]


# ------------------------------------------------------------------ accepted updates


@pytest.mark.parametrize("config", CODECS, ids=IDS)
@pytest.mark.parametrize("rule,params", [("mean", {}), ("norm-bounded-mean", {"clip": 20.0}),
                                         ("median", {}), ("trimmed-mean", {"beta": 0.2}), ("multi-krum", {"f": 1, "m": 3})])
def test_checked_add_equals_two_pass(config, rule, params):
    codec = _codec(config)
    parsed = [_parsed(codec, x, i) for i, x in enumerate(_xs(7))]
    fused = create_aggregator(rule, NUMEL, "cpu", 7, **params)
    plain = create_aggregator(rule, NUMEL, "cpu", 7, **params)
    for i, p in enumerate(parsed):
        norm = fused.add_checked(codec, p, 1.0 + i, 1e6)
        assert norm == pytest.approx(codec.norm(p), rel=1e-5)
        assert norm == pytest.approx(float(codec.decode(p).double().norm()), rel=1e-5)
        plain.add(codec, p, 1.0 + i, norm=codec.norm(p))
    assert fused.count == plain.count == 7 and fused.total_weight == plain.total_weight
    torch.testing.assert_close(fused.result(), plain.result(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", CODECS, ids=IDS)
def test_fused_mean_equals_float64_reference(config):
    codec = _codec(config)
    xs, ws = _xs(6, seed=3), [0.5, 3.0, 1.0, 7.0, 2.5, 1.0]
    acc = WeightedAccumulator(NUMEL)
    ref = torch.zeros(NUMEL, dtype=torch.float64)
    scale = torch.zeros(NUMEL, dtype=torch.float64)
    for i, (x, w) in enumerate(zip(xs, ws, strict=True)):
        p = _parsed(codec, x, i)
        acc.add_parsed_checked(codec, p, w, 1e6)
        dec = codec.decode(p).double()
        ref += w * dec
        scale += w * dec.abs()
    err = (acc.mean().double() - ref / sum(ws)).abs()
    assert bool((err <= 2 * (4 * len(ws) * EPS * scale / sum(ws) + EPS * (ref / sum(ws)).abs()) + 1e-30).all())


def test_qsgd_fused_and_two_pass_paths_agree(monkeypatch):
    """The one-pass QSGD path runs when the scale bound is within max_norm; otherwise two passes."""
    codec = create_codec("qsgd", bits=8, chunk=64)
    p = _parsed(codec, _xs(1)[0])
    bound = math.sqrt(64 * float((p.tensors["scales"].double() ** 2).sum()))
    norm = codec.norm(p)
    assert norm < bound
    outs = []
    for max_norm in (bound * 2, (norm + bound) / 2):  # fused, then two-pass (bound > max_norm >= norm)
        out = torch.zeros(NUMEL)
        assert codec.add_into_checked(p, out, 2.0, max_norm) == pytest.approx(norm, rel=1e-6)
        outs.append(out)
    # one pass folds the level scale into the per-chunk factors: equal up to float32 rounding
    torch.testing.assert_close(outs[0], outs[1], rtol=2 * EPS, atol=2 * EPS * float(p.tensors["scales"].max()))
    with pytest.raises(UpdateRejected) as info:
        codec.add_into_checked(p, torch.zeros(NUMEL), 2.0, norm * 0.99)
    assert info.value.rule == "norm-too-large"


def test_topk_norm_comes_from_parse_and_matches_float64():
    codec = create_codec("topk", ratio=0.05)
    p = _parsed(codec, _xs(1)[0] * 1e20)  # float32 squares overflow: the float64 fallback
    assert math.isfinite(p.params["norm"])
    assert codec.norm(p) == pytest.approx(float(p.tensors["values"].double().norm()), rel=1e-6)


# ------------------------------------------------------------------ rejected updates


def _bad(kind: str, where: int) -> torch.Tensor:
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9))
    if kind == "nan":
        x[where] = math.nan
    elif kind == "inf":
        x[where] = -math.inf
    elif kind == "overflow":  # finite values whose float32 sum of squares overflows
        x[where:] = 3e38
    elif kind == "large":  # finite, norm above max_norm only once the late blocks are read
        x[where:] = 10.0
    elif kind == "large-then-nan":  # too large early, NaN late: the two-pass check says non-finite
        x[:] = 10.0
        x[where] = math.nan
    return x


RULE = {"nan": "non-finite", "inf": "non-finite", "overflow": "non-finite", "large": "norm-too-large",
        "large-then-nan": "non-finite"}
MAX_NORM = 100.0  # randn(1000) has norm ~32; ten 10s already exceed 100 only with many of them


@pytest.mark.parametrize("kind", list(RULE))
@pytest.mark.parametrize("where", [0, 5, 500, NUMEL - 1])
def test_rejection_rule_matches_two_pass_and_mean_is_restored(kind, where):
    if kind == "large" and where > NUMEL - 200:
        where = NUMEL - 200  # at least 200 tens: norm >= 141
    codec = create_codec("dense")
    bad = _dense_parsed(_bad(kind, where))
    agg = create_aggregator("mean", NUMEL, "cpu", 5)
    for i, x in enumerate(_xs(3)):
        agg.add_checked(codec, _dense_parsed(x * (i + 1)), 2.0 + i, MAX_NORM)
    before, count, weight = agg._acc.total.clone(), agg.count, agg.total_weight
    with pytest.raises(UpdateRejected) as info:
        agg.add_checked(codec, bad, 3.0, MAX_NORM)
    assert info.value.rule == RULE[kind]
    # the two-pass check names the same rule
    two = math.sqrt(float(torch.dot(bad.tensors["values"], bad.tensors["values"])))
    assert ("non-finite" if not math.isfinite(two) else "norm-too-large") == RULE[kind]
    assert agg.count == count and agg.total_weight == weight
    after = agg._acc.total
    assert bool(torch.isfinite(after).all())
    assert torch.equal(after, before)  # decided before anything was written
    # and the aggregator goes on as if the update had never come
    agg.add_checked(codec, _dense_parsed(_xs(1, seed=4)[0]), 1.0, MAX_NORM)
    assert agg.count == count + 1


@pytest.mark.parametrize("kind", list(RULE))
@pytest.mark.parametrize("rule,params", [("median", {}), ("trimmed-mean", {"beta": 0.2}), ("krum", {"f": 1})])
def test_buffered_rejection_is_bit_exact(kind, rule, params):
    codec = create_codec("dense")
    xs = _xs(5)
    with_bad = create_aggregator(rule, NUMEL, "cpu", 6, **params)
    without = create_aggregator(rule, NUMEL, "cpu", 6, **params)
    for i, x in enumerate(xs):
        with_bad.add_checked(codec, _dense_parsed(x), 1.0, MAX_NORM)
        without.add_checked(codec, _dense_parsed(x), 1.0, MAX_NORM)
        if i == 2:
            with pytest.raises(UpdateRejected) as info:
                with_bad.add_checked(codec, _dense_parsed(_bad(kind, 700)), 1.0, MAX_NORM)
            assert info.value.rule == RULE[kind]
    assert with_bad.count == without.count == 5
    assert torch.equal(with_bad.result(), without.result())


@pytest.mark.parametrize("config", CODECS, ids=IDS)
def test_every_codec_rejects_too_large_and_leaves_mean_as_it_was(config):
    codec = _codec(config)
    agg = create_aggregator("mean", NUMEL, "cpu", 4)
    agg.add_checked(codec, _parsed(codec, _xs(1)[0]), 1.0, 1e6)
    before = agg._acc.total.clone()
    big = _parsed(codec, _xs(1, seed=2)[0] * 1000)
    norm = codec.norm(big)
    with pytest.raises(UpdateRejected) as info:
        agg.add_checked(codec, big, 1.0, norm / 2)
    assert info.value.rule == "norm-too-large" and info.value.norm == pytest.approx(norm, rel=1e-5)
    assert agg.count == 1
    assert torch.equal(agg._acc.total, before)


def test_unvalidated_add_still_refuses_non_finite_with_aggregation_error():
    codec = create_codec("dense")
    agg = create_aggregator("mean", NUMEL, "cpu", 3)
    agg.add(codec, _dense_parsed(_xs(1)[0]), 1.0)
    with pytest.raises(AggregationError, match="update norm must be finite"):
        agg.add(codec, _dense_parsed(_bad("nan", 900)), 1.0)
    assert agg.count == 1 and bool(torch.isfinite(agg.result()).all())


def test_accumulator_falls_back_to_two_passes_near_overflow():
    """Nothing is added ahead of the decision once that could overflow the sum: with a weight of
    1e36, an update of norm ~32 may not be added block by block (1e36 * 32 > 1e37)."""
    codec = create_codec("dense")
    x = _xs(1)[0]
    acc = WeightedAccumulator(NUMEL)
    assert acc.add_parsed_checked(codec, _dense_parsed(x), 1e36, MAX_NORM) == pytest.approx(float(x.norm()), rel=1e-5)
    torch.testing.assert_close(acc.mean(), x)
    bad = _dense_parsed(_bad("nan", 900))
    before = acc.total.clone()
    with pytest.raises(UpdateRejected):
        acc.add_parsed_checked(codec, bad, 1e36, MAX_NORM)
    assert torch.equal(acc.total, before)  # two passes: decided before anything was written
    # a plain add of unknown norm makes every later checked add two-pass (exact)
    acc.add(x, 1.0)
    before = acc.total.clone()
    with pytest.raises(UpdateRejected):
        acc.add_parsed_checked(codec, bad, 1.0, MAX_NORM)
    assert torch.equal(acc.total, before)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.nan, True])
def test_add_checked_rejects_bad_max_norm(max_norm):
    agg = create_aggregator("mean", NUMEL, "cpu", 3)
    with pytest.raises(AggregationError, match="max norm"):
        agg.add_checked(create_codec("dense"), _dense_parsed(_xs(1)[0]), 1.0, max_norm)


# ------------------------------------------------------------------ CPU sort path of the order statistics


@pytest.mark.parametrize("n", [1, 2, 5, 6, 13])
def test_sorted_median_and_trimmed_mean_equal_numpy(n):
    xs = np.stack([x.numpy() for x in _xs(n, numel=257, seed=n)])
    xs[:, :5] = 1.0  # ties
    med = create_aggregator("median", 257, "cpu", n)
    trim = create_aggregator("trimmed-mean", 257, "cpu", n, beta=0.3)
    for x in xs:
        med.add_dense(torch.from_numpy(x.copy()), 1.0)
        trim.add_dense(torch.from_numpy(x.copy()), 1.0)
    assert np.array_equal(med.result().numpy(), np.median(xs.astype(np.float64), axis=0).astype(np.float32))
    k = int(0.3 * n)
    kept = np.sort(xs.astype(np.float64), axis=0)[k : n - k]
    np.testing.assert_allclose(trim.result().numpy(), kept.mean(0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 7, 8, 9, 255, 1000, 4099])
def test_qsgd_4bit_int16_spread_equals_lane_unpacking(n):
    """The 4-bit fast path (int16 spread, one contiguous copy) gives the same levels as the
    per-lane path, and both are within 2 ulps of the table's (2q - M) / M, extremes exact."""
    gen = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 256, (-(-n // 2),), dtype=torch.uint8, generator=gen)
    codes[0] = 0xF0  # codes 0 and 15: levels -1 and 1
    if n % 2:
        codes[-1] &= 15
    fast = qsgd_mod.level_codes(codes, 4, 0, n, torch.empty(n + 8), torch.empty(n + 8, dtype=torch.int16)).clone()
    lanes = qsgd_mod.level_codes(codes, 4, 0, n, torch.empty(n + 8))
    assert torch.equal(fast, lanes)
    assert fast[0] == -1.0 and (n == 1 or fast[1] == 1.0)
    torch.testing.assert_close(fast, qsgd_mod.unpack_levels(codes, 4, n), rtol=0, atol=2.5 * EPS)
    assert bool((fast.abs() <= 1).all())
