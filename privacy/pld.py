"""The privacy loss distribution (PLD) accountant: the tightest analysis of fedshield's events.

Composes the ledger's sampled Gaussian events as dp-accounting's PLD accountant does
(its ``from_gaussian_mechanism`` and ``self_compose``; add/remove adjacency, pessimistic discretisation: every answer is an upper bound on
the true epsilon). Events are grouped by (q, z) and each group is composed ``count``
times by self-composition (one FFT power), so 10^5 steps cost no more than a few; a
group with q = 1 is the Gaussian of multiplier z / sqrt(count), composed exactly.

The discretisation interval is chosen per ledger from its RDP epsilon ``e`` at a few
integer orders (an upper bound, cheap): ``e / (100 sqrt(n))`` for ``n`` subsampled
steps, in [1e-7, 1e-2], rounded down to a power of two (so the one-event PLD, whose
construction is most of the cost at small q, is cached across rounds). Each
composition can round the loss up by one interval, so a fixed interval (dp-accounting's
default 1e-4) over-states small epsilons after many steps (0.047 for 0.016 at q = 1e-4,
z = 10, 10^5 steps); this one keeps the rounding near 0.1% of epsilon.

Where the PLD would span more than 2e6 intervals (a noise multiplier far below 0.1, whose
epsilon is in the thousands), the RDP bound answers instead: also an upper bound.

dp-accounting is imported inside the functions that need it, so importing fedshield
stays fast.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from .accountant import COARSE_ORDERS, Accountant, Counts, rdp_epsilon, register_accountant

_INTERVAL_RANGE = (1e-7, 1e-2)
_INTERVAL_SHARE = 100.0  # interval = RDP epsilon / (this x sqrt(steps))
_MAX_POINTS = 2e6  # a PLD wider than this many intervals (z far below 0.1) is answered by RDP instead


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


def _group(q: float, z: float, n: int, interval: float) -> Any:
    """The PLD of ``n`` events of (q, z): the Gaussian of multiplier z / sqrt(n) when q = 1 (exact), else the
    one-event PLD self-composed n times."""
    from dp_accounting.pld import privacy_loss_distribution

    if q >= 1:
        return privacy_loss_distribution.from_gaussian_mechanism(standard_deviation=z / math.sqrt(n),
                                                                value_discretization_interval=interval)
    return _one_event(q, z, interval).self_compose(n)


@functools.lru_cache(maxsize=1024)
def pld_epsilon(counts: Counts, delta: float) -> float:
    """The PLD epsilon at ``delta`` of the grouped ledger ``counts`` ((q, z, steps), ...)."""
    if not counts:
        return 0.0
    interval, z_min = discretisation_interval(counts, delta), min(z for _, z, _ in counts)
    if 1 / z_min**2 / interval > _MAX_POINTS:  # the Gaussian loss's scale (1 / z^2) in intervals
        return rdp_epsilon(counts, delta)  # an upper bound too, where the PLD would not fit in memory
    pld = None
    for q, z, n in counts:
        group = _group(q, z, n, interval)
        pld = group if pld is None else pld.compose(group)
    eps = float(pld.get_epsilon_for_delta(delta))
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

__all__ = ["PldAccountant", "discretisation_interval", "pld_epsilon"]
