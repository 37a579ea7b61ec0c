"""The run configuration: one frozen dataclass built once from run_config / TOML."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from aggregation import AggregationError, available_server_optimizers, create_aggregator, create_server_optimizer
from aggregation.codecs import Codec, create_codec
from aggregation.robust import krum_min_updates, trimmed_mean_min_updates
from clients.config import (MAX_NOISE_MULTIPLIER, MIN_LOCAL_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER, TaskSpec, TrainSettings, build_config, check, config_keys,
                            split_mapping, to_mapping, unknown_key)
from clients._errors import ConfigError

from .profiles import SELECTION_POLICIES

_FULL_STEP_OPTIMIZERS = ("fedavg", "fedavgm")  # w + lr * delta: lr 1.0 applies the mean as it is


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the coordinator runs rounds (kebab-case keys in ``[run]`` / run_config)."""

    run_dir: str = ""
    num_rounds: int = 20
    fraction_train: float = 1.0
    min_nodes: int = 2
    wait_nodes_timeout: float = 120.0
    round_timeout: float = 300.0
    close_after_replies: int = 0
    late_replies: str = "drop"
    work_deadline: float = 0.0
    poll_interval: float = 0.1
    server_optimizer: str = "fedavg"
    server_lr: float = 0.0  # 0: 1.0 under fedavg and fedavgm; an adaptive optimizer needs it given
    server_momentum: float = 0.9
    server_beta1: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    seed: int = 0
    max_examples: int = 10_000_000
    max_update_mb: float = 512.0
    max_update_norm: float = 1.0e4
    device: str = "auto"
    selection: str = "uniform"
    fairness: float = 2.0
    federated_eval_every: int = 0  # rounds between federated evaluations (and after the last round); 0: none
    central_eval_every: int = 1  # rounds between evaluations on the task's test set (and after the last); 0: last only
    clients_per_round: int = 0  # nodes asked each round (0: fraction-train of those online, at least min-nodes)

    def effective_server_lr(self) -> float | None:
        """``server-lr``, else (0, unset) 1.0 under fedavg and fedavgm, and None (no default) under the adaptive
        optimizers, whose steps move each coordinate by about the learning rate whatever the update's size."""
        return self.server_lr or (1.0 if self.server_optimizer in _FULL_STEP_OPTIMIZERS else None)

    def optimizer_params(self) -> dict[str, Any]:
        return {"lr": self.effective_server_lr(), "momentum": self.server_momentum, "beta1": self.server_beta1,
                "beta2": self.server_beta2, "tau": self.server_tau}

    def __post_init__(self) -> None:
        check(1 <= self.num_rounds <= 1_000_000, "num-rounds", "be in [1, 1000000]", self.num_rounds)
        check(0 < self.fraction_train <= 1, "fraction-train", "be in (0, 1]", self.fraction_train)
        check(self.min_nodes >= 1, "min-nodes", "be >= 1", self.min_nodes)
        check(self.wait_nodes_timeout > 0, "wait-nodes-timeout", "be > 0 seconds", self.wait_nodes_timeout)
        check(self.round_timeout > 0, "round-timeout", "be > 0 seconds", self.round_timeout)
        check(self.close_after_replies >= 0, "close-after-replies", "be >= 0 (0: wait for every reply)",
              self.close_after_replies)
        check(self.late_replies in ("drop", "carry"), "late-replies",
              "be drop, or carry (a reply that misses its round joins a later one, weighted by its staleness)",
              self.late_replies)
        check(math.isfinite(self.work_deadline) and self.work_deadline >= 0, "work-deadline",
              "be >= 0 seconds (0: every node runs local-epochs)", self.work_deadline)
        check(0 < self.poll_interval <= 10, "poll-interval", "be in (0, 10] seconds", self.poll_interval)
        opts = available_server_optimizers()
        check(self.server_optimizer in opts, "server-optimizer", f"be one of {opts}", self.server_optimizer)
        check(0 <= self.server_lr <= 1e6, "server-lr", "be 0 (the default: 1.0 under fedavg and fedavgm) or in (0, 1e6]",
              self.server_lr)
        # It ran at 1.0 (review helper-56): a FedAdam step moved weights of 0.05 to 0.67 where FedAvg's gave 0.07.
        check(self.effective_server_lr() is not None, "server-lr", f"be given for server-optimizer = "
              f"{self.server_optimizer!r} (an adaptive step moves each coordinate by about server-lr, whatever the "
              "update's size: Reddi et al. tune it over [1e-3, 1]; Flower's defaults are 0.1, and 0.01 for FedYogi)",
              self.server_lr)
        try:  # the optimizer's own rules (momentum and betas in [0, 1), tau >= 1e-18), before anything starts
            create_server_optimizer(self.server_optimizer, **self.optimizer_params())
        except AggregationError as exc:
            raise ConfigError(str(exc)) from None
        check(0 <= self.seed < 2**32, "seed", "be in [0, 2**32)", self.seed)
        # Capped (review helper-56): a client may claim max-examples, and its weight multiplies its update in the
        # float32 sums: 1e38 x an update of 5.0 made the mean inf. 1e12 x max-update-norm (<= 1e18) leaves 10^8 such
        # clients within float32's 3.4e38.
        check(1 <= self.max_examples <= 10**12, "max-examples", "be in [1, 1e12] (a client's weight multiplies its "
              "update in float32 sums)", self.max_examples)
        check(0 < self.max_update_mb <= 1e6, "max-update-mb", "be in (0, 1e6]", self.max_update_mb)
        # Capped: past 1e18 an update's sum of squares nears float32's range (3.4e38), where the paths' float32
        # roundings of it (one per block, per 8K step, per update) could accept and refuse the same update.
        check(0 < self.max_update_norm <= 1e18, "max-update-norm", "be in (0, 1e18]", self.max_update_norm)
        check(self.selection in SELECTION_POLICIES, "selection", f"be one of {list(SELECTION_POLICIES)}", self.selection)
        check(0 <= self.clients_per_round <= 10_000_000, "clients-per-round",
              "be in [0, 10000000] (0: fraction-train of the nodes online decides)", self.clients_per_round)
        check(self.clients_per_round == 0 or self.fraction_train == 1.0, "fraction-train",
              "be left at 1.0 when clients-per-round is given (one of them sets the sample)", self.fraction_train)
        check(0 <= self.federated_eval_every <= 1_000_000, "federated-eval-every",
              "be in [0, 1000000] (rounds between federated evaluations; 0: none)", self.federated_eval_every)
        check(0 <= self.central_eval_every <= 1_000_000, "central-eval-every",
              "be in [0, 1000000] (rounds between evaluations on the test set; 0: after the last round only)",
              self.central_eval_every)
        check(math.isfinite(self.fairness) and self.fairness >= 1, "fairness",
              "be a finite number >= 1 (every client's participation stays >= fair share / fairness)", self.fairness)
        check(self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:[0-9]{1,3})?", self.device) is not None, "device",
              "be auto, cpu or cuda[:N]", self.device)


