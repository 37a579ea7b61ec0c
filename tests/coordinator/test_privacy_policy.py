"""Central and local DP as coordinator policy, end to end on the in-process engine."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from clients.client_app import app
from coordinator import RunConfig, RunDirectory, SyncWorkflow
from coordinator.rundir import METRICS
from privacy import PldAccountant, PrivacyEvent
from simulations.inprocess import InProcessGrid

BASE = {"min-nodes": 2, "fraction-train": 0.5, "seed": 0}


def run(tmp_path, name, clients=10, **kw):
    cfg = RunConfig.from_mapping({**BASE, **kw})
    wf = SyncWorkflow(cfg, InProcessGrid(app, clients), RunDirectory(tmp_path / name))
    return wf, wf.run()


def test_central_dp_records_epsilon_equal_to_the_accountant(tmp_path):
    wf, s = run(tmp_path, "a", **{"num-rounds": 3, "dp": "central", "dp-noise-multiplier": 1.5, "dp-clip": 0.5})
    ref = PldAccountant(1e-5)  # the default accountant
    for _ in range(3):
        ref.compose(PrivacyEvent(0.5, 1.5))  # q = fraction-train: a secret Poisson sample
    assert s["epsilon"] == pytest.approx(ref.epsilon(), rel=1e-9)
    eps = [r["epsilon"] for r in wf.history]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(s["epsilon"])
    assert "user level" in s["privacy_guarantee"] and "C = 0.5" in s["privacy_guarantee"]
    assert (tmp_path / "a" / "epsilon.png").is_file()
    header = next(csv.reader(open(tmp_path / "a" / METRICS)))
    assert "epsilon" in header


def test_noise_is_secret_from_the_run_seed_and_really_added(tmp_path):
    """Clients get the run's seed in every train message: noise drawn from it could be subtracted.
    Two runs with the same seed (same data, same training) must get different noise."""
    kw = {"num-rounds": 1, "dp": "central", "dp-noise-multiplier": 1.0, "dp-clip": 1.0}
    a, _ = run(tmp_path, "s0", **kw)
    b, _ = run(tmp_path, "s1", **kw)
    assert not torch.equal(a.weights, b.weights)
    # With every update clipped to 0 norm impossible; instead: all clients honest, noise std z*C/asked
    # per coordinate. Compare with the same run and a negligible noise multiplier.
    c, _ = run(tmp_path, "tiny", **{**kw, "dp-noise-multiplier": 1e-3})
    diff = (a.weights - c.weights) * 5  # divided by the expected sample, 0.5 x 10 clients
    assert diff.std().item() == pytest.approx(1.0, rel=0.05)  # the noise on the sum has std z*C = 1
    assert abs(diff.mean().item()) < 5 * 1.0 / diff.numel() ** 0.5


def test_budget_stops_before_it_is_exceeded(tmp_path):
    # q=0.5, z=1.0
    ref = PldAccountant(1e-5)  # the default accountant
    eps = []
    for _ in range(6):
        ref.compose(PrivacyEvent(0.5, 1.0))
        eps.append(ref.epsilon())
    target = (eps[2] + eps[3]) / 2  # rounds 1-3 fit, round 4 would exceed
    wf, s = run(tmp_path, "b", **{"num-rounds": 6, "dp": "central", "dp-noise-multiplier": 1.0, "target-epsilon": target})
    assert s["status"] == "budget-exhausted" and s["rounds"] == 3
    assert s["epsilon"] <= target
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["status"] == "budget-exhausted"


def test_resume_keeps_the_spent_budget(tmp_path):
    kw = {"dp": "central", "dp-noise-multiplier": 1.2}
    _, full = run(tmp_path, "full", **{"num-rounds": 4, **kw})
    run(tmp_path, "part", **{"num-rounds": 2, **kw})
    _, resumed = run(tmp_path, "part", **{"num-rounds": 4, **kw})
    assert resumed["epsilon"] == pytest.approx(full["epsilon"], rel=1e-12)


def test_calibration_reaches_but_does_not_pass_the_target(tmp_path):
    wf, s = run(tmp_path, "cal", **{"num-rounds": 5, "dp": "central", "target-epsilon": 4.0})
    assert s["status"] == "completed" and s["rounds"] == 5
    assert 3.5 < s["epsilon"] <= 4.0


def test_central_dp_refuses_settings_without_noise_or_with_robust_rules():
    from clients import ConfigError

    with pytest.raises(ConfigError, match="dp-noise-multiplier must be > 0"):
        RunConfig.from_mapping({"dp": "central"})
    with pytest.raises(ConfigError, match=r"^run\.aggregator must be 'mean' under central DP"):
        RunConfig.from_mapping({"dp": "central", "dp-noise-multiplier": 1.0, "aggregator": "median"})


def test_local_dp_clients_report_their_epsilon(tmp_path):
    wf, s = run(tmp_path, "local", clients=4, **{"num-rounds": 2, "fraction-train": 1.0, "dp": "local",
                                                 "local-noise-multiplier": 1.0, "local-epochs": 1})
    eps = [r["local_epsilon_max"] for r in wf.history]
    assert 0 < eps[0] < eps[1]  # each client's ledger persists across rounds and grows
    assert s["local_epsilon_max"] == pytest.approx(eps[1]) and "DP-SGD" in s["privacy_guarantee"]


def test_adaptive_clipping_runs_with_its_default_count_noise(tmp_path):
    """adaptive-clipping = true with clip-count-noise left unset validates and runs: the count's noise defaults
    to sqrt(10)/2 z, so the count takes 1/10 of the round's budget and the sum is noised with z / sqrt(0.9)."""
    from coordinator.privacy_policy import CentralDp
    from privacy import effective_noise_multiplier

    kw = {"num-rounds": 2, "dp": "central", "dp-noise-multiplier": 1.0, "dp-clip": 1.0, "adaptive-clipping": True}
    cfg = RunConfig.from_mapping({**BASE, **kw})
    assert cfg.privacy.clip_count_noise == 0  # unset
    dp = CentralDp(cfg.privacy, 0.5, 2)
    assert dp.count_noise_std == pytest.approx(10**0.5 / 2)
    assert effective_noise_multiplier(1.0, dp.count_noise_std) == pytest.approx(1 / 0.9**0.5)
    wf, s = run(tmp_path, "adaptive", **kw)
    assert s["status"] == "completed" and s["rounds"] == 2
    assert wf.dp.clip != 1.0  # the clip moved toward the quantile
    ref = PldAccountant(1e-5)  # the count costs nothing extra in the ledger: it is paid for by z_sum > z
    for _ in range(2):
        ref.compose(PrivacyEvent(0.5, 1.0))
    assert s["epsilon"] == pytest.approx(ref.epsilon(), rel=1e-9)


