"""The privacy loss distribution (PLD) accountant: the tightest analysis of fedshield's events.

Composes the ledger's sampled Gaussian events as dp-accounting's PLD accountant does
(its ``from_gaussian_mechanism`` and ``self_compose``; add/remove adjacency, pessimistic discretisation: every answer is an upper bound on
the true epsilon). Events are grouped by (q, z) and each group is composed ``count``
times by self-composition (one FFT power), so 10^5 steps cost no more than a few; a
ledger's q = 1 groups are one Gaussian (multipliers compose exactly: 1/z^2 adds up), and a
ledger of those only has its exact epsilon (Balle & Wang 2018) instead of a PLD.

The discretisation interval is chosen per ledger from its RDP epsilon ``e`` at a few
integer orders (an upper bound, cheap): ``e / (50 sqrt(n))`` for ``n`` subsampled
steps, in [1e-7, 1e-2], rounded down to a power of two (so the one-event PLD, whose
construction is most of the cost at small q, is cached across rounds). Each
composition can round the loss up by one interval, so a fixed interval (dp-accounting's
default 1e-4) over-states small epsilons after many steps (0.047 for 0.016 at q = 1e-4,
z = 10, 10^5 steps); this one keeps it under 0.2% of epsilon (0.02-0.15% against a PLD 8
times finer on q = 1e-3 to 0.2; twice as fine costs twice the time for a quarter of the error).

On a run's hot path the ledger grows by one event (central DP) or one client round
(local DP) at a time: the PLD of each (q, z) group is kept per interval and composed
with the new events only (one FFT convolution), and epsilon is read from it with one
vectorised pass (dp-accounting's is a Python loop), the same answer but for rounding.
Like dp-accounting's accountant composing one event at a time, each composition drops
tails of at most 5e-16 a side: the low-loss side's mass moves up onto the lowest kept
loss, the high-loss side's to the infinite loss (pessimistic both; 10^4 rounds add at
most 5e-12 to delta).

Where the PLD would span more than 2e6 intervals (a noise multiplier far below 0.1, whose
epsilon is in the thousands), the RDP bound answers instead: also an upper bound.

dp-accounting is imported inside the functions that need it, so importing fedshield
stays fast.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from .accountant import COARSE_ORDERS, Accountant, Counts, rdp_epsilon, register_accountant

_INTERVAL_RANGE = (1e-7, 1e-2)
_INTERVAL_SHARE = 50.0  # interval = RDP epsilon / (this x sqrt(steps))
_MAX_POINTS = 2e6  # a PLD wider than this many intervals (z far below 0.1) is answered by RDP instead
_TAIL = 5e-16  # each composition drops tails of this mass a side, as dp-accounting's PLD compose does
_KEPT = 4  # (q, z, interval) groups whose latest PLD is kept for incremental composition (a run has one)


def discretisation_interval(counts: Counts, delta: float) -> float:
    """The PLD's value discretisation interval for the grouped ledger ``counts`` (see the module docstring),
    rounded down to a power of two so that consecutive ledger states share it (and the one-event PLDs cached
    for it)."""
    steps = sum(n for q, _, n in counts if q < 1) + sum(1 for q, _, _ in counts if q >= 1)
    eps = rdp_epsilon(counts, delta, COARSE_ORDERS)
    lo, hi = _INTERVAL_RANGE
    if not math.isfinite(eps) or eps <= 0:
        return hi
    return 2.0 ** math.floor(math.log2(min(hi, max(lo, eps / (_INTERVAL_SHARE * math.sqrt(steps))))))


@functools.lru_cache(maxsize=64)
def _one_event(q: float, z: float, interval: float) -> Any:
    """The PLD of one Poisson-subsampled Gaussian event (as dp-accounting's PLD accountant builds it), cached:
    building it is most of a composition's cost at small q."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(standard_deviation=z, value_discretization_interval=interval,
                                                            sampling_prob=q)


@functools.lru_cache(maxsize=16)
def _events(q: float, z: float, interval: float, k: int) -> Any:
    """The PLD of ``k`` events of (q < 1, z), dense: what a ledger adds per round (one event, or a client round's
    steps)."""
    from dp_accounting.pld import privacy_loss_distribution

    pld = _one_event(q, z, interval) if k == 1 else _one_event(q, z, interval).self_compose(k)
    remove = pld._pmf_remove.to_dense_pmf()
    return privacy_loss_distribution.PrivacyLossDistribution(remove, None if pld._symmetric else
                                                             pld._pmf_add.to_dense_pmf())


def _tail_length(probs: np.ndarray, window: int) -> int:
    """The longest prefix of ``probs`` whose mass is <= _TAIL (``pld_pmf._truncate_tails``'s rule); the prefix sum is
    taken over ``window`` entries first, which is where a composition's new tail lies."""
    sums = np.cumsum(probs[:window])
    if sums[-1] <= _TAIL and window < len(probs):
        sums = np.cumsum(probs)
    return int(np.searchsorted(sums, _TAIL, side="right"))


