"""Privacy accounting: a ledger of per-round events, its composition, and the budget policy.

Each DP round records one ``PrivacyEvent``: the sampled Gaussian mechanism with
client sampling rate ``q`` and noise multiplier ``z``. Two accountants compose them,
chosen by name (``create_accountant``, the run's ``accountant`` key):

- ``"pld"`` (the default, ``PldAccountant`` in ``privacy/pld.py``): privacy loss
  distributions (Koskela et al. 2020, Doroshenko et al. 2022) through dp-accounting's
  PLD accountant, the tightest analysis of these events: at q = 0.003, z = 3.7,
  delta = 1e-6 it gives 0.008 after 7 rounds where RDP gives 0.063.
- ``"rdp"`` (``RdpAccountant``): opacus's RDP analysis of the sampled Gaussian
  (Mironov, Talwar & Zhang 2019) on orders 1.1-10.9 (step 0.1) and 11 to 1024,
  converted to (epsilon, delta) with Balle et al. 2020, Thm. 21:

    epsilon = min over orders a of  rdp(a) + log((a - 1) / a) - (log(delta) + log(a)) / (a - 1)

Both are upper bounds on the epsilon of the same events; the ledger is the same, so a
report can give both. Assumptions the numbers rely on: each round includes each client
independently with probability ``q`` (Poisson sampling; ``q = 1`` means everyone, every
round), adjacency is adding or removing one user's (or example's) data, and the
mechanism's noise is Gaussian with std ``z`` times the sensitivity.

The ledger groups events by (q, z) with counts, and each accountant caches epsilon per
ledger state, so the budget check ("epsilon if one more round ran") and the charge after
the round cost one composition per round, and none when asked again. ``state_dict``
holds only strings, lists, floats and ints, so it survives ``torch.save`` /
``torch.load(weights_only=True)`` in the run's checkpoint; a state without an
``accountant`` name is an RDP ledger of an earlier fedshield (``load_accountant``).

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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from ._opacus import quiet_import_opacus
from ._errors import PrivacyError

_Z_RANGE = (0.01, 1000.0)  # calibration searches noise multipliers in this range
# RDP orders: opacus's defaults (1.1-10.9 by 0.1, 12-63) and 11, then up to 1024: small epsilons
# (small q, large z) have their optimum at orders in the hundreds.
RDP_ORDERS = tuple([1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(11, 64)]
                   + [float(a) for a in (64, 72, 80, 96, 112, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 896,
                                         1024)])
DEFAULT_ACCOUNTANT = "pld"
# A few integer orders: a quick RDP bound where a rough one does (PLD's discretisation, calibration's bracket)
COARSE_ORDERS = (2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0, 192.0, 256.0,
                 384.0, 512.0, 768.0, 1024.0)

# A ledger state: ((q, z, steps), ...) sorted, one entry per distinct (q, z).
Counts = tuple[tuple[float, float, int], ...]


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


def _counts(events: Sequence[PrivacyEvent], start: Counts = ()) -> Counts:
    """``start`` with ``events`` added: one (q, z, steps) per distinct (q, z), sorted."""
    grouped: Counter[tuple[float, float]] = Counter({(q, z): n for q, z, n in start})
    for e in events:
        grouped[(float(e.sampling_rate), float(e.noise_multiplier))] += e.steps
    return tuple(sorted((q, z, n) for (q, z), n in grouped.items()))


class Accountant:
    """A ledger of ``PrivacyEvent``s and the epsilon it spends at ``delta``; subclasses say how to compose.

    A subclass sets ``name`` and implements ``_epsilon(counts, delta)`` (a pure function of the
    grouped ledger, cached here per state).
    """

    name = ""

    def __init__(self, delta: float) -> None:
        self.delta = _check_delta(delta)
        self._events: list[PrivacyEvent] = []
        self._grouped: Counts = ()  # the ledger grouped by (q, z): what the answers are cached by
        self._cache: dict[tuple[Counts, float], float] = {}

    @property
    def events(self) -> list[PrivacyEvent]:
        """The ledger so far (a copy)."""
        return list(self._events)

    @property
    def rounds(self) -> int:
        return sum(e.steps for e in self._events)

    def _epsilon(self, counts: Counts, delta: float) -> float:
        raise NotImplementedError

    def _answer(self, counts: Counts, delta: float | None) -> float:
        delta = self.delta if delta is None else _check_delta(delta)
        if not counts:
            return 0.0
        key = (counts, delta)
        if key not in self._cache:
            if len(self._cache) > 64:  # a ledger only grows: old states are not asked again
                self._cache.clear()
            self._cache[key] = self._epsilon(counts, delta)
        return self._cache[key]

    def compose(self, event: PrivacyEvent) -> None:
        """Record ``event`` (``event.steps`` rounds) in the ledger."""
        _require(isinstance(event, PrivacyEvent), "privacy event", "be a PrivacyEvent", type(event).__name__)
        self._events.append(event)
        self._grouped = _counts([event], self._grouped)

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (the run's delta by default); 0 with no events."""
        return self._answer(self._grouped, delta)

    def epsilon_if(self, event: PrivacyEvent, delta: float | None = None) -> float:
        """Epsilon after composing ``event`` as well, without recording it."""
        _require(isinstance(event, PrivacyEvent), "privacy event", "be a PrivacyEvent", type(event).__name__)
        return self._answer(_counts([event], self._grouped), delta)

    def state_dict(self) -> dict[str, Any]:
        """The ledger as plain strings, lists, floats and ints (safe for ``torch.load(weights_only=True)``)."""
        events = [[float(e.sampling_rate), float(e.noise_multiplier), int(e.steps)] for e in self._events]
        return {"accountant": self.name, "delta": self.delta, "events": events}

    def _load(self, state: Any, need: set[str]) -> tuple[float, list[PrivacyEvent]]:
        _require(isinstance(state, dict), "accountant state", "be a dict", state)
        kind = state.get("accountant", "rdp")  # a state without a name: an RDP ledger of an earlier fedshield
        _require(kind == self.name, "accountant state", f"be a {self.name!r} ledger (resume a run with the accountant "
                 "it was started with)", kind)
        _require(need | {"delta", "events"} <= set(state), "accountant state",
                 f"be a dict with {', '.join(sorted(need | {'delta', 'events'}))}", sorted(state))
        delta, raw = _check_delta(state["delta"]), state["events"]
        _require(isinstance(raw, list) and all(isinstance(e, list | tuple) and len(e) == 3 for e in raw),
                 "accountant events", "be a list of [sampling_rate, noise_multiplier, steps]", raw)
        return delta, [PrivacyEvent(q, z, s) for q, z, s in raw]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the ledger with a saved one."""
        self.delta, self._events = self._load(state, set())
        self._grouped = _counts(self._events)


# -- RDP ---------------------------------------------------------------------------------------------------------
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


def rdp_epsilon(counts: Counts, delta: float, orders: tuple[float, ...] = RDP_ORDERS) -> float:
    """The RDP epsilon at ``delta`` of the grouped ledger ``counts`` at ``orders``."""
    quiet_import_opacus()
    from opacus.accountants.analysis import rdp as privacy_analysis

    rdp = [0.0] * len(orders)
    for q, z, n in counts:
        rdp = [r + n * s for r, s in zip(rdp, _rdp_per_step(q, z, orders))]
    if all(r == 0 for r in rdp):
        return 0.0
    with warnings.catch_warnings():  # "optimal order is the smallest/largest alpha": the bound stays valid
        warnings.simplefilter("ignore")
        eps, _ = privacy_analysis.get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    eps = float(eps)
    return math.inf if math.isnan(eps) else max(0.0, eps)


class RdpAccountant(Accountant):
    """Composes ``PrivacyEvent``s with RDP and answers epsilon for the run's ``delta``.

    Parameters
    ----------
    delta : float
        The run's delta, in (0, 1).
    orders : sequence of float or None
        RDP orders (> 1); None uses ``RDP_ORDERS`` (1.1 to 1024).
    """

    name = "rdp"

    def __init__(self, delta: float, orders: Sequence[float] | None = None) -> None:
        super().__init__(delta)
        self._orders = RDP_ORDERS if orders is None else self._check_orders(orders)

    @staticmethod
    def _check_orders(orders: Any) -> tuple[float, ...]:
        ok = isinstance(orders, Sequence) and len(orders) > 0 and all(_is_real(a) and a > 1 for a in orders)
        _require(ok, "RDP orders", "be a non-empty sequence of finite numbers > 1", orders)
        return tuple(float(a) for a in orders)

    @property
    def orders(self) -> tuple[float, ...]:
        return self._orders

    def _epsilon(self, counts: Counts, delta: float) -> float:
        return rdp_epsilon(counts, delta, self._orders)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "orders": list(self._orders)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the ledger with a saved one, with the orders it was accounted at."""
        delta, events = self._load(state, {"orders"})
        self.delta, self._orders, self._events = delta, self._check_orders(state["orders"]), events
        self._grouped = _counts(events)
        self._cache.clear()