def test_adaptive_clipping_with_a_calibrated_multiplier_is_checked_before_the_run(tmp_path):
    """dp-noise-multiplier calibrated from target-epsilon: the default count noise follows the calibrated z;
    an explicit clip-count-noise below z/2 is refused by the config, naming run.clip-count-noise."""
    from clients import ConfigError
    from coordinator.privacy_policy import CentralDp
    from simulations import load_scenario

    kw = {"dp": "central", "adaptive-clipping": True, "target-epsilon": 8.0}
    cfg = RunConfig.from_mapping(kw)  # the default clip-count-noise: valid whatever z is calibrated to
    z = cfg.calibrated_noise_multiplier()
    dp = CentralDp(cfg.privacy, cfg.dp_sampling_rate(), cfg.server.num_rounds)
    assert dp.z == z and 2 * dp.count_noise_std > z
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({**kw, "clip-count-noise": z / 2})
    msg = str(info.value)
    assert msg.startswith("run.clip-count-noise must be > z/2") and "target-epsilon = 8" in msg
    assert "count-noise-std" not in msg and "\n" not in msg
    with pytest.raises(ConfigError, match=r"^run\.clip-count-noise must be > z/2"):  # the --set path of the CLI
        load_scenario(None, {f"run.{k}": v for k, v in {**kw, "clip-count-noise": 0.1}.items()})
    RunConfig.from_mapping({**kw, "clip-count-noise": z})  # explicit and large enough: accepted


