"""Differential privacy mechanisms, split into "bound the sensitivity" and "add noise".

* Bound: ``clip_scale(norm, clip)`` is the factor that brings one update's L2 norm
  down to at most ``clip``; ``AdaptiveClipping`` moves ``clip`` toward a target
  quantile of the update norms (Andrew et al. 2021).
* Noise: ``GaussianNoise`` adds N(0, std^2) in place; ``CentralGaussianMechanism``
  adds N(0, (z * clip)^2) to the coordinator's sum of clipped updates (central,
  user-level DP).

Randomness. Every draw comes from an explicit source: a ``torch.Generator`` (seeded,
reproducible; for simulations and tests) or, with ``secure=True``, the operating
system's CSPRNG (``os.urandom``), which nobody can replay from a seed. Secure noise
is the sum of four Box-Muller normals halved (the floating-point attack fix opacus
uses, Holohan & Braghin 2021, sec. 5.1).

Privacy assumptions (what the accountant's numbers rely on):

* each participant's update enters the sum once, clipped to L2 norm ``clip`` and
  with weight 1 (a weight w scales the sensitivity to w * clip);
* the noised sum is divided by a public number (the expected number of
  participants), never by the actual count, which is not private;
* the coordinator adding the noise is trusted (central DP);
* floating-point noise is not exactly Gaussian; secure mode removes predictable
  seeds and the known representation attacks, not every floating-point effect.

Example
-------
>>> import torch
>>> g = torch.Generator().manual_seed(0)
>>> mech = CentralGaussianMechanism(clip=1.0, noise_multiplier=1.1, generator=g)
>>> total = torch.zeros(4)
>>> for update in (torch.tensor([3.0, 4.0, 0.0, 0.0]), torch.tensor([0.1, 0.0, 0.0, 0.0])):
...     _ = total.add_(update, alpha=clip_scale(float(update.norm()), mech.clip))
>>> total
tensor([0.7000, 0.8000, 0.0000, 0.0000])
>>> mech.std
1.1
>>> _ = mech.noise_sum_(total)
"""

from __future__ import annotations

import math
import os
from numbers import Real
from typing import Any

import numpy as np
import torch

from ._errors import PrivacyError

_CHUNK = 1 << 18  # secure mode: outputs drawn per chunk (bounds host temporaries to about 40 MB)
_MASK53 = (1 << 53) - 1


def _require(ok: bool, what: str, rule: str, found: Any) -> None:
    if not ok:
        raise PrivacyError(f"{what} must {rule}. Found {found!r}.")


def _is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool) and math.isfinite(x)


def clip_scale(norm: float, clip: float) -> float:
    """The factor ``min(1, clip / norm)`` that bounds an update of L2 norm ``norm`` by ``clip``.

    A zero norm gives 1. A non-finite norm raises PrivacyError: such an update cannot
    be bounded, and letting it through would void the sensitivity the noise is sized for.
    """
    _require(_is_real(clip) and clip > 0, "clip-norm", "be finite and > 0 (it bounds each update's influence)", clip)
    _require(isinstance(norm, Real) and not isinstance(norm, bool) and math.isfinite(norm),
             "update norm", "be finite to be clipped (a NaN or inf update has no bounded influence)", norm)
    _require(norm >= 0, "update norm", "be >= 0", norm)
    return 1.0 if norm <= clip else float(clip) / float(norm)


def _secure_uniform(n: int) -> torch.Tensor:
    """``n`` float64 uniforms in (0, 1] from the OS CSPRNG: 53 random bits each."""
    raw = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64).bitwise_and_(_MASK53)
    return raw.to(torch.float64).add_(1.0).mul_(2.0**-53)


def _secure_standard_normal(n: int) -> torch.Tensor:
    """``n`` float64 N(0, 1) draws on the CPU: Box-Muller on CSPRNG uniforms, four summed and halved."""
    m = 2 * n  # four normals per output, two normals per pair of uniforms
    u = _secure_uniform(2 * m)
    radius = u[:m].log_().mul_(-2.0).sqrt_()
    angle = u[m:].mul_(2.0 * math.pi)
    return (radius * angle.cos()).add_(radius * angle.sin_()).view(2, n).sum(dim=0).mul_(0.5)