def _truncate(probs: np.ndarray, window: int) -> tuple[int, np.ndarray, float]:
    """dp-accounting's pessimistic tail truncation, vectorised: the longest prefix of mass <= _TAIL goes onto the first
    kept loss, the longest suffix of mass <= _TAIL to the infinite loss."""
    left = _tail_length(probs, window)
    right = max(len(probs) - _tail_length(probs[::-1], window), left + 1)
    kept = probs[left:right].copy()
    kept[0] += probs[:left].sum()
    return left, kept, float(probs[right:].sum())


def _spectrum(pmf: Any, size: int) -> np.ndarray:
    """The real FFT of ``pmf``'s probabilities at ``size``, kept on the pmf (a few sizes): the new events' pmf is the
    same every round, and the FFT size changes only every few rounds."""
    from scipy import fft

    kept = pmf.__dict__.setdefault("_fedshield_spectra", OrderedDict())
    if size not in kept:
        kept[size] = fft.rfft(pmf._probs, size)
        while len(kept) > 4:
            kept.popitem(last=False)
    return kept[size]


def _compose_pmf(a: Any, b: Any) -> Any:
    """The composition of the dense PLD pmfs ``a`` (the ledger's) and ``b`` (the new events', whose FFT is kept): one
    FFT convolution and dp-accounting's truncation, as ``DensePLDPmf.compose`` does it."""
    from dp_accounting.pld import pld_pmf
    from scipy import fft

    if not isinstance(a, pld_pmf.DensePLDPmf) or not isinstance(b, pld_pmf.DensePLDPmf):
        if not isinstance(a, pld_pmf.DensePLDPmf) and not isinstance(b, pld_pmf.DensePLDPmf):
            return a.compose(b, tail_mass_truncation=2 * _TAIL)  # both sparse (few losses): dp-accounting's way
        a, b = a.to_dense_pmf(), b.to_dense_pmf()
    length = len(a._probs) + len(b._probs) - 1
    size = fft.next_fast_len(length, real=True)
    probs = fft.irfft(fft.rfft(a._probs, size) * _spectrum(b, size), size)[:length]
    offset, probs, right = _truncate(probs, 2 * len(b._probs))
    infinity = a._infinity_mass + b._infinity_mass - a._infinity_mass * b._infinity_mass
    return pld_pmf.DensePLDPmf(a._discretization, a._lower_loss + b._lower_loss + offset, probs, infinity + right,
                               a._pessimistic_estimate)


def _compose(a: Any, b: Any) -> Any:
    """The composition of two PLDs (both adjacencies) with our vectorised truncation."""
    from dp_accounting.pld import privacy_loss_distribution

    remove = _compose_pmf(a._pmf_remove, b._pmf_remove)
    add = None if a._symmetric and b._symmetric else _compose_pmf(a._pmf_add, b._pmf_add)
    return privacy_loss_distribution.PrivacyLossDistribution(remove, add)


def _epsilon_of_pmf(pmf: Any, delta: float) -> float:
    """``DensePLDPmf.get_epsilon_for_delta``, clamped at 0, in one vectorised pass with the same sums in the same order
    (the same answer but for rounding, ~1e-12). Walking the losses from the largest, it stops at the first loss ``l`` where the mass above
    gives log((upper - delta) / lower) >= l; that log is epsilon. Only losses down to the first negative one can
    give an epsilon > 0, so the pass stops there (and exp(-loss) cannot overflow)."""
    if not hasattr(pmf, "_probs"):  # a sparse pmf (few losses): dp-accounting's loop is short
        return max(0.0, float(pmf.get_epsilon_for_delta(delta)))
    infinity = pmf._infinity_mass
    if infinity > delta:
        return math.inf
    top = pmf._lower_loss + len(pmf._probs) - 1  # the largest loss, in intervals
    count = min(len(pmf._probs), max(0, top) + 2)  # losses >= 0, and the first negative one
    probs = pmf._probs[::-1][:count]
    losses = (top - np.arange(count)) * pmf._discretization
    upper = np.cumsum(np.concatenate(([infinity], probs)))  # the masses before each loss is added
    with np.errstate(under="ignore"):
        lower = np.concatenate(([0.0], np.cumsum(np.exp(-losses) * probs)))
    with np.errstate(divide="ignore", invalid="ignore"):
        candidate = np.log((upper[:-1] - delta) / lower[:-1])
    stop = (upper[:-1] > delta) & (lower[:-1] > 0) & (candidate >= losses)
    underflow = (upper[1:] >= delta) & (lower[1:] == 0)  # exp(-loss) underflowed: dp-accounting answers the loss
    at = int(np.argmax(stop)) if stop.any() else None
    if underflow.any() and (at is None or int(np.argmax(underflow)) < at):
        return max(0.0, float(losses[int(np.argmax(underflow))]))
    if at is None:
        if count == len(pmf._probs) and upper[-1] > lower[-1] + delta:
            return max(0.0, math.log((upper[-1] - delta) / lower[-1]))  # every loss walked (dp-accounting's end)
        return 0.0  # a stop below the first negative loss gives epsilon < 0
    if upper[at] <= lower[at] + delta:
        return 0.0
    return max(0.0, math.log((upper[at] - delta) / lower[at]))