@pytest.mark.parametrize(("setting", "message"), [
    ({"dp-noise-multiplier": 1.0, "clip-count-noise": 0.5},
     "run.clip-count-noise must be > dp-noise-multiplier/2 = 0.5 (the noised count is paid from the same budget; "
     "0 picks a valid value). Found 0.5."),
    ({"dp-noise-multiplier": 1.0, "clip-count-noise": -1.0},
     "run.clip-count-noise must be in [0, 1e+06] (0: auto, sqrt(10)/2 x the noise multiplier). Found -1.0."),
    ({"target-epsilon": 1e-4}, "run.target-epsilon must be reachable with a noise multiplier <= 1000 over "
     "num-rounds = 20 at sampling rate 1 with dp-delta = 1e-05"),
    # values that overflowed float32 noise, the accountant, or drove the clip to 0 (tracebacks, or a run ended)
    ({"dp-noise-multiplier": 1e200}, "run.dp-noise-multiplier must be 0 (calibrate from target-epsilon) or in "
     "[0.001, 1e+06]"),
    ({"dp-noise-multiplier": 1e-300}, "run.dp-noise-multiplier must be 0 (calibrate from target-epsilon) or in "
     "[0.001, 1e+06]"),
    ({"dp-noise-multiplier": 1.0, "dp-clip": 1e300}, "run.dp-clip must be in (0, 1e+09]"),
    ({"dp-noise-multiplier": 1.0, "clip-count-noise": 1e308}, "run.clip-count-noise must be in [0, 1e+06]"),
    ({"dp-noise-multiplier": 1.0, "clip-learning-rate": 1e4}, "run.clip-learning-rate must be in (0, 10]"),
])
def test_bad_adaptive_clipping_and_budget_settings_are_refused_up_front(setting, message):
    from clients import ConfigError

    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping({"dp": "central", "adaptive-clipping": True, **setting})
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(("setting", "message"), [
    # z = 0.5 at q = 1 spends ~10.0 in one round (PLD; 10.7 under RDP): no round could run (the run stopped before round 1 and
    # `fedshield simulate` then crashed formatting the accuracy of a run with no round)
    ({"dp": "central", "dp-noise-multiplier": 0.5, "target-epsilon": 0.1},
     "run.target-epsilon must be >= 9.997, the epsilon one round spends with dp-noise-multiplier = 0.5 at sampling "
     "rate 1 and dp-delta = 1e-05"),
    ({"dp": "local", "target-epsilon": 0.5}, "run.target-epsilon must be 0 unless dp is 'central' or 'distributed'"),
    ({"target-epsilon": 0.5}, "run.target-epsilon must be 0 unless dp is 'central' or 'distributed'"),
])
def test_a_budget_that_would_be_ignored_or_cannot_fit_one_round_is_refused_up_front(setting, message):
    from clients import ConfigError

    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(setting, where="run")
    assert str(info.value).startswith(message)
    fits = {"dp": "central", "dp-noise-multiplier": 0.5, "target-epsilon": 11.0}
    assert RunConfig.from_mapping(fits).privacy.target_epsilon == 11.0


@pytest.mark.parametrize(("setting", "message"), [
    # a noise multiplier without dp ran with no noise at all, silently
    ({"dp-noise-multiplier": 1.2}, "run.dp-noise-multiplier must be left at 0.0 unless dp is 'central' or "
                                   "'distributed', not 'none' (it would be ignored). Found 1.2."),
    ({"dp-secure-noise": True}, "run.dp-secure-noise must be left at false unless dp is 'central'"),
    ({"dp": "distributed", "secure-aggregation": "secagg+", "secagg-weighting": "uniform", "dp-noise-multiplier": 1.0,
      "dp-secure-noise": True}, "run.dp-secure-noise must be left at false unless dp is 'central'"),
    ({"dp": "local", "dp-clip": 2.0}, "run.dp-clip must be left at 1.0 unless dp is 'central' or 'distributed'"),
    ({"dp": "central", "dp-noise-multiplier": 1.0, "local-noise-multiplier": 2.0},
     "run.local-noise-multiplier must be left at 1.0 unless dp is 'local'"),
    ({"local-max-grad-norm": 3.0}, "run.local-max-grad-norm must be left at 1.0 unless dp is 'local'"),
    ({"dp-delta": 1e-6}, "run.dp-delta must be left at 1e-05 unless dp is 'central' or 'distributed' or 'local'"),
    ({"dp": "central", "dp-noise-multiplier": 1.0, "clip-learning-rate": 0.5},
     "run.clip-learning-rate must be left at 0.2 unless adaptive-clipping is true"),
])
def test_a_privacy_setting_the_dp_mode_would_ignore_is_refused(setting, message):
    from clients import ConfigError

    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(setting, where="run")
    assert str(info.value).startswith(message), str(info.value)


def test_adaptive_clipping_outside_central_dp_is_refused():
    from clients import ConfigError

    with pytest.raises(ConfigError, match=r"^run\.adaptive-clipping must be false unless dp = 'central'"):
        RunConfig.from_mapping({"adaptive-clipping": True})


