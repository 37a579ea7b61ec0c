"""Codec contract: every codec round-trips within its bound, adds into an aggregate like a
float64 reference, and rejects malformed encodings with AggregationError before writing."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from aggregation import AggregationError, UpdateRejected, tensor_to_array
from aggregation.codecs import Codec, DenseCodec, Encoded, QSGDCodec, SignCodec, TopKCodec, create_codec
from aggregation.codecs.base import Parsed

NUMEL = 203  # not a multiple of 8 or of any chunk: every codec has a short tail / padding bits
SIZES = [1, 7, 64, 203, 4099]
BIG = 10**9  # max_bytes that never binds
FUZZ = settings(max_examples=40, deadline=None)
# The contract's property tests run on instances of each codec's subclass. They keep no state on
# ``self`` (only class constants and the parametrized config), so differing executors are harmless.
CONTRACT_FUZZ = settings(FUZZ, suppress_health_check=[HealthCheck.differing_executors])
MAGIC = b"\x93NUMPY"

SCALAR_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from([0, 1, 2, 3, 4, 8, 16, 63, 64, 65, 1024, 65536, 131072, NUMEL, NUMEL + 1, -1, 1.0, 2**31,
                     "float16", "float32", "bfloat16", "int32", "dense", "topk", "qsgd", "sign"]),
)
ANY_VALUE = st.one_of(SCALAR_VALUE, st.lists(st.integers(-3, 300), max_size=3))  # ConfigRecord allows lists


def pytest_generate_tests(metafunc):
    if "config" in metafunc.fixturenames and metafunc.cls is not None:
        configs = metafunc.cls.CONFIGS
        metafunc.parametrize("config", configs, ids=["-".join(f"{v}" for v in c.values()) for c in configs])


def _build(config: dict) -> Codec:
    params = {k: v for k, v in config.items() if k != "codec"}
    return create_codec(config["codec"], **params)


def _x(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@lru_cache(maxsize=None)
def _valid(config_items: tuple) -> tuple[Codec, Encoded]:
    codec = _build(dict(config_items))
    enc, _ = codec.encode(_x(NUMEL), generator=torch.Generator().manual_seed(0))
    return codec, enc


def _shares_memory(t: torch.Tensor, array: Array) -> bool:
    base = np.frombuffer(array.data, dtype=np.uint8).ctypes.data
    start = t.data_ptr()
    return base <= start and start + t.numel() * t.element_size() <= base + len(array.data)


def _npy_body_offset(data: bytes) -> int:
    return 10 + int.from_bytes(data[8:10], "little")


def _with(arrays: dict[str, Array], name: str, array: Array) -> dict[str, Array]:
    return {**arrays, name: array}


def _raw(data: bytes, like: Array) -> Array:
    return Array(dtype=like.dtype, shape=tuple(like.shape), stype=like.stype, data=data)


class CodecContract:
    """Tests every codec passes; subclasses set CONFIGS, FINITE, ZERO_COPY and ``assert_within_bound``."""

    CONFIGS: list[dict] = []
    HEADER_VALUES = ANY_VALUE
    FINITE = True  # whether parse guarantees a finite decode
    ZERO_COPY: dict[str, list[str]] = {}  # array name -> parsed tensors that must view its bytes

    def assert_within_bound(self, codec: Codec, x: torch.Tensor, decoded: torch.Tensor, parsed: Parsed) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers

    def valid(self, config) -> tuple[Codec, Encoded]:
        return _valid(tuple(config.items()))

    def rejected(self, codec: Codec, arrays, header, numel: int = NUMEL, max_bytes: int = BIG) -> None:
        sentinel = torch.full((numel,), 7.0)
        with pytest.raises(AggregationError):
            codec.parse(arrays, header, numel, max_bytes)
        assert torch.equal(sentinel, torch.full((numel,), 7.0))

    def parsed_or_rejected(self, codec: Codec, arrays, header, numel: int = NUMEL) -> Parsed | None:
        """Malformed-ish input: AggregationError, or a Parsed whose decode keeps the codec's promises."""
        try:
            parsed = codec.parse(arrays, header, numel, BIG)
        except AggregationError:
            return None
        assert parsed.numel == numel
        decoded = codec.decode(parsed)
        assert decoded.shape == (numel,)
        norm = codec.norm(parsed)
        if self.FINITE:
            assert bool(torch.isfinite(decoded).all())
            assert math.isfinite(norm) and norm >= 0
        return parsed

    # ------------------------------------------------------------------ round trips

    @pytest.mark.parametrize("numel", SIZES)
    def test_round_trip_within_bound(self, config, numel):
        codec = _build(config)
        x = _x(numel, seed=numel)
        enc, _ = codec.encode(x, generator=torch.Generator().manual_seed(1))
        record, header = ArrayRecord(array_dict=enc.arrays), ConfigRecord(enc.header)  # Flower accepts both
        parsed = codec.parse(record, header, numel, BIG)
        assert parsed.codec == codec.name and parsed.nbytes == enc.nbytes
        self.assert_within_bound(codec, x, codec.decode(parsed), parsed)

    def test_config_rebuilds_the_same_codec(self, config):
        codec = _build(config)
        cfg = codec.config()
        ConfigRecord(cfg)  # flat scalars only
        assert cfg["codec"] == codec.name
        again = create_codec(cfg["codec"], **{k: v for k, v in cfg.items() if k != "codec"})
        assert again.config() == cfg
        a, _ = codec.encode(_x(NUMEL), generator=torch.Generator().manual_seed(3))
        b, _ = again.encode(_x(NUMEL), generator=torch.Generator().manual_seed(3))
        assert a.header == b.header
        assert {k: v.data for k, v in a.arrays.items()} == {k: v.data for k, v in b.arrays.items()}

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    @pytest.mark.parametrize("weight", [0.37, 3.0])
    def test_add_into_matches_float64_reference(self, config, dtype, weight):
        codec, enc = self.valid(config)
        parsed = codec.parse(enc.arrays, enc.header, NUMEL, BIG)
        out = _x(NUMEL, seed=9).to(dtype)
        expected = out.double() + weight * codec.decode(parsed).double()
        codec.add_into(parsed, out, weight)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)

    def test_norm_is_the_decoded_norm(self, config):
        codec, enc = self.valid(config)
        parsed = codec.parse(enc.arrays, enc.header, NUMEL, BIG)
        assert codec.norm(parsed) == pytest.approx(float(codec.decode(parsed).double().norm()), rel=1e-5)

    def test_parse_is_zero_copy(self, config):
        codec, enc = self.valid(config)
        parsed = codec.parse(enc.arrays, enc.header, NUMEL, BIG)
        assert self.ZERO_COPY
        for array_name, tensor_names in self.ZERO_COPY.items():
            for name in tensor_names:
                assert _shares_memory(parsed.tensors[name], enc.arrays[array_name]), (array_name, name)

    def test_encode_rejects_bad_input(self, config):
        codec = _build(config)
        with pytest.raises(AggregationError):
            codec.encode(torch.zeros(3, 4))
        with pytest.raises(AggregationError):
            codec.encode(torch.zeros(5), residual=torch.zeros(4))
        with pytest.raises(AggregationError):
            codec.encode(torch.tensor([1.0, float("nan"), 2.0]))

    # ------------------------------------------------------------------ malformed encodings

    def test_wrong_codec_numel_and_budget_are_rejected(self, config):
        codec, enc = self.valid(config)
        self.rejected(codec, enc.arrays, {**enc.header, "codec": "other"})
        self.rejected(codec, enc.arrays, enc.header, numel=NUMEL + 1)
        self.rejected(codec, enc.arrays, enc.header, max_bytes=enc.nbytes - 1)
        codec.parse(enc.arrays, enc.header, NUMEL, enc.nbytes)  # the exact budget is fine

    def test_wrong_array_names_are_rejected(self, config):
        codec, enc = self.valid(config)
        first = sorted(enc.arrays)[0]
        renamed = {(f"{k}_x" if k == first else k): v for k, v in enc.arrays.items()}
        self.rejected(codec, renamed, enc.header)
        self.rejected(codec, {k: v for k, v in enc.arrays.items() if k != first}, enc.header)
        self.rejected(codec, _with(enc.arrays, "extra", enc.arrays[first]), enc.header)

    @CONTRACT_FUZZ
    @given(data=st.data())
    def test_fuzzed_header_is_rejected_or_valid(self, config, data):
        codec, enc = self.valid(config)
        header = dict(enc.header)
        fld = data.draw(st.sampled_from([*sorted(header), "extra"]))
        if data.draw(st.booleans()):
            header.pop(fld, None)
        else:
            header[fld] = data.draw(self.HEADER_VALUES)
        self.parsed_or_rejected(codec, enc.arrays, header)

    @CONTRACT_FUZZ
    @given(data=st.data())
    def test_random_array_bytes_are_rejected(self, config, data):
        codec, enc = self.valid(config)
        name = data.draw(st.sampled_from(sorted(enc.arrays)))
        raw = data.draw(st.binary(max_size=600))
        assume(not raw.startswith(MAGIC))
        self.rejected(codec, _with(enc.arrays, name, _raw(raw, enc.arrays[name])), enc.header)

    @CONTRACT_FUZZ
    @given(data=st.data())
    def test_random_body_is_rejected_or_valid(self, config, data):
        codec, enc = self.valid(config)
        name = data.draw(st.sampled_from(sorted(enc.arrays)))
        old = enc.arrays[name].data
        start = _npy_body_offset(old)
        body = data.draw(st.binary(min_size=len(old) - start, max_size=len(old) - start))
        self.parsed_or_rejected(codec, _with(enc.arrays, name, _raw(old[:start] + body, enc.arrays[name])), enc.header)

    @CONTRACT_FUZZ
    @given(data=st.data())
    def test_truncated_or_extended_arrays_are_rejected(self, config, data):
        codec, enc = self.valid(config)
        name = data.draw(st.sampled_from(sorted(enc.arrays)))
        old = enc.arrays[name]
        change = data.draw(st.integers(-len(old.data), 64).filter(lambda d: d != 0))
        data_bytes = old.data[: len(old.data) + change] if change < 0 else old.data + bytes(change)
        self.rejected(codec, _with(enc.arrays, name, _raw(data_bytes, old)), enc.header)
        # ... and a self-consistent npy array of the wrong length is rejected by the codec itself.
        itemsize = np.dtype(old.dtype).itemsize
        length = len(old.data) - _npy_body_offset(old.data)
        new_len = max(0, length // itemsize + data.draw(st.integers(-3, 3).filter(lambda d: d != 0)))
        wrong = tensor_to_array(torch.zeros(new_len, dtype=getattr(torch, old.dtype)))
        self.rejected(codec, _with(enc.arrays, name, wrong), enc.header)

    @CONTRACT_FUZZ
    @given(data=st.data())
    def test_wrong_array_metadata_is_rejected(self, config, data):
        codec, enc = self.valid(config)
        name = data.draw(st.sampled_from(sorted(enc.arrays)))
        old = enc.arrays[name]
        which = data.draw(st.sampled_from(["dtype", "shape", "stype"]))
        dtype, shape, stype = old.dtype, tuple(old.shape), old.stype
        if which == "dtype":
            dtype = data.draw(st.sampled_from(["float32", "float16", "int8", "int16", "int32", "int64", "uint8",
                                               "bfloat16", "float64", ""]).filter(lambda d: d != old.dtype))
        elif which == "shape":
            shape = data.draw(st.lists(st.integers(0, 2**33), max_size=3).map(tuple).filter(lambda s: s != shape))
        else:
            stype = data.draw(st.text(max_size=12).filter(lambda s: s != old.stype))
        self.rejected(codec, _with(enc.arrays, name, Array(dtype=dtype, shape=shape, stype=stype, data=old.data)),
                      enc.header)


# ====================================================================== dense


class TestDense(CodecContract):
    CONFIGS = [{"codec": "dense", "dtype": d} for d in ("float32", "float16", "bfloat16")]
    FINITE = False  # dense forwards any float; the robust layer judges the norm
    HEADER_VALUES = SCALAR_VALUE  # list values hit the known bug below
    ZERO_COPY = {"values": ["values"]}
    RTOL = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}

    def assert_within_bound(self, codec, x, decoded, parsed):
        atol = 0.0 if codec.dtype == "float32" else 2.0**-24
        torch.testing.assert_close(decoded, x, rtol=self.RTOL[codec.dtype], atol=atol)

    def test_list_valued_dtype_is_rejected(self):
        codec, enc = self.valid(self.CONFIGS[0])
        self.rejected(codec, enc.arrays, {**enc.header, "dtype": ["float32"]})


