"""Local DP-SGD: settings, noise is on, clipping bounds the update, the client's ledger persists,
the fast per-example clipping path agrees with a per-example loop and with Opacus."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from clients import ClientError, ConfigError, TaskSpec, TrainSettings, build_config
from clients.dp_training import (
    FastPrivateTrainer,
    LocalDpSettings,
    accountant_from_state,
    clipped_grad_sum,
    fast_clipping_layers,
    make_private_trainer,
    private_generator,
    resolve_grad_sample_mode,
    train_local_dp,
    vmap_clipped_grad_sum,
)
from clients.tasks import get_task
from clients.training import evaluate, flat_params, load_flat, train_local

pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the smallest alpha")  # tiny noise: huge epsilon

SETTINGS = TrainSettings(local_epochs=3, batch_size=16, lr=0.1, momentum=0.9)
OPACUS_PARAM_ATTRS = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample", "summed_grad")


@pytest.fixture(scope="module")
def task():
    return get_task(TaskSpec(partitioning="iid"))


@pytest.fixture(scope="module")
def data(task):
    part = task.partition(0, 14)  # ~100 examples
    assert 90 <= len(part) <= 110
    return part


def _model(task, seed=0):
    model = task.build_model()
    load_flat(model, task.init_weights(seed))
    return model


def _dp(task, data, dp, seed=0, settings=SETTINGS, state=None):
    return train_local_dp(_model(task), data, settings, dp, torch.Generator().manual_seed(seed), state)


def _steps_and_rate(n, settings):
    per_epoch = math.ceil(n / settings.batch_size)
    return settings.local_epochs * per_epoch, 1.0 / per_epoch


# --- settings ---------------------------------------------------------------------------------


def test_settings_defaults_are_valid():
    dp = LocalDpSettings()
    assert (dp.grad_sample_mode, dp.poisson_sampling) == ("fast", True)
    assert dp.noise_multiplier > 0 and dp.max_grad_norm > 0 and 0 < dp.delta < 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": 0.0},
         "noise-multiplier must be a number in [1e-06, 1e+06] (0 adds no noise: no privacy; below 1e-06 the accountant "
         "cannot charge it; past 1e+06 the accountant overflows and epsilon no longer changes). Found 0.0."),
        ({"noise_multiplier": -1.0}, "noise-multiplier must be a number in [1e-06, 1e+06]"),
        ({"noise_multiplier": float("nan")}, "noise-multiplier must be a number in [1e-06, 1e+06]"),
        ({"noise_multiplier": float("inf")}, "noise-multiplier must be a number in [1e-06, 1e+06]"),
        ({"noise_multiplier": 1e300}, "noise-multiplier must be a number in [1e-06, 1e+06]"),  # OverflowError in Opacus
        ({"noise_multiplier": 1e-300}, "noise-multiplier must be a number in [1e-06, 1e+06]"),  # ZeroDivisionError there
        ({"max_grad_norm": 0.0},
         "max-grad-norm must be a finite number > 0 (it bounds each example's influence). Found 0.0."),
        ({"max_grad_norm": float("inf")}, "max-grad-norm must be a finite number > 0"),
        ({"delta": 0.0}, "delta must be in (0, 1). Found 0.0."),
        ({"delta": 1.0}, "delta must be in (0, 1). Found 1.0."),
        ({"grad_sample_mode": "ew"},
         "grad-sample-mode must be one of ['fast', 'ghost', 'hooks', 'functorch', 'vmap']. Found 'ew'."),
        ({"poisson_sampling": "yes"}, "poisson-sampling must be true or false. Found 'yes'."),
    ],
)
def test_bad_settings_raise_config_error(kwargs, message):
    with pytest.raises(ConfigError) as info:
        LocalDpSettings(**kwargs)
    assert str(info.value).startswith(message)


def test_settings_build_from_kebab_mapping():
    dp = build_config(LocalDpSettings, {"noise-multiplier": 2, "max-grad-norm": 0.5, "grad-sample-mode": "hooks"})
    assert (dp.noise_multiplier, dp.max_grad_norm, dp.grad_sample_mode) == (2.0, 0.5, "hooks")
    with pytest.raises(ConfigError, match=r"^local-dp\.noise-multiplier must be a number in \[1e-06, 1e\+06\]"):
        build_config(LocalDpSettings, {"noise-multiplier": 0}, "local-dp")
    with pytest.raises(ConfigError, match="noise-multipler is not a known key"):
        build_config(LocalDpSettings, {"noise-multipler": 1.0})


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"mechanism": "prv", "history": []}, "accountant-state must be a mapping with mechanism 'rdp'"),
        ([1, 2], "accountant-state must be a mapping"),
        ({"mechanism": "rdp"}, r"accountant-state.history must be a list. Found None."),
        ({"mechanism": "rdp", "history": [[1.0, 0.1, 0]]}, "accountant-state.history must hold"),
        ({"mechanism": "rdp", "history": [[0.0, 0.1, 3]]}, "accountant-state.history must hold"),
        ({"mechanism": "rdp", "history": [[1.0, 1.5, 3]]}, "accountant-state.history must hold"),
        ({"mechanism": "rdp", "history": [[1.0, 0.1]]}, "accountant-state.history must hold"),
    ],
)
def test_bad_accountant_state_raises(state, match):
    with pytest.raises(ConfigError, match=match):
        accountant_from_state(state)


def test_empty_data_and_batchnorm_model_raise_client_error(task, data):
    empty = type(data)(data.x[:0], data.y[:0])
    with pytest.raises(ClientError, match="at least one example"):
        train_local_dp(_model(task), empty, SETTINGS, LocalDpSettings(), torch.Generator(), None)
    bn = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 10))
    with pytest.raises(ClientError, match=r"'1.running_mean' \(and 1 more\) is written from each batch"):
        train_local_dp(bn, data, SETTINGS, LocalDpSettings(), torch.Generator(), None)
    ids = type(data)(np.zeros((len(data), 3), np.int64), data.y)
    renorm = nn.Sequential(nn.Embedding(4, 8, max_norm=1.0), nn.Flatten(), nn.Linear(24, 10))
    with pytest.raises(ClientError, match="embedding '0' renormalises the rows each batch reads"):
        train_local_dp(renorm, ids, SETTINGS, LocalDpSettings(), torch.Generator(), None)


class _LooseParameter(nn.Module):
    """Digits through a layer, plus a bias held by the model itself (no Opacus rule), read directly or through an
    embedding's weight, with dropout in its forward or not."""

    def __init__(self, dropout: float, via_embedding: bool = False):
        super().__init__()
        self.body, self.drop, self.via = nn.Linear(64, 10), nn.Dropout(dropout), via_embedding
        if via_embedding:
            self.shift = nn.Embedding(1, 10)
        else:
            self.shift = nn.Parameter(torch.zeros(10))

    def forward(self, x):
        return self.drop(self.body(x)) + (self.shift.weight[0] if self.via else self.shift)