class GaussianNoise:
    """Adds N(0, std^2) noise in place, on the tensor's own device and dtype.

    Parameters
    ----------
    std : float
        Standard deviation, >= 0. ``std == 0`` adds nothing (and draws nothing); it
        gives no privacy, so DP callers validate ``std > 0`` themselves.
    secure : bool
        Draw from the OS CSPRNG (``os.urandom``) instead of a torch generator. Not
        reproducible by design; ``generator`` must then be None.
    generator : torch.Generator or None
        Source for ``secure=False``; None uses torch's default generator. Draws are made
        on the generator's device and moved to the tensor's.
    """

    def __init__(self, std: float, secure: bool = False, generator: torch.Generator | None = None) -> None:
        _require(_is_real(std) and std >= 0, "noise std", "be finite and >= 0", std)
        _require(isinstance(secure, bool), "secure", "be a bool", secure)
        _require(generator is None or isinstance(generator, torch.Generator), "generator",
                 "be a torch.Generator or None", type(generator).__name__)
        if secure and generator is not None:
            raise PrivacyError("generator must be None in secure mode (noise comes from the OS CSPRNG, "
                               "a seeded generator would make it replayable). Found a torch.Generator.")
        self.std, self.secure, self.generator = float(std), secure, generator

    def add_(self, t: torch.Tensor) -> torch.Tensor:
        """``t += N(0, std^2)`` elementwise; returns ``t``."""
        _require(isinstance(t, torch.Tensor) and t.is_floating_point(), "noised tensor", "be a floating tensor",
                 getattr(t, "dtype", type(t).__name__))
        if self.std == 0 or t.numel() == 0:
            return t
        if self.secure:
            self._add_secure(t)
        else:
            dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
            device = self.generator.device if self.generator is not None else t.device
            noise = torch.randn(t.shape, generator=self.generator, device=device, dtype=dtype)
            t.add_(noise.to(t.device), alpha=self.std)
        return t

    def _add_secure(self, t: torch.Tensor) -> None:
        if not t.is_contiguous():
            noise = _secure_standard_normal(t.numel()).view(t.shape)
            t.add_(noise.to(device=t.device, dtype=t.dtype), alpha=self.std)
            return
        flat = t.view(-1)
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start:start + _CHUNK]
            noise = _secure_standard_normal(part.numel())
            part.add_(noise.to(device=t.device, dtype=t.dtype), alpha=self.std)


class CentralGaussianMechanism:
    """Central, user-level DP on a SUM of clipped updates: adds N(0, (z * clip)^2) per coordinate.

    Under add/remove-one-user adjacency the sum of updates each clipped to ``clip`` (weight 1)
    has L2 sensitivity ``clip``, so this is the Gaussian mechanism with noise multiplier ``z``.
    Record one ``PrivacyEvent(q, z)`` per round with the accountant. With adaptive clipping,
    pass ``effective_noise_multiplier(z, count_noise_std)`` here and still record ``z``.

    Parameters
    ----------
    clip : float
        L2 bound of each participant's update, > 0.
    noise_multiplier : float
        ``z`` > 0: noise std in units of ``clip``.
    secure, generator
        As for ``GaussianNoise``.
    """

    def __init__(self, clip: float, noise_multiplier: float, secure: bool = False,
                 generator: torch.Generator | None = None) -> None:
        _require(_is_real(clip) and clip > 0, "clip-norm",
                 "be finite and > 0 (without a bound on each update the noise protects no one)", clip)
        _require(_is_real(noise_multiplier) and noise_multiplier > 0, "noise-multiplier",
                 "be finite and > 0 for DP (with no noise the sum reveals each update)", noise_multiplier)
        self.clip, self.noise_multiplier = float(clip), float(noise_multiplier)
        self._noise = GaussianNoise(self.noise_multiplier * self.clip, secure=secure, generator=generator)

    @property
    def std(self) -> float:
        """Noise standard deviation added to each coordinate of the sum: ``z * clip``."""
        return self._noise.std

    @property
    def secure(self) -> bool:
        return self._noise.secure

    def scale(self, norm: float) -> float:
        """The clipping factor for one update of L2 norm ``norm`` (``clip_scale(norm, clip)``)."""
        return clip_scale(norm, self.clip)

    def noise_sum_(self, sum_tensor: torch.Tensor) -> torch.Tensor:
        """Add the noise to the sum of clipped updates in place; returns it."""
        return self._noise.add_(sum_tensor)


def effective_noise_multiplier(z: float, count_noise_std: float) -> float:
    """The noise multiplier the update sum must use when the clip is adapted with a noised count.

    Andrew et al. 2021, Theorem 1: noise ``z_delta * C`` on the sum plus noise
    ``count_noise_std`` (``sigma_b``) on the centred count costs what one Gaussian
    mechanism with multiplier ``z`` costs when

        z_delta = (z^-2 - (2 * sigma_b)^-2)^(-1/2)  (>= z).

    Record ``PrivacyEvent(q, z)``; noise the sum with ``z_delta``. Needs ``2 * sigma_b > z``:
    otherwise the count alone would spend the whole round's budget.
    """
    _require(_is_real(z) and z > 0, "noise-multiplier", "be finite and > 0 for DP", z)
    _require(_is_real(count_noise_std) and 2 * count_noise_std > z, "count-noise-std",
             f"be > noise-multiplier / 2 = {z / 2:g} (else the noised count spends the round's whole budget)",
             count_noise_std)
    inner = z**-2 - (2.0 * count_noise_std) ** -2
    return float(inner**-0.5)


