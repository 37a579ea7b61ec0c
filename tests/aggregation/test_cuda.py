"""The aggregation core on a real CUDA device, against the CPU path and float64 references.

Skipped where no GPU is present (CI has none): run on a GPU machine with
``FEDSHIELD_DEVICE=cuda python -m pytest tests/aggregation/test_cuda.py`` (``benchmarks/gpu_check.sh``
does, with the CUDA benchmarks). Every other aggregation test drives the same code on CPU; these
check what only a GPU exercises: the pinned, stream-ordered staging of ``aggregation.staging``
(real events and a side copy stream), the topk / median paths that differ by device, codecs that
encode device tensors, and server optimizers whose state lives on the device.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from aggregation import UpdateRejected, create_aggregator, create_server_optimizer
from aggregation.codecs import create_codec
from aggregation.staging import CudaOps, DeviceStager

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")
CODECS = [("dense", {}), ("dense", {"dtype": "float16"}), ("dense", {"dtype": "bfloat16"}),
          ("topk", {"ratio": 0.01}), ("topk", {"ratio": 0.01, "value_dtype": "float16"}),
          ("qsgd", {"bits": 8}), ("qsgd", {"bits": 4}), ("qsgd", {"bits": 2, "chunk": 64}), ("sign", {})]
NUMEL = 300_007  # odd: a partial qsgd chunk, a partial staging alignment unit, a partial kernel block
BIG = 1 << 40


def _updates(n: int, numel: int = NUMEL, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen) * (0.5 + i % 3) for i in range(n)]


def _parsed(codec, xs: list[torch.Tensor], seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in xs:
        enc = codec.encode(x, None, gen)[0]
        out.append(codec.parse(enc.arrays, enc.header, x.numel(), BIG))
    return out


def _reference_mean(codec, parsed, weights) -> torch.Tensor:
    """The weighted mean of the decoded updates, in float64 on the CPU."""
    total = sum(w * codec.decode(p, "cpu").double() for p, w in zip(parsed, weights))
    return total / sum(weights)


def _close(got: torch.Tensor, ref: torch.Tensor, rel: float = 1e-5) -> None:
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    assert bool(torch.isfinite(got).all())
    err = float(torch.linalg.vector_norm(got - ref)) / max(float(torch.linalg.vector_norm(ref)), 1e-30)
    assert err <= rel, err


@pytest.mark.parametrize("name,params", CODECS, ids=[f"{n}-{p}" for n, p in CODECS])
@pytest.mark.parametrize("batched", [True, False], ids=["batch", "single"])
def test_mean_on_cuda_equals_the_reference_and_the_cpu_path(name, params, batched):
    codec = create_codec(name, **params)
    parsed = _parsed(codec, _updates(24))
    weights = [float(10 + 7 * i) for i in range(len(parsed))]
    results = {}
    for dev in ("cpu", CUDA):
        agg = create_aggregator("mean", NUMEL, dev, len(parsed))
        if batched:
            norms = agg.add_checked_many(codec, parsed, weights, 1e9)
            assert not any(isinstance(r, UpdateRejected) for r in norms)
        else:
            norms = [agg.add_checked(codec, p, w, 1e9) for p, w in zip(parsed, weights)]
        results[str(dev)] = (agg.result(), norms)
        if dev == CUDA and batched:
            assert agg.staging is not None and agg.staging.slot_bytes > 0  # the updates went through pinned slots
    ref = _reference_mean(codec, parsed, weights)
    _close(results["cuda"][0], ref)
    assert results["cuda"][0].device.type == "cuda"
    _close(results["cuda"][0], results["cpu"][0].double())
    for a, b in zip(results["cuda"][1], results["cpu"][1]):
        assert math.isclose(a, b, rel_tol=1e-5)


@pytest.mark.parametrize("name,params", [("dense", {}), ("topk", {"ratio": 0.05}), ("qsgd", {"bits": 4}), ("sign", {})])
def test_rejected_updates_leave_nothing_on_cuda(name, params):
    """A too-large update in the middle of a CUDA batch is refused with its rule; the rest is the
    mean of the others, bit for bit what the batch without it gives."""
    codec = create_codec(name, **params)
    xs = _updates(9, seed=3)
    xs[4] = xs[4] * 1e4
    parsed = _parsed(codec, xs)
    weights = [1.0 + i for i in range(9)]
    max_norm = 5 * max(float(codec.norm(p)) for i, p in enumerate(parsed) if i != 4)
    agg = create_aggregator("mean", NUMEL, CUDA, 9)
    res = agg.add_checked_many(codec, parsed, weights, max_norm)
    assert isinstance(res[4], UpdateRejected) and res[4].rule == "norm-too-large"
    assert agg.count == 8
    clean = create_aggregator("mean", NUMEL, CUDA, 8)
    keep = [i for i in range(9) if i != 4]
    clean.add_checked_many(codec, [parsed[i] for i in keep], [weights[i] for i in keep], max_norm)
    assert torch.equal(agg.result(), clean.result())


def test_non_finite_dense_update_is_refused_on_cuda():
    from tests.aggregation.helpers import sent

    codec = create_codec("dense")
    xs = _updates(4, seed=5)
    xs[2][123] = math.nan
    parsed = []
    for x in xs:
        enc = sent(codec, x)
        parsed.append(codec.parse(enc.arrays, enc.header, NUMEL, BIG))
    agg = create_aggregator("mean", NUMEL, CUDA, 4)
    res = agg.add_checked_many(codec, parsed, [1.0] * 4, 1e9)
    assert isinstance(res[2], UpdateRejected) and res[2].rule == "non-finite"
    _close(agg.result(), _reference_mean(codec, [parsed[i] for i in (0, 1, 3)], [1.0] * 3))


ROBUST = [("median", {}, 7), ("median", {}, 8), ("trimmed-mean", {"beta": 0.2}, 10), ("krum", {"f": 2}, 9),
          ("multi-krum", {"f": 2, "m": 4}, 9), ("norm-bounded-mean", {"clip": 300.0}, 6)]


@pytest.mark.parametrize("rule,params,n", ROBUST, ids=[f"{r}-{n}" for r, _, n in ROBUST])
def test_robust_rules_on_cuda_equal_the_cpu_path(rule, params, n):
    codec = create_codec("dense")
    xs = _updates(n, seed=7)
    xs[1] = -20 * xs[1]  # one attacker: sign-flipped and scaled
    parsed = _parsed(codec, xs)
    weights = [1.0 + (i % 4) for i in range(n)]
    chunk = {} if rule == "norm-bounded-mean" else {"chunk_size": 50_001}  # several column chunks
    out = {}
    for dev in ("cpu", CUDA):
        agg = create_aggregator(rule, NUMEL, dev, n, **params, **chunk)
        res = agg.add_checked_many(codec, parsed, weights, 1e9)
        assert not any(isinstance(r, UpdateRejected) for r in res)
        out[str(dev)] = (agg.result(), getattr(agg, "selected", None))
    got, want = out["cuda"], out["cpu"]
    assert got[0].device.type == "cuda"
    assert got[1] == want[1]  # Krum's choices
    if rule == "median":  # only a selection (and, for an even count, a float64 mean of two): exact
        assert torch.equal(got[0].cpu(), want[0])
    else:
        _close(got[0], want[0].double(), 1e-6)


@pytest.mark.parametrize("rule,params", [("norm-bounded-mean", {"clip": 300.0}), ("median", {}),
                                         ("trimmed-mean", {"beta": 0.2})])
@pytest.mark.parametrize("name,codec_params", [("qsgd", {"bits": 8}), ("qsgd", {"bits": 2, "chunk": 64}),
                                               ("topk", {"ratio": 0.01}), ("sign", {})])
def test_compressed_updates_under_robust_rules_on_cuda_equal_the_cpu_path(rule, params, name, codec_params):
    """These rules read each staged update's norm (qsgd's on the host: its codes copied back from the
    device, which must land before they are read) or decode it into their buffer."""
    codec = create_codec(name, **codec_params)
    parsed = _parsed(codec, _updates(10, seed=17))
    out = {}
    for dev in ("cpu", CUDA):
        agg = create_aggregator(rule, NUMEL, dev, 10, **params)
        norms = agg.add_checked_many(codec, parsed, [1.0 + i for i in range(10)], 1e9)
        out[str(dev)] = (agg.result(), norms)
    _close(out["cuda"][0], out["cpu"][0].double(), 1e-6)
    for a, b in zip(out["cuda"][1], out["cpu"][1]):
        assert math.isclose(a, b, rel_tol=1e-6)


def test_staging_pipeline_with_real_streams_and_growing_slots():
    """Updates of growing sizes through two pinned slots on a side copy stream: every update is
    added whole (a missing wait shows as a wrong sum, a freed slot still in use as garbage)."""
    codec = create_codec("dense")
    sizes = [1000, 1000, 50_000, 3, 200_000, 200_000, 1_000_003, 17, 1_000_003, 1_000_003]
    xs = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(sizes)]
    parsed = [_parsed(codec, [x])[0] for x in xs]
    stager = DeviceStager(CUDA)
    assert isinstance(stager.ops, CudaOps)
    sums = torch.zeros(len(xs), dtype=torch.float64, device=CUDA)
    for i, p in enumerate(stager.pipeline(parsed)):
        t = p.tensors["values"]
        assert t.device.type == "cuda" and t.numel() == sizes[i]
        # a slow reader: the next update's copy runs meanwhile into the other slot
        sums[i] = (t.double() * torch.linspace(0.5, 1.5, t.numel(), device=CUDA, dtype=torch.float64)).sum()
    torch.cuda.synchronize()
    want = torch.stack([(x.double() * torch.linspace(0.5, 1.5, x.numel(), dtype=torch.float64)).sum() for x in xs])
    assert torch.allclose(sums.cpu(), want, rtol=1e-12, atol=1e-9)
    assert stager.slot_bytes >= 4 * 1_000_003


def test_an_update_already_on_the_device_is_not_copied_again():
    """``"cuda"`` (what a config names) and a tensor's ``cuda:0`` are one device: a caller's device
    tensor is handed over as it is, not copied to the host and back."""
    codec = create_codec("dense")
    p = _parsed(codec, _updates(1, seed=19))[0]
    on_dev = dataclasses.replace(p, tensors={k: v.to(CUDA) for k, v in p.tensors.items()})
    stager = DeviceStager("cuda")
    (got,) = list(stager.pipeline([on_dev]))
    assert got.tensors["values"].data_ptr() == on_dev.tensors["values"].data_ptr() and stager.slot_bytes == 0


def test_many_rounds_reuse_the_slots_without_mixing_updates():
    codec = create_codec("dense")
    agg = create_aggregator("mean", NUMEL, CUDA, 16)
    for rnd in range(4):
        xs = _updates(16, seed=100 + rnd)
        parsed = _parsed(codec, xs)
        agg.add_checked_many(codec, parsed, [1.0] * 16, 1e9)
        _close(agg.result(), torch.stack([x.double() for x in xs]).mean(0), 1e-6)
        agg.reset()


@pytest.mark.parametrize("name,params", [("dense", {}), ("dense", {"dtype": "bfloat16"}), ("topk", {"ratio": 0.01}),
                                         ("sign", {})])
def test_encoding_a_device_tensor_gives_the_cpu_encoding(name, params):
    """A GPU client encodes its update on the device: the wire form decodes as the CPU's does,
    and the error-feedback residual stays on the device."""
    codec = create_codec(name, **params)
    x = _updates(1, seed=11)[0]
    residual = torch.randn(NUMEL, generator=torch.Generator().manual_seed(12)) * 0.1
    cpu_enc, cpu_res = codec.encode(x, residual)
    dev_enc, dev_res = codec.encode(x.to(CUDA), residual.to(CUDA))
    assert dev_enc.header == cpu_enc.header
    a = codec.decode(codec.parse(cpu_enc.arrays, cpu_enc.header, NUMEL, BIG))
    b = codec.decode(codec.parse(dev_enc.arrays, dev_enc.header, NUMEL, BIG))
    _close(b, a.double(), 1e-6)
    if cpu_res is not None:
        assert dev_res.device.type == "cuda"
        _close(dev_res, cpu_res.double(), 1e-5)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_qsgd_encoded_on_the_device_stays_within_one_step(bits):
    codec = create_codec("qsgd", bits=bits, chunk=1024)
    x = _updates(1, seed=13)[0]
    enc, _ = codec.encode(x.to(CUDA), None, torch.Generator(device=CUDA).manual_seed(0))
    parsed = codec.parse(enc.arrays, enc.header, NUMEL, BIG)
    scales = parsed.tensors["scales"].double().repeat_interleave(1024)[:NUMEL]
    step = 2 * scales / (2**bits - 1)
    err = (codec.decode(parsed, CUDA).double().cpu() - x.double()).abs()
    assert bool((err <= step * (1 + 1e-6) + 1e-30).all())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_unpacking_on_the_device_equals_the_cpu(bits):
    from aggregation.codecs.qsgd import pack_codes, unpack_levels

    codes = torch.randint(0, 2**bits, (NUMEL,), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    # within one float32 ulp, not bit-equal: CUDA divides by a scalar as a multiply by its reciprocal
    torch.testing.assert_close(unpack_levels(packed.to(CUDA), bits, NUMEL).cpu(), unpack_levels(packed, bits, NUMEL),
                               rtol=2**-23, atol=0)


@pytest.mark.parametrize("name,params", [("fedavg", {"lr": 0.7}), ("fedavgm", {"lr": 1.0, "momentum": 0.9}),
                                         ("fedadam", {"lr": 0.01}), ("fedyogi", {"lr": 0.01}),
                                         ("fedadagrad", {"lr": 0.01})])
def test_server_optimizers_on_cuda_equal_the_cpu(name, params):
    w0 = torch.randn(NUMEL, generator=torch.Generator().manual_seed(21))
    deltas = _updates(5, seed=22)
    out = {}
    for dev in ("cpu", CUDA):
        opt = create_server_optimizer(name, **params)
        w = w0.to(dev).clone()
        for i, d in enumerate(deltas):
            if i == 3:  # a checkpoint in the middle: the state comes back onto the weights' device
                state = opt.state_dict()
                opt = create_server_optimizer(name, **params)
                opt.load_state_dict(state)
            w = opt.step(w, d.to(dev))
        assert w.device.type == torch.device(dev).type
        out[str(dev)] = w
    _close(out["cuda"], out["cpu"].double(), 1e-6)
