"""Fused CPU kernels for checking and adding a batch of updates (numba, compiled on first use).

Why: on CPU, torch runs one operation at a time, so the norm check and the weighted add read
each update twice (``dot``, then ``add_``), and every add streams the whole running sum through
the cache again. These kernels walk the sum in cache-sized blocks and, per block, take every
update of a batch in turn: its block's sum of squares, then (if the block may be added ahead of
the decision) its weighted add while the block is still in L1/L2. Each update is read from
memory once and the sum stays in cache, which brings a 100 x 1M float32 mean to within ~1.2x
of a plain read of the same bytes (``benchmarks/aggregation.py``).

Parallelism: the blocks are split into contiguous ranges, one per torch intra-op thread, run on
a small pool of Python threads (the kernels release the GIL). numba's own threading layers are
not used: they would start a second OpenMP pool beside torch's.

Used only for CPU float32 sums, and only when numba imports; ``FEDSHIELD_KERNELS=torch`` turns
them off (the torch code paths in the codecs are then used, and the tests run both).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

ENV_VAR = "FEDSHIELD_KERNELS"
BLOCK = 1 << 17  # elements of the sum per block: 512 KB, kept in L2 while every update of a batch is added
SUB = 1 << 13  # elements per step (32 KB of each update): the unit kept or rebuilt

_lock = threading.Lock()
_impl: Any = None  # the compiled module namespace, False when unavailable
_pool: ThreadPoolExecutor | None = None


def enabled() -> bool:
    """Whether the numba kernels are used (numba importable and not turned off by ``FEDSHIELD_KERNELS``)."""
    choice = os.environ.get(ENV_VAR, "").strip().lower()
    if choice not in ("", "auto", "numba", "torch"):
        from ._errors import AggregationError
        raise AggregationError(f"{ENV_VAR} must be 'auto', 'numba' or 'torch'. Found {choice!r}.")
    if choice == "torch":
        return False
    return load() is not None


def applies(out: torch.Tensor) -> bool:
    """Whether a sum tensor can take the kernels: CPU, float32, contiguous, and kernels enabled."""
    return out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous() and enabled()


def load() -> Any:
    """The compiled kernels (a namespace), or None where numba does not import."""
    global _impl
    if _impl is None:
        with _lock:
            if _impl is None:
                try:
                    _impl = _compile()
                except ImportError:
                    _impl = False
    return _impl or None


def _compile() -> Any:
    from types import SimpleNamespace

    from . import _numba_kernels as k  # ImportError where numba is not installed

    return SimpleNamespace(dense_range=k.dense_range, qsgd_range=k.qsgd_range, qsgd_add=k.qsgd_add,
                           sparse_scan=k.sparse_scan, scatter_range=k.scatter_range)


def batch_arrays(count: int, numel: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed ``sq`` (float64) and ``added`` (int64) arrays, (count, blocks), for the range kernels."""
    blocks = -(-numel // block)
    return np.zeros((count, blocks), dtype=np.float64), np.zeros((count, blocks), dtype=np.int64)


def typed_list(arrays: list[np.ndarray]) -> Any:
    from numba.typed import List

    lst = List()
    for a in arrays:
        lst.append(a)
    return lst


def threads() -> int:
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def run_ranges(fn: Any, numel: int, block: int, *args: Any, per_thread: int = 4) -> None:
    """Run ``fn(*args, lo, hi)`` over ``[0, numel)`` in block-aligned ranges, about ``per_thread``
    per thread, which the threads (the calling one and the pool's) take in turn as they finish:
    a thread slowed by the machine's other load takes fewer, instead of holding up the sum."""
    global _pool
    nblocks = -(-numel // block)
    workers = min(threads(), nblocks)
    if workers == 1:
        fn(*args, 0, numel)
        return
    per = max(1, nblocks // (workers * per_thread))  # blocks per range
    ranges = iter([(b * block, min(numel, (b + per) * block)) for b in range(0, nblocks, per)])
    take = threading.Lock()

    def work() -> None:
        while True:
            with take:
                r = next(ranges, None)
            if r is None:
                return
            fn(*args, *r)

    if _pool is None or _pool._max_workers < workers - 1:
        with _lock:
            if _pool is None or _pool._max_workers < workers - 1:
                _pool = ThreadPoolExecutor(max_workers=workers - 1, thread_name_prefix="fedshield-kernel")
    futures = [_pool.submit(work) for _ in range(workers - 1)]
    try:
        work()
    finally:
        for fut in futures:
            fut.result()