class AdaptiveClipping:
    """Geometric adaptive clipping toward a target quantile of the update norms (Andrew et al. 2021).

    Each round, with ``m`` the expected number of participants (public) and the clip
    ``C`` used in that round::

        b = (sum_i (1[norm_i <= C] - 1/2) + N(0, sigma_b^2)) / m + 1/2
        C <- C * exp(-learning_rate * (b - target_quantile))

    Centring each bit at 1/2 halves the count's sensitivity (as in the paper and TF
    Privacy's quantile estimator); with exactly ``m`` participants ``b`` is the noised
    fraction of norms at or below ``C``. The noised count is a release too: it consumes
    privacy budget, which ``effective_noise_multiplier`` accounts for. ``count_noise_std
    == 0`` releases the count without protection (use it only without DP). The paper
    suggests ``sigma_b = m / 20``.
    """

    def __init__(self, initial_clip: float, target_quantile: float = 0.5, learning_rate: float = 0.2, *,
                 count_noise_std: float, secure: bool = False, generator: torch.Generator | None = None) -> None:
        self._noise = GaussianNoise(count_noise_std, secure=secure, generator=generator)
        self._set(initial_clip, target_quantile, learning_rate)

    def _set(self, clip: Any, target_quantile: Any, learning_rate: Any) -> None:
        _require(_is_real(clip) and clip > 0, "clip-norm", "be finite and > 0", clip)
        _require(_is_real(target_quantile) and 0 < target_quantile < 1, "target-quantile", "be in (0, 1)",
                 target_quantile)
        _require(_is_real(learning_rate) and learning_rate > 0, "clip learning-rate", "be finite and > 0",
                 learning_rate)
        self._clip, self.target_quantile, self.learning_rate = float(clip), float(target_quantile), float(learning_rate)

    @property
    def clip(self) -> float:
        """The clip to use for the next round."""
        return self._clip

    @property
    def count_noise_std(self) -> float:
        return self._noise.std

    def update(self, norms: torch.Tensor, expected: int) -> float:
        """Take this round's pre-clip update norms (1-D) and ``expected`` participants; return the new clip."""
        _require(isinstance(norms, torch.Tensor) and norms.dim() == 1, "norms", "be a 1-D tensor",
                 getattr(norms, "shape", type(norms).__name__))
        _require(bool(torch.isfinite(norms).all()) and bool((norms >= 0).all()), "norms", "be finite and >= 0",
                 norms.tolist() if norms.numel() <= 8 else "a non-finite or negative norm")
        _require(isinstance(expected, int) and not isinstance(expected, bool) and expected >= 1,
                 "expected participants", "be an int >= 1", expected)
        below = int((norms <= self._clip).sum())
        centred = torch.tensor(below - 0.5 * norms.numel(), dtype=torch.float64)
        b = float(self._noise.add_(centred)) / expected + 0.5
        # kept within [1e-12, 1e12]: a clip of 0 or inf would end the run (every norm bound must be finite, > 0)
        self._clip = min(max(self._clip * math.exp(-self.learning_rate * (b - self.target_quantile)), 1e-12), 1e12)
        return self._clip

    def state_dict(self) -> dict[str, float]:
        """Floats only (the generator is the caller's to save)."""
        return {"clip": self._clip, "target_quantile": self.target_quantile, "learning_rate": self.learning_rate,
                "count_noise_std": self._noise.std}

    def load_state_dict(self, state: dict[str, float]) -> None:
        _require(isinstance(state, dict) and set(state) == set(self.state_dict()), "adaptive clipping state",
                 f"have keys {sorted(self.state_dict())}", sorted(state) if isinstance(state, dict) else state)
        _require(state["count_noise_std"] == self._noise.std, "count-noise-std",
                 f"match this run's {self._noise.std!r} (the budget was planned for it)", state["count_noise_std"])
        self._set(state["clip"], state["target_quantile"], state["learning_rate"])


_SKELLAM_EXACT_MAX = 1e12


def skellam_noise(n: int, mu: float, rng: np.random.Generator | None = None) -> torch.Tensor:
    """``n`` int64 draws of Skellam(mu, mu) = Poisson(mu) - Poisson(mu): mean 0, variance 2*mu.

    Integer noise for distributed DP under secure aggregation (Agarwal, Kairouz, Liu 2021):
    a sum of independent Skellam draws is Skellam with the summed parameter, so each of n
    clients adding Skellam(mu/n) gives the aggregate exactly Skellam(mu). Without ``rng`` the
    Poisson draws come from numpy's PCG64DXSM seeded with 256 bits from the OS CSPRNG (the
    stream itself is a fast PRNG, not a CSPRNG; its seed is never known to the coordinator).

    Above ``mu = 1e12`` numpy's Poisson sampler loses precision (its variance is 7% off at
    1e14 and 22% at 5e14), so there the draw is the rounded normal of the same variance from
    the OS CSPRNG; at that scale (std > 1.4e6) its distance to Skellam is far below 1e-6.
    """
    _require(isinstance(n, int) and n >= 0, "noise length", "be an integer >= 0", n)
    _require(_is_real(mu) and mu >= 0, "skellam mu", "be finite and >= 0", mu)
    if mu > _SKELLAM_EXACT_MAX and rng is None:
        return _secure_standard_normal(n).mul_(math.sqrt(2.0 * mu)).round_().to(torch.int64)
    if rng is None:
        rng = np.random.Generator(np.random.PCG64DXSM(int.from_bytes(os.urandom(32), "little")))
    return torch.from_numpy(rng.poisson(mu, n) - rng.poisson(mu, n))
