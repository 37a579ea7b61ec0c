"""Central (user-level) differential privacy as a coordinator policy.

Per round: check the budget before sampling; clip every accepted update to the
current clip norm and weight it 1 (each client's influence on the sum is at most
C); add Gaussian noise of std z*C to the sum (z*2C under FedBuff, where a client's
update displaces another's); divide by a public count fixed before the run
(never the number of clients drawn or online); record one sampled-Gaussian event
in the ledger, composed by the run's ``accountant`` (PLD by default, or RDP). The
ledger (naming its accountant), z and the clip norm live in the checkpoint; a run
resumes with the accountant it was started with (the fingerprint names it; an older
checkpoint's ledger, which names none, is an RDP one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from logging import INFO
from typing import Any

import torch
from flwr.common.logger import log

from aggregation import create_aggregator
from privacy import (
    AdaptiveClipping,
    CentralGaussianMechanism,
    PrivacyBudget,
    PrivacyError,
    PrivacyEvent,
    available_accountants,
    calibrate_noise_multiplier,
    create_accountant,
    effective_noise_multiplier,
    epsilon_of,
    load_accountant,
)

from ._errors import CoordinatorError
from .config import PrivacySettings, min_survivors


class CentralDp:
    """Sensitivity bound + noise + accounting + budget for one run."""

    def __init__(self, cfg: PrivacySettings, expected_rate: float, num_rounds: int) -> None:
        self.cfg = cfg
        self.accountant = create_accountant(cfg.accountant, cfg.dp_delta)
        self.budget = PrivacyBudget(cfg.target_epsilon, cfg.dp_delta) if cfg.target_epsilon > 0 else None
        if cfg.dp_noise_multiplier > 0:
            self.z = cfg.dp_noise_multiplier
        else:  # calibrate for the target over the planned rounds at the expected sampling rate
            plan = {name: calibrate_noise_multiplier(cfg.target_epsilon, cfg.dp_delta, expected_rate, num_rounds,
                                                     accountant=name) for name in available_accountants()}
            self.z = plan[cfg.accountant]
            log(INFO, "[fedshield] %s DP: noise multiplier %.4f calibrated for epsilon %.3g (delta %g) over %d rounds at "
                "q=%.3g with the %s accountant (%s)", cfg.dp, self.z, cfg.target_epsilon, cfg.dp_delta, num_rounds,
                expected_rate, cfg.accountant, ", ".join(f"{k}: {v:.4f}" for k, v in plan.items()))
        self.clip = cfg.dp_clip
        # The seeded (fast) generators draw from a secret seed, never from the run's seed: clients get that in
        # every train message (and config.json holds it), and could then subtract the noise. A fresh one per
        # process, so a resumed run's noise is independent of the first session's too.
        self._secret = os.urandom(32)
        # adaptive clipping: clip-count-noise, or when 0 (unset) a value derived from z (PrivacySettings.count_noise_std)
        self.count_noise_std = cfg.count_noise_std(self.z)
        self.adaptive = (AdaptiveClipping(cfg.dp_clip, cfg.clip_target_quantile, cfg.clip_learning_rate,
                                          count_noise_std=self.count_noise_std, secure=cfg.dp_secure_noise,
                                          generator=None if cfg.dp_secure_noise else torch.Generator().manual_seed(self._seed("count", 0)))
                         if cfg.adaptive_clipping else None)
        if self.adaptive is not None and cfg.clip_count_noise == 0:
            log(INFO, "[fedshield] adaptive clipping: clip-count-noise %.4g (auto, from noise multiplier %.4g); the "
                "update sum's noise multiplier is %.4g", self.count_noise_std, self.z,
                effective_noise_multiplier(self.z, self.count_noise_std))

    def _seed(self, what: str, rnd: int) -> int:
        """A 63-bit generator seed for ``what`` in round ``rnd``, derived from the secret."""
        digest = hashlib.sha256(self._secret + f"{what}:{rnd}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    # -- per round -----------------------------------------------------------
    def event(self, sampling_rate: float) -> PrivacyEvent:
        return PrivacyEvent(sampling_rate=min(1.0, max(sampling_rate, 1e-12)), noise_multiplier=self.z)

    def check_budget(self, sampling_rate: float) -> None:
        """Raise BudgetExhausted if the next round would take epsilon past the target."""
        if self.budget is not None:
            self.budget.check_next(self.accountant, self.event(sampling_rate))

    def make_aggregator(self, numel: int, device: Any, max_clients: int) -> Any:
        return create_aggregator("norm-bounded-mean", numel, device, max_clients, clip=self.clip)

    def release(self, agg: Any, asked: int, rnd: int) -> torch.Tensor:
        """The noised mean delta: (sum of clipped updates + N(0, (z_sum*C)^2)) / asked (a public count)."""
        total = agg.result().mul_(agg.total_weight) if agg.count else torch.zeros(agg.numel, device=agg.device)
        z_sum = effective_noise_multiplier(self.z, self.count_noise_std) if self.adaptive else self.z
        gen = None if self.cfg.dp_secure_noise else torch.Generator().manual_seed(self._seed("sum", rnd))
        CentralGaussianMechanism(self.clip, z_sum, secure=self.cfg.dp_secure_noise,
                                 generator=gen).noise_sum_(total)
        return total.div_(max(1, asked))

    def after_round(self, sampling_rate: float, norms: list[float], asked: int) -> None:
        self.accountant.compose(self.event(sampling_rate))
        if self.adaptive is not None:
            self.clip = self.adaptive.update(torch.tensor(norms, dtype=torch.float64), max(1, asked))

    @property
    def epsilon(self) -> float:
        return self.accountant.epsilon()

    def epsilon_by_accountant(self) -> dict[str, float]:
        """The ledger's epsilon under each accountant (the report shows what the tighter analysis gains)."""
        return {name: epsilon_of(self.accountant.events, self.cfg.dp_delta, name) for name in available_accountants()}

    def describe(self) -> str:
        clip = None if self.adaptive else self.clip
        if self.budget is not None:
            text = self.budget.describe(self.accountant, level="user", clip=clip)
        else:
            spent = max(self.epsilon, 1e-12)  # no budget set: describe what was spent
            text = PrivacyBudget(spent, self.cfg.dp_delta).describe(self.accountant, level="user", clip=clip)
            text = text.replace(f" (target epsilon {spent:g})", " (no target-epsilon set)")
        return text

    # -- checkpoint ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "z": self.z, "clip": self.clip,
                "adaptive": self.adaptive.state_dict() if self.adaptive else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        accountant = load_accountant(state["accountant"])
        if accountant.name != self.cfg.accountant:  # (the fingerprint says so first, naming the setting)
            raise PrivacyError(f"accountant must be {accountant.name!r} to resume this run (its ledger was kept with "
                               f"it). Found {self.cfg.accountant!r}.")
        self.accountant = accountant
        z, clip = float(state["z"]), float(state["clip"])
        if not (math.isfinite(z) and z > 0 and math.isfinite(clip) and clip > 0):
            raise ValueError(f"its noise multiplier ({z:g}) and clip ({clip:g}) must be finite and > 0")
        self.z, self.clip = z, clip
        if self.adaptive is not None and state.get("adaptive"):
            self.adaptive.load_state_dict(state["adaptive"])