class _Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self._module = nn.Sequential(nn.utils.spectral_norm(nn.Linear(64, 32)), nn.ReLU())
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self._module(x))


def test_what_opacus_cannot_give_a_per_example_gradient_for_takes_the_vmap_path(data, caplog):
    import logging

    from clients.dp_training import _VMAP_FOR, replayed_modules

    dp = LocalDpSettings(grad_sample_mode="hooks")
    assert replayed_modules(_LooseParameter(0.5)) == [("the model itself", ["shift"], True)]
    # a parameter read as module.weight: Opacus's hooks never see it, found at the first step (nothing stepped or
    # charged yet): the call starts again on vmap, said once, and the model's class takes vmap from then on
    _VMAP_FOR.clear()
    loose = _LooseParameter(0.0, via_embedding=True)
    assert resolve_grad_sample_mode(loose, "hooks") == "hooks"
    with caplog.at_level(logging.INFO):
        _, stats, ledger = train_local_dp(loose, data, SETTINGS, dp, torch.Generator().manual_seed(0), None)
        _, again, _ = train_local_dp(_LooseParameter(0.0, True), data, SETTINGS, dp, torch.Generator(), None)
    said = [r.getMessage() for r in caplog.records if "vmap path clips" in r.getMessage()]
    assert len(said) == 1 and "shift.weight got no per-example gradient from Opacus's hooks" in said[0], said
    assert stats["dp-path"] == again["dp-path"] == "vmap" and resolve_grad_sample_mode(loose, "hooks") == "vmap"
    direct = train_local_dp(_LooseParameter(0.0, True), data, SETTINGS, LocalDpSettings(grad_sample_mode="vmap"),
                            torch.Generator(), None)
    assert stats["epsilon"] == direct[1]["epsilon"] and ledger == direct[2]  # the failed start charged nothing
    # trainable parameters in a ParameterList (never called): vmap at once
    listed = nn.Sequential(nn.Linear(64, 10))
    listed.extra = nn.ParameterList([nn.Parameter(torch.zeros(10))])
    assert resolve_grad_sample_mode(listed, "hooks") == "vmap"
    # ghost (the default's fallback without a task loss) finds it in its backward, before any step: vmap likewise
    _VMAP_FOR.clear()
    _, ghost, _ = train_local_dp(_LooseParameter(0.0, True), data, SETTINGS, LocalDpSettings(grad_sample_mode="ghost"),
                                 torch.Generator(), None)
    assert ghost["dp-path"] == "vmap" and ghost["dp-steps"] > 0
    # a trainable layer with buffers (spectral_norm's u and v), which Opacus refuses: vmap, said once; the model is
    # the caller's whole module, even one holding a submodule named as Opacus's wrapper holds it (_module)
    normed = _Wrapped()
    head = normed.head.weight.detach().clone()
    with caplog.at_level(logging.INFO):
        out, stats, _ = train_local_dp(normed, data, SETTINGS, dp, torch.Generator(), None)
    assert stats["dp-path"] == "vmap" and math.isfinite(stats["train-loss"])
    assert out is normed and not torch.equal(head, normed.head.weight)
    assert any("trainable layer with buffers (spectral_norm's vectors)" in r.getMessage() for r in caplog.records)
    # the model's own parameter with dropout in its forward: vmap, not Opacus's replay (which cannot draw it)
    _, stats, _ = train_local_dp(_LooseParameter(0.5), data, SETTINGS, dp, torch.Generator(), None)
    assert stats["dp-path"] == "vmap" and stats["dp-steps"] > 0 and math.isfinite(stats["train-loss"])