CODEC_PARAMS = {
    "dense": {"dtype": "codec_dtype"},
    "topk": {"ratio": "topk_ratio", "value_dtype": "topk_value_dtype", "error_feedback": "error_feedback"},
    "qsgd": {"bits": "qsgd_bits", "chunk": "qsgd_chunk"},
    "sign": {"error_feedback": "error_feedback"},
}


def _codec_error(codec: str, message: str) -> str:
    """A codec's "<codec> <param> must ..." message, naming the config key instead (``qsgd-bits must ...``)."""
    for param, attr in CODEC_PARAMS[codec].items():
        lead = f"{codec} {param} must "
        if message.startswith(lead):
            return f"{attr.replace('_', '-')} must {message[len(lead):]}"
    return f"codec settings must be valid (codec {codec!r}): {message}"


AGGREGATOR_PARAMS = {
    "mean": {}, "norm-bounded-mean": {"clip": "clip_norm"}, "median": {}, "trimmed-mean": {"beta": "trim_beta"},
    "krum": {"f": "krum_f"}, "multi-krum": {"f": "krum_f", "m": "krum_m"},
}


_CODEC_AND_RULE_FIELDS = frozenset(a for p in (*CODEC_PARAMS.values(), *AGGREGATOR_PARAMS.values()) for a in p.values())


@dataclasses.dataclass(frozen=True)
class AggregationSettings:
    """How updates travel (codec) and are combined (aggregation rule)."""

    codec: str = "dense"
    codec_dtype: str = "float32"
    topk_ratio: float = 0.01
    topk_value_dtype: str = "float16"
    qsgd_bits: int = 8
    qsgd_chunk: int = 1024
    error_feedback: bool = True
    aggregator: str = "mean"
    clip_norm: float = 10.0
    trim_beta: float = 0.2
    krum_f: int = 1
    krum_m: int = 1
    slow_link_mbps: float = 0.0
    slow_link_codec: str = "topk"

    def __post_init__(self) -> None:
        check(self.codec in CODEC_PARAMS, "codec", f"be one of {sorted(CODEC_PARAMS)}", self.codec)
        check(self.slow_link_codec in CODEC_PARAMS, "slow-link-codec", f"be one of {sorted(CODEC_PARAMS)}",
              self.slow_link_codec)
        check(math.isfinite(self.slow_link_mbps) and self.slow_link_mbps >= 0, "slow-link-mbps",
              "be >= 0 Mbit/s (0: every node uses codec)", self.slow_link_mbps)
        check(self.aggregator in AGGREGATOR_PARAMS, "aggregator", f"be one of {sorted(AGGREGATOR_PARAMS)}", self.aggregator)
        # Every codec's settings are checked, not only those of the codecs in use: a wrong value
        # (qsgd-bits = 3 beside codec = "dense") is a mistake to report, not a setting to ignore.
        for name in sorted(CODEC_PARAMS):
            try:
                self.make_codec(name)
            except AggregationError as exc:
                raise ConfigError(_codec_error(name, str(exc))) from None
        # The rules' own parameters, likewise for every rule (the aggregators check them again, and
        # those that depend on the number of clients, when a round creates them).
        check(math.isfinite(self.clip_norm) and self.clip_norm > 0, "clip-norm", "be finite and > 0", self.clip_norm)
        check(0 <= self.trim_beta < 0.5, "trim-beta", "be in [0, 0.5)", self.trim_beta)
        check(self.krum_f >= 0, "krum-f", "be >= 0", self.krum_f)
        check(self.krum_m >= 1, "krum-m", "be >= 1", self.krum_m)

    def unused_keys(self) -> set[str]:
        """The settings of the codecs and rules this configuration does not use (range-checked, never read): a resume
        does not compare them."""
        codecs = {self.codec, *([self.slow_link_codec] if self.slow_link_mbps > 0 else [])}
        used = {a for c in codecs for a in CODEC_PARAMS[c].values()} | set(AGGREGATOR_PARAMS[self.aggregator].values())
        out = {a.replace("_", "-") for a in _CODEC_AND_RULE_FIELDS - used}
        return out | ({"slow-link-codec"} if self.slow_link_mbps == 0 else set())

    def codec_params(self, name: str | None = None) -> dict[str, Any]:
        return {k: getattr(self, attr) for k, attr in CODEC_PARAMS[name or self.codec].items()}

    def make_codec(self, name: str | None = None) -> Codec:
        """``codec`` (or the named one, e.g. ``slow-link-codec``) with its parameters from these settings."""
        return create_codec(name or self.codec, **self.codec_params(name))

    def aggregator_params(self) -> dict[str, Any]:
        return {k: getattr(self, attr) for k, attr in AGGREGATOR_PARAMS[self.aggregator].items()}

    def min_updates(self) -> int:
        """The fewest updates the aggregator can combine (Krum's 2f + 3, Multi-Krum's also m + f), or, for the
        trimmed mean, trim anything from (``trimmed_mean_min_updates``: 5 at trim-beta 0.2); else 1."""
        if self.aggregator in ("krum", "multi-krum"):
            return krum_min_updates(**self.aggregator_params())
        if self.aggregator == "trimmed-mean":
            return trimmed_mean_min_updates(self.trim_beta)
        return 1

    def make_aggregator(self, numel: int, device: Any, max_clients: int) -> Any:
        """An aggregator with room for ``max_clients`` updates, and never less than it needs to combine any
        (a round that reached fewer nodes then keeps the model, with too_few_updates, instead of failing)."""
        return create_aggregator(self.aggregator, numel, device, max(max_clients, self.min_updates()),
                                 **self.aggregator_params())


