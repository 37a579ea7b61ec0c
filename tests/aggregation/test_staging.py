"""aggregation.staging: the CUDA copy pipeline, driven on CPU by a simulated device.

``SimOps`` stands in for ``CudaOps``: a copy stream and a compute stream of deferred operations,
run in a random order that respects stream order and event waits (CUDA's rules: a wait captures
the event's latest record; an event never recorded has happened). Copies read their source when
they run, not when they are queued, so a missing wait in the stager (the host rewriting a slot
whose copy has not run, a copy overwriting a device slot before its adds ran, an add running before
its copy) gives a wrong sum for some schedules; ``test_the_simulator_catches_a_missing_wait``
checks that it does.
"""

from __future__ import annotations

import math
import random
from collections import deque

import pytest
import torch

from aggregation import create_aggregator
from aggregation._errors import AggregationError, UpdateRejected
from aggregation.codecs import create_codec
from aggregation.staging import ALIGN, DeviceStager

from .helpers import sent


class _Op:
    def __init__(self, fn, waits):
        self.fn, self.waits, self.ran = fn, waits, False


class _Event:
    def __init__(self):
        self.op: _Op | None = None  # the op it was last recorded after (None: never recorded)


def _happened(op: _Op | None) -> bool:
    return op is None or op.ran


class SimOps:
    """A simulated device: two streams of deferred ops, advanced at random at every call."""

    def __init__(self, seed: int, eager_compute: bool = False):
        self.rng = random.Random(seed)
        self.streams = {"copy": deque(), "compute": deque()}
        self.eager_compute = eager_compute  # the caller's adds run on the host at once (an aggregator on CPU)
        self.copies = 0

    def host_buffer(self, nbytes):
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # garbage, not zeros: a missed copy shows

    def device_buffer(self, nbytes):
        return torch.full((nbytes,), 0xCD, dtype=torch.uint8)

    def event(self):
        return _Event()

    def _push(self, stream, fn, waits=()):
        op = _Op(fn, [e.op for e in waits])  # a wait captures the event's latest record
        self.streams[stream].append(op)
        return op

    def _step(self) -> bool:
        ready = [q for q in self.streams.values() if q and all(_happened(w) for w in q[0].waits)]
        if not ready:
            return False
        op = self.rng.choice(ready).popleft()
        op.fn()
        op.ran = True
        return True

    def _progress(self):
        for _ in range(self.rng.randrange(3)):
            self._step()

    def _run_until(self, op):
        while not _happened(op):
            assert self._step(), "deadlock: the awaited op can never run"

    def host_wait(self, event):
        self._progress()
        self._run_until(event.op)

    def copy_async(self, dst, src, after, done):
        self._progress()
        self.copies += 1
        done.op = self._push("copy", lambda: dst.copy_(src), [after])

    def compute_wait(self, event):
        self._progress()
        op = self._push("compute", lambda: None, [event])
        if self.eager_compute:
            self._run_until(op)

    def compute_record(self, event):
        event.op = self._push("compute", lambda: None)

    def compute(self, fn):
        self._push("compute", fn)
        self._progress()

    def drain(self):
        while self._step():
            pass
        assert not any(self.streams.values()), "ops left that can never run"


def _updates(codec, n, numel, seed):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        enc, _ = codec.encode(torch.randn(numel, generator=gen), None, gen)
        out.append(codec.parse(enc.arrays, enc.header, numel, 1 << 30))
    return out


CODECS = {
    "dense fp32": lambda: create_codec("dense"),
    "dense bf16": lambda: create_codec("dense", dtype="bfloat16"),
    "topk fp16": lambda: create_codec("topk", ratio=0.05, value_dtype="float16"),
    "qsgd 4-bit": lambda: create_codec("qsgd", bits=4),
    "sign": lambda: create_codec("sign"),
}