# --- training ---------------------------------------------------------------------------------


def test_seeded_run_is_reproducible_and_differs_from_non_dp(task, data):
    dp = LocalDpSettings(noise_multiplier=1.0)
    a, _, _ = _dp(task, data, dp, seed=3)
    b, _, _ = _dp(task, data, dp, seed=3)
    c, _, _ = _dp(task, data, dp, seed=4)
    plain = _model(task)
    train_local(plain, data, SETTINGS, torch.Generator().manual_seed(3))
    assert torch.equal(flat_params(a), flat_params(b))
    assert not torch.equal(flat_params(a), flat_params(c))
    start = task.init_weights(0)
    gap = (flat_params(a) - flat_params(plain)).norm()
    assert gap > 0.1 * (flat_params(plain) - start).norm()


@pytest.mark.parametrize("poisson", [True, False])
def test_batches_are_poisson_sampled_unless_turned_off(task, data, poisson):
    model, sizes = _model(task), []
    handle = model.register_forward_pre_hook(lambda _m, args: sizes.append(len(args[0])))
    dp = LocalDpSettings(poisson_sampling=poisson)
    train_local_dp(model, data, SETTINGS, dp, torch.Generator().manual_seed(0), None)
    handle.remove()
    steps, q = _steps_and_rate(len(data), SETTINGS)
    assert sizes[:2] == [SETTINGS.batch_size] * 2  # (the check before training: two batches, no step)
    sizes = sizes[2:]
    assert len(sizes) == steps
    per_epoch = steps // SETTINGS.local_epochs
    last = len(data) - SETTINGS.batch_size * (per_epoch - 1)
    fixed = ([SETTINGS.batch_size] * (per_epoch - 1) + [last]) * SETTINGS.local_epochs
    if poisson:  # each example joins each batch with rate q: sizes vary around n q
        assert sizes != fixed and len(set(sizes)) >= 4
        assert abs(np.mean(sizes) - len(data) * q) < 3
    else:
        assert sizes == fixed


def test_without_a_generator_the_draws_come_from_os_entropy(task, data):
    dp = LocalDpSettings(noise_multiplier=1.0)
    a, _, _ = train_local_dp(_model(task), data, SETTINGS, dp, None, None)
    b, _, _ = train_local_dp(_model(task), data, SETTINGS, dp, None, None)
    assert not torch.equal(flat_params(a), flat_params(b))
    assert private_generator().initial_seed() != private_generator().initial_seed()


def test_returned_model_is_the_plain_input_model(task, data):
    model = _model(task)
    params_before = list(model.parameters())
    out, stats, _ = train_local_dp(model, data, SETTINGS, LocalDpSettings(), torch.Generator().manual_seed(0), None)
    assert out is model and type(out) is nn.Sequential
    assert [id(p) for p in out.parameters()] == [id(p) for p in params_before]
    for m in out.modules():
        assert not m._forward_hooks and not m._backward_hooks and not m._forward_pre_hooks
        assert not hasattr(m, "activations")
    for p in out.parameters():
        assert not any(hasattr(p, attr) for attr in OPACUS_PARAM_ATTRS)
    nn.functional.cross_entropy(out(torch.from_numpy(data.x[:8])), torch.from_numpy(data.y[:8])).backward()
    assert all(not hasattr(p, "grad_sample") for p in out.parameters())
    assert set(stats) >= {"train-loss", "train-time-s", "epsilon", "dp-steps", "dp-path"}
    assert stats.pop("dp-path") == "fast"
    assert all(isinstance(v, float) and math.isfinite(v) for v in stats.values())