def _epsilon_for_delta(pld: Any, delta: float) -> float:
    eps = _epsilon_of_pmf(pld._pmf_remove, delta)
    return eps if pld._symmetric else max(eps, _epsilon_of_pmf(pld._pmf_add, delta))


_latest: OrderedDict[tuple[float, float, float], tuple[int, Any]] = OrderedDict()  # (q, z, interval) -> (n, PLD)
_latest_lock = threading.Lock()


def _group(q: float, z: float, n: int, interval: float) -> Any:
    """The PLD of ``n`` events of (q, z): the Gaussian of multiplier z / sqrt(n) when q = 1 (exact); else the
    group's latest PLD (fewer events, same interval) composed with the new ones, or the one-event PLD
    self-composed n times."""
    from dp_accounting.pld import privacy_loss_distribution

    if q >= 1:
        return privacy_loss_distribution.from_gaussian_mechanism(standard_deviation=z / math.sqrt(n),
                                                                value_discretization_interval=interval)
    key = (q, z, interval)
    with _latest_lock:
        seen, pld = _latest.get(key, (0, None))
    if seen == n:
        return pld
    if 0 < seen < n:
        pld = _compose(pld, _events(q, z, interval, n - seen))
    else:
        pld = _one_event(q, z, interval).self_compose(n)
    with _latest_lock:
        _latest[key] = (n, pld)
        _latest.move_to_end(key)
        while len(_latest) > _KEPT:
            _latest.popitem(last=False)
    return pld


def gaussian_epsilon(z: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of the Gaussian mechanism with noise multiplier ``z`` (Balle & Wang 2018,
    Thm. 8: delta(eps) = Phi(1/2z - eps z) - e^eps Phi(-1/2z - eps z)), by bisection, rounded up."""
    from scipy.special import log_ndtr

    mu = 1 / z

    def excess(eps: float) -> float:  # delta(eps) - delta, from logs (both terms are tiny where eps is large)
        a, b = log_ndtr(mu / 2 - eps / mu), log_ndtr(-mu / 2 - eps / mu) + eps
        return (math.exp(a) * -math.expm1(b - a) if b < a else 0.0) - delta

    if excess(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > 0:
        lo, hi = hi, hi * 2
        if hi > 1e6:
            return math.inf
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) > 0 else (lo, mid)
    return hi


@functools.lru_cache(maxsize=1024)
def pld_epsilon(counts: Counts, delta: float) -> float:
    """The PLD epsilon at ``delta`` of the grouped ledger ``counts`` ((q, z, steps), ...)."""
    if not counts:
        return 0.0
    sampled = [(q, z, n) for q, z, n in counts if q < 1]
    everyone = sum(n / z**2 for q, z, n in counts if q >= 1)  # Gaussians compose exactly: 1/z^2 adds up
    if not sampled:
        return gaussian_epsilon(1 / math.sqrt(everyone), delta)
    interval, z_min = discretisation_interval(counts, delta), min(z for _, z, _ in sampled)
    if everyone:
        z_min = min(z_min, 1 / math.sqrt(everyone))
    if 1 / z_min**2 / interval > _MAX_POINTS:  # the Gaussian loss's scale (1 / z^2) in intervals
        return rdp_epsilon(counts, delta)  # an upper bound too, where the PLD would not fit in memory
    pld = None
    for q, z, n in sampled:
        group = _group(q, z, n, interval)
        pld = group if pld is None else pld.compose(group)
    if everyone:
        pld = pld.compose(_group(1.0, 1 / math.sqrt(everyone), 1, interval))
    eps = _epsilon_for_delta(pld, delta)
    return math.inf if math.isnan(eps) else max(0.0, eps)


class PldAccountant(Accountant):
    """Composes ``PrivacyEvent``s with privacy loss distributions; epsilon for the run's ``delta``.

    Parameters
    ----------
    delta : float
        The run's delta, in (0, 1).
    """

    name = "pld"

    def _epsilon(self, counts: Counts, delta: float) -> float:
        return pld_epsilon(counts, delta)


register_accountant("pld", PldAccountant)

__all__ = ["PldAccountant", "discretisation_interval", "gaussian_epsilon", "pld_epsilon"]