def _staged_sum(codec, batch, weights, ops, slots=2):
    stager = DeviceStager("cpu", slots=slots, ops=ops)
    out = torch.zeros(batch[0].numel)
    for dev, w in zip(stager.pipeline(batch), weights, strict=True):
        ops.compute(lambda d=dev, w=w: codec.add_into(d, out, w))
    ops.drain()
    return out, stager


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("seed", range(12))
def test_pipeline_sum_equals_the_direct_sum_under_any_schedule(name, seed):
    codec = CODECS[name]()
    numel = 1000 + 37 * seed  # sizes that are not multiples of the slot alignment
    batch = _updates(codec, 7, numel, seed)
    weights = [1.0 + i for i in range(len(batch))]
    direct = torch.zeros(numel)
    for p, w in zip(batch, weights):
        codec.add_into(p, direct, w)
    ops = SimOps(seed)
    staged, stager = _staged_sum(codec, batch, weights, ops, slots=2 + seed % 2)
    assert torch.equal(staged, direct)
    assert ops.copies == len(batch)
    nbytes = sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in batch[0].tensors.values())
    assert stager.slot_bytes == max(nbytes, ALIGN), "a slot holds one update: O(model size)"


def test_staged_tensors_keep_dtype_shape_and_values():
    codec = create_codec("topk", ratio=0.1, value_dtype="float16")
    (p,) = _updates(codec, 1, 500, 0)
    ops = SimOps(0, eager_compute=True)
    (dev,) = list(DeviceStager("cpu", ops=ops).pipeline([p]))
    for name, t in p.tensors.items():
        assert dev.tensors[name].dtype == t.dtype and torch.equal(dev.tensors[name], t)
        assert dev.tensors[name].data_ptr() != t.data_ptr(), "the staged copy must not alias the record"
        offset = dev.tensors[name].data_ptr() - dev.tensors["indices"].data_ptr()
        assert offset % ALIGN == 0, "each tensor starts at an aligned offset of the slot"
    assert dev.host.keys() == p.host.keys() and dev.params == p.params and dev.numel == p.numel  # host arrays stay


def test_slots_grow_for_a_larger_update_after_their_work_is_done():
    codec = create_codec("dense")
    small, large = _updates(codec, 3, 100, 1), _updates(codec, 3, 5000, 2)
    ops = SimOps(3)
    stager = DeviceStager("cpu", ops=ops)
    for batch in (small, large, small):
        out = torch.zeros(batch[0].numel)
        for dev in stager.pipeline(batch):
            ops.compute(lambda d=dev: codec.add_into(d, out, 1.0))
        ops.drain()
        assert torch.equal(out, sum(p.tensors["values"] for p in batch))
    assert stager.slot_bytes == 5000 * 4 + (-(5000 * 4) % ALIGN)


def test_the_simulator_catches_a_missing_wait():
    """Each of the stager's three waits is needed: without it, some schedule gives a wrong sum."""
    codec = create_codec("dense")
    batch = _updates(codec, 6, 300, 4)
    direct = sum(p.tensors["values"] for p in batch)

    def wrong_for_some_seed(patch) -> bool:
        for seed in range(40):
            ops = SimOps(seed)
            patch(ops)
            out, _ = _staged_sum(codec, batch, [1.0] * len(batch), ops)
            if not torch.equal(out, direct):
                return True
        return False

    def no_host_wait(ops):
        ops.host_wait = lambda event: ops._progress()

    def no_compute_wait(ops):
        ops.compute_wait = lambda event: ops._progress()

    def copy_ignores_consumed(ops):
        real = ops.copy_async
        ops.copy_async = lambda dst, src, after, done: real(dst, src, _Event(), done)

    assert wrong_for_some_seed(lambda ops: None) is False
    for patch in (no_host_wait, no_compute_wait, copy_ignores_consumed):
        assert wrong_for_some_seed(patch), patch.__name__


def test_device_tensors_and_duck_typed_sources_pass_through():
    ops = SimOps(0, eager_compute=True)
    stager = DeviceStager("meta", ops=ops)  # a non-CPU device without a GPU
    (p,) = _updates(create_codec("dense"), 1, 64, 0)
    on_device = p.__class__(p.codec, p.numel, {"values": torch.empty(64, device="meta")}, p.params, p.nbytes)
    staged, _ = stager.stage(on_device)
    assert staged is on_device and ops.copies == 0, "tensors already on the device are not copied"

    class Source:
        numel = 64

    src = Source()
    assert stager.stage(src)[0] is src


