"""The privacy loss distribution (PLD) accountant: the tightest analysis of fedshield's events.

Composes the ledger's sampled Gaussian events with dp-accounting's PLD accountant
(add/remove adjacency, pessimistic discretisation: every answer is an upper bound on
the true epsilon). Events are grouped by (q, z) and each group is composed ``count``
times by self-composition (one FFT power), so 10^5 steps cost no more than a few; a
group with q = 1 is the Gaussian of multiplier z / sqrt(count), composed exactly.

The discretisation interval is chosen per ledger from its RDP epsilon ``e`` at a few
integer orders (an upper bound, cheap): ``e / (100 sqrt(n))`` for ``n`` subsampled steps, in [1e-7, 1e-2]. Each
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

from .accountant import COARSE_ORDERS, Accountant, Counts, rdp_epsilon, register_accountant

_INTERVAL_RANGE = (1e-7, 1e-2)
_INTERVAL_SHARE = 100.0  # interval = RDP epsilon / (this x sqrt(steps))
_MAX_POINTS = 2e6  # a PLD wider than this many intervals (z far below 0.1) is answered by RDP instead


def discretisation_interval(counts: Counts, delta: float) -> float:
    """The PLD's value discretisation interval for the grouped ledger ``counts`` (see the module docstring)."""
    steps = sum(n for q, _, n in counts if q < 1) + sum(1 for q, _, _ in counts if q >= 1)
    eps = rdp_epsilon(counts, delta, COARSE_ORDERS)
    lo, hi = _INTERVAL_RANGE
    if not math.isfinite(eps) or eps <= 0:
        return hi
    return min(hi, max(lo, eps / (_INTERVAL_SHARE * math.sqrt(steps))))


@functools.lru_cache(maxsize=1024)
def pld_epsilon(counts: Counts, delta: float) -> float:
    """The PLD epsilon at ``delta`` of the grouped ledger ``counts`` ((q, z, steps), ...)."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    if not counts:
        return 0.0
    interval, z_min = discretisation_interval(counts, delta), min(z for _, z, _ in counts)
    if (1 / z_min**2 + 20 / z_min) / interval > _MAX_POINTS:  # the loss's range (to ~10 std) in intervals
        return rdp_epsilon(counts, delta)  # an upper bound too, where the PLD would not fit in memory
    acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=interval)
    for q, z, n in counts:
        gaussian = dp_accounting.GaussianDpEvent(z)
        acc.compose(gaussian if q >= 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian), n)
    eps = float(acc.get_epsilon(delta))
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
