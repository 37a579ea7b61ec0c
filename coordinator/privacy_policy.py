"""Central (user-level) differential privacy as a coordinator policy.

Per round: check the budget before sampling; clip every accepted update to the
current clip norm and weight it 1 (each client's influence on the sum is at most
C); add Gaussian noise of std z*C to the sum; divide by the number of clients
asked (a public count); record one sampled-Gaussian event in the RDP ledger.
The ledger, z and the clip norm live in the checkpoint.
"""

from __future__ import annotations

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

from .config import PrivacySettings


class CentralDp:
    """Sensitivity bound + noise + accounting + budget for one run."""

    def __init__(self, cfg: PrivacySettings, expected_rate: float, num_rounds: int, seed: int) -> None:
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
        self.adaptive = (AdaptiveClipping(cfg.dp_clip, cfg.clip_target_quantile, cfg.clip_learning_rate,
                                          count_noise_std=cfg.clip_count_noise, secure=cfg.dp_secure_noise,
                                          generator=None if cfg.dp_secure_noise else torch.Generator().manual_seed(seed + 7))
                         if cfg.adaptive_clipping else None)
        self.seed = seed

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
        """The noised mean delta: (sum of clipped updates + N(0, (z_sum*C)^2)) / asked."""
        total = agg.result().mul_(agg.total_weight) if agg.count else torch.zeros(agg.numel, device=agg.device)
        z_sum = effective_noise_multiplier(self.z, self.cfg.clip_count_noise) if self.adaptive else self.z
        gen = None if self.cfg.dp_secure_noise else torch.Generator().manual_seed(self.seed * 1_000_003 + rnd)
        CentralGaussianMechanism(self.clip, z_sum, secure=self.cfg.dp_secure_noise, generator=gen).noise_sum_(total)
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
            return self.budget.describe(self.accountant, level="user", clip=clip)
        spent = max(self.epsilon, 1e-12)  # no budget set: describe what was spent
        text = PrivacyBudget(spent, self.cfg.dp_delta).describe(self.accountant, level="user", clip=clip)
        return text.replace(f" (target epsilon {spent:g})", " (no target-epsilon set)")

    # -- checkpoint ------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"accountant": self.accountant.state_dict(), "z": self.z, "clip": self.clip,
                "adaptive": self.adaptive.state_dict() if self.adaptive else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state["accountant"])
        self.z, self.clip = float(state["z"]), float(state["clip"])
        if self.adaptive is not None and state.get("adaptive"):
            self.adaptive.load_state_dict(state["adaptive"])
