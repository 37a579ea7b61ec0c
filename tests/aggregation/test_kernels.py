"""The fused batch kernels (aggregation.kernels): ``add_checked_many`` on a batch gives the same
verdicts as ``add_checked`` one update at a time, and a sum within float32 rounding of the
float64 reference over the accepted updates, whatever the batch holds (NaN, inf, values that
would overflow float32, norms past the limit, in any block) and however small the budget for
adds made ahead of a decision is. Also: the torch fallback (``FEDSHIELD_KERNELS=torch``) and
the rules that take a batch one update at a time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregation import AggregationError, UpdateRejected, WeightedAccumulator, create_aggregator, kernels
from aggregation.codecs import create_codec

from .helpers import sent

pytestmark = pytest.mark.skipif(not kernels.enabled(), reason="numba kernels unavailable")

CODECS = [("dense", {}), ("qsgd", {"bits": 8, "chunk": 64}), ("qsgd", {"bits": 4, "chunk": 128}),
          ("qsgd", {"bits": 2, "chunk": 1024}), ("topk", {"ratio": 0.05})]


def _parse(codec, x: torch.Tensor, seed: int = 0):
    enc = sent(codec, x, torch.Generator().manual_seed(seed))
    return codec.parse(dict(enc.arrays), enc.header, x.numel(), 1 << 40)


def _dense_parsed(values: np.ndarray):
    """A dense float32 Parsed over arbitrary values (NaN, inf included): encode would refuse nothing,
    but building it directly keeps the values exactly as given."""
    codec = create_codec("dense")
    return codec, _parse(codec, torch.from_numpy(values.astype(np.float32)))


def _one_at_a_time(codec, batch, weights, max_norm, numel):
    acc = WeightedAccumulator(numel)
    return acc, [_verdict(acc, codec, p, w, max_norm) for p, w in zip(batch, weights, strict=True)]


def _verdict(acc, codec, parsed, weight, max_norm):
    try:
        return acc.add_parsed_checked(codec, parsed, weight, max_norm)
    except UpdateRejected as rej:
        return rej


def _verdicts(results):
    return [r.rule if isinstance(r, UpdateRejected) else "ok" for r in results]


def _reference(codec, batch, weights, results, numel):
    ref = np.zeros(numel, np.float64)
    for p, w, r in zip(batch, weights, results, strict=True):
        if not isinstance(r, UpdateRejected):
            ref += w * codec.decode(p).numpy().astype(np.float64)
    return ref


def _tolerance(codec, batch, weights, numel):
    """float32 rounding of the sum: a few eps per add of every update's magnitude, finite ones."""
    mag = np.zeros(numel, np.float64)
    for p, w in zip(batch, weights, strict=True):
        d = np.nan_to_num(np.abs(codec.decode(p).numpy().astype(np.float64)), nan=0.0, posinf=0.0)
        mag += w * np.minimum(d, 1e30)
    return 8 * len(batch) * np.finfo(np.float32).eps * mag + 1e-30


@pytest.mark.parametrize("name,params", CODECS)
@pytest.mark.parametrize("numel", [1, 777, (1 << 16) + 3, 3 * (1 << 16)])
def test_batch_equals_one_at_a_time(name, params, numel):
    codec = create_codec(name, **params)
    gen = torch.Generator().manual_seed(numel)
    xs = [torch.randn(numel, generator=gen) * (1 + i) for i in range(6)]
    batch = [_parse(codec, x, i) for i, x in enumerate(xs)]
    weights = [1.0, 2.5, 7.0, 0.25, 3.0, 1.0]
    max_norm = float(np.median([codec.norm(p) for p in batch]))  # about half are refused
    acc = WeightedAccumulator(numel)
    results = acc.add_parsed_checked_many(codec, batch, weights, max_norm)
    single, expected = _one_at_a_time(codec, batch, weights, max_norm, numel)
    assert _verdicts(results) == _verdicts(expected)
    for r, e in zip(results, expected, strict=True):
        if not isinstance(r, UpdateRejected):
            assert r == pytest.approx(e, rel=1e-5)
    assert acc.count == single.count and acc.total_weight == single.total_weight
    ref = _reference(codec, batch, weights, results, numel)
    got = acc.total.numpy().astype(np.float64)
    assert np.all(np.abs(got - ref) <= _tolerance(codec, batch, weights, numel))