# ====================================================================== topk


def _topk_payload(indices, values, value_dtype="float32") -> Array:
    idx = torch.tensor(indices, dtype=torch.int64).to(torch.int32)
    vals = torch.tensor(values, dtype=getattr(torch, value_dtype))
    return tensor_to_array(torch.cat([idx.view(torch.uint8), vals.view(torch.uint8)]))


class TestTopK(CodecContract):
    CONFIGS = [{"codec": "topk", "ratio": r, "value_dtype": d, "error_feedback": True}
               for d in ("float32", "float16") for r in (0.01, 0.1, 1.0)]
    ZERO_COPY = {"payload": ["indices", "values"]}

    def assert_within_bound(self, codec, x, decoded, parsed):
        idx = parsed.tensors["indices"].long()
        k = codec.k_for(x.numel())
        assert idx.numel() == k and bool((idx[1:] > idx[:-1]).all())
        rest = torch.ones_like(x, dtype=torch.bool)
        rest[idx] = False
        assert bool((decoded[rest] == 0).all())
        if rest.any():
            assert float(x[idx].abs().min()) >= float(x[rest].abs().max())  # the k largest |x|
        if codec.value_dtype == "float32":
            assert torch.equal(decoded[idx], x[idx])
        else:  # half an ulp, or half the smallest subnormal
            torch.testing.assert_close(decoded[idx], x[idx], rtol=2.0**-11, atol=2.0**-25)

    @pytest.mark.parametrize(("ratio", "numel", "k"), [(0.01, 9610, 97), (0.07, 100, 7), (1e-9, 50, 1), (1.0, 5, 5),
                                                      (0.5, 3, 2)])
    def test_k_is_ceil_of_ratio_times_numel(self, ratio, numel, k):
        assert TopKCodec(ratio=ratio).k_for(numel) == k

    def test_one_percent_fp16_is_50x_smaller_than_dense_fp32(self):
        x = _x(9610)
        dense, _ = DenseCodec("float32").encode(x)
        sparse, _ = TopKCodec(ratio=0.01, value_dtype="float16").encode(x)
        assert len(sparse.arrays) == 1
        assert dense.nbytes / sparse.nbytes >= 50, (dense.nbytes, sparse.nbytes)

    @pytest.mark.parametrize("value_dtype", ["float32", "float16"])
    def test_error_feedback_loses_nothing(self, value_dtype):
        codec = TopKCodec(ratio=0.05, value_dtype=value_dtype)
        total_in, total_out, residual = torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(NUMEL), None
        for t in range(20):
            delta = _x(NUMEL, seed=100 + t)
            enc, residual = codec.encode(delta, residual)
            codec.add_into(codec.parse(enc.arrays, enc.header, NUMEL, BIG), total_out, 1.0)
            total_in += delta.double()
        torch.testing.assert_close(total_out.double() + residual.double(), total_in, rtol=0, atol=1e-4)

    def test_without_error_feedback_there_is_no_residual(self):
        assert TopKCodec(error_feedback=False).encode(_x(10))[1] is None

    def test_float16_saturates_instead_of_overflowing(self):
        codec = TopKCodec(ratio=0.5, value_dtype="float16")
        enc, residual = codec.encode(torch.tensor([1e6, -2e5, 1.0, 0.0]))
        decoded = codec.decode(codec.parse(enc.arrays, enc.header, 4, BIG))
        assert decoded.tolist() == [65504.0, -65504.0, 0.0, 0.0]
        assert residual.tolist() == [1e6 - 65504.0, -2e5 + 65504.0, 1.0, 0.0]

    @pytest.mark.parametrize("params", [{"ratio": 0}, {"ratio": 1.5}, {"ratio": float("nan")}, {"ratio": True},
                                        {"ratio": "0.1"}, {"value_dtype": "bfloat16"}, {"value_dtype": 16},
                                        {"error_feedback": 1}, {"k": 3}])
    def test_bad_params_are_rejected(self, params):
        with pytest.raises(AggregationError):
            create_codec("topk", **params)
        with pytest.raises(TypeError):
            TopKCodec(0.1)  # keyword-only

    @pytest.mark.parametrize(("indices", "why"), [([0, 0, 5], "duplicate"), ([5, 3, 9], "unsorted"),
                                                  ([-1, 3, 9], "negative"), ([1, 2, NUMEL], "past the end"),
                                                  ([1, 2, 2**31 - 1], "huge")])
    def test_bad_indices_are_rejected(self, indices, why):
        codec = TopKCodec(ratio=0.01)
        header = {"codec": "topk", "numel": NUMEL, "k": 3, "value_dtype": "float32"}
        codec.parse({"payload": _topk_payload([1, 2, 3], [1.0, 2.0, 3.0])}, header, NUMEL, BIG)  # control
        self.rejected(codec, {"payload": _topk_payload(indices, [1.0, 2.0, 3.0])}, header)

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
    @pytest.mark.parametrize("value_dtype", ["float32", "float16"])
    def test_non_finite_values_are_rejected(self, bad, value_dtype):
        header = {"codec": "topk", "numel": NUMEL, "k": 3, "value_dtype": value_dtype}
        self.rejected(TopKCodec(), {"payload": _topk_payload([1, 2, 3], [1.0, bad, 3.0], value_dtype)}, header)

    @pytest.mark.parametrize(("k", "value_dtype"), [(0, "float32"), (NUMEL + 1, "float32"), (3.0, "float32"),
                                                    (True, "float32"), ("3", "float32"), (3, "bfloat16"),
                                                    (3, ["float32"]), (None, "float32"), (2, "float32"),
                                                    (3, "float16")])
    def test_bad_header_fields_are_rejected(self, k, value_dtype):
        header = {"codec": "topk", "numel": NUMEL, "k": k, "value_dtype": value_dtype}
        self.rejected(TopKCodec(), {"payload": _topk_payload([1, 2, 3], [1.0, 2.0, 3.0])}, header)

    @FUZZ
    @given(indices=st.lists(st.one_of(st.integers(-3, NUMEL + 3), st.integers(-(2**31), 2**31 - 1)), min_size=5,
                            max_size=5),
           values=st.lists(st.floats(width=32), min_size=5, max_size=5))
    def test_parse_accepts_exactly_sorted_in_range_finite(self, indices, values):
        header = {"codec": "topk", "numel": NUMEL, "k": 5, "value_dtype": "float32"}
        arrays = {"payload": _topk_payload(indices, values)}
        ok = all(0 <= i < NUMEL for i in indices) and all(a < b for a, b in zip(indices, indices[1:], strict=False))
        ok = ok and all(math.isfinite(v) for v in values)
        if ok:
            decoded = TopKCodec().decode(TopKCodec().parse(arrays, header, NUMEL, BIG))
            assert decoded[indices].tolist() == torch.tensor(values).tolist()
        else:
            self.rejected(TopKCodec(), arrays, header)


