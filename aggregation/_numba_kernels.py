"""The numba kernels of :mod:`aggregation.kernels` (imported only where numba is: see ``kernels.load``).

Module-level functions, not closures: numba's on-disk cache keys a closure by its cells, and a
cell holding another jitted function pickles differently in every process, so closures were
compiled again by every process (about a second) and their cache files piled up. Globals are
resolved at compile time and the cache is invalidated by this file's timestamp instead.
"""

from __future__ import annotations

import numpy as np
from numba import njit

# Reorder sums (SIMD) and fuse multiply-adds (FMA: fewer instructions per element where the CPU has
# it); NaN and inf still propagate. ``axpy`` and ``add_sumsq`` both fuse
# ``out += w * x`` into one FMA, so a step rebuilt by ``axpy`` rounds as it did in ``add_sumsq``.
_FASTMATH = {"reassoc", "nsz", "arcp", "contract"}

jit = njit(nogil=True, cache=True, fastmath=_FASTMATH)

# Indices are unsigned (np.uint64) throughout: numba then drops its negative-index
# wraparound, which is what lets LLVM vectorize these loops (4-10x on AVX2/AVX-512).


@jit
def sumsq(x, lo, hi):
    lo = np.uint64(lo)
    acc = np.float32(0.0)
    for i in range(np.uint64(hi) - lo):
        v = x[lo + i]
        acc += v * v
    return acc


@jit
def add_sumsq(x, out, lo, hi, w):
    """``out[lo:hi] += w * x[lo:hi]``; returns the float32 sum of squares of ``x[lo:hi]``. One pass (SIMD)."""
    lo = np.uint64(lo)
    acc = np.float32(0.0)
    for i in range(np.uint64(hi) - lo):
        v = x[lo + i]
        acc += v * v
        out[lo + i] += w * v
    return acc


@jit
def axpy(x, out, lo, hi, w):
    lo = np.uint64(lo)
    for i in range(np.uint64(hi) - lo):
        out[lo + i] += w * x[lo + i]


@jit
def add4_sumsq(x0, x1, x2, x3, out, lo, hi, w, sq4):
    """``add_sumsq`` for four updates at once (``w``: their four float32 weights): the sum is
    read and written once per four updates. ``sq4``: the four float32 sums of squares."""
    lo = np.uint64(lo)
    w0, w1, w2, w3 = w[0], w[1], w[2], w[3]
    a0 = np.float32(0.0)
    a1 = np.float32(0.0)
    a2 = np.float32(0.0)
    a3 = np.float32(0.0)
    for i in range(np.uint64(hi) - lo):
        v0 = x0[lo + i]
        v1 = x1[lo + i]
        v2 = x2[lo + i]
        v3 = x3[lo + i]
        a0 += v0 * v0
        a1 += v1 * v1
        a2 += v2 * v2
        a3 += v3 * v3
        out[lo + i] += (w0 * v0 + w1 * v1) + (w2 * v2 + w3 * v3)
    sq4[0] = a0
    sq4[1] = a1
    sq4[2] = a2
    sq4[3] = a3


@jit
def rebuild(xs, w32, out, start, added, b0, bi, s0, s1, upto):
    """Step ``[s0, s1)`` of block ``bi`` (starting at ``b0``) set back to the block's values
    before the batch (``start``) plus the step of every update below ``upto`` kept so far."""
    for i in range(s0, s1):
        out[i] = start[i - b0]
    for e in range(upto):
        if added[e, bi] >= s1 - b0:
            axpy(xs[e], out, s0, s1, w32[e])


@jit
def zero_range(out, lo, hi):
    lo = np.uint64(lo)
    for i in range(np.uint64(hi) - lo):
        out[lo + i] = np.float32(0.0)