# -- registry ----------------------------------------------------------------------------------------------------
_ACCOUNTANTS: dict[str, Callable[[float], Accountant]] = {}


def register_accountant(name: str, factory: Callable[[float], Accountant]) -> None:
    """Make ``create_accountant(name, delta)`` call ``factory(delta)``; a name registered twice is an error."""
    _require(name not in _ACCOUNTANTS, "accountant name", "be registered once", name)
    _ACCOUNTANTS[name] = factory


def available_accountants() -> tuple[str, ...]:
    return tuple(sorted(_ACCOUNTANTS))


def create_accountant(name: str, delta: float) -> Accountant:
    """A fresh accountant by name: ``"pld"`` (privacy loss distributions, the default) or ``"rdp"``."""
    _require(name in _ACCOUNTANTS, "accountant", f"be one of {list(available_accountants())}", name)
    return _ACCOUNTANTS[name](delta)


def load_accountant(state: Any) -> Accountant:
    """The accountant a saved ledger was kept with (an RDP one for a state of an earlier fedshield), loaded."""
    kind = state.get("accountant", "rdp") if isinstance(state, dict) else None
    acc = create_accountant(kind, 0.5)
    acc.load_state_dict(state)
    return acc


def epsilon_of(events: Sequence[PrivacyEvent], delta: float, accountant: str) -> float:
    """Epsilon of ``events`` at ``delta`` under the named accountant."""
    acc = create_accountant(accountant, delta)
    for e in events:
        acc.compose(e)
    return acc.epsilon()