def test_accuracy_band_large_noise_vs_small_noise_vs_non_dp(task, data):
    """Mean of 3 seeds. z=5 learns (above chance) but far less than non-DP; if the noise were
    switched off, the clipped run would land above the band (measured ~0.60 vs ~0.35)."""
    settings = TrainSettings(local_epochs=20, batch_size=64, lr=0.5, momentum=0.5)
    acc = {"sgd": [], "z=1e-6": [], "z=5": []}
    for seed in range(3):
        plain = _model(task)
        train_local(plain, data, settings, torch.Generator().manual_seed(seed))
        acc["sgd"].append(evaluate(plain, task.test_set)[0])
        for key, z in (("z=1e-6", 1e-6), ("z=5", 5.0)):
            model, _, _ = _dp(task, data, LocalDpSettings(noise_multiplier=z), seed=seed, settings=settings)
            acc[key].append(evaluate(model, task.test_set)[0])
    mean = {k: float(np.mean(v)) for k, v in acc.items()}
    assert mean["sgd"] >= 0.75, mean
    assert 0.45 <= mean["z=1e-6"] <= mean["sgd"], mean  # learning works through clipping
    assert 0.20 <= mean["z=5"] <= 0.50, mean  # noise is on, learning is not broken
    assert mean["z=5"] <= mean["sgd"] - 0.30, mean


@pytest.mark.parametrize("poisson", [False, True])
@pytest.mark.parametrize("mode", ["fast", "ghost", "hooks"])
def test_clipping_bounds_the_update(task, data, mode, poisson):
    """||w_T - w_0|| <= lr/(1-beta) * sum_t ||g_t||, g_t = (sum_i clip(g_ti) + noise_t) / E,
    so with |B_t| examples of norm <= C each: ||g_t|| <= (|B_t| C + ||noise_t||) / E.
    Fixed batches: sum_t |B_t| = epochs * n; Poisson batches: |B_t| <= n."""
    n, c, z = len(data), 1e-3, 1e-6
    steps, q = _steps_and_rate(n, SETTINGS)
    expected_batch = int(n * q)
    dim = task.init_weights(0).numel()
    noise = z * c * (math.sqrt(dim) + 10.0)  # ||N(0, (zC)^2 I_d)||, far into the tail
    examples = SETTINGS.local_epochs * n if not poisson else steps * n
    bound = SETTINGS.lr / (1 - SETTINGS.momentum) * (examples * c + steps * noise) / expected_batch
    dp = LocalDpSettings(noise_multiplier=z, max_grad_norm=c, grad_sample_mode=mode, poisson_sampling=poisson)
    model, stats, _ = _dp(task, data, dp)
    assert stats["dp-path"] == mode
    start = task.init_weights(0)
    moved = (flat_params(model) - start).norm().item()
    plain = _model(task)
    train_local(plain, data, SETTINGS, torch.Generator().manual_seed(0))
    assert stats["dp-steps"] == steps
    assert 0 < moved <= bound
    assert (flat_params(plain) - start).norm().item() > 20 * bound  # the bound is not vacuous


def test_fast_ghost_hooks_and_functorch_give_the_same_model(task, data):
    """Same seed: same Poisson batches and the same noise draws on every path (fast included)."""
    runs = {mode: _dp(task, data, LocalDpSettings(grad_sample_mode=mode), seed=5)[0]
            for mode in ("fast", "ghost", "hooks", "functorch", "vmap")}
    ref = flat_params(runs["hooks"])
    for mode in ("fast", "ghost", "functorch", "vmap"):
        torch.testing.assert_close(flat_params(runs[mode]), ref, rtol=1e-4, atol=1e-5)


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.out(torch.relu(self.b(torch.relu(self.a(x)))))


def test_fast_and_ghost_fall_back_where_the_model_does_not_allow_them(task, data):
    assert resolve_grad_sample_mode(task.build_model(), "fast") == "fast"
    assert resolve_grad_sample_mode(task.build_model(), "ghost") == "ghost"
    assert resolve_grad_sample_mode(task.build_model(), "hooks") == "hooks"
    tied = _Tied()
    assert resolve_grad_sample_mode(tied, "fast") == "hooks"
    assert resolve_grad_sample_mode(tied, "ghost") == "hooks"
    before = flat_params(tied).clone()
    out, stats, _ = train_local_dp(tied, data, SETTINGS, LocalDpSettings(), torch.Generator().manual_seed(0), None)
    assert out.b.weight is out.a.weight and not torch.equal(flat_params(out), before)
    assert stats["epsilon"] > 0 and stats["dp-path"] == "hooks"
    # A layer the fast path does not know (LayerNorm: per example, but not Linear/Conv2d): Opacus ghost runs.
    norm = nn.Sequential(nn.Linear(64, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 10))
    _, stats, _ = train_local_dp(norm, data, SETTINGS, LocalDpSettings(), torch.Generator().manual_seed(0), None)
    assert stats["dp-path"] == "ghost" and stats["epsilon"] > 0


class _TiedLm(nn.Module):
    """Token ids through an embedding whose table is also the output layer (tied), and positions held by the
    model itself (Opacus's hooks would replay the model's forward for them)."""

    def __init__(self):
        super().__init__()
        self.emb, self.pos = nn.Embedding(20, 8), nn.Parameter(torch.randn(4, 8))
        self.mix, self.drop = nn.Linear(32, 8), nn.Dropout(0.0)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.drop(torch.tanh(self.mix((self.emb(x) + self.pos).flatten(1)))))


