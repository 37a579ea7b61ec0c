"""DP mechanisms: clipping bounds the norm, the noise is what it claims, adaptive clipping tracks its quantile."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from privacy import (
    AdaptiveClipping,
    CentralGaussianMechanism,
    GaussianNoise,
    PrivacyError,
    clip_scale,
    effective_noise_multiplier,
)

N = 200_000  # draws per statistical check; every bound below is 5 standard errors
PHI1 = math.erf(1 / math.sqrt(2))  # P(|Z| <= 1) for a standard normal


def assert_gaussian(noise: torch.Tensor, std: float) -> None:
    """Mean 0, variance std^2 (chi-square bound), and the normal's mass within one std."""
    x = noise.double().flatten()
    n = x.numel()
    assert abs(float(x.mean())) <= 5 * std / math.sqrt(n)
    assert abs(float(x.var()) / std**2 - 1) <= 5 * math.sqrt(2 / (n - 1))
    within = float((x.abs() <= std).double().mean())
    assert abs(within - PHI1) <= 5 * math.sqrt(PHI1 * (1 - PHI1) / n)


# --- bound the sensitivity ---------------------------------------------------------------------------------

@given(norm=st.floats(0, 1e30), clip=st.floats(1e-6, 1e6))
def test_clip_scale_bounds_the_norm_and_never_scales_up(norm, clip):
    s = clip_scale(norm, clip)
    assert 0 < s <= 1
    assert norm * s <= clip * (1 + 1e-12)
    if norm <= clip:
        assert s == 1.0
    else:
        assert norm * s == pytest.approx(clip, rel=1e-12)


@pytest.mark.parametrize(("norm", "clip", "field"), [
    (float("nan"), 1.0, "update norm"), (float("inf"), 1.0, "update norm"), (-1.0, 1.0, "update norm"),
    (1.0, 0.0, "clip-norm"), (1.0, -1.0, "clip-norm"), (1.0, float("inf"), "clip-norm"),
])
def test_clip_scale_refuses_what_cannot_be_bounded(norm, clip, field):
    with pytest.raises(PrivacyError, match=f"{field} must .* Found"):
        clip_scale(norm, clip)


# --- add noise ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_seeded_noise_is_gaussian_with_the_stated_std(dtype):
    t = torch.zeros(N, dtype=dtype)
    out = GaussianNoise(2.5, generator=torch.Generator().manual_seed(1)).add_(t)
    assert out is t and t.dtype == dtype
    assert_gaussian(t, 2.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_secure_noise_is_gaussian_with_the_stated_std(dtype):
    t = torch.zeros(N, dtype=dtype)
    GaussianNoise(0.3, secure=True).add_(t)
    assert_gaussian(t, 0.3)


def test_noise_adds_to_what_is_there_including_non_contiguous_tensors():
    base = torch.full((400, 500), 7.0)
    view = base.t()  # not contiguous
    GaussianNoise(1.0, secure=True).add_(view)
    assert_gaussian(base - 7.0, 1.0)
    GaussianNoise(1.0, generator=torch.Generator().manual_seed(3)).add_(view)
    assert_gaussian(base - 7.0, math.sqrt(2.0))


def test_secure_noise_spans_several_chunks_with_fresh_draws():
    from privacy import dp

    t = torch.zeros(dp._CHUNK + 1000)
    GaussianNoise(1.0, secure=True).add_(t)
    head, tail = t[:1000], t[dp._CHUNK:]
    assert not torch.equal(head, tail)
    assert_gaussian(t, 1.0)


def test_secure_noise_reaches_every_coordinate_of_every_chunk():
    """A chunk's last coordinate left un-noised passed the distribution checks (one in 2**18)."""
    from privacy import dp

    t = torch.zeros(2 * dp._CHUNK + 5)
    GaussianNoise(1.0, secure=True).add_(t)
    assert (t != 0).all() and t[dp._CHUNK - 1] != 0 and t[2 * dp._CHUNK - 1] != 0 and t[-1] != 0


def test_seeded_noise_reproduces_and_different_seeds_differ():
    def draw(seed: int) -> torch.Tensor:
        return GaussianNoise(1.0, generator=torch.Generator().manual_seed(seed)).add_(torch.zeros(1000))

    assert torch.equal(draw(5), draw(5))
    assert not torch.equal(draw(5), draw(6))


def test_secure_noise_ignores_and_leaves_torch_seed_alone():
    draws = []
    for _ in range(2):
        torch.manual_seed(0)
        state = torch.random.get_rng_state()
        draws.append(GaussianNoise(1.0, secure=True).add_(torch.zeros(1000)))
        assert torch.equal(torch.random.get_rng_state(), state)
    assert not torch.equal(draws[0], draws[1])


def test_zero_std_adds_nothing():
    t = torch.arange(5.0)
    assert torch.equal(GaussianNoise(0.0, secure=True).add_(t), torch.arange(5.0))
    assert torch.equal(GaussianNoise(0.0).add_(t), torch.arange(5.0))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"std": -1.0}, "noise std must"), ({"std": float("nan")}, "noise std must"),
    ({"std": 1.0, "secure": True, "generator": torch.Generator()}, "generator must be None in secure mode"),
    ({"std": 1.0, "generator": 42}, "generator must"),
])
def test_gaussian_noise_refuses_bad_settings(kwargs, match):
    with pytest.raises(PrivacyError, match=match):
        GaussianNoise(**kwargs)