@st.composite
def _dense_batches(draw):
    numel = draw(st.sampled_from([5, 1000, (1 << 16) + 17, 2 * (1 << 16)]))
    count = draw(st.integers(1, 9))  # groups of four, a partial group
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = [rng.standard_normal(numel).astype(np.float32) for _ in range(count)]
    for row in rows:  # corruptions at random places: a NaN, an inf, overflowing or merely large values
        kind = draw(st.sampled_from(["none", "nan", "inf", "-inf", "huge", "large"]))
        if kind == "none":
            continue
        at = rng.integers(0, numel, size=draw(st.integers(1, 3)))
        row[at] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "huge": 3e38, "large": 1e4}[kind]
    weights = [draw(st.floats(0.01, 1e3)) for _ in range(count)]
    max_norm = draw(st.sampled_from([1e3, 1e5, math.inf]))
    budget = draw(st.sampled_from([None, 1e3, 1.0]))  # None: the accumulator's own (1e37)
    return numel, rows, weights, max_norm, budget


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dense_batches())
def test_corrupted_batches_are_refused_exactly_like_single_adds(case):
    numel, rows, weights, max_norm, budget = case
    codec = create_codec("dense")
    batch = [_dense_parsed(r)[1] for r in rows]
    out = torch.zeros(numel)
    before = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    out += before
    results = codec.add_batch_checked(batch, out, weights, max_norm, 1e37 if budget is None else budget)
    _, expected = _one_at_a_time(codec, batch, weights, max_norm, numel)
    assert _verdicts(results) == _verdicts(expected)
    assert torch.isfinite(out).all()  # nothing refused leaves a trace beyond rounding, never a NaN or inf
    ref = before.numpy().astype(np.float64) + _reference(codec, batch, weights, results, numel)
    tol = _tolerance(codec, batch, weights, numel) + 4 * np.finfo(np.float32).eps * np.abs(ref)
    assert np.all(np.abs(out.numpy() - ref) <= tol)


def test_a_refused_update_in_a_later_block_leaves_nothing_behind():
    numel = 3 * kernels.BLOCK
    codec = create_codec("dense")
    good = np.ones(numel, np.float32)
    bad = np.ones(numel, np.float32)
    bad[-1] = np.nan  # every block but the last is added ahead, then rebuilt without it
    batch = [_dense_parsed(good)[1], _dense_parsed(bad)[1]]
    out = torch.zeros(numel)
    results = codec.add_batch_checked(batch, out, [2.0, 3.0], math.inf, 1e37)
    assert not isinstance(results[0], UpdateRejected) and results[1].rule == "non-finite"
    assert torch.equal(out, torch.full((numel,), 2.0))


@pytest.mark.parametrize("name, params, rule", [("dense", {}, "non-finite"), ("dense", {}, "norm-too-large"),
                                                ("qsgd", {"bits": 8, "chunk": 64}, "norm-too-large")])