WORKFLOWS = ("sync", "fedbuff")


@dataclasses.dataclass(frozen=True)
class AsyncSettings:
    """Which round logic runs: synchronous rounds, or buffered asynchronous aggregation (FedBuff)."""

    workflow: str = "sync"
    concurrency: int = 10
    buffer_size: int = 5
    max_staleness: int = 20
    staleness: str = "polynomial"
    staleness_a: float = 0.5

    def __post_init__(self) -> None:
        check(self.workflow in WORKFLOWS, "workflow", f"be one of {list(WORKFLOWS)}", self.workflow)
        check(self.concurrency >= 1, "concurrency", "be >= 1", self.concurrency)
        check(self.buffer_size >= 1, "buffer-size", "be >= 1", self.buffer_size)
        check(self.max_staleness >= 0, "max-staleness", "be >= 0", self.max_staleness)
        check(self.staleness in ("constant", "polynomial"), "staleness", "be constant or polynomial", self.staleness)
        check(self.staleness_a >= 0, "staleness-a", "be >= 0", self.staleness_a)

    def workflow_kwargs(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "buffer_size": self.buffer_size, "max_staleness": self.max_staleness,
                "staleness": self.staleness,
                "staleness_params": {"a": self.staleness_a} if self.staleness == "polynomial" else {}}


DP_MODES = ("none", "central", "local", "distributed")
MAX_DP_CLIP = 1e9  # with z <= 1e6 the noise's std stays far inside float32
COUNT_BUDGET_SHARE = 0.1  # clip-count-noise = 0 (auto): the noised count takes this share of a round's budget


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)  # as TOML writes it


# The dp modes each setting is read under, and the settings only adaptive clipping reads: the others
# must leave them at their defaults. IGNORABLE_KEYS: every setting some configuration does not read
# (a resume does not compare them where the current one does not read them).
_DP_KEY_MODES = {"dp_clip": ("central", "distributed"), "dp_noise_multiplier": ("central", "distributed"),
                 "dp_delta": ("central", "distributed", "local"), "accountant": ("central", "distributed", "local"),
                 "dp_secure_noise": ("central",), "dp_expected_clients": ("central",), "local_noise_multiplier": ("local",),
                 "local_max_grad_norm": ("local",)}
MAX_EXPECTED_CLIENTS = 10**9
_ADAPTIVE_FIELDS = ("clip_target_quantile", "clip_learning_rate", "clip_count_noise")
IGNORABLE_KEYS = frozenset(name.replace("_", "-") for name in (*_DP_KEY_MODES, *_ADAPTIVE_FIELDS, *_CODEC_AND_RULE_FIELDS,
                                                                 "slow_link_codec"))


