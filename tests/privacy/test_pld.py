"""The PLD accountant (the default) and planning: within 1% of dp-accounting on a grid of q, z, steps and delta.

The reference is dp-accounting 0.6's own PLD accountant, composed event by group with a
twice as fine discretisation than ours (its answer is then the closer upper bound);
RDP is checked against dp-accounting's RDP accountant at the same orders (1.1 to 1024).
Grid points are chosen where epsilon means something (>= 0.01): far below, 1% of it is
below any discretisation.
"""

from __future__ import annotations

import functools
import logging
import math

import dp_accounting
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant

from privacy import (
    PldAccountant,
    PrivacyBudget,
    PrivacyError,
    PrivacyEvent,
    RdpAccountant,
    available_accountants,
    calibrate_noise_multiplier,
    create_accountant,
    epsilon_of,
    load_accountant,
)
from privacy.accountant import RDP_ORDERS
from privacy.pld import discretisation_interval

# (q, z, steps, delta): q from 1e-4 to 1, z from 0.5 to 10, up to 10^5 steps, delta 1e-5 to 1e-10
GRID = [
    (1e-4, 0.5, 100_000, 1e-5), (1e-4, 10.0, 100_000, 1e-10), (1e-3, 1.0, 10_000, 1e-8), (1e-3, 3.0, 100_000, 1e-6),
    (0.003, 3.7, 250, 1e-6), (0.01, 1.0, 100_000, 1e-5), (0.01, 0.5, 100, 1e-10), (0.1, 2.0, 1000, 1e-7),
    (0.2, 0.966, 20, 1e-5), (0.5, 5.0, 50, 1e-9), (1.0, 0.5, 10, 1e-10), (1.0, 10.0, 100_000, 1e-5),
    (1.0, 3.0, 1, 1e-6),
]


@pytest.fixture(autouse=True)
def _quiet_dp_accounting():
    logger = logging.getLogger("absl")  # dp-accounting's "failed to converge" warnings, one per dropped order
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _event(q: float, z: float) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(z)
    return gaussian if q == 1 else dp_accounting.PoissonSampledDpEvent(q, gaussian)


@functools.cache
def pld_reference(q: float, z: float, steps: int, delta: float) -> float:
    interval = discretisation_interval(((q, z, steps),), delta) / 2
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=interval)
    acc.compose(_event(q, z), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(("q", "z", "steps", "delta"), GRID)
def test_pld_within_one_percent_of_dp_accounting(q, z, steps, delta):
    acc = PldAccountant(delta)
    acc.compose(PrivacyEvent(q, z, steps))
    mine, ref = acc.epsilon(), pld_reference(q, z, steps, delta)
    assert ref >= 0.01, "grid points must spend a meaningful epsilon"
    assert ref * (1 - 1e-3) <= mine <= ref * 1.01, (mine, ref)
    assert mine <= epsilon_of([PrivacyEvent(q, z, steps)], delta, "rdp") * (1 + 1e-3), "PLD is the tighter analysis"


@pytest.mark.parametrize(("q", "z", "steps", "delta"), GRID)
def test_rdp_within_one_percent_of_dp_accounting_at_the_same_orders(q, z, steps, delta):
    ref_acc = dp_accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS))
    ref_acc.compose(_event(q, z), steps)
    mine, ref = epsilon_of([PrivacyEvent(q, z, steps)], delta, "rdp"), ref_acc.get_epsilon(delta)
    assert mine <= ref * (1 + 1e-9) and mine == pytest.approx(ref, rel=0.01)


def test_the_issue_example_small_sampling_rate_needs_large_orders_or_pld():
    """q = 0.003, z = 3.7, delta = 1e-6: opacus's orders (to 63) gave 0.140 after 7 rounds; dp-accounting 0.063."""
    seven = [PrivacyEvent(0.003, 3.7, 7)]
    assert epsilon_of(seven, 1e-6, "rdp") == pytest.approx(0.063, abs=5e-4)
    assert epsilon_of(seven, 1e-6, "pld") < 0.01
    assert max(RDP_ORDERS) >= 1024 and any(a != int(a) for a in RDP_ORDERS)