register_accountant("rdp", RdpAccountant)


# -- planning and the budget ---------------------------------------------------------------------------------------
def calibrate_noise_multiplier(target_epsilon: float, delta: float, sampling_rate: float, rounds: int,
                               tol: float = 0.001, orders: Sequence[float] | None = None,
                               accountant: str = DEFAULT_ACCOUNTANT) -> float:
    """The smallest noise multiplier ``z`` (within ``tol``, relative) for which ``rounds`` events
    of ``(sampling_rate, z)`` keep epsilon at ``delta`` <= ``target_epsilon`` under ``accountant``
    (``orders``: the RDP orders, for ``accountant = "rdp"`` only).

    A binary search on the accountant: the answer ``z`` meets the target; ``z / (1 + tol)`` does
    not. Raises PrivacyError when the target needs ``z`` outside [0.01, 1000]: unreachable, or so
    loose it protects no one.
    """
    _require(_is_real(target_epsilon) and target_epsilon > 0, "target-epsilon", "be finite and > 0",
             target_epsilon)
    _require(isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1, "rounds", "be an int >= 1",
             rounds)
    _require(_is_real(tol) and 0 < tol < 0.5, "tol", "be in (0, 0.5)", tol)
    acc = RdpAccountant(delta, orders) if orders is not None else create_accountant(accountant, delta)
    _require(orders is None or accountant == "rdp", "orders", "be None unless accountant = 'rdp'", orders)

    def eps(z: float) -> float:
        return acc.epsilon_if(PrivacyEvent(sampling_rate, z, rounds))

    lo, hi = _Z_RANGE
    if acc.name != "rdp":  # PLD never needs more noise than RDP: RDP's answer (fast) brackets the search
        try:
            z_rdp = calibrate_noise_multiplier(target_epsilon, delta, sampling_rate, rounds, tol, COARSE_ORDERS, "rdp")
        except PrivacyError as exc:
            if "reachable" not in str(exc):
                raise  # RDP meets the target at z = 0.01 already: so does PLD, which is tighter
            z_rdp = hi
        if z_rdp < hi and eps(z_rdp) <= target_epsilon:
            hi, lo = z_rdp, max(lo, z_rdp / 2)
            while lo > _Z_RANGE[0] and eps(lo) <= target_epsilon:
                lo, hi = max(_Z_RANGE[0], lo / 2), lo
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

    def check_next(self, accountant: Accountant, event: PrivacyEvent) -> None:
        """Raise BudgetExhausted if composing ``event`` would take epsilon past the target."""
        after = accountant.epsilon_if(event, self.delta)
        if after > self.target_epsilon:
            spent = accountant.epsilon(self.delta)
            raise BudgetExhausted(
                f"privacy budget must not be exceeded: the next round would reach epsilon {after:.4g} "
                f"(delta {self.delta:g}, {accountant.name} accountant), past target-epsilon {self.target_epsilon:g}. "
                f"Found {spent:.4g} spent so far after {len(accountant.events)} events; stop here, running the round "
                "would void the guarantee.")

    def describe(self, accountant: Accountant, level: str = "user", clip: float | None = None) -> str:
        """One paragraph stating the guarantee reached so far and what it assumes."""
        _require(level in ("user", "example"), "privacy level", "be 'user' or 'example'", level)
        events = accountant.events
        eps = accountant.epsilon(self.delta)
        unit, adder = ("client", "coordinator") if level == "user" else ("example", "trainer")
        _require(clip is None or (_is_real(clip) and clip > 0), "clip-norm", "be finite and > 0 or None", clip)
        c_val = "" if clip is None else f" = {clip:g}"
        qs = ", ".join(f"{q:g}" for q in sorted({float(e.sampling_rate) for e in events})) or "n/a"
        zs = ", ".join(f"{z:g}" for z in sorted({float(e.noise_multiplier) for e in events})) or "n/a"
        analysis = {"pld": "privacy loss distribution", "rdp": "RDP"}.get(accountant.name, accountant.name)
        return (
            f"({eps:.3g}, {self.delta:g})-differential privacy at the {level} level after {accountant.rounds} rounds "
            f"(target epsilon {self.target_epsilon:g}): changing whether one {unit}'s data is present changes "
            f"the probability of any outcome by at most a factor exp({eps:.3g}), except with probability "
            f"{self.delta:g}. This assumes that each round includes each {unit} independently with probability "
            f"q ({qs}; Poisson sampling, q=1 meaning all), that each {unit}'s contribution is clipped to L2 norm "
            f"C{c_val} and enters the sum with weight 1, that a trusted {adder} adds Gaussian noise of std z*C "
            f"(z: {zs}) to the sum and divides only by a public count, and add/remove-one-{unit} adjacency as in "
            f"the {analysis} analysis of the sampled Gaussian mechanism (under replace-one adjacency the sensitivity "
            f"doubles to 2*C and this epsilon does not apply)."
        )