@pytest.mark.parametrize("fresh", [True, False])
def test_a_refused_update_with_a_huge_weight_does_not_wipe_out_the_others(name, params, rule, fresh):
    """The attack a review found: a client claims 10^7 examples (max-examples allows it) and sends
    large values, refused only once its last block is read (a NaN there, or its norm). Its earlier
    blocks were added ahead of the decision; subtracting them again left float32 rounding of
    10^7 * 100 in every element, far above the honest sum (10 * 0.01 per client), which came out
    as 0 instead of 0.01. The blocks must be rebuilt: the sum equals the honest clients' sum to
    their own float32 rounding, on a fresh sum (the round's first batch) and on one that already
    holds earlier batches. (qsgd's scales are checked finite when parsed: no NaN reaches its kernel.)"""
    numel = 3 * kernels.BLOCK + 77
    codec = create_codec(name, **params)
    honest = [_parse(codec, torch.full((numel,), 0.01), seed=i) for i in range(3)]
    values = np.full(numel, 100.0, np.float32)
    if rule == "non-finite":
        values[-1] = np.nan
    bad = _dense_parsed(values)[1] if name == "dense" else _parse(codec, torch.from_numpy(values), seed=9)
    max_norm = 1e4 if rule == "norm-too-large" else math.inf  # 100 * sqrt(numel) > 1e4
    acc = WeightedAccumulator(numel)
    ref = np.zeros(numel)
    if not fresh:  # an earlier batch (checked: its norm known, so the next batch is added ahead too)
        earlier = [_parse(codec, torch.full((numel,), 0.01), seed=7)]
        ref += _reference(codec, earlier, [10.0], acc.add_parsed_checked_many(codec, earlier, [10.0], max_norm), numel)
    batch = [honest[0], bad, honest[1], honest[2]]
    results = acc.add_parsed_checked_many(codec, batch, [10.0, 1e7, 10.0, 10.0], max_norm)
    assert _verdicts(results) == ["ok", rule, "ok", "ok"]
    ref += _reference(codec, batch, [10.0, 1e7, 10.0, 10.0], results, numel)
    got = acc.total.numpy().astype(np.float64)
    assert np.all(np.abs(got - ref) <= 1e-6 * np.abs(ref)), float(np.abs(got - ref).max())


