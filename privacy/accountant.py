"""Privacy accounting: a ledger of per-round events, RDP composition, and the budget policy.

Each DP round records one ``PrivacyEvent``: the sampled Gaussian mechanism with
client sampling rate ``q`` and noise multiplier ``z``. ``RdpAccountant`` composes
them with opacus's RDP analysis of the sampled Gaussian mechanism (Mironov, Talwar
& Zhang 2019) and converts to (epsilon, delta) with Balle et al. 2020, Thm. 21:

    epsilon = min over orders a of  rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1)

which is the same formula dp-accounting's ``compute_epsilon`` uses (written there as
``r + log1p(-1/a) - log(delta * a) / (a - 1)``). Nothing here re-derives the maths;
this module only wires opacus's functions. dp-accounting is a test-only reference.

Assumptions the numbers rely on: each round includes each client independently with
probability ``q`` (Poisson sampling; ``q = 1`` means everyone, every round), adjacency
is adding or removing one user's (or example's) data, and the mechanism's noise is
exactly Gaussian with std ``z`` times the sensitivity.

The ledger (``state_dict``) holds only lists, floats and ints, so it survives
``torch.save`` / ``torch.load(weights_only=True)`` in the run's checkpoint, and a
resumed run keeps its spent budget.

Example
-------
>>> acc = RdpAccountant(delta=1e-5)
>>> for _ in range(3):
...     acc.compose(PrivacyEvent(sampling_rate=1.0, noise_multiplier=1.0))
>>> round(acc.epsilon(), 2)
9.01
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from ._opacus import quiet_import_opacus
from ._errors import PrivacyError

_Z_RANGE = (0.01, 1000.0)  # calibration searches noise multipliers in this range


class BudgetExhausted(PrivacyError):
    """The next round would take epsilon past the run's target."""


def _require(ok: bool, what: str, rule: str, found: Any) -> None:
    if not ok:
        raise PrivacyError(f"{what} must {rule}. Found {found!r}.")


def _is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def _check_delta(delta: Any) -> float:
    _require(_is_real(delta) and 0 < delta < 1, "delta", "be in (0, 1) (and well below 1 / number of users)", delta)
    return float(delta)


@dataclass(frozen=True)
class PrivacyEvent:
    """``steps`` rounds of the sampled Gaussian mechanism: rate ``q`` in (0, 1], multiplier ``z`` > 0."""

    sampling_rate: float
    noise_multiplier: float
    steps: int = 1

    def __post_init__(self) -> None:
        _require(_is_real(self.sampling_rate) and 0 < self.sampling_rate <= 1, "sampling-rate",
                 "be in (0, 1] (the fraction of clients sampled per round)", self.sampling_rate)
        _require(_is_real(self.noise_multiplier) and self.noise_multiplier > 0, "noise-multiplier",
                 "be finite and > 0 for DP (with no noise epsilon is infinite)", self.noise_multiplier)
        _require(isinstance(self.steps, int) and not isinstance(self.steps, bool) and self.steps >= 1,
                 "event steps", "be an int >= 1", self.steps)


def _default_orders() -> tuple[float, ...]:
    quiet_import_opacus()
    from opacus.accountants import RDPAccountant

    return tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)


@functools.lru_cache(maxsize=256)
def _rdp_per_step(q: float, z: float, orders: tuple[float, ...]) -> tuple[float, ...]:
    """opacus's RDP of one sampled Gaussian step at each order; an order opacus cannot
    evaluate counts as inf (it then simply does not take part in the minimum)."""
    quiet_import_opacus()
    from opacus.accountants.analysis import rdp as privacy_analysis

    out = []
    for a in orders:
        try:
            out.append(float(privacy_analysis.compute_rdp(q=q, noise_multiplier=z, steps=1, orders=a)))
        except (ValueError, OverflowError, ZeroDivisionError):
            out.append(math.inf)
    return tuple(out)


def _epsilon(orders: tuple[float, ...], rdp: Sequence[float], delta: float) -> float:
    quiet_import_opacus()
    from opacus.accountants.analysis import rdp as privacy_analysis

    if all(r == 0 for r in rdp):
        return 0.0
    with warnings.catch_warnings():  # "optimal order is the smallest/largest alpha": the bound stays valid
        warnings.simplefilter("ignore")
        eps, _ = privacy_analysis.get_privacy_spent(orders=list(orders), rdp=list(rdp), delta=delta)
    eps = float(eps)
    return math.inf if math.isnan(eps) else max(0.0, eps)