@jit
def dense_range(xs, ws, caps, out, block, sub, sq, added, zero, lo, hi):
    """Blocks ``[lo, hi)`` of the sum (``lo`` a multiple of ``block``), each in steps of
    ``sub`` elements. Per block, updates are taken four at a time (one read and write of the
    sum per four), each step's sums of squares fused with the weighted add. An update's step
    is kept while every step of the block so far had a norm within ``caps[c]`` (NaN never
    does). When one is not, the step is rebuilt: the block's values before the batch (copied
    once per block) plus every step kept so far, update by update; that update is then only
    measured for the rest of the block (its group adds one update at a time there).
    ``sq[c, b]``: the block's sum of squares (float64 over steps); ``added[c, b]``: how many
    of its first elements were added. ``zero``: the sum's blocks are set to zero first (a fresh
    sum is zeroed here, block by block, by the thread that then adds into it: in its cache)."""
    n = len(xs)
    start = np.empty(block, dtype=np.float32)
    w32 = np.empty(n + 4, dtype=np.float32)
    for c in range(n):
        w32[c] = np.float32(ws[c])
    sq4 = np.empty(4, dtype=np.float32)
    adding = np.empty(n, dtype=np.bool_)
    for b0 in range(lo, hi, block):
        b1 = min(hi, b0 + block)
        bi = b0 // block
        if zero:
            zero_range(out, b0, b1)
        for i in range(b1 - b0):
            start[i] = out[b0 + i]
        for c in range(n):
            adding[c] = True
            sq[c, bi] = 0.0
            added[c, bi] = 0
        for g in range(0, n, 4):
            gn = min(4, n - g)
            for s0 in range(b0, b1, sub):
                s1 = min(b1, s0 + sub)
                fast = gn == 4 and adding[g] and adding[g + 1] and adding[g + 2] and adding[g + 3]
                if fast:
                    add4_sumsq(xs[g], xs[g + 1], xs[g + 2], xs[g + 3], out, s0, s1, w32[g:g + 4], sq4)
                    failed = False
                    for k in range(4):
                        sq[g + k, bi] += sq4[k]
                        if sq4[k] <= caps[g + k] * caps[g + k]:
                            added[g + k, bi] = s1 - b0
                        else:
                            adding[g + k] = False
                            failed = True
                    if failed:
                        rebuild(xs, w32, out, start, added, b0, bi, s0, s1, g + 4)
                else:
                    for c in range(g, g + gn):
                        if adding[c]:
                            s = add_sumsq(xs[c], out, s0, s1, w32[c])
                            sq[c, bi] += s
                            if s <= caps[c] * caps[c]:
                                added[c, bi] = s1 - b0
                            else:
                                adding[c] = False
                                rebuild(xs, w32, out, start, added, b0, bi, s0, s1, g + gn)
                        else:
                            sq[c, bi] += sumsq(xs[c], s0, s1)