@pytest.mark.parametrize("build", [_TiedLm, _Tied, lambda: get_task(TaskSpec()).build_model()],
                         ids=["tied-lm", "tied-linear", "mlp"])
def test_the_vmap_clipped_sum_is_the_per_example_loops_for_any_model(build):
    torch.manual_seed(3)
    model = build()
    x = torch.randint(0, 20, (10, 4)) if isinstance(model, _TiedLm) else torch.randn(10, 64)
    y = torch.randint(0, 10, (10,))
    _, _, norms = vmap_clipped_grad_sum(model, x, y, 1e9)
    clip = float(norms.median())
    sums, loss, norms = vmap_clipped_grad_sum(model, x, y, clip, chunk=3)  # chunks of 3, 3, 3 and 1
    ref, ref_norms = _per_example_loop(model, x, y, clip)
    assert 3 <= int((norms > clip).sum()) <= 7
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-5, atol=1e-6)
    assert loss.item() == pytest.approx(nn.functional.cross_entropy(model(x), y).item(), rel=1e-5)
    assert len(sums) == len([p for p in model.parameters() if p.requires_grad])  # a tied table once
    for got, loop in zip(sums, ref, strict=True):
        torch.testing.assert_close(got.double(), loop, rtol=1e-4, atol=1e-6)
    if isinstance(model, _TiedLm):  # and Opacus's hooks, once the positions (which they would replay) are frozen
        model.pos.requires_grad_(False)
        vmap_sums, _, _ = vmap_clipped_grad_sum(model, x, y, clip)
        for got, opacus in zip(vmap_sums, _opacus_clipped_sum(model, x, y, clip), strict=True):
            torch.testing.assert_close(got, opacus, rtol=1e-4, atol=1e-6)


# --- the fast per-example clipping path ------------------------------------------------------


def _cnn():
    """The benchmark's CNN (498,630 parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 12 * 12, 52), nn.ReLU(), nn.Linear(52, 10),
    )


def _strided_cnn():
    """Padding, stride, dilation, a bias-free conv, nesting. Per-example conv gradients by each route:
    im2col (the 1x1 conv: few input channels; the stride-2 conv), shifted matmuls (the dilated conv:
    stride 1, 16 input channels); the last conv's norm by Gram matrices (ghost): 5x5 outputs,
    L^2 = 625 < O * C*kh*kw = 16 * 144."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 1),
        nn.Sequential(nn.Conv2d(4, 16, 3, stride=2, padding=1), nn.Tanh()),
        nn.Conv2d(16, 16, (3, 2), padding=(2, 1), dilation=(2, 1), bias=False), nn.AvgPool2d(2),
        nn.Conv2d(16, 16, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 5 * 5, 10),
    )


def _per_example_loop(model, x, y, clip):
    """Brute force in float64: each example's own backward, clipped with Opacus's factor, summed."""
    model = model.double()
    params = [p for p in model.parameters() if p.requires_grad]
    sums, norms = [torch.zeros_like(p) for p in params], []
    for i in range(len(y)):
        xi = x[i:i + 1].double() if x.is_floating_point() else x[i:i + 1]  # (token ids stay integers)
        loss = nn.functional.cross_entropy(model(xi), y[i:i + 1], reduction="sum")
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        norms.append(norm)
        for total, g in zip(sums, grads):
            total.add_(g, alpha=min(1.0, clip / (norm.item() + 1e-6)))
    model.float()
    return sums, torch.stack(norms)


def _opacus_clipped_sum(model, x, y, clip):
    """Opacus's own per-example gradients (GradSampleModule, hooks) clipped and summed as DPOptimizer does."""
    from opacus import GradSampleModule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gsm = GradSampleModule(model, loss_reduction="sum")
        nn.functional.cross_entropy(gsm(x), y, reduction="sum").backward()
    params = [p for p in model.parameters() if p.requires_grad]
    samples = [p.grad_sample.reshape(len(y), -1) for p in params]
    norms = torch.stack([s.norm(dim=1) for s in samples], dim=1).norm(dim=1)
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    sums = [torch.einsum("i,i...", factor, p.grad_sample) for p in params]
    gsm._close()
    for p in params:
        p.grad = None
    return sums


_MODELS = {
    "mlp": (lambda: get_task(TaskSpec()).build_model(), (64,)),
    "linear": (lambda: nn.Linear(64, 10), (64,)),
    "cnn": (_cnn, (1, 28, 28)),
    "strided-cnn": (_strided_cnn, (2, 27, 25)),
    "linear-over-a-sequence": (lambda: nn.Sequential(nn.Unflatten(1, (8, 8)), nn.Linear(8, 16), nn.GELU(),
                                                     nn.Flatten(), nn.Linear(128, 10)), (64,)),
}


