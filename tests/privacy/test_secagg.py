"""SecAgg+ cryptographic core: Shamir sharing, keys, masking, graphs, and timings against Flower's."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from privacy import PrivacyError
from privacy.secagg import shamir
from privacy.secagg.masking import apply_masks_, keystream
from privacy.secagg.shamir import split_bytes
from privacy.secagg import (
    PRIME,
    KeyPair,
    Share,
    agree,
    check_threshold,
    choose_degree,
    combine,
    complete_graph,
    decrypt_share,
    dequantize,
    derive_key,
    derive_pairwise,
    encrypt_share,
    expand_seed,
    harary_graph,
    mask,
    quantization_step,
    quantize,
    ring_sum,
    split,
    unmask,
)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# chi-square critical values at p = 0.999 (df = 15, 255)
CHI2_999 = {15: 37.70, 255: 330.52}


def chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


# --------------------------------------------------------------------------- Shamir


@FAST
@given(secret=st.binary(min_size=1, max_size=70), n=st.integers(2, 12), data=st.data())
def test_any_t_of_n_shares_recover_the_secret(secret, n, data):
    t = data.draw(st.integers(2, n))
    shares = split(secret, t, n)
    chosen = data.draw(st.permutations(shares))[: data.draw(st.integers(t, n))]
    assert combine(chosen, t) == secret
    with pytest.raises(PrivacyError, match="at least t"):
        combine(chosen[: t - 1], t)


def test_shares_roundtrip_through_bytes_and_have_a_fixed_layout():
    secret = os.urandom(32)
    shares = split(secret, 3, 5)
    blobs = [s.to_bytes() for s in shares]
    assert {len(b) for b in blobs} == {12 + 4 * 11}
    assert combine([Share.from_bytes(b) for b in blobs[1:4]], 3) == secret


def test_t_minus_one_shares_are_independent_of_the_secret():
    # t = 3: shares at x = 1, 2 of an all-zero and an all-0xFF secret are uniform over GF(p).
    rng = np.random.default_rng(1234)
    for secret in (bytes(3), b"\xff" * 3):
        values = np.array([[s.values[0] for s in split(secret, 3, 5, rng=rng)[:2]] for _ in range(3000)])
        for column in values.T:
            counts = np.bincount(column * 16 // PRIME, minlength=16)
            assert chi_square(counts) < CHI2_999[15], counts
        # and the two visible shares are not correlated with each other
        assert abs(np.corrcoef(values.T)[0, 1]) < 0.1


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b[:-1], "must be"),
        (lambda b: b"XXXX" + b[4:], "must start"),
        (lambda b: b[:4] + bytes(4) + b[8:], "x-coordinate"),
        (lambda b: b[:8] + bytes(4) + b[12:], "secret length"),
        (lambda b: b[:12] + b"\xff\xff\xff\xff" + b[16:], "field elements"),
        (lambda b: b[:5], "at least"),
    ],
)
def test_malformed_shares_are_rejected(mutate, match):
    blob = split(os.urandom(32), 2, 3)[0].to_bytes()
    with pytest.raises(PrivacyError, match=match):
        Share.from_bytes(mutate(blob))


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=80))
def test_random_bytes_either_parse_exactly_or_raise(blob):
    try:
        share = Share.from_bytes(blob)
    except PrivacyError:
        return
    assert share.to_bytes() == blob


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=40), st.integers(2, 30), st.data())
def test_up_to_half_the_spare_shares_may_be_wrong_and_are_named(secret, n, data):
    """Berlekamp-Welch: of m >= t shares, any (m - t) // 2 may be wrong (in any of their chunks);
    the secret is decoded and exactly the wrong ones are reported."""
    t = data.draw(st.integers(2, n))
    shares = shamir.split(secret, t, n)
    m = data.draw(st.integers(t, n))
    picked = data.draw(st.permutations(range(n)))[:m]
    xs = np.array([shares[i].x for i in picked], dtype=np.int64)
    ys = np.stack([shares[i].values for i in picked]).copy()
    wrong = data.draw(st.lists(st.integers(0, m - 1), unique=True, max_size=(m - t) // 2))
    for w in wrong:
        chunk = data.draw(st.integers(0, ys.shape[1] - 1))
        ys[w, chunk] = (ys[w, chunk] + data.draw(st.integers(1, shamir.PRIME - 1))) % shamir.PRIME
    got, right = shamir.decode_values(xs, ys, t, len(secret))
    assert got == secret
    assert sorted(np.flatnonzero(~right).tolist()) == sorted(wrong)


def test_too_many_wrong_shares_are_refused_not_decoded_to_another_secret():
    rng = np.random.default_rng(0)
    for _ in range(20):
        shares = shamir.split(os.urandom(32), 8, 20)
        xs = np.array([s.x for s in shares], dtype=np.int64)
        ys = np.stack([s.values for s in shares]).copy()
        ys[rng.choice(20, 7, replace=False)] = rng.integers(0, shamir.PRIME, size=(7, ys.shape[1]))  # e = 6
        with pytest.raises(PrivacyError, match="cannot be decoded|do not decode|inconsistent"):
            shamir.decode_values(xs, ys, 8, 32)


def test_combine_rejects_duplicates_mixed_lengths_and_mixed_secrets():
    a, b, c = split(b"x" * 32, 3, 5), split(b"y" * 33, 3, 5), split(b"z" * 32, 3, 5)
    with pytest.raises(PrivacyError, match="distinct"):
        combine([a[0], a[0], a[1]], 3)
    with pytest.raises(PrivacyError, match="secret length"):
        combine([a[0], a[1], b[2]], 3)
    with pytest.raises(PrivacyError, match="inconsistent"):
        combine([a[0], a[1], c[2]], 3)
    with pytest.raises(PrivacyError, match="inconsistent"):
        combine([a[0], a[1], a[2], c[3]], 3)
    with pytest.raises(PrivacyError, match="2 <= t <= n"):
        split(b"s", 1, 3)
    with pytest.raises(PrivacyError, match="2 <= t <= n"):
        split(b"s", 4, 3)


# --------------------------------------------------------------------------- keys


def test_both_sides_derive_the_same_keys_and_context_changes_them():
    a, b = KeyPair.generate(), KeyPair.generate()
    ka = derive_pairwise(agree(a, b.public_bytes), run_id=7, round=3, node_a=11, node_b=22)
    kb = derive_pairwise(agree(b.private, a.public_bytes), run_id=7, round=3, node_a=22, node_b=11)
    assert ka.mask_seed == kb.mask_seed and ka.share_key == kb.share_key
    assert len(ka.mask_seed) == len(ka.share_key) == 32 and ka.mask_seed != ka.share_key
    secret = agree(a, b.public_bytes)
    others = [derive_pairwise(secret, run_id=8, round=3, node_a=11, node_b=22),
              derive_pairwise(secret, run_id=7, round=4, node_a=11, node_b=22),
              derive_pairwise(secret, run_id=7, round=3, node_a=11, node_b=23)]
    seeds = {ka.mask_seed} | {k.mask_seed for k in others} | {k.share_key for k in others}
    assert len(seeds) == 7
    assert "secret" in repr(ka) and a.private_bytes().hex() not in repr(a)


def test_derive_key_gives_each_purpose_its_own_key():
    secret = agree(KeyPair.generate(), KeyPair.generate().public_bytes)
    ctx = {"run_id": 7, "round": 3, "node_a": 11, "node_b": 22}
    both = derive_pairwise(secret, **ctx)
    assert derive_key(secret, "mask-seed", **ctx) == both.mask_seed
    assert derive_key(secret, "share-key", **{**ctx, "node_a": 22, "node_b": 11}) == both.share_key
    for bad in ("mask", "", None, b"mask-seed"):
        with pytest.raises(PrivacyError, match="key purpose"):
            derive_key(secret, bad, **ctx)
    with pytest.raises(PrivacyError, match="32 bytes"):
        derive_key(secret[:31], "mask-seed", **ctx)


def test_apply_masks_adds_and_subtracts_each_keystream():
    seeds = [(os.urandom(32), 1), (os.urandom(32), -1), (os.urandom(32), 1)]
    words = np.arange(1000, dtype=np.uint32)
    want = np.arange(1000, dtype=np.uint64)
    for seed, sign in seeds:
        stream = keystream(seed, 1000).astype(np.uint64)
        want = want + stream if sign > 0 else want - stream  # uint64 wraps mod 2**64, a multiple of 2**32
    apply_masks_(words, seeds)
    assert np.array_equal(words, (want % 2**32).astype(np.uint32))
    with pytest.raises(PrivacyError, match="32 bytes"):
        apply_masks_(words, [(bytes(31), 1)])


def test_a_recovered_private_key_recomputes_the_pairwise_seed():
    a, b = KeyPair.generate(), KeyPair.generate()
    rebuilt = KeyPair.from_private_bytes(combine(split(a.private_bytes(), 2, 3)[1:], 2))
    assert rebuilt.public_bytes == a.public_bytes
    assert agree(rebuilt, b.public_bytes) == agree(b, a.public_bytes)


def test_key_agreement_rejects_bad_peer_keys():
    with pytest.raises(PrivacyError, match="low-order"):
        agree(KeyPair.generate(), bytes(32))
    with pytest.raises(PrivacyError, match="32 bytes"):
        agree(KeyPair.generate(), bytes(31))
    with pytest.raises(PrivacyError, match="different node ids"):
        derive_pairwise(bytes(32), run_id=1, round=1, node_a=5, node_b=5)


def test_share_encryption_binds_key_and_context():
    key = os.urandom(32)
    ctx = {"sender": 1, "receiver": 2, "round": 3, "stage": "share-keys"}
    blob = encrypt_share(key, b"share bytes", **ctx)
    assert decrypt_share(key, blob, **ctx) == b"share bytes"
    assert encrypt_share(key, b"share bytes", **ctx) != blob  # fresh nonce
    for change in ({"sender": 2, "receiver": 1}, {"round": 4}, {"stage": "unmask"}):
        with pytest.raises(PrivacyError, match="failed authentication"):
            decrypt_share(key, blob, **{**ctx, **change})
    tampered = bytearray(blob)
    tampered[20] ^= 1
    for bad_key, bad_blob in ((key, bytes(tampered)), (os.urandom(32), blob), (key, blob[:20])):
        with pytest.raises(PrivacyError, match="failed authentication"):
            decrypt_share(bad_key, bad_blob, **ctx)


# --------------------------------------------------------------------------- masking


def test_expand_seed_is_deterministic_and_uses_the_whole_seed():
    seed = bytes(range(32))
    a, b = expand_seed(seed, 1000), expand_seed(seed, 1000)
    assert torch.equal(a, b) and a.dtype == torch.int64
    assert int(a.min()) >= 0 and int(a.max()) < 2**32
    assert torch.equal(expand_seed(seed, 10), a[:10])
    assert not torch.equal(expand_seed(seed[:31] + b"\x00", 1000), a)  # the last byte counts
    with pytest.raises(PrivacyError, match="32 bytes"):
        expand_seed(seed[:16], 10)


def _simulate(n: int, dropped: set[int], dim: int, bits: int = 32, graph=None):
    """Run the masking arithmetic of one round; return (server result, plain ring sum)."""
    ids = list(range(100, 100 + n))
    graph = graph or {i: frozenset(set(ids) - {i}) for i in ids}
    pairs = {i: KeyPair.generate() for i in ids}
    self_seeds = {i: os.urandom(32) for i in ids}
    gen = torch.Generator().manual_seed(n)
    qs = {i: quantize(torch.rand(dim, generator=gen) * 2 - 1, 1.0, n, bits, generator=gen) for i in ids}

    def seed(u, v):
        return derive_pairwise(agree(pairs[u], pairs[v].public_bytes), run_id=1, round=1, node_a=u, node_b=v).mask_seed

    survivors = [i for i in ids if i - 100 not in dropped]
    masked = [mask(qs[u], self_seeds[u], {v: seed(u, v) for v in graph[u]}, u, bits) for u in survivors]
    dropped_ids = [i for i in ids if i - 100 in dropped]
    # the server recomputes s_uv from each dropped node's (Shamir-recovered) private key
    dropped_pairwise = {v: {u: seed(v, u) for u in graph[v] if u in survivors} for v in dropped_ids}
    result = unmask(ring_sum(masked, bits), [self_seeds[u] for u in survivors], dropped_pairwise, bits)
    return result, ring_sum([qs[u] for u in survivors], bits), masked


@settings(max_examples=25, deadline=None)
@given(n=st.integers(2, 8), data=st.data(), dim=st.integers(1, 50), bits=st.sampled_from([32, 20]))
def test_unmasked_sum_equals_the_plain_sum_of_survivors(n, data, dim, bits):
    dropped = data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))
    result, plain, _ = _simulate(n, dropped, dim, bits)
    assert torch.equal(result, plain)


def test_unmasking_works_on_a_sparse_graph():
    ids = list(range(100, 112))
    graph = harary_graph(ids, 4, b"public seed")
    result, plain, _ = _simulate(12, {1, 5, 9}, 64, graph=graph)
    assert torch.equal(result, plain)


def test_a_masked_input_looks_uniform():
    q = torch.zeros(1 << 16, dtype=torch.int64)  # the most structured input there is
    seed_rng = np.random.default_rng(7)
    pair_seed = seed_rng.bytes(32)
    masked = mask(q, seed_rng.bytes(32), {2: pair_seed}, 1)
    byte_counts = np.bincount(masked.numpy().astype("<u4").view(np.uint8), minlength=256)
    assert chi_square(byte_counts) < CHI2_999[255]
    top_counts = np.bincount((masked.numpy() >> 28), minlength=16)
    assert chi_square(top_counts) < CHI2_999[15]


@FAST
@given(n=st.integers(1, 50), clip=st.floats(1e-3, 1e3), seed=st.integers(0, 2**31))
def test_dequantized_sum_is_within_n_steps_of_the_float_sum(n, clip, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = (torch.rand(n, 200, generator=gen, dtype=torch.float64) * 2 - 1) * clip
    total = ring_sum([quantize(x, clip, n, generator=gen) for x in xs])
    err = (dequantize(total, n, clip) - xs.sum(0)).abs().max()
    assert err <= n * quantization_step(clip, n) * (1 + 1e-6)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 2**20])
@pytest.mark.parametrize("bits", [32, 16])
def test_the_overflow_bound_holds_at_the_extremes(n, bits):
    clip = 3.5
    if n >= 2**bits:  # a ring too small for n clients is refused, never wrapped
        with pytest.raises(PrivacyError, match="without overflow"):
            quantize(torch.zeros(4), clip, n, bits)
        return
    step = quantization_step(clip, n, bits)
    top = quantize(torch.full((4,), clip), clip, n, bits)
    bottom = quantize(torch.full((4,), -clip), clip, n, bits)
    assert int(top.max()) * n < 2**bits and int(bottom.max()) == 0
    assert torch.allclose(dequantize(top * n, n, clip, bits), torch.full((4,), n * clip, dtype=torch.float64),
                          atol=n * step)
    assert torch.allclose(dequantize(bottom * n, n, clip, bits), torch.full((4,), -n * clip, dtype=torch.float64))
    if n <= 7:  # also through the ring sum, with masks on
        result, plain, _ = _simulate(max(n, 2), set(), 4, bits)
        assert torch.equal(result, plain)


def test_stochastic_rounding_is_unbiased():
    gen = torch.Generator().manual_seed(0)
    clip, n = 1.0, 2**30  # a coarse grid: two levels per unit
    x = torch.full((200_000,), 0.3)
    q = quantize(x, clip, n, generator=gen).to(torch.float64)
    step = quantization_step(clip, n)
    assert abs(float(q.mean()) * step - clip - 0.3) < 0.01 * step


def test_out_of_range_values_raise_unless_clipping_is_asked_for():
    x = torch.tensor([0.5, -2.0, 3.0])
    with pytest.raises(PrivacyError, match="2 values lie outside"):
        quantize(x, 1.0, 4)
    q = quantize(x, 1.0, 1, clipping="clip", generator=torch.Generator().manual_seed(0))
    assert torch.allclose(dequantize(q, 1, 1.0), torch.tensor([0.5, -1.0, 1.0], dtype=torch.float64), atol=1e-6)
    with pytest.raises(PrivacyError, match="NaN"):
        quantize(torch.tensor([float("nan")]), 1.0, 4, clipping="clip")
    with pytest.raises(PrivacyError, match="clip must be"):
        quantize(x, 0.0, 4)
    with pytest.raises(PrivacyError, match="without overflow"):
        quantize(x, 1.0, 2**16, bits=16)


# --------------------------------------------------------------------------- graph


@pytest.mark.parametrize(("n", "k"), [(5, 2), (20, 6), (101, 10), (64, 62), (10, 30)])
def test_harary_graph_is_regular_symmetric_and_seeded(n, k):
    ids = [1000 + 7 * i for i in range(n)]
    g = harary_graph(ids, k, b"round-1")
    degree = min(k, n - 1)
    assert set(g) == set(ids)
    assert all(len(nb) == degree and u not in nb for u, nb in g.items())
    assert all(u in g[v] for u, nb in g.items() for v in nb)
    assert harary_graph(list(reversed(ids)), k, b"round-1") == g
    if degree < n - 1:
        assert harary_graph(ids, k, b"round-2") != g


def test_complete_graph_and_bad_inputs():
    g = complete_graph([3, 1, 2])
    assert g == {1: frozenset({2, 3}), 2: frozenset({1, 3}), 3: frozenset({1, 2})}
    with pytest.raises(PrivacyError, match="even"):
        harary_graph(range(10), 3, b"s")
    with pytest.raises(PrivacyError, match="distinct"):
        harary_graph([1, 1, 2, 3], 2, b"s")


def test_check_threshold():
    check_threshold(3, 4)
    check_threshold(4, 4)
    for t, k in ((2, 4), (5, 4), (1, 2)):
        with pytest.raises(PrivacyError, match="k/2 < t <= k"):
            check_threshold(t, k)


def test_choose_degree_grows_slowly_and_satisfies_the_threshold_rule():
    degrees = [choose_degree(n, 0.1)[0] for n in (100, 1000, 10_000, 100_000)]
    assert degrees == sorted(degrees) and degrees[-1] < 100
    for n in (10, 100, 1000):
        k, t = choose_degree(n, 0.2)
        check_threshold(t, k)
    assert choose_degree(8, 0.3) == (7, 4)
    with pytest.raises(PrivacyError, match="dropout_rate"):
        choose_degree(100, 0.5)


def test_split_bytes_is_split_serialised_and_combines():
    secret = os.urandom(32)
    blobs = split_bytes(secret, 4, 7)
    assert [shamir.share_x(b, 32) for b in blobs] == list(range(1, 8))
    assert {len(b) for b in blobs} == {shamir.share_size(32)}
    shares = [Share.from_bytes(b) for b in blobs]
    assert [s.to_bytes() for s in shares] == blobs
    assert combine(shares[2:6], 4) == secret
    ok, xs, values = shamir.parse_shares(blobs[1:5], 32)
    assert ok.all() and xs.tolist() == [2, 3, 4, 5]
    assert shamir.combine_values(xs, values, 4, 32) == secret


def _mutations(blob: bytes) -> list[bytes]:
    return [blob[:-1], blob + b"\0", b"XXXX" + blob[4:], blob[:4] + bytes(4) + blob[8:],
            blob[:8] + (33).to_bytes(4, "little") + blob[12:], blob[:12] + b"\xff\xff\xff\xff" + blob[16:],
            blob[:4] + (PRIME).to_bytes(4, "little") + blob[8:], b"", blob]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=60), max_size=4), st.integers(0, 2**32 - 1))
def test_parse_shares_accepts_exactly_what_from_bytes_accepts_for_the_length(noise, seed):
    """The vectorised parser (the server's unmasking) and the one-share parser agree on every blob:
    valid shares, each single-field corruption of one, and random bytes."""
    blob = split_bytes(bytes(np.random.default_rng(seed).integers(0, 256, 32, dtype=np.uint8)), 2, 3)[1]
    blobs = _mutations(blob) + noise
    ok, xs, values = shamir.parse_shares(blobs, 32)
    for i, b in enumerate(blobs):
        try:
            s = Share.from_bytes(b)
            good = s.secret_len == 32
        except PrivacyError:
            good = False
        assert ok[i] == good, (i, b[:16])
        if good:
            assert xs[i] == s.x and np.array_equal(values[i], s.values)
            assert shamir.share_x(b, 32) == s.x
        else:
            with pytest.raises(PrivacyError):
                shamir.share_x(b, 32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_quantize_leaves_its_input_alone_and_rounds_as_specified(dtype):
    """The rounding works in place on scratch: never on the caller's tensor (a float64 input is
    not copied by ``.to``); and q = floor(y) + [u < frac(y)], y = (x + clip) / step, exactly."""
    x = (torch.rand(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2 - 1).to(dtype)
    before = x.clone()
    q = quantize(x, 1.0, 10, 32, generator=torch.Generator().manual_seed(2))
    assert torch.equal(x, before)
    y = (x.to(torch.float64) + 1.0) / quantization_step(1.0, 10, 32)
    u = torch.rand(5000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(q, (torch.floor(y) + (u < y - torch.floor(y)).to(torch.float64)).to(torch.int64))