def test_gaussian_noise_refuses_integer_tensors():
    with pytest.raises(PrivacyError, match="floating tensor"):
        GaussianNoise(1.0).add_(torch.zeros(3, dtype=torch.int64))


# --- central mechanism -------------------------------------------------------------------------------------

@pytest.mark.parametrize("secure", [False, True])
def test_central_mechanism_noises_the_sum_with_z_times_clip(secure):
    gen = None if secure else torch.Generator().manual_seed(11)
    mech = CentralGaussianMechanism(clip=0.5, noise_multiplier=1.2, secure=secure, generator=gen)
    assert mech.std == pytest.approx(0.6) and mech.secure is secure
    total = torch.full((N,), 3.0)
    assert mech.noise_sum_(total) is total
    assert_gaussian(total - 3.0, 0.6)
    assert mech.scale(2.0) == pytest.approx(0.25) and mech.scale(0.1) == 1.0


@pytest.mark.parametrize(("clip", "z", "message"), [
    (1.0, 0, "noise-multiplier must be finite and > 0 for DP (with no noise the sum reveals each update). Found 0."),
    (1.0, -0.5, "noise-multiplier must"), (1.0, float("nan"), "noise-multiplier must"),
    (0.0, 1.0, "clip-norm must"), (float("inf"), 1.0, "clip-norm must"),
])
def test_central_mechanism_says_what_breaks_for_privacy(clip, z, message):
    with pytest.raises(PrivacyError) as info:
        CentralGaussianMechanism(clip=clip, noise_multiplier=z)
    assert str(info.value).startswith(message)