@dataclasses.dataclass(frozen=True)
class PrivacySettings:
    """Differential privacy: central (the coordinator clips and noises the sum) or local (DP-SGD)."""

    dp: str = "none"
    dp_clip: float = 1.0
    dp_noise_multiplier: float = 0.0
    target_epsilon: float = 0.0
    dp_delta: float = 1e-5
    accountant: str = "pld"  # "pld" (privacy loss distributions, the tightest) or "rdp"
    dp_secure_noise: bool = False
    adaptive_clipping: bool = False
    clip_target_quantile: float = 0.5
    clip_learning_rate: float = 0.2
    clip_count_noise: float = 0.0  # 0: auto, see count_noise_std()
    # The public number a central-DP round's noised sum is divided by; 0: fraction-train x the population
    # (num-supernodes under simulate, the enrolled keys under coordinator start). Never the drawn count.
    dp_expected_clients: int = 0
    local_noise_multiplier: float = 1.0
    local_max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        check(self.dp in DP_MODES, "dp", f"be one of {list(DP_MODES)}", self.dp)
        check(0 < self.dp_clip <= MAX_DP_CLIP, "dp-clip", f"be in (0, {MAX_DP_CLIP:g}] (it bounds each client's "
              "influence; the noise's std z x dp-clip must stay a float32)", self.dp_clip)
        check(self.dp_noise_multiplier == 0 or MIN_NOISE_MULTIPLIER <= self.dp_noise_multiplier <= MAX_NOISE_MULTIPLIER,
              "dp-noise-multiplier", f"be 0 (calibrate from target-epsilon) or in [{MIN_NOISE_MULTIPLIER:g}, "
              f"{MAX_NOISE_MULTIPLIER:g}] (below, epsilon is infinite; above, the accountant overflows)",
              self.dp_noise_multiplier)
        check(self.target_epsilon >= 0, "target-epsilon", "be >= 0 (0: no budget)", self.target_epsilon)
        check(0 <= self.dp_expected_clients <= MAX_EXPECTED_CLIENTS, "dp-expected-clients", "be in "
              f"[0, {MAX_EXPECTED_CLIENTS}] (0: fraction-train x the number of clients of the run)", self.dp_expected_clients)
        check(0 < self.dp_delta < 1, "dp-delta", "be in (0, 1)", self.dp_delta)
        from privacy import available_accountants

        check(self.accountant in available_accountants(), "accountant", f"be one of {list(available_accountants())} "
              "(pld: privacy loss distributions, the tightest epsilon; rdp: Renyi DP)", self.accountant)
        check(self.target_epsilon == 0 or self.dp in ("central", "distributed"), "target-epsilon",
              "be 0 unless dp is 'central' or 'distributed' (only the coordinator's noise is accounted and its budget "
              f"enforced; under dp = {self.dp!r} it would be ignored)", self.target_epsilon)
        if self.dp in ("central", "distributed"):
            check(self.dp_noise_multiplier > 0 or self.target_epsilon > 0, "dp-noise-multiplier",
                  f"be > 0, or target-epsilon be set to calibrate it, under {self.dp} DP (no noise: no privacy)",
                  self.dp_noise_multiplier)
        if self.dp == "distributed":
            check(not self.adaptive_clipping, "adaptive-clipping", "be false under distributed DP (the coordinator "
                  "never sees an update's norm)", self.adaptive_clipping)
        if self.adaptive_clipping:
            check(self.dp == "central", "adaptive-clipping", "be false unless dp = 'central' (it adapts the "
                  "coordinator's dp-clip; under other dp modes it would be ignored)", self.adaptive_clipping)
        check(0 < self.clip_target_quantile < 1, "clip-target-quantile", "be in (0, 1)", self.clip_target_quantile)
        check(0 < self.clip_learning_rate <= 10, "clip-learning-rate", "be in (0, 10] (the clip moves by up to "
              "exp(+-lr/2) a round; more drives it to 0 or infinity)", self.clip_learning_rate)
        check(0 <= self.clip_count_noise <= MAX_NOISE_MULTIPLIER, "clip-count-noise",
              f"be in [0, {MAX_NOISE_MULTIPLIER:g}] (0: auto, sqrt(10)/2 x the noise multiplier)", self.clip_count_noise)
        if self.adaptive_clipping and self.dp_noise_multiplier > 0:
            self.check_count_noise(self.dp_noise_multiplier, f"dp-noise-multiplier/2 = {self.dp_noise_multiplier / 2:g}")
        check(MIN_LOCAL_NOISE_MULTIPLIER <= self.local_noise_multiplier <= MAX_NOISE_MULTIPLIER, "local-noise-multiplier",
              f"be in [{MIN_LOCAL_NOISE_MULTIPLIER:g}, {MAX_NOISE_MULTIPLIER:g}] (below, no privacy is left to account; past that the "
              "accountant overflows)",
              self.local_noise_multiplier)
        check(self.local_max_grad_norm > 0, "local-max-grad-norm", "be > 0", self.local_max_grad_norm)
        # A setting that the chosen dp mode does not use must keep its default: set, it would be ignored
        # (a noise multiplier under dp = "none" ran with no noise at all, silently).
        default = PrivacySettings.__dataclass_fields__
        for name, unless in self._ignored_fields():
            value = getattr(self, name)
            if value != default[name].default:
                raise ConfigError(f"{name.replace('_', '-')} must be left at {_shown(default[name].default)} unless "
                                  f"{unless} (it would be ignored). Found {_shown(value)}.")

    def _ignored_fields(self) -> list[tuple[str, str]]:
        """(field, what would make it read) for each setting this configuration does not read."""
        out = [(name, f"dp is {' or '.join(repr(m) for m in modes)}, not {self.dp!r}")
               for name, modes in _DP_KEY_MODES.items() if self.dp not in modes]
        if not self.adaptive_clipping:
            out += [(name, "adaptive-clipping is true") for name in _ADAPTIVE_FIELDS]
        return out

    def ignored_keys(self) -> set[str]:
        """The settings this configuration does not read (they keep their defaults, see above)."""
        return {name.replace("_", "-") for name, _ in self._ignored_fields()}

    def count_noise_std(self, z: float) -> float:
        """The adaptive clip's count noise std (sigma_b, in counts) for the round noise multiplier ``z``.

        ``clip-count-noise`` when set; when 0 (unset), ``z / (2 sqrt(COUNT_BUDGET_SHARE))`` = sqrt(10)/2 z
        ~= 1.58 z: the noised count then takes 1/10 of each round's privacy budget and the update sum's
        noise multiplier grows from z to z / sqrt(0.9) ~= 1.054 z (Andrew et al. 2021, Thm 1:
        z_sum = (z^-2 - (2 sigma_b)^-2)^-1/2). The paper's sigma_b = m/20 for m clients a round needs
        m > 10 z to be valid at all; this default is valid for every m and z.
        """
        if self.clip_count_noise > 0:
            return self.clip_count_noise
        return z / (2.0 * math.sqrt(COUNT_BUDGET_SHARE))

    def check_count_noise(self, z: float, bound: str) -> None:
        """An explicit clip-count-noise must exceed z/2 (else the count alone spends the round's budget);
        ``bound`` says what z/2 is, in the user's keys."""
        if self.adaptive_clipping and self.clip_count_noise > 0:
            check(2 * self.clip_count_noise > z, "clip-count-noise",
                  f"be > {bound} (the noised count is paid from the same budget; 0 picks a valid value)",
                  self.clip_count_noise)

    def local_record(self) -> dict[str, Any]:
        return {"noise-multiplier": self.local_noise_multiplier, "max-grad-norm": self.local_max_grad_norm,
                "delta": self.dp_delta, "accountant": self.accountant}