# ====================================================================== qsgd


def _per_coordinate_scale(parsed: Parsed, numel: int) -> torch.Tensor:
    return parsed.tensors["scales"].double()[torch.arange(numel) // parsed.params["chunk"]]


def _step(parsed: Parsed, numel: int) -> torch.Tensor:
    """Per-coordinate quantization step 2s / (2**bits - 1)."""
    return 2 * _per_coordinate_scale(parsed, numel) / (2 ** parsed.params["bits"] - 1)


class TestQSGD(CodecContract):
    CONFIGS = [{"codec": "qsgd", "bits": b, "chunk": c} for b in (2, 4, 8) for c in (64, 65536)]
    ZERO_COPY = {"codes": ["codes"], "scales": ["scales"]}

    def assert_within_bound(self, codec, x, decoded, parsed):
        err = (decoded.double() - x.double()).abs()
        assert bool((err <= _step(parsed, x.numel()) * (1 + 1e-6) + 1e-30).all())
        assert bool((decoded.abs() <= _per_coordinate_scale(parsed, x.numel())).all())

    @pytest.mark.parametrize("numel", [203, 512])
    def test_unbiased(self, config, numel):
        codec, draws = _build(config), 400
        x = _x(numel, seed=5)
        x[:8] = 0.0  # exact zeros, too
        gen = torch.Generator().manual_seed(1234)
        total = torch.zeros(numel, dtype=torch.float64)
        for _ in range(draws):
            enc, residual = codec.encode(x, generator=gen)
            assert residual is None
            parsed = codec.parse(enc.arrays, enc.header, numel, BIG)
            total += codec.decode(parsed).double()
        step = _step(parsed, numel)
        mean_err = total / draws - x.double()
        # Each decode is x + step * (B - f), B ~ Bernoulli(f): variance step^2 f (1 - f) <= step^2 / 4.
        t = x.double() / step + (2**codec.bits - 1) / 2  # (x / s + 1) * M / 2, in [0, M]
        f = t - t.floor()
        sigma = step * torch.sqrt(f * (1 - f) / draws)
        # per coordinate: Hoeffding at 1e-6 (distribution-free, union over coordinates)
        assert bool((mean_err.abs() <= step * math.sqrt(math.log(2 * numel / 1e-6) / (2 * draws)) + 1e-12).all())
        # all coordinates together: the standardized mean error is N(0, 1/numel) -> 5 sigma
        z = (mean_err[sigma > 0] / sigma[sigma > 0]).sum() / math.sqrt(int((sigma > 0).sum()))
        assert abs(float(z)) < 5.0

    @pytest.mark.parametrize("bits", [2, 4, 8])
    def test_codes_take_bits_per_coordinate(self, bits):
        numel = 10_000
        enc, _ = QSGDCodec(bits=bits).encode(_x(numel))
        codes = enc.arrays["codes"].data
        assert len(codes) - _npy_body_offset(codes) == math.ceil(numel * bits / 8)
        assert len(codes) <= numel * bits / 8 + 128

    @pytest.mark.parametrize("bits", [1, 2, 4, 8])
    def test_pack_unpack_round_trip(self, bits):
        from aggregation.codecs.qsgd import pack_codes, unpack_levels

        m = 2**bits - 1
        codes = torch.randint(0, 2**bits, (37,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
        levels = unpack_levels(pack_codes(codes, bits), bits, 37)
        assert torch.equal(levels, (2 * codes.float() - m) / m)
        assert float(levels.abs().max()) <= 1.0

    @pytest.mark.parametrize("bits", [1, 2, 4])
    @pytest.mark.parametrize("numel", [1, 37, 4096])
    def test_the_gpu_unpacking_by_shifts_equals_the_table(self, bits, numel):
        from aggregation.codecs.qsgd import pack_codes, unpack_levels, unpack_levels_by_shifts

        codes = torch.randint(0, 2**bits, (numel,), dtype=torch.uint8, generator=torch.Generator().manual_seed(numel))
        packed = pack_codes(codes, bits)
        assert torch.equal(unpack_levels_by_shifts(packed, bits, numel), unpack_levels(packed, bits, numel))

    def test_zero_chunks_decode_to_zero(self):
        codec = QSGDCodec(bits=2, chunk=64)
        x = torch.zeros(200)
        x[70] = 3.0
        enc, _ = codec.encode(x)
        decoded = codec.decode(codec.parse(enc.arrays, enc.header, 200, BIG))
        assert bool((decoded[:64] == 0).all()) and bool((decoded[128:] == 0).all())

    @pytest.mark.parametrize("params", [{"bits": 3}, {"bits": 1}, {"bits": 16}, {"bits": 8.0}, {"bits": True},
                                        {"chunk": 32}, {"chunk": 1000}, {"chunk": 131072}, {"chunk": "1024"},
                                        {"chunk": 1024.0}, {"ratio": 0.1}])
    def test_bad_params_are_rejected(self, params):
        with pytest.raises(AggregationError):
            create_codec("qsgd", **params)

    @pytest.mark.parametrize(("bits", "chunk"), [(3, 64), (2.0, 64), (True, 64), ("2", 64), (None, 64), (2, 96),
                                                 (2, 32), (2, 131072), (2, 64.0), (2, [64]), (4, 64), (2, 128)])
    def test_bad_header_fields_are_rejected(self, bits, chunk):
        codec, enc = self.valid({"codec": "qsgd", "bits": 2, "chunk": 64})
        self.rejected(codec, enc.arrays, {**enc.header, "bits": bits, "chunk": chunk})

    @FUZZ
    @given(scales=st.lists(st.floats(width=32), min_size=4, max_size=4))
    def test_parse_accepts_exactly_finite_non_negative_scales(self, scales):
        codec, enc = self.valid({"codec": "qsgd", "bits": 2, "chunk": 64})
        arrays = _with(enc.arrays, "scales", tensor_to_array(torch.tensor(scales, dtype=torch.float32)))
        if all(math.isfinite(s) and s >= 0 for s in scales):
            self.parsed_or_rejected(codec, arrays, enc.header)
            codec.parse(arrays, enc.header, NUMEL, BIG)
        else:
            self.rejected(codec, arrays, enc.header)

    @FUZZ
    @given(last=st.integers(0, 255), bits=st.sampled_from([2, 4]))
    def test_nonzero_padding_bits_are_rejected(self, last, bits):
        codec, enc = self.valid({"codec": "qsgd", "bits": bits, "chunk": 64})
        codes = torch.frombuffer(bytearray(enc.arrays["codes"].data[_npy_body_offset(enc.arrays["codes"].data):]),
                                 dtype=torch.uint8)
        codes[-1] = last
        arrays = _with(enc.arrays, "codes", tensor_to_array(codes))
        used = NUMEL * bits % 8
        if last >> used == 0:
            codec.parse(arrays, enc.header, NUMEL, BIG)
        else:
            self.rejected(codec, arrays, enc.header)


# ====================================================================== sign


class TestSign(CodecContract):
    CONFIGS = [{"codec": "sign", "error_feedback": True}, {"codec": "sign", "error_feedback": False}]
    ZERO_COPY = {"bits": ["bits"], "scale": ["scale"]}

    def assert_within_bound(self, codec, x, decoded, parsed):
        scale = torch.tensor(parsed.params["scale"], dtype=torch.float32)
        assert float(scale) == pytest.approx(float(x.double().abs().mean()), rel=1e-6)
        assert torch.equal(decoded, torch.where(x >= 0, scale, -scale))

    def test_zero_counts_as_positive(self):
        codec = SignCodec()
        enc, residual = codec.encode(torch.tensor([0.0, -0.0, -2.0, 2.0]))
        decoded = codec.decode(codec.parse(enc.arrays, enc.header, 4, BIG))
        assert decoded.tolist() == [1.0, 1.0, -1.0, 1.0]
        assert residual.tolist() == [-1.0, -1.0, -1.0, 1.0]

    def test_one_bit_per_coordinate(self):
        numel = 10_001
        enc, _ = SignCodec().encode(_x(numel))
        bits = enc.arrays["bits"].data
        assert len(bits) - _npy_body_offset(bits) == math.ceil(numel / 8)
        assert enc.nbytes <= math.ceil(numel / 8) + 2 * 128 + 4  # two npy headers and one float32

    def test_error_feedback_loses_nothing(self):
        codec = SignCodec()
        total_in, total_out, residual = torch.zeros(NUMEL, dtype=torch.float64), torch.zeros(NUMEL), None
        for t in range(20):
            delta = _x(NUMEL, seed=200 + t)
            enc, residual = codec.encode(delta, residual)
            codec.add_into(codec.parse(enc.arrays, enc.header, NUMEL, BIG), total_out, 1.0)
            total_in += delta.double()
        torch.testing.assert_close(total_out.double() + residual.double(), total_in, rtol=0, atol=1e-4)

    @pytest.mark.parametrize("params", [{"error_feedback": 1}, {"error_feedback": "yes"}, {"scale": 1.0}])
    def test_bad_params_are_rejected(self, params):
        with pytest.raises(AggregationError):
            create_codec("sign", **params)

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, -1e-30])
    def test_bad_scale_is_rejected(self, bad):
        codec, enc = self.valid({"codec": "sign", "error_feedback": True})
        arrays = _with(enc.arrays, "scale", tensor_to_array(torch.tensor([bad], dtype=torch.float32)))
        self.rejected(codec, arrays, enc.header)

    @FUZZ
    @given(last=st.integers(0, 255))
    def test_nonzero_padding_bits_are_rejected(self, last):
        codec, enc = self.valid({"codec": "sign", "error_feedback": True})
        data = enc.arrays["bits"].data
        bits = torch.frombuffer(bytearray(data[_npy_body_offset(data):]), dtype=torch.uint8)
        bits[-1] = last
        arrays = _with(enc.arrays, "bits", tensor_to_array(bits))
        if last >> (NUMEL % 8) == 0:
            codec.parse(arrays, enc.header, NUMEL, BIG)
        else:
            self.rejected(codec, arrays, enc.header)


def test_every_codec_has_a_contract_class():
    covered = {c["codec"] for cls in (TestDense, TestTopK, TestQSGD, TestSign) for c in cls.CONFIGS}
    from aggregation.codecs import available_codecs

    assert covered == set(available_codecs())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dense_values_past_the_wire_range_saturate_instead_of_becoming_inf(dtype):
    """float16 turned 1e5 into inf on the wire, which the coordinator then rejected as non-finite."""
    codec = create_codec("dense", dtype=dtype)
    x = torch.tensor([1e5, -1e5, 1.0, 3.4e38])
    enc, _ = codec.encode(x)
    got = codec.decode(codec.parse(enc.arrays, enc.header, 4, BIG))
    limit = torch.finfo(getattr(torch, dtype)).max
    assert torch.isfinite(got).all() and got[2] == 1.0 and got[3] == limit
    if dtype == "float16":
        assert got[0] == limit and got[1] == -limit


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dense_norm_of_a_long_update_stays_accurate(dtype):
    """The norm decides rejection and norm-bounded scaling: one float32 reduction over 8M elements
    was off by 3e-5 (the dot) to 3e-4 (vector_norm: float16, bfloat16) on CPU, where CUDA's was not."""
    codec = create_codec("dense", dtype=dtype)
    x = torch.randn(8_000_000, generator=torch.Generator().manual_seed(0)) * 3
    enc, _ = codec.encode(x)
    parsed = codec.parse(enc.arrays, enc.header, x.numel(), BIG)
    exact = float(torch.linalg.vector_norm(codec.decode(parsed).double()))
    assert codec.norm(parsed) == pytest.approx(exact, rel=1e-5)


def test_dense_norm_past_float32s_range_is_non_finite_on_every_path():
    """Blocks each within float32, their total past it: the blockwise float64 sum had made the norm a
    finite 2e19, so ``add_checked`` accepted what ``add_checked_many`` rejected as non-finite."""
    from aggregation import create_aggregator
    from aggregation.codecs.dense import BLOCK

    codec = create_codec("dense")
    x = torch.zeros(2 * BLOCK)
    x[0] = x[BLOCK] = 1.4e19  # each square 1.96e38 < 3.4e38, their sum past it
    enc, _ = codec.encode(x)
    parsed = codec.parse(enc.arrays, enc.header, x.numel(), BIG)
    assert codec.norm(parsed) == math.inf
    one = create_aggregator("mean", x.numel(), "cpu", 1)
    with pytest.raises(UpdateRejected) as rej:
        one.add_checked(codec, parsed, 1.0)
    many = create_aggregator("mean", x.numel(), "cpu", 1)
    (res,) = many.add_checked_many(codec, [parsed], [1.0])
    assert rej.value.rule == res.rule == "non-finite"


def test_dense_dtype_of_the_wrong_type_is_an_aggregation_error():
    with pytest.raises(AggregationError, match="dense dtype must be one of"):
        create_codec("dense", dtype=["float32"])  # was TypeError: unhashable type: 'list'


def test_topk_sends_its_exact_ranges_always_and_keeps_no_residual_there():
    """A model's running statistics (values to average) ride beside top-k's k, exactly, outside its error feedback:
    sparsified and delayed, a BatchNorm CNN's variances went to 0 and below (a new user's)."""
    x = torch.zeros(100)
    x[[3, 50, 97]] = torch.tensor([5.0, -6.0, 7.0])
    x[10:14] = torch.tensor([1e-3, -2e-3, 0.0, 4e-3])  # small statistics' deltas: plain top-k would drop them
    x[60] = 9e-4
    codec = TopKCodec(ratio=0.03, exact=[10, 4, 60, 1])
    enc, residual = codec.encode(x)
    assert enc.header["k"] == codec.k_for(95) + 5 == 8
    parsed = codec.parse(enc.arrays, enc.header, 100, 10**6)
    out = torch.zeros(100)
    codec.add_into(parsed, out, 1.0)
    kept = [3, 10, 11, 12, 13, 50, 60, 97]
    assert torch.equal(out[kept], x[kept]) and out.count_nonzero() == 7  # (x[12] is 0)
    assert torch.equal(residual[kept], torch.zeros(len(kept))) and torch.equal(residual + out, x)
    assert create_codec("topk", **{k: v for k, v in codec.config().items() if k != "codec"}).config() == codec.config()
    assert "exact" not in TopKCodec(ratio=0.03).config()  # (an update without statistics: the header as before)
    big = TopKCodec(ratio=1.0, exact=[0, 100])  # every coordinate exact: k = n
    assert big.encode(x)[0].header["k"] == 100
    for bad in ([10], [10, 0], [10, 4, 12, 1], [-1, 2], [1.0, 2], "0,1"):
        with pytest.raises(AggregationError, match="topk exact must"):
            TopKCodec(exact=bad)
    with pytest.raises(AggregationError, match=r"topk exact must lie in \[0, 100\)"):
        TopKCodec(exact=[99, 2]).encode(x)