def test_central_dp_rounds_take_a_secret_poisson_sample():
    """Each node in with probability fraction-train, drawn from the OS: sizes vary, the run's seed
    does not predict it, and selection other than uniform is refused under central DP."""
    import statistics

    from clients import ConfigError
    from coordinator import SyncWorkflow as Wf

    cfg = RunConfig.from_mapping({**BASE, "dp": "central", "dp-noise-multiplier": 1.0, "fraction-train": 0.3})
    wf = Wf.__new__(Wf)  # select() needs only the config and the flag
    wf.cfg, wf.poisson = cfg, True
    nodes = list(range(1000, 1100))
    samples = [wf.select(nodes, 1) for _ in range(200)]  # the same round: a seeded sample would repeat
    sizes = [len(x) for x in samples]
    assert len({tuple(x) for x in samples}) > 190 and abs(statistics.mean(sizes) - 30) < 2 and min(sizes) < 25
    assert all(set(x) <= set(nodes) for x in samples)
    with pytest.raises(ConfigError, match="selection must be 'uniform' under central DP"):
        RunConfig.from_mapping({**BASE, "dp": "central", "dp-noise-multiplier": 1.0, "selection": "fast-fair"})


def test_central_dp_under_fedbuff_is_refused_with_the_reason_and_what_to_use():
    """Which clients fill a FedBuff release follows the dispatch schedule, and one client's presence changes it for
    the rest of the run (review helper-55: with 6 vs 7 nodes, releases it was not in differed in up to 2 buffer-size
    updates): noise for that would swamp the model, and noise for less under-states epsilon."""
    from clients import ConfigError

    with pytest.raises(ConfigError, match=r"^run\.workflow must be 'sync' under central DP .*2 x buffer-size x "
                                          r"dp-clip.*use dp = 'local'.* Found 'fedbuff'"):
        RunConfig.from_mapping({**BASE, "dp": "central", "dp-noise-multiplier": 1.0, "workflow": "fedbuff",
                                "fraction-train": 1.0})
    local = RunConfig.from_mapping({**BASE, "dp": "local", "workflow": "fedbuff", "fraction-train": 1.0})
    assert local.privacy.dp == "local" and local.asynchrony.workflow == "fedbuff"


def test_close_after_replies_is_refused_under_central_dp():
    """A round closed after k replies holds a fixed number of updates: a fast client pushes a slow one out (2C)."""
    from clients import ConfigError

    with pytest.raises(ConfigError, match=r"^run\.close-after-replies must be 0 under central DP .*2 dp-clip"):
        RunConfig.from_mapping({**BASE, "dp": "central", "dp-noise-multiplier": 1.0, "close-after-replies": 2})
    RunConfig.from_mapping({**BASE, "close-after-replies": 2})  # without central DP: allowed


@pytest.mark.parametrize("fraction, expected, want", [(1.0, 0, 10), (0.5, 0, 5), (0.5, 7, 7), (0.05, 0, 1)])
def test_a_central_dp_round_divides_by_a_public_count_fixed_before_the_run(tmp_path, monkeypatch, fraction, expected, want):
    """The noised sum was divided by the number of clients asked (q = 1) or by q x the nodes online: both change
    with one client's presence, and the release's norm then told the two worlds apart (divisor 2 vs 3: norms 49
    vs 33). It is now divided by dp-expected-clients, or fraction-train x the run's clients (num-supernodes)."""
    from coordinator.privacy_policy import CentralDp

    asked = []
    release = CentralDp.release
    monkeypatch.setattr(CentralDp, "release", lambda self, agg, n, rnd: asked.append(n) or release(self, agg, n, rnd))
    kw = {"num-rounds": 2, "dp": "central", "dp-noise-multiplier": 1.0, "fraction-train": fraction,
          "dp-expected-clients": expected}
    wf, s = run(tmp_path, "div", **kw)
    assert s["status"] == "completed" and wf.dp_divisor == want and asked == [want, want]