SECURE_AGGREGATION = ("none", "secagg+")


@dataclasses.dataclass(frozen=True)
class SecureAggSettings:
    """SecAgg+ (privacy/secagg): the coordinator learns only the sum of the clients' updates.

    ``secagg-degree`` 0 picks the smallest even k (and t = k/2 + 1) for which, at
    ``secagg-dropout-rate``, every node keeps t surviving neighbours except with
    probability 2**-20; ``secagg-degree`` >= n - 1 is the complete graph.
    ``secagg-clip`` bounds every coordinate (values beyond it are clipped and
    counted); ``secagg-bits`` is the ring size (32, or 16 / 8 to send fewer bytes);
    ``secagg-sparse-ratio`` < 1 sends a shared random subset of coordinates with
    error feedback. ``secagg-pipeline`` sets the next round up during this one
    (its keys ride on this round's masked-input and unmask messages), so a round
    after the first takes two round trips instead of four.
    """

    secure_aggregation: str = "none"
    secagg_degree: int = 0
    secagg_threshold: int = 0
    secagg_dropout_rate: float = 0.1
    secagg_bits: int = 32
    secagg_clip: float = 1.0
    secagg_weighting: str = "num-examples"
    secagg_max_weight: int = 1000
    secagg_sparse_ratio: float = 1.0
    secagg_stage_timeout: float = 60.0
    secagg_pipeline: bool = True

    def __post_init__(self) -> None:
        check(self.secure_aggregation in SECURE_AGGREGATION, "secure-aggregation", f"be one of {list(SECURE_AGGREGATION)}",
              self.secure_aggregation)
        check(self.secagg_degree == 0 or self.secagg_degree >= 2, "secagg-degree",
              "be 0 (choose from secagg-dropout-rate) or an integer >= 2", self.secagg_degree)
        check(self.secagg_threshold == 0 or self.secagg_threshold >= 2, "secagg-threshold",
              "be 0 (k/2 + 1) or an integer >= 2", self.secagg_threshold)
        if self.secagg_degree and self.secagg_threshold:
            check(self.secagg_degree / 2 < self.secagg_threshold <= self.secagg_degree, "secagg-threshold",
                  f"satisfy k/2 < t <= k with k = secagg-degree = {self.secagg_degree} (t <= k/2 would let the "
                  "coordinator rebuild both secrets of one client)", self.secagg_threshold)
        check(0 <= self.secagg_dropout_rate < 0.5, "secagg-dropout-rate", "be in [0, 0.5)", self.secagg_dropout_rate)
        check(self.secagg_bits in (8, 16, 32), "secagg-bits", "be 8, 16 or 32", self.secagg_bits)
        check(math.isfinite(self.secagg_clip) and self.secagg_clip > 0, "secagg-clip", "be a finite number > 0",
              self.secagg_clip)
        check(self.secagg_weighting in ("num-examples", "uniform"), "secagg-weighting", "be num-examples or uniform",
              self.secagg_weighting)
        check(self.secagg_max_weight >= 1, "secagg-max-weight", "be >= 1 (examples; larger counts are capped)",
              self.secagg_max_weight)
        check(0 < self.secagg_sparse_ratio <= 1, "secagg-sparse-ratio", "be in (0, 1]", self.secagg_sparse_ratio)
        check(self.secagg_stage_timeout > 0, "secagg-stage-timeout", "be > 0 seconds", self.secagg_stage_timeout)

    @property
    def enabled(self) -> bool:
        return self.secure_aggregation != "none"

    def graph(self, n: int) -> tuple[int, int]:
        """(k, t) for ``n`` selected nodes."""
        from privacy.secagg import choose_degree

        if self.secagg_degree:
            k = min(self.secagg_degree, n - 1)
            k = k if k == n - 1 or k % 2 == 0 else k - 1
        else:
            k, _ = choose_degree(n, self.secagg_dropout_rate)
        t = self.secagg_threshold or k // 2 + 1
        if not k / 2 < t <= k:
            raise ConfigError(f"secagg-threshold must satisfy k/2 < t <= k; with {n} nodes k = {k}. Found t = {t}.")
        return k, t