# --- adaptive clipping -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 5.0), (0.8, 0.5), (2.0, 100.0)])
def test_effective_noise_multiplier_inverts_the_papers_composition(z, sigma_b):
    z_delta = effective_noise_multiplier(z, sigma_b)
    assert z_delta > z
    assert (z_delta**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(z, rel=1e-12)


@pytest.mark.parametrize(("z", "sigma_b"), [(1.0, 0.5), (1.0, 0.1), (1.0, 0.0), (0.0, 1.0)])
def test_effective_noise_multiplier_refuses_a_count_that_spends_the_budget(z, sigma_b):
    with pytest.raises(PrivacyError, match="must"):
        effective_noise_multiplier(z, sigma_b)


def test_adaptive_clip_update_follows_the_formula_exactly_without_count_noise():
    ac = AdaptiveClipping(2.5, target_quantile=0.25, learning_rate=0.2, count_noise_std=0.0)
    new = ac.update(torch.tensor([1.0, 2.0, 3.0, 4.0]), expected=4)  # b = 2/4
    assert new == ac.clip == pytest.approx(2.5 * math.exp(-0.2 * (0.5 - 0.25)))
    ac = AdaptiveClipping(10.0, count_noise_std=0.0)
    ac.update(torch.tensor([1.0, 2.0]), expected=4)  # b = (2 - 1) / 4 + 1/2: bits centred at 1/2
    assert ac.clip == pytest.approx(10.0 * math.exp(-0.2 * (0.75 - 0.5)))


@pytest.mark.parametrize(("start", "quantile", "expect"), [(0.5, 0.5, 5.0), (40.0, 0.5, 5.0), (1.0, 0.9, 9.0)])
def test_adaptive_clip_converges_to_the_target_quantile(start, quantile, expect):
    gen = torch.Generator().manual_seed(7)
    ac = AdaptiveClipping(start, target_quantile=quantile, learning_rate=0.2, count_noise_std=1.0, generator=gen)
    history = []
    for _ in range(400):
        norms = torch.rand(100, generator=gen) * 10.0  # U(0, 10): the q-quantile is 10 q
        history.append(ac.update(norms, expected=100))
    late = torch.tensor(history[-100:])
    assert abs(float(late.mean()) - expect) < 0.5
    assert float(late.min()) > expect - 1.5 and float(late.max()) < expect + 1.5


def test_adaptive_clip_count_noise_can_be_secure():
    ac = AdaptiveClipping(5.0, count_noise_std=2.0, secure=True)
    clips = {ac.update(torch.full((10,), 1.0), expected=10) for _ in range(5)}
    assert len(clips) == 5 and all(math.isfinite(c) and c > 0 for c in clips)


def test_adaptive_state_round_trip_through_torch_weights_only(tmp_path):
    ac = AdaptiveClipping(3.0, target_quantile=0.7, learning_rate=0.1, count_noise_std=0.0)
    ac.update(torch.tensor([1.0, 5.0]), expected=2)
    state = ac.state_dict()
    assert all(type(v) is float for v in state.values())
    torch.save(state, tmp_path / "clip.pt")
    resumed = AdaptiveClipping(1.0, count_noise_std=0.0)
    resumed.load_state_dict(torch.load(tmp_path / "clip.pt", weights_only=True))
    assert resumed.state_dict() == state
    with pytest.raises(PrivacyError, match="count-noise-std must match"):
        AdaptiveClipping(1.0, count_noise_std=3.0).load_state_dict(state)


@pytest.mark.parametrize(("norms", "expected", "match"), [
    (torch.tensor([1.0, float("nan")]), 2, "norms must"), (torch.tensor([-1.0]), 1, "norms must"),
    (torch.ones(2, 2), 4, "norms must be a 1-D"), (torch.ones(2), 0, "expected participants must"),
])
def test_adaptive_update_refuses_bad_inputs_and_keeps_its_clip(norms, expected, match):
    ac = AdaptiveClipping(2.0, count_noise_std=0.0)
    with pytest.raises(PrivacyError, match=match):
        ac.update(norms, expected)
    assert ac.clip == 2.0


@pytest.mark.parametrize("kwargs", [{"initial_clip": 0.0}, {"initial_clip": 1.0, "target_quantile": 1.0},
                                    {"initial_clip": 1.0, "learning_rate": 0.0}])
def test_adaptive_clipping_refuses_bad_settings(kwargs):
    with pytest.raises(PrivacyError, match="must"):
        AdaptiveClipping(**kwargs, count_noise_std=1.0)


@pytest.mark.parametrize("mu", [0.5, 50.0, 1e9, 1e14])
def test_skellam_noise_has_mean_zero_and_variance_two_mu(mu):
    from privacy import skellam_noise

    rng = np.random.default_rng(3) if mu < 1e12 else None  # above 1e12: rounded CSPRNG normal, no rng
    x = skellam_noise(200_000, mu, rng).double()
    assert x.dtype == torch.float64 and skellam_noise(5, mu).dtype == torch.int64
    assert abs(float(x.var()) / (2 * mu) - 1) < 0.02
    assert abs(float(x.mean())) < 5 * math.sqrt(2 * mu / 200_000)