def test_grouped_ledger_equals_repeated_events_and_mixed_groups_compose():
    a, b = PldAccountant(1e-5), PldAccountant(1e-5)
    a.compose(PrivacyEvent(0.1, 1.3, steps=7))
    for _ in range(7):
        b.compose(PrivacyEvent(0.1, 1.3))
    assert a.epsilon() == b.epsilon() > 0
    before = a.epsilon()
    a.compose(PrivacyEvent(1.0, 4.0))
    assert a.epsilon() > before and a.epsilon_if(PrivacyEvent(0.1, 1.3)) > a.epsilon()


def test_epsilon_if_then_compose_is_one_composition(monkeypatch):
    """The budget check's answer is the charge's: asking again after the round costs nothing."""
    import privacy.pld as pld

    calls = []
    real = pld.pld_epsilon.__wrapped__
    monkeypatch.setattr(pld, "pld_epsilon", lambda c, d: calls.append(c) or real(c, d))
    acc, event = PldAccountant(1e-5), PrivacyEvent(0.2, 1.1)
    for _ in range(3):
        predicted = acc.epsilon_if(event)
        acc.compose(event)
        assert acc.epsilon() == predicted == acc.epsilon()
    assert len(calls) == 3  # and a repeated question (a report, the summary) is a lookup


@pytest.mark.parametrize("name", ["pld", "rdp"])
def test_state_round_trip_names_its_accountant(name, tmp_path):
    acc = create_accountant(name, 1e-6)
    for event in (PrivacyEvent(0.1, 1.1), PrivacyEvent(0.05, 0.9, steps=4)):
        acc.compose(event)
    torch.save(acc.state_dict(), tmp_path / "s.pt")
    loaded = load_accountant(torch.load(tmp_path / "s.pt", weights_only=True))
    assert loaded.name == name and loaded.events == acc.events and loaded.epsilon() == acc.epsilon() > 0
    other = create_accountant({"pld": "rdp", "rdp": "pld"}[name], 1e-6)
    with pytest.raises(PrivacyError, match=f"accountant state must be a '{other.name}' ledger"):
        other.load_state_dict(acc.state_dict())


def test_an_old_rdp_ledger_keeps_its_orders_and_epsilon():
    old_orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # opacus's, before this change
    state = {"delta": 1e-5, "orders": [float(a) for a in old_orders], "events": [[0.003, 3.7, 7]]}  # no "accountant"
    acc = load_accountant(state)
    assert isinstance(acc, RdpAccountant) and acc.orders == tuple(float(a) for a in old_orders)
    assert acc.epsilon() == RdpAccountant(1e-5, old_orders).epsilon_if(PrivacyEvent(0.003, 3.7, 7))  # as recorded
    assert acc.epsilon() > epsilon_of(acc.events, 1e-5, "rdp")  # the new orders reach further


def test_registry_refuses_unknown_names():
    assert available_accountants() == ("pld", "rdp")
    with pytest.raises(PrivacyError, match=r"accountant must be one of \['pld', 'rdp'\]. Found 'prv'"):
        create_accountant("prv", 1e-5)


@pytest.mark.parametrize(("target", "delta", "q", "rounds"),
                         [(1.0, 1e-5, 0.2, 20), (3.0, 1e-5, 0.01, 1000), (8.0, 1e-6, 1.0, 10), (0.5, 1e-8, 0.003, 250)])
@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_planned_noise_meets_its_target_and_one_percent_less_does_not(target, delta, q, rounds, accountant):
    z = calibrate_noise_multiplier(target, delta, q, rounds, accountant=accountant)
    assert epsilon_of([PrivacyEvent(q, z, rounds)], delta, accountant) <= target
    assert epsilon_of([PrivacyEvent(q, 0.99 * z, rounds)], delta, accountant) > target
    if accountant == "pld":
        assert z < calibrate_noise_multiplier(target, delta, q, rounds, accountant="rdp")


def test_budget_with_pld_stops_before_the_round_that_would_pass_the_target():
    budget, acc, event = PrivacyBudget(2.0, 1e-5), PldAccountant(1e-5), PrivacyEvent(0.1, 1.0)
    rounds = 0
    while True:
        try:
            budget.check_next(acc, event)
        except PrivacyError as exc:
            assert "pld accountant" in str(exc)
            break
        acc.compose(event)
        rounds += 1
    assert acc.epsilon() <= 2.0 < acc.epsilon_if(event) and rounds > 1