def skellam_rho(mu_sum: float, l2: float, l1: float) -> float:
    """zCDP rho of the Skellam sum of parameter ``mu_sum`` (variance 2 mu_sum per coordinate) for an integer
    update of L2 / L1 sensitivity ``l2`` / ``l1`` (in grid levels): its RDP at order a is at most
    a l2^2 / (4 mu) + ((2a - 1) l2^2 + 6 l1) / (16 mu^2) <= a rho for every a >= 1 (Agarwal, Kairouz & Liu 2021,
    Thm 3.5), rho = l2^2 / (4 mu) + (2 l2^2 + 6 l1) / (16 mu^2): the Gaussian term and the discretisation term."""
    return l2 * l2 / (4 * mu_sum) + (2 * l2 * l2 + 6 * l1) / (16 * mu_sum * mu_sum)


def skellam_mu_for(z: float, l2: float, l1: float) -> float:
    """The Skellam sum's mu whose rho (``skellam_rho``) is a Gaussian's of multiplier ``z``, 1 / (2 z^2)."""
    a, b, rho = (2 * l2 * l2 + 6 * l1) / 16, l2 * l2 / 4, 1 / (2 * z * z)
    return (math.sqrt(b * b + 4 * a * rho) + b) / (2 * rho)  # 1 / x, x the positive root of a x^2 + b x = rho