@pytest.mark.parametrize("name", list(_MODELS))
def test_fast_clipped_sum_equals_a_per_example_loop_and_opacus(name):
    """Noise off: the fast path's summed clipped gradient is the per-example loop's and Opacus's,
    with the clip at the median norm so that some examples are clipped and some are not."""
    build, shape = _MODELS[name]
    torch.manual_seed(1)
    model = build()
    assert fast_clipping_layers(model) is not None
    x, y = torch.randn(12, *shape), torch.randint(0, 10, (12,))
    _, _, norms = clipped_grad_sum(model, x, y, 1e9)
    clip = float(norms.median())
    sums, loss, norms = clipped_grad_sum(model, x, y, clip)
    ref, ref_norms = _per_example_loop(model, x, y, clip)
    assert 3 <= int((norms > clip).sum()) <= 9  # a mix of clipped and unclipped examples
    torch.testing.assert_close(norms.double(), ref_norms, rtol=1e-5, atol=1e-6)
    assert loss.item() == pytest.approx(nn.functional.cross_entropy(model(x), y).item(), rel=1e-5)
    params = [p for p in model.parameters() if p.requires_grad]
    assert [s.shape for s in sums] == [p.shape for p in params]
    assert all(p.grad is None for p in params)  # the fast path leaves .grad alone
    for fast, loop in zip(sums, ref):
        torch.testing.assert_close(fast.double(), loop, rtol=1e-4, atol=1e-6)
    for fast, opacus in zip(sums, _opacus_clipped_sum(model, x, y, clip)):
        torch.testing.assert_close(fast, opacus, rtol=1e-4, atol=1e-6)
    # Every example clipped: each contributes norm C exactly, so ||sum|| <= n C.
    sums, _, _ = clipped_grad_sum(model, x, y, 1e-3)
    assert torch.sqrt(sum(s.square().sum() for s in sums)) <= 12 * 1e-3 * (1 + 1e-5)


def test_fast_path_frozen_layers_and_what_it_refuses():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    model[0].requires_grad_(False)  # a frozen layer: clipping covers the trainable parameters only
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    sums, _, _ = clipped_grad_sum(model, x, y, 0.5)
    ref, _ = _per_example_loop(model, x, y, 0.5)
    assert len(sums) == 2
    for fast, loop in zip(sums, ref):
        torch.testing.assert_close(fast.double(), loop, rtol=1e-4, atol=1e-6)
    lin = nn.Linear(64, 10)
    refused = {
        "tied": _Tied(),
        "custom forward": type("Custom", (nn.Sequential,), {})(nn.Linear(64, 10)),
        "batchnorm": nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)),
        "layer twice": nn.Sequential(nn.Linear(64, 64), nn.ReLU(), lin, nn.ReLU(), lin),
        "grouped conv": nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 10)),
        "parametrised activation": nn.Sequential(nn.Linear(64, 10), nn.PReLU()),
        "softmax over the batch": nn.Sequential(nn.Linear(64, 10), nn.Softmax(dim=0)),
    }
    for what, bad in refused.items():
        assert fast_clipping_layers(bad) is None, what
        assert resolve_grad_sample_mode(bad, "fast") != "fast", what
    with pytest.raises(ClientError, match="fast per-example clipping"):
        clipped_grad_sum(refused["tied"], x, y, 1.0)


def test_fast_trainer_noise_is_opacus_draws_with_std_z_c_over_the_expected_batch():
    """One step: grad = (clipped sum + N(0, (zC)^2)) / E with E = int(n q); the noise is torch.normal
    from the noise generator, parameter by parameter (Opacus's draws); statistically std = z C."""
    torch.manual_seed(0)
    model = _cnn()
    n, batch, z, clip = 200, 64, 1.5, 0.7
    x, y = torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch,
                                         generator=torch.Generator().manual_seed(0))
    dp = LocalDpSettings(noise_multiplier=z, max_grad_norm=clip)
    settings = TrainSettings(local_epochs=1, batch_size=batch, lr=0.1, momentum=0.0)
    trainer = make_private_trainer(model, loader, settings, dp, noise_generator=torch.Generator().manual_seed(7))
    assert isinstance(trainer, FastPrivateTrainer) and trainer.grad_sample_mode == "fast"
    expected = int(n / math.ceil(n / batch))
    assert trainer.expected_batch_size == expected == 50
    xb, yb = x[:40], y[:40]
    sums, _, _ = clipped_grad_sum(model, xb, yb, clip)
    trainer.step(xb, yb)
    replay = torch.Generator().manual_seed(7)
    noise = []
    for p, total in zip(model.parameters(), sums):
        drawn = torch.normal(mean=0, std=z * clip, size=p.shape, generator=replay)
        torch.testing.assert_close(p.grad * expected - total, drawn, rtol=1e-4, atol=1e-5)
        noise.append((p.grad * expected - total).flatten())
    noise = torch.cat(noise).double()  # 498,630 draws: the std is known to ~0.1 %
    assert abs(noise.mean().item()) < 5 * z * clip / math.sqrt(len(noise))
    assert noise.std().item() == pytest.approx(z * clip, rel=0.01)
    # An empty Poisson batch: the update is noise only, still divided by the expected batch size.
    trainer.step(xb[:0], yb[:0])
    noise = torch.cat([(p.grad * expected).flatten() for p in model.parameters()]).double()
    assert noise.std().item() == pytest.approx(z * clip, rel=0.01)
    assert trainer.accountant.history == [(z, 1 / 4, 2)]  # q = 1 / ceil(200 / 64)
    out = trainer.close()
    assert out is model and all(p.grad is None for p in model.parameters())
    assert not any(m._forward_hooks for m in model.modules())