# -- the hot path: incremental composition, the vectorised epsilon, the exact Gaussian ------------------------------
@pytest.mark.parametrize(("q", "z"), [(0.2, 1.0), (0.01, 1.0), (0.003, 3.7), (0.05, 0.6)])
def test_a_ledger_charged_round_by_round_equals_one_composed_at_once(q, z, monkeypatch):
    """The run's path (one composition per round on the kept PLD) against a fresh self-composition: equal within
    rounding, and never below it by more than rounding (the dropped tails only add to delta)."""
    import privacy.pld as pld

    pld._latest.clear()
    steps, real = [], pld._compose
    monkeypatch.setattr(pld, "_compose", lambda a, b: steps.append(1) or real(a, b))
    acc, event = PldAccountant(1e-6), PrivacyEvent(q, z)
    for _ in range(150):
        acc.epsilon_if(event)
        acc.compose(event)
    by_round = acc.epsilon()
    assert len(steps) > 140  # one composition a round, but where the discretisation interval changed
    pld._latest.clear()
    at_once = pld.pld_epsilon.__wrapped__(((q, z, 150),), 1e-6)
    assert by_round == pytest.approx(at_once, rel=1e-8) and by_round >= at_once * (1 - 1e-12)
    assert at_once == pytest.approx(pld_reference(q, z, 150, 1e-6), rel=0.01)


@pytest.mark.parametrize("delta", [0.9, 0.3, 1e-3, 1e-7, 1e-12, 1e-30])
@pytest.mark.parametrize(("q", "z", "steps"), [(0.2, 1.0, 30), (0.01, 0.5, 200), (0.5, 8.0, 3), (1.0, 0.3, 1)])
def test_vectorised_epsilon_is_dp_accountings_answer(q, z, steps, delta):
    """Our one-pass epsilon against dp-accounting's loop on the same PLD: the same sums in the same order, so equal
    but for rounding, including the answers 0 (a huge delta) and inf (delta below the infinite loss's mass)."""
    from dp_accounting.pld import privacy_loss_distribution

    import privacy.pld as pld

    built = privacy_loss_distribution.from_gaussian_mechanism(standard_deviation=z, value_discretization_interval=1e-3,
                                                            sampling_prob=q).self_compose(steps)
    ours, theirs = pld._epsilon_for_delta(built, delta), max(0.0, built.get_epsilon_for_delta(delta))
    assert ours == pytest.approx(theirs, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize(("z", "delta"), [(0.5, 1e-10), (1.0, 1e-5), (3.0, 1e-6), (20.0, 1e-5), (0.1, 1e-8)])
def test_the_gaussian_has_its_exact_epsilon(z, delta):
    """A ledger of q = 1 events only: the Gaussian mechanism's exact epsilon (Balle & Wang 2018), at or below
    dp-accounting's pessimistic PLD and within 1% of it, and it meets delta (dp-accounting's exact delta)."""
    from dp_accounting.pld import privacy_loss_mechanism

    from privacy.pld import gaussian_epsilon

    eps = gaussian_epsilon(z, delta)
    exact_delta = privacy_loss_mechanism.GaussianPrivacyLoss(z).get_delta_for_epsilon(eps)
    assert exact_delta <= delta * (1 + 1e-9)
    assert privacy_loss_mechanism.GaussianPrivacyLoss(z).get_delta_for_epsilon(eps * (1 - 1e-6)) > delta
    reference = pld_reference(1.0, z, 1, delta)
    assert eps <= reference and eps == pytest.approx(reference, rel=0.01)
    # groups of q = 1 at different multipliers compose as one Gaussian: 1/z^2 adds up
    acc = PldAccountant(delta)
    acc.compose(PrivacyEvent(1.0, z * 2, steps=2))
    acc.compose(PrivacyEvent(1.0, z * math.sqrt(2)))
    assert acc.epsilon() == pytest.approx(eps, rel=1e-9)
