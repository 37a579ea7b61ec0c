"""Server momentum and adaptive server optimizers (Reddi et al. 2021): steps equal a scalar
float64 reference, state survives torch.save / torch.load(weights_only=True), bad settings raise.

Tolerance: the optimizers run in float32; each step rounds a handful of times per coordinate,
so after 3 steps a relative error of 1e-5 (about 80 float32 eps) is ample.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from aggregation import (
    AggregationError,
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    available_server_optimizers,
    create_server_optimizer,
)
from aggregation.optimizers import TAU_MIN

W0 = [0.5, -1.0, 2.0]
DELTAS = [[0.1, -0.2, 0.0], [0.3, 0.05, -0.4], [-0.2, 0.1, 0.02]]
ADAPTIVE = {"fedadagrad": FedAdagrad, "fedadam": FedAdam, "fedyogi": FedYogi}
PARAMS = {"fedavgm": {"lr": 0.7, "momentum": 0.8}, "fedadagrad": {"lr": 0.05, "beta1": 0.8, "tau": 1e-2},
          "fedadam": {"lr": 0.05, "beta1": 0.8, "beta2": 0.9, "tau": 1e-2},
          "fedyogi": {"lr": 0.05, "beta1": 0.8, "beta2": 0.9, "tau": 1e-2}}


def _reference(name: str, steps: int, lr: float, momentum: float = 0.9, beta1: float = 0.9, beta2: float = 0.99,
               tau: float = 1e-3) -> list[float]:
    """The paper's update, one Python float at a time."""
    out = []
    for i, w in enumerate(W0):
        m, v = 0.0, tau**2
        for d in (row[i] for row in DELTAS[:steps]):
            if name == "fedavgm":
                m = momentum * m + d
                w += lr * m
                continue
            m = beta1 * m + (1 - beta1) * d
            if name == "fedadagrad":
                v = v + d * d
            elif name == "fedadam":
                v = beta2 * v + (1 - beta2) * d * d
            else:
                v = v - (1 - beta2) * d * d * math.copysign(1.0, v - d * d) * (v != d * d)
            w += lr * m / (math.sqrt(v) + tau)
        out.append(w)
    return out


def _steps(opt, steps: int, w: torch.Tensor | None = None) -> torch.Tensor:
    w = torch.tensor(W0) if w is None else w
    for d in DELTAS[:steps]:
        w = opt.step(w, torch.tensor(d))
    return w


def test_all_are_registered():
    assert {"fedavg", "fedavgm", "fedadagrad", "fedadam", "fedyogi"} <= set(available_server_optimizers())


def test_fedavgm_by_hand():
    opt = create_server_optimizer("fedavgm", lr=1.0, momentum=0.5)
    w = torch.tensor([0.0, 1.0])
    out = []
    for d in ([1.0, 2.0], [1.0, 0.0], [-1.0, 1.0]):
        w = opt.step(w, torch.tensor(d))
        out.append(w.tolist())
    # m: [1, 2] -> [1.5, 1] -> [-0.25, 1.5]; w accumulates m
    assert out == [[1.0, 3.0], [2.5, 4.0], [2.25, 5.5]]


def test_fedadam_first_step_by_hand():
    opt = create_server_optimizer("fedadam", lr=0.1)  # beta1 0.9, beta2 0.99, tau 1e-3
    w = opt.step(torch.tensor([0.0]), torch.tensor([1.0]))
    # m = 0.1, v = 0.99 * 1e-6 + 0.01 = 0.01000099, step = 0.1 * 0.1 / (sqrt(v) + 1e-3)
    assert w.item() == pytest.approx(0.01 / (math.sqrt(0.01000099) + 1e-3), rel=1e-6)


@pytest.mark.parametrize("name", list(PARAMS))
@pytest.mark.parametrize("defaults", [False, True])
def test_three_steps_equal_the_scalar_reference(name, defaults):
    params = ({"lr": 0.05} if defaults else PARAMS[name])
    opt = create_server_optimizer(name, **params)
    for steps in (1, 2, 3):
        opt = create_server_optimizer(name, **params)
        w = _steps(opt, steps)
        assert w.dtype == torch.float32
        assert w.tolist() == pytest.approx(_reference(name, steps, **params), rel=1e-5, abs=1e-7)
        assert opt.state_dict()["t"] == steps


def test_yogi_moves_v_toward_delta_squared_by_its_sign():
    opt = create_server_optimizer("fedyogi", lr=0.1, beta2=0.5, tau=1.0)  # v starts at tau^2 = 1
    opt.step(torch.zeros(2), torch.tensor([0.5, 2.0]))  # d^2 = 0.25 < v, 4 > v
    assert opt.state_dict()["v"].tolist() == pytest.approx([1 - 0.5 * 0.25, 1 + 0.5 * 4.0])