# --- accounting -------------------------------------------------------------------------------


def test_epsilon_grows_across_rounds_when_the_ledger_is_carried(task, data):
    from privacy import PrivacyEvent, epsilon_of

    dp = LocalDpSettings(noise_multiplier=1.0, delta=1e-5)
    steps, q = _steps_and_rate(len(data), SETTINGS)
    _, s1, state1 = _dp(task, data, dp, seed=0)
    state1 = json.loads(json.dumps(state1))  # the ledger travels as plain data
    _, s2, state2 = _dp(task, data, dp, seed=1, state=state1)
    _, s3, _ = _dp(task, data, dp, seed=1)  # no ledger: a fresh accountant
    assert 0 < s1["epsilon"] < s2["epsilon"] and math.isfinite(s2["epsilon"])
    assert s3["epsilon"] == pytest.approx(s1["epsilon"], rel=1e-12)
    assert s1["dp-steps"] == s2["dp-steps"] == steps
    assert state1 == {"mechanism": "rdp", "history": [[1.0, q, steps]]}
    assert state2 == {"mechanism": "rdp", "history": [[1.0, q, 2 * steps]]}
    for stats, total in ((s1, steps), (s2, 2 * steps)):  # composed by the default (PLD) accountant
        assert stats["epsilon"] == pytest.approx(epsilon_of([PrivacyEvent(q, 1.0, total)], 1e-5, "pld"), rel=1e-12)
        assert stats["epsilon"] < epsilon_of([PrivacyEvent(q, 1.0, total)], 1e-5, "rdp")


def test_epsilon_agrees_with_dp_accounting(task, data):
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting import rdp

    from privacy.accountant import RDP_ORDERS

    steps, q = _steps_and_rate(len(data), SETTINGS)
    _, stats, state = _dp(task, data, LocalDpSettings(noise_multiplier=1.0, delta=1e-5, accountant="rdp"))
    _, pld_stats, pld_state = _dp(task, data, LocalDpSettings(noise_multiplier=1.0, delta=1e-5))
    assert state == pld_state  # one ledger, two ways to compose it
    assert pld_stats["epsilon"] < stats["epsilon"]
    ref = rdp.RdpAccountant(orders=list(RDP_ORDERS))
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.compose(event, steps)
        expected = ref.get_epsilon(1e-5)
    assert stats["epsilon"] == pytest.approx(expected, rel=1e-3)


@pytest.mark.parametrize("mode", ["fast", "hooks"])
@pytest.mark.parametrize("n, epochs", [(93, 1), (94, 1), (93, 3)])
def test_the_planned_epsilon_is_never_below_what_training_charges(task, data, mode, n, epochs):
    """Opacus's DPDataLoader takes int(1 / (1 / L)) steps for L batches: 92 for 93. The fast trainer charges
    q = 1 / 92; the plan assumed 1 / 93 over 93 steps, under the charge (a --max-local-epsilon just above the
    plan let the ledger pass it). The plan now equals the fast path's charge and bounds the hooks path's."""
    from clients.dp_training import planned_epsilon
    from clients.tasks.base import Dataset

    settings = TrainSettings(local_epochs=epochs, batch_size=1, lr=0.1)
    dp = LocalDpSettings(noise_multiplier=0.8, grad_sample_mode=mode)
    plan = planned_epsilon(None, dp, settings, n)
    _, stats, _ = _dp(task, Dataset(data.x[:n], data.y[:n]), dp, settings=settings)
    assert stats["epsilon"] <= plan * (1 + 1e-12)
    if mode == "fast":
        assert stats["epsilon"] == pytest.approx(plan, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_models_clipped_sums_are_its_float32_ones(dtype):
    """Norms in float32, the clipped sums in the model's dtype: both paths, on a fast-path model."""
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    x, y = torch.randn(12, 64), torch.randint(0, 10, (12,))
    ref, _, ref_norms = clipped_grad_sum(model, x, y, 0.5)
    half = copy.deepcopy(model).to(dtype)
    for fn in (clipped_grad_sum, vmap_clipped_grad_sum):
        sums, _, norms = fn(half, x.to(dtype), y, 0.5)
        assert norms.dtype == torch.float32
        torch.testing.assert_close(norms, ref_norms, rtol=3e-2, atol=1e-3)
        for got, want in zip(sums, ref, strict=True):  # (the whole step in bfloat16 keeps 2-3 digits: 6.5% here)
            assert (got.float() - want).norm() <= (0.1 if dtype == torch.bfloat16 else 0.02) * want.norm()


def test_the_vmap_path_takes_an_empty_batch():
    model = nn.Linear(4, 3)
    sums, loss, norms = vmap_clipped_grad_sum(model, torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), 1.0)
    assert all(not s.any() for s in sums) and loss.item() == 0 and norms.numel() == 0