def test_refusals_inside_groups_of_four_rebuild_the_sum():
    """Nine updates (two groups of four, one alone); members refused at the first, a middle and
    the last step of a block, in the first and in a later block: the sum equals the float64 sum
    of the others, the refused leave nothing behind."""
    numel = 2 * kernels.BLOCK + 100
    codec = create_codec("dense")
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(numel).astype(np.float32) for _ in range(9)]
    rows[1][0] = np.nan  # first step of the first block
    rows[2][kernels.BLOCK // 2] = np.inf  # a middle step
    rows[5][kernels.BLOCK - 1] = 3e38  # the last step of a block (overflows the weighted add)
    rows[8][kernels.BLOCK + kernels.SUB + 3] = -np.inf  # the lone update, in the second block
    batch = [_dense_parsed(r)[1] for r in rows]
    weights = [1.0 + i for i in range(9)]
    out = torch.zeros(numel)
    results = codec.add_batch_checked(batch, out, weights, math.inf, 1e37)
    assert _verdicts(results) == ["ok", "non-finite", "non-finite", "ok", "ok", "non-finite", "ok", "ok", "non-finite"]
    ref = sum(w * r.astype(np.float64) for i, (w, r) in enumerate(zip(weights, rows)) if i not in (1, 2, 5, 8))
    assert torch.isfinite(out).all()
    np.testing.assert_allclose(out.numpy(), ref, rtol=0, atol=1e-4)


def test_steps_too_large_to_add_ahead_are_added_once_decided():
    """A budget of 1 lets nothing of norm > 1 be added ahead: every block is decided first, then added."""
    numel = 2 * kernels.BLOCK + 5
    codec = create_codec("dense")
    x = np.full(numel, 2.0, np.float32)
    out = torch.zeros(numel)
    results = codec.add_batch_checked([_dense_parsed(x)[1]], out, [1.5], math.inf, 1.0)
    assert results[0] == pytest.approx(2.0 * math.sqrt(numel))
    assert torch.equal(out, torch.full((numel,), 3.0))


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_qsgd_huge_scales_are_decided_before_they_are_added(bits):
    numel, chunk = 4096, 64
    codec = create_codec("qsgd", bits=bits, chunk=chunk)
    x = torch.randn(numel)
    x[:chunk] *= 1e36  # the first chunk's scale: past what may be added ahead
    p = _parse(codec, x)
    out = torch.zeros(numel)
    res = codec.add_batch_checked([p], out, [10.0], 1e3, 1e37)
    assert isinstance(res[0], UpdateRejected) and res[0].rule == "norm-too-large"
    assert torch.equal(out, torch.zeros(numel))
    res = codec.add_batch_checked([p], out, [1.0], math.inf, 1e37)
    assert not isinstance(res[0], UpdateRejected)
    np.testing.assert_allclose(out.numpy(), codec.decode(p).numpy(), rtol=1e-6)


def test_mixed_qsgd_widths_take_the_one_at_a_time_path():
    numel = 1000
    batch = [_parse(create_codec("qsgd", bits=b), torch.randn(numel)) for b in (8, 4)]
    codec = create_codec("qsgd", bits=8)
    assert codec.add_batch_checked(batch, torch.zeros(numel), [1.0, 1.0], math.inf, 1e37) is None
    agg = create_aggregator("mean", numel, "cpu", 4)
    res = agg.add_checked_many(codec, batch, [1.0, 1.0])
    assert agg.count == 2 and all(not isinstance(r, UpdateRejected) for r in res)


def test_torch_fallback(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "torch")
    assert not kernels.enabled()
    codec = create_codec("dense")
    x = np.arange(10, dtype=np.float32)
    assert codec.add_batch_checked([_dense_parsed(x)[1]], torch.zeros(10), [1.0], math.inf, 1e37) is None
    agg = create_aggregator("mean", 10, "cpu", 2)
    res = agg.add_checked_many(codec, [_dense_parsed(x)[1], _dense_parsed(x * np.nan)[1]], [1.0, 1.0])
    assert res[1].rule == "non-finite" and agg.count == 1
    assert torch.equal(agg.result(), torch.from_numpy(x))
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(AggregationError, match="FEDSHIELD_KERNELS must be"):
        kernels.enabled()


@pytest.mark.parametrize("rule,params", [("median", {}), ("trimmed-mean", {"beta": 0.2}), ("krum", {"f": 1}),
                                         ("norm-bounded-mean", {"clip": 5.0})])
def test_rules_without_a_batch_path_add_one_at_a_time(rule, params):
    numel = 50
    codec = create_codec("dense")
    rows = [np.random.default_rng(i).standard_normal(numel).astype(np.float32) for i in range(7)]
    rows[2][3] = np.inf
    batch = [_dense_parsed(r)[1] for r in rows]
    many = create_aggregator(rule, numel, "cpu", 8, **params)
    res = many.add_checked_many(codec, batch, [1.0] * 7, 1e3)
    single = create_aggregator(rule, numel, "cpu", 8, **params)
    for p in batch:
        try:
            single.add_checked(codec, p, 1.0, 1e3)
        except UpdateRejected:
            pass
    assert _verdicts(res) == ["ok", "ok", "non-finite", "ok", "ok", "ok", "ok"]
    assert many.count == single.count == 6
    assert torch.equal(many.result(), single.result())


def test_a_batch_past_max_clients_is_refused_before_anything_is_added():
    codec = create_codec("dense")
    agg = create_aggregator("mean", 4, "cpu", 2)
    batch = [_dense_parsed(np.ones(4, np.float32))[1] for _ in range(3)]
    with pytest.raises(AggregationError, match="max-clients"):
        agg.add_checked_many(codec, batch, [1.0] * 3)
    assert agg.count == 0


@pytest.mark.parametrize("numel, block", [(1, 4), (7, 4), (8, 4), (9, 4), (100, 3), (1 << 20, 1 << 17), (1000, 1000)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_run_ranges_covers_every_element_once_in_block_aligned_ranges(monkeypatch, numel, block, threads):
    monkeypatch.setattr(kernels, "threads", lambda: threads)
    seen: list = []
    kernels.run_ranges(lambda tag, lo, hi: seen.append((tag, lo, hi)), numel, block, "t")
    assert {tag for tag, _, _ in seen} == {"t"}  # the extra arguments come first
    seen = [(lo, hi) for _, lo, hi in seen]
    seen.sort()
    assert seen[0][0] == 0 and seen[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(seen, seen[1:]))  # contiguous, no overlap
    assert all(lo % block == 0 and lo < hi for lo, hi in seen)


def test_run_ranges_waits_for_every_thread_and_raises_a_failure(monkeypatch):
    monkeypatch.setattr(kernels, "threads", lambda: 2)
    done: list[tuple[int, int]] = []
    first: list[int] = []

    def fn(lo, hi):
        if lo == 0:
            first.append(hi)
            raise ValueError("boom")
        done.append((lo, hi))

    with pytest.raises(ValueError, match="boom"):
        kernels.run_ranges(fn, 64, 4)
    # the first range failed; the other thread took every other range before run_ranges returned
    assert first and first[0] + sum(hi - lo for lo, hi in done) == 64


@pytest.mark.parametrize("name,params", CODECS)
@pytest.mark.parametrize("numel", [777, 3 * (1 << 16) + 5])
@pytest.mark.parametrize("refuse_all", [False, True])
def test_zero_in_pass_overwrites_a_garbage_sum(name, params, numel, refuse_all):
    """``zero=True``: ``out`` starts as garbage (NaN here) and ends as the sum of the accepted
    updates alone, the same bits as adding into a zeroed sum, even when every update is refused."""
    codec = create_codec(name, **params)
    gen = torch.Generator().manual_seed(7)
    batch = [_parse(codec, torch.randn(numel, generator=gen), i) for i in range(5)]
    weights = [1.0, 2.0, 0.5, 3.0, 1.5]
    max_norm = 1e-6 if refuse_all else math.inf
    zeroed, garbage = torch.zeros(numel), torch.full((numel,), math.nan)
    want = codec.add_batch_checked(batch, zeroed, weights, max_norm, 1e37)
    got = codec.add_batch_checked(batch, garbage, weights, max_norm, 1e37, zero=True)
    assert _verdicts(got) == _verdicts(want)
    assert all(isinstance(r, UpdateRejected) for r in got) == refuse_all
    assert torch.equal(garbage, zeroed)


def test_fresh_and_reset_sums_are_zeroed_by_whichever_path_comes_first():
    """A fresh CPU sum is left unwritten until its first add (the tests poison it with NaN): the
    batch kernels zero it in their pass, and every other path (single adds, the torch fallback,
    ``total``, ``mean``) zeroes it first; ``reset`` leaves it unwritten again."""
    codec = create_codec("dense")
    x = torch.arange(10, dtype=torch.float32)
    p = _parse(codec, x)
    acc = WeightedAccumulator(10)
    assert torch.isnan(acc._sum).all()  # the suite's poison (tests/conftest.py): nothing hides a missed zeroing
    assert torch.equal(acc.total, torch.zeros(10))
    for add in (lambda a: a.add_parsed_checked_many(codec, [p], [2.0]), lambda a: a.add_parsed_checked(codec, p, 2.0),
                lambda a: a.add_parsed(codec, p, 2.0), lambda a: a.add(x, 2.0)):
        acc.reset()
        assert torch.isnan(acc._sum).all()
        add(acc)
        assert torch.equal(acc.total, 2 * x)
        assert torch.equal(acc.mean(), x)
    float64 = WeightedAccumulator(10, dtype=torch.float64)  # not the kernels' case: zeroed when made
    assert torch.equal(float64._sum, torch.zeros(10, dtype=torch.float64))


def test_a_qsgd_scale_past_float32_s_square_root_keeps_a_finite_norm_and_an_infinite_one_is_refused():
    """The kernel squared each chunk's float32 scale in float32 (numba keeps float() of a float32 a float32): a
    scale past 1.8e19 made the norm inf, and an unbounded max_norm then accepted it (inf <= inf). A review."""
    from aggregation.codecs.base import settle_batch

    codec = create_codec("qsgd", bits=8, chunk=64)
    x = torch.full((256,), 1e20)
    ref = float(np.linalg.norm(codec.decode(_parse(codec, x)).double().numpy()))
    norms = WeightedAccumulator(256).add_parsed_checked_many(codec, [_parse(codec, x)], [1.0])
    assert norms[0] == pytest.approx(ref, rel=1e-6)
    sq, added = np.array([[math.inf]]), np.zeros((1, 1), np.int64)
    (verdict,) = settle_batch(sq, added, 1.0, math.inf, 256, 256, lambda c, lo, hi: None, lambda lo, hi: None,
                              float32_norm=False)
    assert isinstance(verdict, UpdateRejected) and verdict.rule == "non-finite"