def test_every_codec_adds_an_update_staged_to_a_non_cpu_device():
    """On CUDA the stager swaps each tensor for a device view; QSGD read its scales with ``.numpy()``,
    which a device tensor refuses (TypeError: the first batch ended the run). ``meta`` stands in for
    CUDA here (it refuses ``.numpy()`` alike); host arrays made by parse stay with the update."""
    class MetaOps:
        def host_buffer(self, n): return torch.empty(n, dtype=torch.uint8)
        def device_buffer(self, n): return torch.empty(n, dtype=torch.uint8, device="meta")
        def event(self): return object()
        def host_wait(self, e): pass
        def copy_async(self, dst, src, after, done): dst.copy_(src)
        def compute_wait(self, e): pass
        def compute_record(self, e): pass

    for name, params in [("dense", {}), ("topk", {"ratio": 0.1}), ("sign", {}), ("qsgd", {"bits": 4, "chunk": 64})]:
        codec = create_codec(name, **params)
        (p,) = _updates(codec, 1, 300, 1)
        staged = next(iter(DeviceStager("meta", ops=MetaOps()).pipeline([p])))
        assert all(t.device.type == "meta" for t in staged.tensors.values()) and staged.host.keys() == p.host.keys()
        out = torch.zeros(300, device="meta")
        codec.add_into(staged, out, 2.0)  # (meta has no values to compare: test_aggregator_batches... does)


def test_slots_must_be_at_least_two():
    with pytest.raises(AggregationError, match="slots must be an integer >= 2"):
        DeviceStager("cpu", slots=1, ops=SimOps(0))


@pytest.mark.parametrize("rule,params", [("mean", {}), ("median", {}), ("krum", {"f": 1}),
                                         ("trimmed-mean", {"beta": 0.2})])
def test_aggregator_batches_through_the_stager_like_without(rule, params):
    """The aggregator's CUDA wiring (``staging`` set), run on CPU: same results, same rejections."""
    codec = create_codec("dense")
    batch = _updates(codec, 6, 400, 5)
    bad = torch.randn(400)
    bad[7] = math.nan
    enc = sent(codec, bad)
    batch.insert(2, codec.parse(enc.arrays, enc.header, 400, 1 << 30))  # non-finite: rejected
    huge, _ = codec.encode(torch.full((400,), 50.0))
    batch.insert(4, codec.parse(huge.arrays, huge.header, 400, 1 << 30))  # norm 1000 > 100: rejected
    weights = [1.0 + i for i in range(len(batch))]
    plain = create_aggregator(rule, 400, "cpu", 10, **params)
    staged = create_aggregator(rule, 400, "cpu", 10, **params)
    ops = SimOps(6, eager_compute=True)
    staged.staging = DeviceStager("cpu", ops=ops)
    want = plain.add_checked_many(codec, batch, weights, 100.0)
    got = staged.add_checked_many(codec, batch, weights, 100.0)
    assert [type(r) for r in got] == [type(r) for r in want]
    assert [r.rule for r in got if isinstance(r, UpdateRejected)] == ["non-finite", "norm-too-large"]
    assert ops.copies == len(batch)
    assert staged.count == plain.count == len(batch) - 2
    assert torch.allclose(staged.result(), plain.result(), rtol=1e-6, atol=1e-7)


def test_cpu_aggregators_do_not_stage():
    assert create_aggregator("mean", 10, "cpu", 2).staging is None


def test_an_update_handed_over_waits_for_its_own_copy_only():
    """When update k is handed over, the compute stream has waited for the copies of updates 0..k
    and no later one: a wait for k + 1's copy queued ahead of k's adds made every norm check of k
    wait for the next copy too (on a real GPU: no overlap of copies and adds at all)."""
    codec = create_codec("dense")
    batch = _updates(codec, 5, 300, 6)
    ops = SimOps(0)
    copies, waited = [], []
    real_copy, real_wait = ops.copy_async, ops.compute_wait

    def copy_async(dst, src, after, done):
        real_copy(dst, src, after, done)
        copies.append(done.op)

    def compute_wait(event):
        waited.append(event.op)
        real_wait(event)

    ops.copy_async, ops.compute_wait = copy_async, compute_wait
    stager = DeviceStager("cpu", ops=ops)
    for k, _ in enumerate(stager.pipeline(batch)):
        assert len(copies) == min(k + 2, len(batch))  # the next update's copy is already queued
        assert [copies.index(op) for op in waited] == list(range(k + 1))
    ops.drain()