class RdpAccountant:
    """Composes ``PrivacyEvent``s with RDP and answers epsilon for the run's ``delta``.

    Parameters
    ----------
    delta : float
        The run's delta, in (0, 1).
    orders : sequence of float or None
        RDP orders (> 1); None uses opacus's ``RDPAccountant.DEFAULT_ALPHAS``.
    """

    def __init__(self, delta: float, orders: Sequence[float] | None = None) -> None:
        self.delta = _check_delta(delta)
        self._orders = _default_orders() if orders is None else self._check_orders(orders)
        self._events: list[PrivacyEvent] = []
        self._rdp = [0.0] * len(self._orders)

    @staticmethod
    def _check_orders(orders: Any) -> tuple[float, ...]:
        ok = isinstance(orders, Sequence) and len(orders) > 0 and all(_is_real(a) and a > 1 for a in orders)
        _require(ok, "RDP orders", "be a non-empty sequence of finite numbers > 1", orders)
        return tuple(float(a) for a in orders)

    @property
    def orders(self) -> tuple[float, ...]:
        return self._orders

    @property
    def events(self) -> list[PrivacyEvent]:
        """The ledger so far (a copy)."""
        return list(self._events)

    def _with(self, event: PrivacyEvent) -> list[float]:
        _require(isinstance(event, PrivacyEvent), "privacy event", "be a PrivacyEvent", type(event).__name__)
        step = _rdp_per_step(float(event.sampling_rate), float(event.noise_multiplier), self._orders)
        return [r + event.steps * s for r, s in zip(self._rdp, step)]

    def compose(self, event: PrivacyEvent) -> None:
        """Record ``event`` (``event.steps`` rounds) in the ledger."""
        self._rdp = self._with(event)
        self._events.append(event)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (the run's delta by default); 0 with no events."""
        return _epsilon(self._orders, self._rdp, self.delta if delta is None else _check_delta(delta))

    def epsilon_if(self, event: PrivacyEvent, delta: float | None = None) -> float:
        """Epsilon after composing ``event`` as well, without recording it."""
        return _epsilon(self._orders, self._with(event), self.delta if delta is None else _check_delta(delta))

    def state_dict(self) -> dict[str, Any]:
        """The ledger as plain lists, floats and ints (safe for ``torch.load(weights_only=True)``)."""
        events = [[float(e.sampling_rate), float(e.noise_multiplier), int(e.steps)] for e in self._events]
        return {"delta": self.delta, "orders": list(self._orders), "events": events}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the ledger with a saved one; the RDP is recomputed from its events."""
        _require(isinstance(state, dict) and {"delta", "orders", "events"} <= set(state), "accountant state",
                 "be a dict with delta, orders and events", sorted(state) if isinstance(state, dict) else state)
        delta, orders = _check_delta(state["delta"]), self._check_orders(state["orders"])
        raw = state["events"]
        _require(isinstance(raw, list) and all(isinstance(e, list | tuple) and len(e) == 3 for e in raw),
                 "accountant events", "be a list of [sampling_rate, noise_multiplier, steps]", raw)
        events = [PrivacyEvent(q, z, s) for q, z, s in raw]
        fresh = RdpAccountant(delta, orders)
        for e in events:
            fresh.compose(e)
        self.delta, self._orders, self._events, self._rdp = fresh.delta, fresh._orders, fresh._events, fresh._rdp


def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling_rate: float, rounds: int,
                               tol: float = 0.01, orders: Sequence[float] | None = None) -> float:
    """The smallest noise multiplier ``z`` (within ``tol``, relative) for which ``rounds`` events
    of ``(sampling_rate, z)`` keep epsilon at ``delta`` <= ``target_epsilon``.

    The answer ``z`` meets the target; ``z / (1 + tol)`` does not. Raises PrivacyError when
    the target needs ``z`` outside [0.01, 1000]: unreachable, or so loose it protects no one.
    """
    _require(_is_real(target_epsilon) and target_epsilon > 0, "target-epsilon", "be finite and > 0",
             target_epsilon)
    _require(isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1, "rounds", "be an int >= 1",
             rounds)
    _require(_is_real(tol) and 0 < tol < 0.5, "tol", "be in (0, 0.5)", tol)
    acc = RdpAccountant(delta, orders)

    def eps(z: float) -> float:
        return acc.epsilon_if(PrivacyEvent(sampling_rate, z, rounds))

    lo, hi = _Z_RANGE
    if eps(hi) > target_epsilon:
        raise PrivacyError(f"target-epsilon must be reachable with noise-multiplier <= {hi:g} over {rounds} rounds "
                           f"at sampling-rate {sampling_rate:g}, delta {delta:g}. Found target {target_epsilon:g}, "
                           f"but even z={hi:g} spends {eps(hi):.4g}.")
    if eps(lo) <= target_epsilon:
        raise PrivacyError(f"target-epsilon must need noise-multiplier >= {lo:g} to mean any privacy. "
                           f"Found {target_epsilon:g}, which z={lo:g} already meets ({eps(lo):.4g}).")
    while hi / lo > 1 + tol:  # invariant: eps(lo) > target >= eps(hi); epsilon falls as z grows
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if eps(mid) <= target_epsilon else (mid, hi)
    return hi


@dataclass(frozen=True)
class PrivacyBudget:
    """The run's privacy budget as a coordinator policy: never start a round that would pass it."""

    target_epsilon: float
    delta: float

    def __post_init__(self) -> None:
        _require(_is_real(self.target_epsilon) and self.target_epsilon > 0, "target-epsilon", "be finite and > 0",
                 self.target_epsilon)
        _check_delta(self.delta)

    def check_next(self, accountant: RdpAccountant, event: PrivacyEvent) -> None:
        """Raise BudgetExhausted if composing ``event`` would take epsilon past the target."""
        after = accountant.epsilon_if(event, self.delta)
        if after > self.target_epsilon:
            spent = accountant.epsilon(self.delta)
            raise BudgetExhausted(
                f"privacy budget must not be exceeded: the next round would reach epsilon {after:.4g} "
                f"(delta {self.delta:g}), past target-epsilon {self.target_epsilon:g}. Found {spent:.4g} spent so far "
                f"after {len(accountant.events)} events; stop here, running the round would void the guarantee.")

    def describe(self, accountant: RdpAccountant, level: str = "user", clip: float | None = None) -> str:
        """One paragraph stating the guarantee reached so far and what it assumes."""
        _require(level in ("user", "example"), "privacy level", "be 'user' or 'example'", level)
        events = accountant.events
        eps = accountant.epsilon(self.delta)
        unit, adder = ("client", "coordinator") if level == "user" else ("example", "trainer")
        _require(clip is None or (_is_real(clip) and clip > 0), "clip-norm", "be finite and > 0 or None", clip)
        c_val = "" if clip is None else f" = {clip:g}"
        qs = ", ".join(f"{q:g}" for q in sorted({float(e.sampling_rate) for e in events})) or "n/a"
        zs = ", ".join(f"{z:g}" for z in sorted({float(e.noise_multiplier) for e in events})) or "n/a"
        rounds = sum(e.steps for e in events)
        return (
            f"({eps:.3g}, {self.delta:g})-differential privacy at the {level} level after {rounds} rounds "
            f"(target epsilon {self.target_epsilon:g}): changing whether one {unit}'s data is present changes "
            f"the probability of any outcome by at most a factor exp({eps:.3g}), except with probability "
            f"{self.delta:g}. This assumes that each round includes each {unit} independently with probability "
            f"q ({qs}; Poisson sampling, q=1 meaning all), that each {unit}'s contribution is clipped to L2 norm "
            f"C{c_val} and enters the sum with weight 1, that a trusted {adder} adds Gaussian noise of std z*C "
            f"(z: {zs}) to the sum and divides only by a public count, and add/remove-one-{unit} adjacency as in "
            f"the RDP analysis of the sampled Gaussian mechanism (under replace-one adjacency the sensitivity "
            f"doubles to 2*C and this epsilon does not apply)."
        )