@pytest.mark.parametrize("mode", ["fast", "ghost", "hooks", "functorch", "vmap"])
def test_an_empty_poisson_batch_is_a_noise_only_step_on_every_path(mode):
    """Three examples in batches of one under Poisson sampling draw empty batches; ghost's and functorch's forward
    of an empty batch failed on an embedding with a raw RuntimeError."""
    class Bag(nn.Module):  # (ghost computes LayerNorm's per-example gradients: a leftover empty one failed it)
        def __init__(self):
            super().__init__()
            self.e, self.o = nn.Embedding(20, 16), nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 3))

        def forward(self, x):
            return self.o(self.e(x).mean(1))

    from clients import Dataset

    torch.manual_seed(0)
    model = Bag()
    before = [p.detach().clone() for p in model.parameters()]
    data = Dataset(np.random.default_rng(0).integers(0, 20, (3, 8)), np.array([0, 1, 2]))
    _, stats, _ = train_local_dp(model, data, TrainSettings(local_epochs=10, batch_size=1, lr=0.1),
                                 LocalDpSettings(grad_sample_mode=mode), torch.Generator().manual_seed(1))
    assert stats["dp-steps"] == 30 and stats["epsilon"] > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


class _GrowingCache(nn.Module):
    """A cache buffer re-registered larger when a longer input comes (as rotary-position caches do)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 3)
        self.register_buffer("cache", torch.ones(4), persistent=False)

    def forward(self, x):
        if x.shape[1] > len(self.cache):
            self.register_buffer("cache", torch.ones(x.shape[1]), persistent=False)
        return self.lin((x * self.cache[: x.shape[1]]).sum(1, keepdim=True))


class _DataInit(nn.Module):
    """ActNorm-style: its first training forward sets a parameter from the batch."""

    def __init__(self):
        super().__init__()
        self.lin, self.shift = nn.Linear(6, 3), nn.Parameter(torch.zeros(6))
        self.register_buffer("ready", torch.tensor(False))

    def forward(self, x):
        if self.training and not self.ready:
            with torch.no_grad():
                self.shift.copy_(x.mean(0))
                self.ready.fill_(True)
        return self.lin(x - self.shift)


def test_the_check_before_training_finds_state_written_from_the_data_and_leaves_the_model_as_it_was():
    from clients import Dataset
    from clients.dp_training import data_dependent_state

    rng = np.random.default_rng(0)
    grows = _GrowingCache()  # written from the input's length alone: passes, and the cache is put back
    assert data_dependent_state(grows, torch.randn(4, 12)) == [] and grows.cache.shape == (4,)
    _, stats, _ = train_local_dp(_GrowingCache(), Dataset(rng.normal(size=(20, 12)).astype(np.float32),
                                                          rng.integers(0, 3, 20)), SETTINGS, LocalDpSettings(),
                                 torch.Generator(), None)
    assert stats["dp-steps"] > 0
    init = _DataInit()
    before = init.shift.detach().clone()
    assert data_dependent_state(init, torch.randn(4, 6)) == ["shift"] and torch.equal(init.shift, before)
    assert not bool(init.ready) and init.training

    def crop(x, y, generator):  # an augmentation that changes the shape: the check feeds what training feeds
        return x[:, :6], y

    running = nn.Sequential(nn.Linear(6, 6), _MeanOf())
    assert data_dependent_state(running, torch.randn(4, 10), augment=crop) == ["1.mean"]
    with pytest.raises(ClientError, match=r"the model's forward must run on two batches of this node's data before "
                                          r"training .* Found RuntimeError: mat1 and mat2 shapes cannot be multiplied"):
        data_dependent_state(running, torch.randn(4, 10))


class _MeanOf(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(6))

    def forward(self, x):
        self.mean.copy_(x.detach().mean(0))
        return x[:, :3]


def test_the_check_before_training_gives_both_batches_the_same_random_draws():
    """A buffer written from random numbers, not from the data (noise injected in training), passes."""
    from clients.dp_training import data_dependent_state

    class Jitter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(6, 3)
            self.register_buffer("last", torch.zeros(3))

        def forward(self, x):
            self.last.copy_(torch.rand(3))
            return self.lin(x)

    assert data_dependent_state(Jitter(), torch.randn(4, 6)) == []