def test_yogi_leaves_v_unchanged_where_delta_squared_equals_it():
    """sign(v - d**2) is 0 there: v neither grows nor shrinks (a where(v > d**2, 1, -1) would grow it)."""
    opt = create_server_optimizer("fedyogi", lr=0.1, beta1=0.0, beta2=0.5, tau=0.5)  # v starts at 0.25
    w = opt.step(torch.zeros(3), torch.tensor([0.5, -0.5, 0.25]))  # d^2 = 0.25, 0.25, 0.0625
    assert opt.state_dict()["v"].tolist() == [0.25, 0.25, 0.25 - 0.5 * 0.0625]
    assert w.tolist() == pytest.approx([0.1 * 0.5 / 1.0, -0.1 * 0.5 / 1.0, 0.1 * 0.25 / (math.sqrt(0.21875) + 0.5)])


@pytest.mark.parametrize("name", list(PARAMS))
def test_state_round_trip_through_torch_save_continues_like_an_uninterrupted_run(name):
    full = create_server_optimizer(name, **PARAMS[name])
    w_full = torch.tensor(W0)
    for d in DELTAS + DELTAS:
        w_full = full.step(w_full, torch.tensor(d))
    first = create_server_optimizer(name, **PARAMS[name])
    w = torch.tensor(W0)
    for d in DELTAS:
        w = first.step(w, torch.tensor(d))
    buf = io.BytesIO()
    torch.save({"weights": w, "optimizer": first.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    second = create_server_optimizer(name, **PARAMS[name])
    second.load_state_dict(saved["optimizer"])
    w = saved["weights"]
    for d in DELTAS:
        w = second.step(w, torch.tensor(d))
    assert torch.equal(w, w_full)
    assert second.state_dict()["t"] == full.state_dict()["t"] == 6


@pytest.mark.parametrize("name", list(PARAMS))
def test_state_dict_holds_copies_of_plain_values_on_the_weights_device(name):
    opt = create_server_optimizer(name, **PARAMS[name])
    assert opt.state_dict() == {"t": 0}
    w = opt.step(torch.tensor(W0, dtype=torch.float64), torch.tensor(DELTAS[0]))
    state = opt.state_dict()
    slots = {"m"} if name == "fedavgm" else {"m", "v"}
    assert set(state) == {"t"} | slots
    for key in slots:
        assert state[key].dtype == w.dtype == torch.float64 and state[key].device == w.device
    before = {k: v.clone() for k, v in state.items() if k != "t"}
    opt.step(w, torch.tensor(DELTAS[1]))
    assert all(torch.equal(state[k], before[k]) for k in before)  # a later step does not change a saved state


@pytest.mark.parametrize("name", list(PARAMS))
def test_load_state_dict_checks_keys_types_and_shapes(name):
    opt = create_server_optimizer(name, **PARAMS[name])
    _steps(opt, 2)
    good = opt.state_dict()
    bad_states = [
        {"t": -1},
        {"t": 1.0, **{k: v for k, v in good.items() if k != "t"}},
        {"t": 2},  # steps taken but no tensors
        {**good, "extra": torch.zeros(3)},
        {"t": 0, **{k: v for k, v in good.items() if k != "t"}},
        {**good, "m": torch.zeros(3, 1)},
        {**good, "m": torch.zeros(3, dtype=torch.int64)},
    ]
    nan_m = good["m"].clone()
    nan_m[1] = math.nan
    bad_states.append({**good, "m": nan_m})  # a damaged checkpoint: the next step would make the model NaN
    if name == "fedavgm":
        bad_states.append({**good, "v": torch.zeros(3)})
    else:
        bad_states += [{"t": 2, "m": good["m"]}, {**good, "m": torch.zeros(4)}, {**good, "v": -good["v"] - 1}]
    for state in bad_states:
        fresh = create_server_optimizer(name, **PARAMS[name])
        with pytest.raises(AggregationError, match="optimizer state"):
            fresh.load_state_dict(state)
        assert fresh.state_dict() == {"t": 0}
    with pytest.raises(AggregationError, match=r"optimizer state .* must have the current state's shape \(3,\)"):
        opt.load_state_dict({**good, **{k: torch.zeros(4) for k in good if k != "t"}})  # opt has stepped on (3,)
    fresh = create_server_optimizer(name, **PARAMS[name])
    fresh.load_state_dict({**good, **{k: torch.zeros(4) for k in good if k != "t"}})  # shape is checked at the step
    with pytest.raises(AggregationError, match=r"weights must have the optimizer state's shape \(4,\)\. Found \(3,\)"):
        fresh.step(torch.zeros(3), torch.zeros(3))
    fresh = create_server_optimizer(name, **PARAMS[name])
    fresh.load_state_dict(good)
    with pytest.raises(AggregationError, match=r"weights must have the optimizer state's shape \(3,\)\. Found \(4,\)"):
        fresh.step(torch.zeros(4), torch.zeros(4))
    with pytest.raises(AggregationError, match=r"delta must have shape \(3,\)\. Found \(2,\)"):
        fresh.step(torch.zeros(3), torch.zeros(2))


@pytest.mark.parametrize("name", list(ADAPTIVE))
@pytest.mark.parametrize(("param", "value"), [
    ("lr", 0.0), ("lr", -1.0), ("lr", math.nan), ("lr", math.inf), ("lr", True),
    ("beta1", -0.1), ("beta1", 1.0), ("beta1", math.nan), ("beta1", "0.9"),
    ("beta2", -0.1), ("beta2", 1.0), ("beta2", math.inf),
    ("tau", 0.0), ("tau", -1e-3), ("tau", math.inf), ("tau", math.nan), ("tau", None),
])
def test_adaptive_rejects_bad_settings(name, param, value):
    params = {"lr": 0.1, param: value}
    with pytest.raises(AggregationError, match=rf"server-{param} must .*\. Found"):
        create_server_optimizer(name, **params)


@pytest.mark.parametrize("name", list(ADAPTIVE))
@pytest.mark.parametrize("tau", [1e-46, 1e-40, 1e-30, 1e-19])
def test_a_tau_whose_square_is_no_normal_float32_is_refused(name, tau):
    """Review helper-56, F1: any tau > 0 was taken. Under ~1e-45 tau is 0 in float32, and a coordinate whose
    delta is 0 became 0/0 = NaN; under ~1.1e-19 tau**2 (v's start) is 0 or subnormal, and a delta whose square
    rounds to 0 moved its weight by up to lr * delta / tau (1e-25 with tau 1e-30: thousands)."""
    with pytest.raises(AggregationError, match=r"server-tau must be >= 1e-18 \(tau\*\*2, v's starting value, must stay "
                                               r"a normal float32: .*0/0 = NaN\)\. Found"):
        create_server_optimizer(name, lr=0.1, tau=tau)


def test_the_config_check_refuses_a_tau_the_optimizer_refuses():
    from clients import ConfigError
    from coordinator import RunConfig

    with pytest.raises(ConfigError, match=r"server-tau must be >= 1e-18 .*\. Found 1e-30"):
        RunConfig.from_mapping({"server-optimizer": "fedyogi", "server-lr": 0.1, "server-tau": 1e-30})
    assert RunConfig.from_mapping({"server-optimizer": "fedyogi", "server-lr": 0.1, "server-tau": TAU_MIN})


@pytest.mark.parametrize("name", list(ADAPTIVE))
def test_at_the_smallest_tau_a_zero_or_tiny_delta_barely_moves_its_weight(name):
    opt = create_server_optimizer(name, lr=0.1, tau=TAU_MIN)
    w = torch.zeros(4)
    for _ in range(3):
        w = opt.step(w, torch.tensor([0.0, 1e-25, 1e-3, -1.0]))
    assert float(opt.state_dict()["v"][0]) >= torch.finfo(torch.float32).tiny  # tau**2: a normal float32
    assert bool(torch.isfinite(w).all()) and w[0] == 0.0
    assert 0.0 < float(w[1]) < 1e-6  # a 1e-25 delta: not lr * delta / tau-sized
    assert 0.01 < float(w[2]) < 0.5 and -0.5 < float(w[3]) < -0.01  # ordinary deltas: at most about lr a step


@pytest.mark.parametrize("value", [-0.1, 1.0, math.nan, True, None])
def test_fedavgm_rejects_bad_momentum(value):
    with pytest.raises(AggregationError, match=r"server-momentum must be in \[0.0, 1.0\)\. Found"):
        create_server_optimizer("fedavgm", lr=1.0, momentum=value)


def test_unknown_settings_are_ignored_and_adaptive_lr_is_required():
    opt = create_server_optimizer("fedadam", lr=0.1, momentum=0.3, foo="bar")
    assert isinstance(opt, FedAdam) and (opt.beta1, opt.beta2, opt.tau) == (0.9, 0.99, 1e-3)
    assert isinstance(create_server_optimizer("fedavgm", beta1=0.5), FedAvgM)
    for name in ADAPTIVE:
        with pytest.raises(AggregationError, match="server-lr must be given"):
            create_server_optimizer(name, beta1=0.5)


@pytest.mark.parametrize("name", list(PARAMS))
def test_a_state_of_another_model_s_size_is_refused_at_load_not_at_the_first_step(name):
    """A fresh optimizer took any length, and the resumed run failed after its first round of training."""
    opt = create_server_optimizer(name, **PARAMS[name])
    _steps(opt, 2)
    fresh = create_server_optimizer(name, **PARAMS[name])
    fresh.load_state_dict(opt.state_dict(), numel=3)
    with pytest.raises(AggregationError, match=r"must have the model's shape \(4,\). Found \(3,\)"):
        create_server_optimizer(name, **PARAMS[name]).load_state_dict(opt.state_dict(), numel=4)
    with pytest.raises(AggregationError, match="optimizer state must be a dict. Found list"):
        create_server_optimizer(name, **PARAMS[name]).load_state_dict([1, 2])