def test_central_dp_without_a_known_population_needs_dp_expected_clients(tmp_path):
    """A deployment's Grid does not know its clients in advance: the divisor must be given (coordinator start
    gives the enrolled keys' count), never taken from who is online."""
    from clients import ConfigError

    class Deployment(InProcessGrid):  # a Grid with no simulated population (as Flower's SuperLink grid)
        ENGINE = "flower"

    grid = Deployment(app, 3)
    del grid.contexts  # (not a dict: the workflow cannot count the population)
    grid.contexts = None
    cfg = RunConfig.from_mapping({**BASE, "dp": "central", "dp-noise-multiplier": 1.0})
    with pytest.raises(ConfigError, match=r"^run\.dp-expected-clients must be set under dp = 'central' when the run"):
        SyncWorkflow(cfg, grid, RunDirectory(tmp_path / "d"))
    wf = SyncWorkflow(cfg, grid, RunDirectory(tmp_path / "d"), sim_nodes=8)  # Flower's simulation engine: its count
    assert wf.dp_divisor == 4


def test_distributed_dp_clients_clip_below_dp_clip_by_the_rounding_they_may_add():
    """Stochastic rounding moves a vector by up to step x sqrt(numel): clipping to dp-clip itself let a quantized
    update pass it (a mutation review, helper-53, found this untested)."""
    from coordinator import CoordinatorError
    from coordinator.config import PrivacySettings
    from coordinator.privacy_policy import DistributedDp

    dp = DistributedDp(PrivacySettings(dp="distributed", dp_clip=0.5, dp_noise_multiplier=0.8), 1.0, 1, 0.2)
    clip, mu = dp.client_noise(selected=10, step=0.001, numel=100)
    assert clip == pytest.approx(0.5 - 0.001 * 10)
    # the Gaussian's mu, and 7e-6 more for Skellam's discretisation term (skellam_mu_for)
    assert mu == pytest.approx((0.8 * 0.5 / 0.001) ** 2 / (10 * 0.8) / 2, rel=1e-5)
    assert mu > (0.8 * 0.5 / 0.001) ** 2 / (10 * 0.8) / 2
    with pytest.raises(CoordinatorError, match="must exceed the quantization grid"):
        dp.client_noise(selected=10, step=0.05, numel=100)  # rounding 0.5 >= clip




def _as_before_the_accountant_key(run_dir, old_orders):
    """Rewrite a run's checkpoint as fedshield wrote it before `accountant`: no such key in its fingerprint, and
    its ledger an unnamed RDP state at opacus's orders (to 63)."""
    path = run_dir / "checkpoint.pt"
    ckpt = torch.load(path, weights_only=True)
    del ckpt["fingerprint"]["accountant"]
    ledger = ckpt["privacy"]["accountant"]
    del ledger["accountant"]
    ledger["orders"] = old_orders
    from privacy import RdpAccountant

    old = RdpAccountant(ledger["delta"], old_orders)
    for q, z, n in ledger["events"]:
        old.compose(PrivacyEvent(q, z, n))
    for row in ckpt["history"]:
        row["epsilon"] = old.epsilon()  # (one round: what that run recorded)
    RunDirectory(run_dir).save_checkpoint(ckpt)
    return old.epsilon()


def test_an_old_rdp_run_resumes_only_with_the_accountant_it_was_started_with(tmp_path):
    """A checkpoint from before `accountant` was kept with RDP: resumed under the PLD default it is refused with
    one line naming the setting; with accountant = "rdp" it goes on with its own ledger and orders."""
    from coordinator import CoordinatorError

    kw = {"dp": "central", "dp-noise-multiplier": 1.2, "accountant": "rdp"}
    run(tmp_path, "old", **{"num-rounds": 1, **kw})
    old_orders = [1 + x / 10.0 for x in range(1, 100)] + [float(a) for a in range(12, 64)]
    spent = _as_before_the_accountant_key(tmp_path / "old", old_orders)
    with pytest.raises(CoordinatorError, match=r"Found accountant = 'rdp' there, 'pld' now"):
        run(tmp_path, "old", **{"num-rounds": 2, "dp": "central", "dp-noise-multiplier": 1.2})
    wf, s = run(tmp_path, "old", **{"num-rounds": 2, **kw})
    assert s["rounds"] == 2 and wf.dp.accountant.orders == tuple(old_orders)
    assert wf.history[0]["epsilon"] == spent < s["epsilon"]


def test_summary_gives_epsilon_under_both_accountants(tmp_path):
    wf, s = run(tmp_path, "both", **{"num-rounds": 2, "dp": "central", "dp-noise-multiplier": 1.0})
    both = s["epsilon_by_accountant"]
    assert s["accountant"] == "pld" and both["pld"] == pytest.approx(s["epsilon"], rel=1e-12)
    assert both["pld"] < both["rdp"]