class DistributedDp(CentralDp):
    """Distributed DP under SecAgg+: each client clips to dp-clip and adds its share of Skellam noise.

    The coordinator sees only the noised sum. Noise is sized so that the survivors' Skellam sum,
    when at least ``(1 - secagg-dropout-rate)`` of the selected clients survive, is ``z``-zCDP-equivalent:
    its RDP at every order is at most the Gaussian's of multiplier ``z`` (``skellam_mu_for``), with two
    terms stated: discretisation (the update is quantized to the ring's grid, step s: clients clip to
    ``C - s sqrt(d)`` so the quantized update's L2 sensitivity is ``C / s`` levels, its L1 at most
    ``min(sqrt(d), C / s)`` times that; Skellam's excess over the Gaussian, (2 l2^2 + 6 l1) / (16 mu^2), is
    paid with slightly more noise, a relative 1e-8 at 10^4 levels) and modular clipping (the sum is taken
    mod the ring: a function of the noised sum, so post-processing at no privacy cost; ``secagg-clip`` leaves
    8 std of room, so it wraps with probability < 1e-14 per coordinate, a utility matter). A round with fewer
    survivors is not unmasked (nothing is released, nothing spent); one unmasked and then failed by a later
    check is charged all the same. Each round is charged as a Gaussian with the survivors' actual ``z_eff >= z``
    and no sampling amplification (the coordinator, the party this protects against, chooses the sample).
    That bound is an RDP theorem, so distributed DP is always accounted (and its budget enforced) with the RDP
    accountant, whatever ``accountant`` says; the Gaussian's PLD figure, an approximation for Skellam noise
    (whose own multi-dimensional PLD is not computed here), is only reported beside it.
    """

    def __init__(self, cfg: PrivacySettings, expected_rate: float, num_rounds: int, dropout_rate: float) -> None:
        if cfg.accountant != "rdp":  # the Skellam bound is an RDP theorem; a Gaussian PLD of it would not be one
            log(INFO, "[fedshield] distributed DP: accounted with the RDP accountant, whose bound on the Skellam noise is "
                "proven (a Gaussian's PLD for it is not); the report gives the PLD figure beside it")
            cfg = dataclasses.replace(cfg, accountant="rdp")
        # The coordinator picks the sample and sees who took part: against it, sampling amplifies nothing.
        super().__init__(cfg, 1.0, num_rounds)
        self.dropout_rate = dropout_rate
        self._sensitivity: tuple[float, float] | None = None  # (l2, l1) in levels of the last round's grid

    def event(self, sampling_rate: float) -> PrivacyEvent:
        return PrivacyEvent(sampling_rate=1.0, noise_multiplier=self.z)

    def min_survivors(self, selected: int) -> int:
        return min_survivors(selected, self.dropout_rate)

    def client_noise(self, selected: int, step: float, numel: int) -> tuple[float, float]:
        """(clip each client applies before quantizing, Skellam mu per coordinate) for ``selected`` clients.

        Stochastic rounding moves a vector by at most ``step * sqrt(numel)``; clipping to
        ``C - step * sqrt(numel)`` keeps the quantized vector within C (``C / step`` levels).
        """
        clip = self.clip - step * math.sqrt(numel)
        if clip <= 0:
            raise CoordinatorError(f"dp-clip={self.clip:g} must exceed the quantization grid's rounding "
                                   f"({step * math.sqrt(numel):.3g}); use more secagg-bits or a larger dp-clip.")
        l2 = self.clip / step
        self._sensitivity = (l2, l2 * min(math.sqrt(numel), l2))
        return clip, skellam_mu_for(self.z, *self._sensitivity) / (selected * (1 - self.dropout_rate))

    def after_secure_round(self, sampling_rate: float, survivors: int, selected: int) -> None:
        if self._sensitivity is None:  # (not reached: a round's noise plan comes first) the Gaussian part alone
            z_eff = self.z * math.sqrt(survivors / (selected * (1 - self.dropout_rate)))
        else:
            mu_sum = survivors * skellam_mu_for(self.z, *self._sensitivity) / (selected * (1 - self.dropout_rate))
            z_eff = 1 / math.sqrt(2 * skellam_rho(mu_sum, *self._sensitivity))
        self.accountant.compose(PrivacyEvent(sampling_rate=1.0, noise_multiplier=z_eff))

    def describe(self) -> str:
        pld = (" Under the PLD accountant the rounds are composed as that Gaussian's privacy loss distribution, an "
               "approximation for Skellam noise; set accountant = 'rdp' for the proven bound."
               if self.cfg.accountant == "pld" else "")
        return (super().describe() + " The noise is distributed: each client adds its share of Skellam noise to its "
                "quantized, clipped update under SecAgg+, so the coordinator never sees an un-noised sum; the guarantee "
                "assumes the coordinator follows the protocol (semi-honest) and no client colludes with it, claims no "
                "amplification by sampling against it, and charges Skellam as the Gaussian that dominates its RDP "
                "(Agarwal, Kairouz & Liu 2021, Thm 3.5), the discretisation term included (quantization to the ring's "
                "grid is inside the clip; the sum's reduction mod the ring is post-processing)." + pld)