@jit
def qsgd_levels(codes, bits, c0, c1, lev):
    """``lev[:c1 - c0] = 2q - M`` (float32, exact) for codes ``[c0, c1)`` (``c0`` a multiple of ``8 // bits``)."""
    fm = np.float32((1 << bits) - 1)
    two = np.float32(2.0)
    if bits == 8:
        u0 = np.uint64(c0)
        for i in range(np.uint64(c1) - u0):
            lev[i] = np.float32(codes[u0 + i]) * two - fm
    elif bits == 4:
        j0 = np.uint64(c0 // 2)
        for j in range(np.uint64((c1 - c0 + 1) // 2)):
            b = codes[j0 + j]
            lev[2 * j] = np.float32(b & 15) * two - fm
            lev[2 * j + 1] = np.float32(b >> 4) * two - fm
    else:
        j0 = np.uint64(c0 // 4)
        for j in range(np.uint64((c1 - c0 + 3) // 4)):
            b = codes[j0 + j]
            lev[4 * j] = np.float32(b & 3) * two - fm
            lev[4 * j + 1] = np.float32((b >> 2) & 3) * two - fm
            lev[4 * j + 2] = np.float32((b >> 4) & 3) * two - fm
            lev[4 * j + 3] = np.float32(b >> 6) * two - fm


@jit
def levels_sq(lev, n):
    acc = np.float32(0.0)
    for i in range(np.uint64(n)):
        acc += lev[i] * lev[i]
    return acc


@jit
def levels_add(lev, out, c0, c1, g):
    u0 = np.uint64(c0)
    for i in range(np.uint64(c1) - u0):
        out[u0 + i] += g * lev[i]


@jit
def qsgd_range(codes_l, scales_l, bits, chunk, ws, cap2, out, block, sq, added, zero, lo, hi):
    """``dense_range`` for QSGD updates, one chunk (one scale) per step, decoded once into an
    L1 buffer of levels ``2q - M``. Values are ``s (2q - M) / M``; ``sq`` and ``cap2`` are in
    units of ``1 / M^2``. A chunk is added while every chunk of the block so far is within
    ``cap2[c]`` (the levels are bounded, so nothing is added before its chunk is measured).
    ``zero``: as ``dense_range``'s."""
    m = (1 << bits) - 1
    lev = np.empty(chunk + 8, dtype=np.float32)
    for b0 in range(lo, hi, block):
        b1 = min(hi, b0 + block)
        bi = b0 // block
        if zero:
            zero_range(out, b0, b1)
        for c in range(len(codes_l)):
            codes, scales = codes_l[c], scales_l[c]
            f = ws[c] / m
            total, stop, adding = 0.0, b0, True
            for c0 in range(b0, b1, chunk):
                c1 = min(b1, c0 + chunk)
                s = np.float64(scales[c0 // chunk])  # float() of a float32 stays float32 under numba: s * s
                qsgd_levels(codes, bits, c0, c1, lev)     # overflowed past 1.8e19
                chunk_sq = np.float64(levels_sq(lev, c1 - c0)) * s * s
                total += chunk_sq
                if adding and chunk_sq <= cap2[c]:
                    levels_add(lev, out, c0, c1, np.float32(f * s))
                    stop = c1
                else:
                    adding = False
            sq[c, bi] = total
            added[c, bi] = stop - b0


@jit
def qsgd_add(codes, scales, bits, chunk, f, out, lo, hi):
    """``out[lo:hi] += f * s * (2q - M)`` for the chunks in ``[lo, hi)`` (``lo`` a multiple of ``chunk``)."""
    lev = np.empty(chunk + 8, dtype=np.float32)
    for c0 in range(lo, hi, chunk):
        c1 = min(hi, c0 + chunk)
        qsgd_levels(codes, bits, c0, c1, lev)
        levels_add(lev, out, c0, c1, np.float32(f * np.float64(scales[c0 // chunk])))


@jit
def sparse_scan(idx, vals):
    """(whether ``idx`` is strictly increasing, the float32 sum of squares of ``vals``): one
    pass each, SIMD, for top-k parsing."""
    bad = 0
    for j in range(np.uint64(idx.size - 1) if idx.size else np.uint64(0)):
        bad += idx[j + np.uint64(1)] <= idx[j]
    acc = np.float32(0.0)
    for j in range(np.uint64(vals.size)):
        acc += vals[j] * vals[j]
    return bad == 0, acc


@jit
def scatter_range(idx_l, vals_l, ws, out, zero, lo, hi):
    """``out[i] += w * v`` for every update's entries whose index ``i`` lies in ``[lo, hi)``
    (indices validated: sorted, in range, no duplicates; found by binary search). Unsigned
    positions and indices: no negative-index wraparound test per entry. ``zero``: as
    ``dense_range``'s (``[lo, hi)`` set to zero first)."""
    if zero:
        zero_range(out, lo, hi)
    for c in range(len(idx_l)):
        idx, vals = idx_l[c], vals_l[c]
        w = np.float32(ws[c])
        j0 = np.searchsorted(idx, lo)
        j1 = np.searchsorted(idx, hi)
        for j in range(np.uint64(j0), np.uint64(j1)):
            out[np.uint64(idx[j])] += w * vals[j]