def min_survivors(selected: int, dropout_rate: float) -> int:
    """The fewest survivors a distributed-DP round of ``selected`` nodes releases a sum with."""
    return max(1, math.ceil(selected * (1 - dropout_rate) - 1e-9))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs: server settings, the task, the clients' training."""

    server: ServerSettings = ServerSettings()
    task: TaskSpec = TaskSpec()
    train: TrainSettings = TrainSettings()
    aggregation: AggregationSettings = AggregationSettings()
    privacy: PrivacySettings = PrivacySettings()
    asynchrony: AsyncSettings = AsyncSettings()
    secure: SecureAggSettings = SecureAggSettings()

    def __post_init__(self) -> None:
        if self.asynchrony.workflow == "fedbuff":  # settings of synchronous rounds FedBuff would silently ignore
            srv = self.server
            for ok, key, rule, found in (
                (srv.fraction_train == 1.0, "fraction-train", "be 1.0 (FedBuff keeps concurrency nodes busy)",
                 srv.fraction_train),
                (srv.close_after_replies == 0, "close-after-replies", "be 0 (FedBuff releases every buffer-size replies)",
                 srv.close_after_replies),
                (srv.late_replies == "drop", "late-replies", "be 'drop' (FedBuff weighs every late reply by its "
                 "staleness)", srv.late_replies),
                (srv.work_deadline == 0, "work-deadline", "be 0 (every node runs local-epochs)", srv.work_deadline),
                (srv.selection == "uniform", "selection", "be 'uniform' (FedBuff gives work to idle nodes at random)",
                 srv.selection),
            ):
                check(ok, key, f"{rule} under workflow = 'fedbuff'", found)
        if self.server.clients_per_round:
            check(self.privacy.dp != "central" and self.asynchrony.workflow == "sync", "clients-per-round",
                  "be 0 under central DP (its secret Poisson sample is set by fraction-train) and FedBuff (by "
                  "concurrency)", self.server.clients_per_round)
        if self.server.federated_eval_every:
            check(self.asynchrony.workflow == "sync", "federated-eval-every", "be 0 under workflow = 'fedbuff' "
                  "(federated evaluation runs between synchronous rounds)", self.server.federated_eval_every)
            check(self.privacy.dp not in ("local", "distributed"), "federated-eval-every", "be 0 under local or "
                  "distributed DP (each client's evaluation reaches the coordinator un-noised, outside the guarantee "
                  "that protects the clients from it)", self.server.federated_eval_every)
        if self.aggregation.slow_link_mbps > 0:
            check(self.asynchrony.workflow == "sync", "slow-link-mbps", "be 0 under workflow = 'fedbuff' (per-link "
                  "codecs are for synchronous rounds)", self.aggregation.slow_link_mbps)
        check(self.privacy.dp != "local" or self.train.proximal_mu == 0, "proximal-mu", "be 0 under dp = 'local' "
              "(DP-SGD's loop has no proximal term: it would be ignored)", self.train.proximal_mu)
        if self.server.late_replies == "carry":
            check(self.privacy.dp not in ("central", "distributed") and not self.secure.enabled, "late-replies",
                  "be 'drop' under central or distributed DP and secure aggregation (a round's sum must hold only that "
                  "round's clients)", self.server.late_replies)
        if self.privacy.dp == "distributed":
            check(self.secure.enabled, "secure-aggregation", "be 'secagg+' under dp = 'distributed' (clients add "
                  "their share of the noise; secure aggregation hides everything but the noised sum)",
                  self.secure.secure_aggregation)
            check(self.secure.secagg_weighting == "uniform", "secagg-weighting", "be 'uniform' under distributed DP "
                  "(every client's influence is bounded by dp-clip)", self.secure.secagg_weighting)
        if self.secure.enabled:
            for ok, key, rule, found in (
                (self.aggregation.aggregator == "mean", "aggregator", "be 'mean'", self.aggregation.aggregator),
                (self.aggregation.codec == "dense", "codec", "be 'dense' (use secagg-bits / secagg-sparse-ratio to "
                 "compress)", self.aggregation.codec),
                (self.aggregation.slow_link_mbps == 0, "slow-link-mbps", "be 0 (masked sums need one encoding)",
                 self.aggregation.slow_link_mbps),
                (self.privacy.dp != "central", "dp", "not be 'central' (the coordinator cannot clip updates it cannot see)",
                 self.privacy.dp),
                (self.asynchrony.workflow == "sync", "workflow", "be 'sync'", self.asynchrony.workflow),
                # a SecAgg+ round's stages wait for their quorum, its nodes are not profiled: these would be ignored
                (self.server.selection == "uniform", "selection", "be 'uniform'", self.server.selection),
                (self.server.work_deadline == 0, "work-deadline", "be 0", self.server.work_deadline),
                (self.server.close_after_replies == 0, "close-after-replies", "be 0 (a stage waits for its own "
                 "quorum: secagg-stage-timeout)", self.server.close_after_replies),
            ):
                check(ok, key, f"{rule} under secure-aggregation = {self.secure.secure_aggregation!r}", found)
            # A round of min-nodes must be able to run: 3 nodes at least (the sum of two reveals each to the
            # other), and an explicit secagg-threshold within the degree such a round gets.
            check(self.server.min_nodes >= 3, "min-nodes", "be >= 3 under secure aggregation (with 2, the sum reveals "
                  "each client's update to the other)", self.server.min_nodes)
            try:
                self.secure.graph(self.server.min_nodes)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (a round of min-nodes = {self.server.min_nodes} nodes could never run: raise "
                                  "min-nodes or lower secagg-threshold)") from None
        agg = self.aggregation
        need = agg.min_updates()
        if need > 1:  # else every round would end with too few updates to combine (or, trimmed, a plain mean)
            params = AGGREGATOR_PARAMS[agg.aggregator]  # krum: f; multi-krum: f and m; trimmed-mean: beta
            why = (f"to give aggregator = {agg.aggregator!r} the {need} updates it needs with "
                   + " and ".join(f"{attr.replace('_', '-')} = {getattr(agg, attr)}" for attr in params.values())
                   + (" (with fewer, floor(trim-beta x n) = 0: it would trim nothing, a plain mean)"
                      if agg.aggregator == "trimmed-mean" else ""))
            if self.asynchrony.workflow == "sync":
                check(self.server.min_nodes >= need, "min-nodes", f"be >= {need} {why}", self.server.min_nodes)
                close = self.server.close_after_replies  # a round closed after fewer replies could never combine them
                check(close == 0 or close >= need, "close-after-replies", f"be 0 or >= {need} {why}", close)
            else:
                check(self.asynchrony.buffer_size >= need, "buffer-size", f"be >= {need} {why}",
                      self.asynchrony.buffer_size)
        if self.privacy.dp == "central":
            check(self.asynchrony.workflow == "sync", "workflow", "be 'sync' under central DP (which clients fill a FedBuff "
                  "release follows the dispatch schedule, and one client's presence changes it for the rest of the run: "
                  "a release's sum can then move by 2 x buffer-size x dp-clip, not the one clip norm the noise is sized "
                  "for; under FedBuff use dp = 'local', where each client noises its own update)", self.asynchrony.workflow)
            check(self.server.selection == "uniform", "selection", "be 'uniform' under central DP (rounds take a "
                  "secret Poisson sample, which is what the accounting assumes)", self.server.selection)
            check(self.server.close_after_replies == 0, "close-after-replies", "be 0 under central DP (a round closed "
                  "after a fixed number of replies lets one client's reply push another's out: the sum then moves by "
                  "2 dp-clip, twice what the accounting assumes)", self.server.close_after_replies)
            check(self.aggregation.aggregator == "mean", "aggregator",
                  "be 'mean' under central DP (each update is clipped to dp-clip and weighted 1)", self.aggregation.aggregator)
        z = self.privacy.dp_noise_multiplier
        if self.privacy.dp in ("central", "distributed") and z == 0:
            # Calibrated from target-epsilon: do it now (as the run will), so that an unreachable target or a
            # clip-count-noise too small for the calibrated multiplier is reported before anything starts.
            z = self.calibrated_noise_multiplier()
            self.privacy.check_count_noise(z, f"z/2 = {z / 2:.4g}, where z = {z:.4g} is the noise multiplier calibrated "
                                              f"for target-epsilon = {self.privacy.target_epsilon:g} over num-rounds = "
                                              f"{self.server.num_rounds}")
        elif self.privacy.dp in ("central", "distributed") and self.privacy.target_epsilon > 0:
            self.check_first_round_fits(z)
        if self.privacy.dp == "distributed":
            # The clipped, Skellam-noised sum of s survivors must not wrap around the ring: s (secagg-clip - C) >=
            # 8 z C per coordinate (8 standard deviations of the summed noise). No round selects fewer nodes than
            # min-nodes, and fewer survivors need more room, so this holds for every round.
            s = min_survivors(self.server.min_nodes, self.secure.secagg_dropout_rate)
            need = self.privacy.dp_clip * (1 + 8 * z / s)
            check(self.secure.secagg_clip >= need, "secagg-clip", f"be >= dp-clip * (1 + 8 z / s) = {need:.4g} so that "
                  f"the noised sum of s = {s} survivors (min-nodes = {self.server.min_nodes} less secagg-dropout-rate) "
                  "cannot wrap around the ring", self.secure.secagg_clip)

    def one_update_per_node(self) -> str:
        """Why a FedBuff release takes at most one update from each node ('' when a node may add several): the
        robust rules count updates as distinct clients (a fast node filling a release with its updates was the
        median of it). Such a release needs ``buffer-size`` distinct nodes."""
        return "" if self.aggregation.aggregator == "mean" else f"under the {self.aggregation.aggregator} rule"

    def release_short_of_nodes(self, nodes: int) -> str:
        """``one_update_per_node``'s reason when this run is FedBuff and ``nodes`` distinct nodes cannot fill a
        release of ``buffer-size`` (it would stall, then fail, once clients had trained), else ''."""
        why = self.one_update_per_node()
        return why if self.asynchrony.workflow == "fedbuff" and why and self.asynchrony.buffer_size > nodes else ""

    def dp_divisor(self, population: int | None) -> int:
        """The public count a synchronous central-DP round's noised sum is divided by: ``dp-expected-clients``,
        else the expected sample, ``fraction-train`` x ``population`` (the run's clients: fixed before it starts).
        Never the count of clients online or drawn, which one client's presence changes (the release would
        reveal it). ConfigError when neither is known."""
        if self.privacy.dp_expected_clients:
            return self.privacy.dp_expected_clients
        if not population:
            raise ConfigError("run.dp-expected-clients must be set under dp = 'central' when the run does not know its "
                              "clients in advance (the noised sum is divided by this public number, never by the count "
                              "online, which would reveal whether a client took part): set it to fraction-train x the "
                              "number of clients. Found 0.")
        return max(1, round(self.dp_sampling_rate() * population))

    @property
    def private_model(self) -> bool:
        """Whether clients train the task's model by DP-SGD (local DP), which may change it (Opacus's fix)."""
        return self.privacy.dp == "local"

    def dp_sampling_rate(self) -> float:
        """The sampling rate central / distributed DP is calibrated and accounted at: ``fraction-train``
        for synchronous central DP, whose rounds then take a secret Poisson sample (each node with
        that probability, from the OS's CSPRNG: ``SyncWorkflow.select``), the sample the subsampled
        Gaussian's accounting assumes (central DP is synchronous only); 1 (no amplification) under
        distributed DP (the coordinator, the party it protects against, picks the sample)."""
        if self.privacy.dp == "central":
            return self.server.fraction_train
        return 1.0

    def check_first_round_fits(self, z: float) -> None:
        """A given ``dp-noise-multiplier`` must let at least one round run within ``target-epsilon``
        (at ``dp_sampling_rate()``); otherwise the run would stop before round 1 with nothing learned."""
        from privacy import PrivacyEvent, epsilon_of

        p, q = self.privacy, self.dp_sampling_rate()
        first = epsilon_of([PrivacyEvent(sampling_rate=q, noise_multiplier=z)], p.dp_delta, p.accountant)
        check(first <= p.target_epsilon, "target-epsilon",
              f"be >= {first:.4g}, the epsilon one round spends with dp-noise-multiplier = {z:g} at sampling rate "
              f"{q:g} and dp-delta = {p.dp_delta:g} (else no round can run: raise it, raise the noise multiplier, or "
              "set it to 0 to calibrate it from target-epsilon)", p.target_epsilon)

    def calibrated_noise_multiplier(self) -> float:
        """The noise multiplier calibrated for ``target-epsilon`` over ``num-rounds`` at ``dp_sampling_rate()``
        (what the run's DP policy computes when ``dp-noise-multiplier = 0``); a ConfigError if unreachable."""
        from privacy import PrivacyError, calibrate_noise_multiplier
        from privacy.accountant import _Z_RANGE

        p, rounds, q = self.privacy, self.server.num_rounds, self.dp_sampling_rate()
        try:
            return calibrate_noise_multiplier(p.target_epsilon, p.dp_delta, q, rounds, accountant=p.accountant)
        except PrivacyError as exc:
            where = f"over num-rounds = {rounds} at sampling rate {q:g} with dp-delta = {p.dp_delta:g}"
            if "reachable" in str(exc):
                rule = (f"be reachable with a noise multiplier <= {_Z_RANGE[1]:g} {where} (raise it, or run fewer "
                        "rounds)")
            else:
                rule = (f"be small enough to need a noise multiplier >= {_Z_RANGE[0]:g} {where} (a looser target "
                        "protects no one)")
            raise ConfigError(f"target-epsilon must {rule}. Found {p.target_epsilon!r}.") from None

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], where: str = "run") -> "RunConfig":
        """Build from one flat kebab-case mapping; unknown keys are an error."""
        known = set().union(*(config_keys(c) for c in (ServerSettings, TaskSpec, TrainSettings, AggregationSettings, PrivacySettings,
                                         AsyncSettings, SecureAggSettings)))
        unknown = sorted(set(mapping) - known)
        if unknown:
            raise unknown_key(f"{where}.", unknown[0], known)
        server, task, train, agg, priv, asy, sec = split_mapping(mapping, ServerSettings, TaskSpec, TrainSettings,
                                                                 AggregationSettings, PrivacySettings, AsyncSettings,
                                                                 SecureAggSettings)
        parts = dict(
            server=build_config(ServerSettings, server, where),
            task=build_config(TaskSpec, task, where),
            train=build_config(TrainSettings, train, where),
            aggregation=build_config(AggregationSettings, agg, where),
            privacy=build_config(PrivacySettings, priv, where),
            asynchrony=build_config(AsyncSettings, asy, where),
            secure=build_config(SecureAggSettings, sec, where),
        )
        try:  # the rules that tie keys of several groups together name their key with the table, like the rest
            return cls(**parts)
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}" if where else str(exc)) from None

    def to_mapping(self) -> dict[str, Any]:
        return {**to_mapping(self.server), **to_mapping(self.task), **to_mapping(self.train), **to_mapping(self.aggregation),
                **to_mapping(self.privacy), **to_mapping(self.asynchrony), **to_mapping(self.secure)}

    def replace(self, **server_changes: Any) -> "RunConfig":
        return dataclasses.replace(self, server=dataclasses.replace(self.server, **server_changes))
