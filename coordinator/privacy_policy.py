"""Central (user-level) differential privacy as a coordinator policy.

Per round: check the budget before sampling; clip every accepted update to the
current clip norm and weight it 1 (each client's influence on the sum is at most
C); add Gaussian noise of std z*C to the sum (z*2C under FedBuff, where a client's
update displaces another's); divide by a public count fixed before the run
(never the number of clients drawn or online); record one sampled-Gaussian event
in the RDP ledger. The ledger, z and the clip norm live in the checkpoint.
"""

from __future__ import annotations

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
    PrivacyEvent,
    RdpAccountant,
    calibrate_noise_multiplier,
    effective_noise_multiplier,
)

from ._errors import CoordinatorError
from .config import PrivacySettings, min_survivors


class CentralDp:
    """Sensitivity bound + noise + accounting + budget for one run."""

    def __init__(self, cfg: PrivacySettings, expected_rate: float, num_rounds: int) -> None:
        self.cfg = cfg
        self.accountant = RdpAccountant(cfg.dp_delta)
        self.budget = PrivacyBudget(cfg.target_epsilon, cfg.dp_delta) if cfg.target_epsilon > 0 else None
        if cfg.dp_noise_multiplier > 0:
            self.z = cfg.dp_noise_multiplier
        else:  # calibrate for the target over the planned rounds at the expected sampling rate
            self.z = calibrate_noise_multiplier(cfg.target_epsilon, cfg.dp_delta, expected_rate, num_rounds)
            log(INFO, "[fedshield] central DP: noise multiplier %.4f calibrated for epsilon %.3g over %d rounds at q=%.3g",
                self.z, cfg.target_epsilon, num_rounds, expected_rate)
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
        self.accountant.load_state_dict(state["accountant"])
        z, clip = float(state["z"]), float(state["clip"])
        if not (math.isfinite(z) and z > 0 and math.isfinite(clip) and clip > 0):
            raise ValueError(f"its noise multiplier ({z:g}) and clip ({clip:g}) must be finite and > 0")
        self.z, self.clip = z, clip
        if self.adaptive is not None and state.get("adaptive"):
            self.adaptive.load_state_dict(state["adaptive"])


class DistributedDp(CentralDp):
    """Distributed DP under SecAgg+: each client clips to dp-clip and adds its share of Skellam noise.

    The coordinator sees only the noised sum. Noise is sized so the survivors' total has
    std ``z * C`` when at least ``(1 - secagg-dropout-rate)`` of the selected clients survive
    (each adds variance ``(z C)^2 / (n (1 - r))``); a round with fewer survivors is not
    unmasked (nothing is released, nothing spent); one unmasked and then failed by a later check
    is charged all the same (the coordinator saw its noised sum). Each round is accounted as a Gaussian with
    ``z_eff = z * sqrt(survivors / (n (1 - r))) >= z`` and no sampling amplification (the
    coordinator, the party this protects against, chooses the sample): Skellam noise of that
    variance, at the scale of the quantization grid here (std of 1e4+ levels), is within a
    negligible margin of the Gaussian (Agarwal, Kairouz, Liu 2021, Thm 3.5).
    """

    def __init__(self, cfg: PrivacySettings, expected_rate: float, num_rounds: int, dropout_rate: float) -> None:
        # The coordinator picks the sample and sees who took part: against it, sampling amplifies nothing.
        super().__init__(cfg, 1.0, num_rounds)
        self.dropout_rate = dropout_rate

    def event(self, sampling_rate: float) -> PrivacyEvent:
        return PrivacyEvent(sampling_rate=1.0, noise_multiplier=self.z)

    def min_survivors(self, selected: int) -> int:
        return min_survivors(selected, self.dropout_rate)

    def client_noise(self, selected: int, step: float, numel: int) -> tuple[float, float]:
        """(clip each client applies before quantizing, Skellam mu per coordinate) for ``selected`` clients.

        Stochastic rounding moves a vector by at most ``step * sqrt(numel)``; clipping to
        ``C - step * sqrt(numel)`` keeps the quantized vector within C.
        """
        clip = self.clip - step * math.sqrt(numel)
        if clip <= 0:
            raise CoordinatorError(f"dp-clip={self.clip:g} must exceed the quantization grid's rounding "
                                   f"({step * math.sqrt(numel):.3g}); use more secagg-bits or a larger dp-clip.")
        sigma_levels = self.z * self.clip / step
        return clip, sigma_levels**2 / (selected * (1 - self.dropout_rate)) / 2.0

    def after_secure_round(self, sampling_rate: float, survivors: int, selected: int) -> None:
        z_eff = self.z * math.sqrt(survivors / (selected * (1 - self.dropout_rate)))
        self.accountant.compose(PrivacyEvent(sampling_rate=1.0, noise_multiplier=z_eff))

    def describe(self) -> str:
        return (super().describe() + " The noise is distributed: each client adds its share of Skellam noise to its "
                "quantized, clipped update under SecAgg+, so the coordinator never sees an un-noised sum; the guarantee "
                "assumes the coordinator follows the protocol (semi-honest) and no client colludes with it, claims no "
                "amplification by sampling against it, and accounts Skellam as a Gaussian of the same variance.")
