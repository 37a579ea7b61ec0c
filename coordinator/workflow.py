"""Synchronous federated rounds, written once against Flower's Grid and a Clock.

Nothing here knows where clients run: the service passes the SuperLink's Grid,
Flower's simulation passes its in-memory Grid, and fedshield's own engines pass
theirs (with a virtual clock).
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from logging import INFO, WARNING
from typing import Any, Protocol

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from aggregation import AggregationError, create_server_optimizer, get_device, tensor_to_array
from aggregation._errors import shown
from aggregation.codecs import create_codec
from aggregation.staleness import create_staleness
from clients import ClientError
from clients.protocol import (ARRAYS, CLIENT_TIME, CODEC, CONFIG, LOCAL_DP, MESSAGE_TYPE_TRAIN, METRICS, WEIGHTS, TrainInstruction,
                              message_nbytes, metric_values, update_nbytes)
from clients.tasks import Task, evaluated, get_task, load_task
from clients.tasks.layout import frozen_match

from ._errors import CoordinatorError
from privacy import BudgetExhausted, PrivacyError

from .config import IGNORABLE_KEYS, RunConfig
from .live import NO_LIVE, recorded
from .privacy_policy import CentralDp, DistributedDp
from .profiles import ProfileRegistry, ascending, select_fast_fair, select_uniform
from .progress import format_row, result_text
from .rundir import CONFIG as CONFIG_FILE
from .rundir import SUMMARY, RunDirectory, finite, weights_sha256
from .secure import SecureRound
from .validation import (
    LossMean,
    deadline_of,
    pull_bounded,
    RejectedReply,
    RoundExpectation,
    ValidReply,
    add_replies,
    pushed,
    staleness_factor,
    validate_reply,
)


_SECRET_RNG = random.SystemRandom()  # central DP's Poisson sampling: nothing a client knows predicts it


class Clock(Protocol):
    """Time as the round logic sees it (wall clock, or a simulation's virtual clock)."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class RunInterrupted(CoordinatorError):
    """The run was stopped from outside (Ctrl-C on a simulation whose ServerApp runs in a thread)."""


class StoppableClock(WallClock):
    """A wall clock whose waits end the run once ``stop`` is set. The round logic waits on the Grid
    only through ``sleep``, so a run in a thread stops within one poll interval, before it saves
    another round (Flower's simulation engine runs the ServerApp in a thread that Ctrl-C does not reach)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def sleep(self, seconds: float) -> None:
        if self.stop.wait(seconds):
            raise RunInterrupted("the run was interrupted; rounds not finished are not saved")


def _evaluated(row: dict[str, Any]) -> bool:
    """Whether a row holds a central evaluation: a finite accuracy, loss or task metric (nan in the rounds
    ``central-eval-every`` skips)."""
    values = [row.get("test_accuracy"), row.get("test_loss"), *(row.get("test_metrics") or {}).values()]
    return any(finite(v) for v in values)


def eval_fields(values: dict[str, float]) -> dict[str, Any]:
    """A task's evaluation (``metric_values`` of its ``evaluate``) as a row's fields: ``test_accuracy`` (nan where
    the task has none), ``test_loss`` and, where it gives more metrics, ``test_metrics`` (name -> number)."""
    extra = dict(values)
    fields = {"test_accuracy": extra.pop("accuracy", math.nan), "test_loss": extra.pop("loss", math.nan)}
    return {**fields, "test_metrics": extra} if extra else fields


def weights_digest(weights: torch.Tensor) -> str:
    """Short SHA-256 of the flat float32 weights (identifies a model version in logs; the checkpoint's in full)."""
    return weights_sha256(weights.detach().float())[:16]


RoundCallback = Callable[[dict[str, Any]], None]


# Settings a resumed run may change: how long to wait and where, not what is computed.
RESUMABLE_CHANGES = frozenset({"num-rounds", "run-dir", "device", "poll-interval", "round-timeout", "wait-nodes-timeout",
                               "secagg-stage-timeout", "secagg-pipeline", "min-nodes", "max-update-mb", "target-epsilon",
                               "dp-expected-clients"})  # (public, fixed before each round: from the enrolled keys)
FINGERPRINT_VERSION = 2


def run_fingerprint(cfg: RunConfig, numel: int, nodes: int | None = None, engine: str | None = None,
                    frozen: tuple[float, ...] = ()) -> dict[str, Any]:
    """What a run directory's checkpoint must agree with to be resumed: every setting but those in
    RESUMABLE_CHANGES, the model's size, (simulations) the node count and the engine (``engine_of``: a
    virtual run resumed in process mixed simulated and wall time in one history; the other way, the
    checkpoint's engine state could not be read). Resuming non-private rounds
    under DP would claim a guarantee for rounds that had none, another codec, learning rate or data
    split would make the run a mix of two experiments; ``target-epsilon`` counts only where it sets
    the noise (a budget that only stops the run may be raised to go on)."""
    # settings this configuration does not read are left out: a run started before they were refused
    # (a dp-clip under dp = "none") resumes once its config drops them, and another codec's or rule's settings
    # (range-checked, unused) may change
    out = {k: v for k, v in cfg.to_mapping().items()
           if k not in RESUMABLE_CHANGES | cfg.privacy.ignored_keys() | cfg.aggregation.unused_keys()}
    out["server-lr"] = cfg.server.effective_server_lr()  # (0, unset, is fedavg's 1.0, which checkpoints before it name)
    if cfg.asynchrony.workflow == "fedbuff":  # releases discounted by staleness (BufferedAsyncWorkflow._release) since
        out["fedbuff-release"] = "sum n s delta / sum n"  # this was recorded: an older run would mix two rules
    p = cfg.privacy
    if p.dp in ("central", "distributed") and p.dp_noise_multiplier == 0:  # calibrated from the budget
        out["target-epsilon"] = p.target_epsilon
    out.update({"numel": numel, "fingerprint-version": FINGERPRINT_VERSION})
    if frozen:  # the frozen entries the trained weights were paired with (Task.frozen_summary; compared with
        out["frozen-check"] = list(frozen)  # frozen_match's tolerance: another machine's build passes)
    if nodes is not None:
        out["nodes"] = nodes
    if engine is not None:
        out["engine"] = engine
    return out


NO_UPDATES = "no-updates"  # a run status: no round aggregated an update


def no_updates_reason(rejected: dict[str, int]) -> str:
    """Why a run learned nothing, in one line: the refusals by rule, or that no reply came."""
    why = (", ".join(f"{n} {rule}" for rule, n in sorted(rejected.items(), key=lambda kv: -kv[1])) if rejected
           else "no reply was refused, none was valid in time")
    return (f"no round aggregated an update: the model is the one the run started from (refused replies: {why}; "
            "see the log for each reason)")


def engine_of(grid: Any) -> str:
    """The engine a Grid belongs to, as a scenario's ``engine`` names it: fedshield's ``inprocess`` or ``virtual``,
    else ``flower`` (Flower's simulation engine, or a SuperLink's clients)."""
    return getattr(grid, "ENGINE", "flower")


def check_resumable(cfg: RunConfig, ckpt: dict[str, Any], run_dir: Any, nodes: int | None, engine: str) -> None:
    """Before a run starts (``fedshield simulate``, ``coordinator start``): CoordinatorError naming each setting in
    which ``run_dir``'s checkpoint differs from this run (as the workflow checks again when it resumes)."""
    task = get_task(cfg.task)
    check_fingerprint(ckpt, run_fingerprint(cfg, task.num_parameters(cfg.private_model), nodes, engine,
                                            task.frozen_summary(cfg.server.seed, cfg.private_model)), run_dir)


def check_fingerprint(ckpt: dict[str, Any], want: dict[str, Any], path: Any) -> None:
    """One CoordinatorError naming each setting that differs between the checkpoint and ``want``. A
    checkpoint of an earlier fedshield (no ``fingerprint-version``) recorded fewer settings: those it has
    must agree."""
    have = dict(ckpt["fingerprint"])
    if "accountant" in want and "dp" in have:  # a DP run from before the choice was kept with the RDP accountant
        have.setdefault("accountant", "rdp")
    keys = set(have) | set(want) if have.get("fingerprint-version") == FINGERPRINT_VERSION else set(have)
    for key in ("nodes", "engine"):  # a checkpoint from before it recorded its node count (Flower's engine), its engine
        if key not in have:
            keys.discard(key)
    keys -= {k for k in IGNORABLE_KEYS if k not in want}  # not read now: whatever the checkpoint says of them
    same = {k: have.get(k) == want.get(k) for k in keys}
    if "frozen-check" in keys:  # within float noise (another machine's build), as a client compares it
        same["frozen-check"] = frozen_match(tuple(have.get("frozen-check") or ()), tuple(want.get("frozen-check") or ()))
    diff = ", ".join(f"{k} = {shown(have.get(k, '(unset)'), 40)} there, {shown(want.get(k, '(unset)'), 40)} now"
                     for k in sorted(keys, key=str) if not same[k])
    if diff:
        hint = ""
        if not same.get("numel", True) and "frozen-check" in want and "frozen-check" not in have:
            hint = (" (this task's frozen parameters stay off the wire, and the checkpoint is from a fedshield that "
                    "sent them: set federate_frozen = True on the task to resume it)")
        raise CoordinatorError(f"run directory {path} must hold a checkpoint of this configuration to resume. "
                               f"Found {diff}{hint}; use another run-dir, or the settings it was run with.")


class SyncWorkflow:
    """Runs ``num-rounds`` synchronous rounds, resuming from the run directory's checkpoint.

    A Grid with ``state_dict`` / ``load_state_dict`` (fedshield's engines': the clients' error-feedback
    residuals, and the virtual engine's clock and simulated devices) is saved with every round and
    restored on resume, so that a resumed simulation goes on as the uninterrupted one would instead
    of starting its clock, devices and residuals again.
    """

    live: Any = NO_LIVE  # status.json and TensorBoard files, while ``run`` runs (coordinator.live)

    def __init__(
        self,
        cfg: RunConfig,
        grid: Grid,
        run_dir: RunDirectory,
        clock: Clock | None = None,
        on_round: RoundCallback | None = None,
        sim_nodes: int | None = None,
    ) -> None:
        self.cfg, self.grid, self.run_dir = cfg, grid, run_dir
        self.sim_nodes = sim_nodes  # a simulation on Flower's engine: its node count (the grid does not tell)
        self.clock = clock or WallClock()
        self.on_round = on_round
        self.device = get_device(cfg.server.device)
        self.task = load_task(cfg.task)
        # the global model: built as clients build it (local DP: as Opacus fixed it), seen through its layout
        self.layout = self.task.layout(cfg.private_model)
        self.model = self.task.build(cfg.private_model).to(self.device)
        if self.layout.local:  # what never travels (frozen parameters, kept entries): as a client's first round
            self.layout.load_local(self.model, {}, start=self.task.initial_local(cfg.server.seed, cfg.private_model))
        self.frozen = self.task.frozen_summary(cfg.server.seed, cfg.private_model)  # (sent, and fingerprinted)
        self._check_evaluate()
        self._eval_names: set[str] = set()  # what the task's evaluate has given here (eval_names)
        self.numel = self.layout.numel
        self.optimizer = create_server_optimizer(cfg.server.server_optimizer, **cfg.server.optimizer_params())
        # Federated buffers (running statistics) are averaged, not optimized: they take the plain mean delta whatever
        # the server optimizer; variances are kept at 0 or above (see ModelLayout.nonneg)
        self._buffers = self.layout.index(buffers=True).to(self.device)
        self._nonneg = self.layout.index(self.layout.nonneg).to(self.device)
        if cfg.train.proximal_mu > 0 and type(self.task).train is not Task.train:
            log(WARNING, "[fedshield] %s brings its own train: proximal-mu = %g reaches it as settings.proximal_mu, and "
                "only its loop can apply it (the global weights are the model's at the start of train; docs/tasks.md)",
                type(self.task).__name__, cfg.train.proximal_mu)
        a = cfg.aggregation
        # (top-k always sends them, beside its k: see _make_codec)
        lossy = [c for c in (a.codec, a.slow_link_codec if a.slow_link_mbps > 0 else "dense") if c not in ("dense", "topk")]
        if self._buffers.numel() and lossy:
            log(WARNING, "[fedshield] %s federates %d buffer values (running statistics) and codec %r compresses them "
                "like any delta: the global statistics drift from the clients' mean (a variance the sum takes below 0 "
                "keeps its value); keep them on the clients with federate_buffers = False (FedBN), or use topk, "
                "which always sends them", type(self.task).__name__, self._buffers.numel(), lossy[0])
        self.codec, self.codec_header, self.max_update_bytes = self._codec_plan(self._make_codec(cfg.aggregation.codec))
        # slow-link-mbps: nodes reporting a slower uplink are asked for slow-link-codec instead
        self.slow_link = (self._codec_plan(self._make_codec(cfg.aggregation.slow_link_codec))
                          if cfg.aggregation.slow_link_mbps > 0 else None)
        self._slow_nodes: set[int] = set()
        dp_args = (cfg.privacy, cfg.dp_sampling_rate(), cfg.server.num_rounds)
        self.poisson = cfg.dp_sampling_rate() < 1.0  # secret Poisson sampling (see select)
        self._online, self._rate = 0, 1.0
        self.dp = (CentralDp(*dp_args) if cfg.privacy.dp == "central"
                   else DistributedDp(*dp_args, cfg.secure.secagg_dropout_rate) if cfg.privacy.dp == "distributed"
                   else None)
        # A synchronous central-DP round divides its noised sum by this public count (RunConfig.dp_divisor)
        self.dp_divisor = (cfg.dp_divisor(self._population())
                           if cfg.privacy.dp == "central" else 0)
        self.status = "completed"
        self.weights = self.task.init_weights(cfg.server.seed, cfg.private_model).to(self.device)
        self.round, self.version = 0, 0
        self.history: list[dict[str, Any]] = []
        self.rejections: Counter[str] = Counter()
        self.profiles = ProfileRegistry()
        self.secure = SecureRound(self) if cfg.secure.enabled else None
        # late-replies = "carry": messages a round closed without, still awaited (id -> that round's expectation).
        # In flight only: a resumed run does not wait for them.
        self._late: dict[str, RoundExpectation] = {}
        self._epochs: dict[int, int] = {}  # local epochs each node was last asked for
        if getattr(self, "staleness_fn", None) is None:  # a subclass given its own (FedBuff's argument) keeps it
            self.staleness_fn = create_staleness(cfg.asynchrony.staleness,
                                                 **cfg.asynchrony.workflow_kwargs()["staleness_params"])
        # Any clock but a wall clock is a simulation's: only then do rows carry sim_time_s (and the run
        # directory's plots say "simulated").
        self.simulated = not isinstance(self.clock, WallClock)
        self.wall_start = time.monotonic()
        self.wall_before = 0.0  # wall seconds earlier sessions of this run spent (set on resume)
        self.resumed_extra: dict[str, Any] = {}  # a subclass's ``_extra_state`` from the checkpoint resumed
        self._resume()

    def _make_codec(self, name: str) -> Any:
        """The codec ``name`` with its settings; top-k with the model's federated buffers (running statistics) always
        sent beside its k: values to average, which a sparsified, delayed delta distorted (a BatchNorm CNN's
        statistics went to 0 and below under topk)."""
        ranges = self.layout.buffer_ranges() if name == "topk" else []
        return create_codec(name, **self.cfg.aggregation.codec_params(name), **({"exact": ranges} if ranges else {}))

    def _codec_plan(self, codec: Any) -> tuple[Any, dict[str, Any], int]:
        """A codec, the header its replies must carry for this model, and the largest honest reply's size."""
        enc, _ = codec.encode(torch.zeros(self.numel))
        return codec, dict(enc.header), min(int(self.cfg.server.max_update_mb * 2**20), enc.nbytes + 1024)

    def _is_slow_link(self, node: int) -> bool:
        link = self.profiles.link_mbps(node)
        return self.slow_link is not None and link is not None and link < self.cfg.aggregation.slow_link_mbps

    # -- state -------------------------------------------------------------
    def _population(self) -> int | None:
        """A simulation's node count (fedshield's engines hold their nodes' contexts; on Flower's, ``sim_nodes``);
        None for a deployment, whose clients are not known in advance."""
        return len(self.grid.contexts) if isinstance(getattr(self.grid, "contexts", None), dict) else self.sim_nodes

    def fingerprint(self) -> dict[str, Any]:
        """What a run directory's checkpoint must agree with to be resumed: see :func:`run_fingerprint`."""
        return run_fingerprint(self.cfg, self.numel, self._population(), engine_of(self.grid), self.frozen)

    def instruction(self, rnd: int, train: Any = None) -> TrainInstruction:
        """A train or evaluate message's instruction for round (or sequence number) ``rnd``: the run's seed, task
        and ``train`` settings (default the run's) and the summary of its frozen entries (``Task.frozen_summary``)."""
        return TrainInstruction(round=rnd, version=self.version, seed=self.cfg.server.seed, task=self.cfg.task,
                                train=self.cfg.train if train is None else train, frozen=self.frozen)

    def _resume(self) -> None:
        ckpt = self.run_dir.load_checkpoint()
        if ckpt is None:
            return
        check_fingerprint(ckpt, self.fingerprint(), self.run_dir.path)
        if self.dp is not None and not (isinstance(ckpt.get("privacy"), dict) and ckpt["privacy"]):
            raise CoordinatorError(f"run directory {self.run_dir.path}: the checkpoint of this DP run must hold its "
                                   "privacy accounting ('privacy'); without it the spent budget would start again "
                                   "at zero. Use another run-dir.")
        self.round, self.version = int(ckpt["round"]), int(ckpt["version"])
        self.weights = ckpt["weights"].to(self.device)
        try:
            self.optimizer.load_state_dict(ckpt["optimizer"], numel=self.numel)
        except AggregationError as exc:
            raise CoordinatorError(f"run directory {self.run_dir.path}: the checkpoint's server optimizer state must fit "
                                   f"this run. Found: {exc}; use another run-dir.") from None
        self.history = list(ckpt["history"])
        self.rejections = Counter(ckpt["rejections"])
        if self.dp is not None:
            try:
                self.dp.load_state_dict(ckpt["privacy"])  # the spent budget carries over
            except (KeyError, TypeError, ValueError, AttributeError, PrivacyError) as exc:
                raise CoordinatorError(f"run directory {self.run_dir.path}: the checkpoint's privacy accounting must "
                                       f"be readable. Found it is not ({type(exc).__name__}: {shown(str(exc), 60)}); "
                                       "use another run-dir.") from None
            spent = [row["epsilon"] for row in self.history if row.get("epsilon") is not None]
            # an accountant with events taken out would under-state the budget spent from here on (1e-6: the PLD
            # composed round by round and the resumed one composed at once differ in rounding, ~1e-9)
            if spent and not math.isclose(spent[-1], self.dp.epsilon, rel_tol=1e-6, abs_tol=1e-12):
                raise CoordinatorError(f"run directory {self.run_dir.path}: the checkpoint's privacy accounting must "
                                       f"give the epsilon its last round recorded ({spent[-1]:.6g}). Found "
                                       f"{self.dp.epsilon:.6g}; use another run-dir.")
        if ckpt.get("profiles"):
            self.profiles.load_state_dict(ckpt["profiles"])
        if ckpt.get("engine") and hasattr(self.grid, "load_state_dict"):
            try:
                self.grid.load_state_dict(ckpt["engine"])
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CoordinatorError(f"run directory {self.run_dir.path}: the checkpoint's engine state must be this "
                                       f"engine's. Found it unreadable ({type(exc).__name__}: "
                                       f"{shown(str(exc), 60)}); use another run-dir.") from None
        self.wall_before = self._spent("wall_time_s")
        self.resumed_extra = dict(ckpt.get("extra") or {})
        log(INFO, "[fedshield] resuming from %s at round %d (version %d, model sha256 %s)",
            self.run_dir.path, self.round + 1, self.version, weights_digest(self.weights))

    def _extra_state(self) -> dict[str, Any]:
        """A subclass's own state to checkpoint (read back as ``self.resumed_extra``)."""
        return {}

    def _checkpoint(self) -> None:
        self.run_dir.save_checkpoint({
            "round": self.round, "version": self.version, "weights": self.weights.cpu(),
            "optimizer": self.optimizer.state_dict(), "history": self.history,
            "rejections": dict(self.rejections), "fingerprint": self.fingerprint(),
            "privacy": self.dp.state_dict() if self.dp is not None else {},
            "profiles": self.profiles.state_dict(),
            "engine": self.grid.state_dict() if hasattr(self.grid, "state_dict") else {},
            "extra": self._extra_state(),
        })
        self.run_dir.write_metrics(self.history)

    # -- rounds ------------------------------------------------------------
    def _step(self, rnd: int, delta: torch.Tensor, row: dict[str, Any]) -> bool:
        """Apply the round's aggregate with the server optimizer, and advance the model's version, unless it holds
        a non-finite value: then the model is kept and the row says so (``non_finite_aggregate``). Every update is
        checked before it is added, so this is a last guard (a weighted sum past float32's range, say): a
        non-finite model would be checkpointed, sent to every client, and refused on resume."""
        if not bool(torch.isfinite(delta).all()):
            row["non_finite_aggregate"] = True
            log(WARNING, "[fedshield] round %d: the aggregate holds a non-finite value; the global model is unchanged",
                rnd)
            return False
        variances = self.weights[self._nonneg] if self._nonneg.numel() else None
        stats = self.weights[self._buffers] + delta[self._buffers] if self._buffers.numel() else None
        self.weights = self.optimizer.step(self.weights, delta)
        if stats is not None:
            self.weights[self._buffers] = stats
        if variances is not None:  # one the sum took below 0 keeps its value (at 0 its layer would scale by 1/sqrt(eps))
            now = self.weights[self._nonneg]
            self.weights[self._nonneg] = torch.where(now >= 0, now, variances)
        self.version += 1
        return True

    def _wait_for_nodes(self) -> list[int]:
        s = self.cfg.server
        deadline = self.clock.now() + s.wait_nodes_timeout
        while True:
            nodes = ascending(self.grid.get_node_ids())
            self.live.waiting(len(nodes), s.min_nodes, self.round + 1)  # status.json: written when either changes
            if len(nodes) >= s.min_nodes:
                return nodes
            if self.clock.now() >= deadline:
                hint = getattr(self.grid, "too_few_online_hint", None)  # the virtual engine's: nodes come and go
                raise CoordinatorError(
                    f"min-nodes={s.min_nodes} nodes must be online within wait-nodes-timeout={s.wait_nodes_timeout} s. "
                    f"Found {len(nodes)}." + (f" {hint()}" if hint is not None else "")
                )
            self.clock.sleep(min(1.0, s.wait_nodes_timeout))

    def select(self, nodes: list[int], rnd: int) -> list[int]:
        """``fraction-train`` of the online nodes (at least ``min-nodes``), by the ``selection`` policy.

        ``uniform``: a seeded random sample. ``fast-fair``: fast nodes first, with
        priority for any node below its fair share / ``fairness`` (see
        :func:`coordinator.profiles.select_fast_fair`). Under central DP with ``fraction-train`` < 1:
        secret Poisson sampling instead (each node independently, from the OS), the sample the
        subsampled Gaussian's accounting (q = ``fraction-train``) assumes; its size varies, and may
        be below ``min-nodes`` or 0 (the release is then noise only).
        """
        s = self.cfg.server
        if self.poisson:  # central DP: each node in with probability fraction-train, from the OS's CSPRNG
            return sorted(n for n in nodes if _SECRET_RNG.random() < s.fraction_train)
        k = min(len(nodes), max(s.min_nodes, s.clients_per_round or math.ceil(s.fraction_train * len(nodes))))
        if s.selection == "fast-fair":
            return select_fast_fair(nodes, k, self.profiles, s.fairness, s.seed, rnd)
        return select_uniform(nodes, k, s.seed, rnd)

    def _send(self, rnd: int, selected: list[int]) -> tuple[dict[str, int], int]:
        array = tensor_to_array(self.weights)
        arrays = ArrayRecord({WEIGHTS: array})
        codecs = {False: ConfigRecord(self.codec.config())}
        if self.slow_link is not None:
            codecs[True] = ConfigRecord(self.slow_link[0].config())
        local_dp = ConfigRecord(self.cfg.privacy.local_record()) if self.cfg.privacy.dp == "local" else None
        records: dict[int, ConfigRecord] = {}  # one per distinct amount of local work
        contents: dict[tuple[int, bool], RecordDict] = {}  # one per distinct (work, link): nothing writes to them

        def content(node: int) -> RecordDict:
            # work-deadline: a node measured as slow gets fewer local epochs, so it finishes in time
            epochs = self.profiles.local_epochs(node, self.cfg.train.local_epochs, self.cfg.server.work_deadline)
            self._epochs[node] = epochs
            slow = self._is_slow_link(node)
            (self._slow_nodes.add if slow else self._slow_nodes.discard)(node)
            if (epochs, slow) not in contents:
                if epochs not in records:
                    train = dataclasses.replace(self.cfg.train, local_epochs=epochs)
                    records[epochs] = self.instruction(rnd, train).to_record()
                out = contents[epochs, slow] = RecordDict({ARRAYS: arrays, CONFIG: records[epochs],
                                                           CODEC: codecs[slow]})
                if local_dp is not None:
                    out[LOCAL_DP] = local_dp
            return contents[epochs, slow]
        s = self.cfg.server
        # A carried message stays useful for max-staleness more rounds.
        ttl = s.round_timeout * (1 + (self.cfg.asynchrony.max_staleness if s.late_replies == "carry" else 0)) + 60.0
        msgs = [Message(content(n), dst_node_id=n, message_type=MESSAGE_TYPE_TRAIN, group_id=str(rnd), ttl=ttl)
                for n in selected]

        ids = pushed(self.grid, msgs)
        if len(ids) != len(msgs):
            log(WARNING, "[fedshield] round %d: %d of %d messages were not accepted by the grid", rnd, len(msgs) - len(ids), len(msgs))
        sent = {mid: m.metadata.dst_node_id for mid, m in ids}
        return sent, len(array.data) * len(ids)

    def _prune_late(self) -> None:
        """Forget carried messages whose reply could no longer be used (staler than max-staleness)."""
        bound = self.cfg.asynchrony.max_staleness
        for mid in [m for m, e in self._late.items() if self.version - e.version > bound]:
            e = self._late.pop(mid)
            log(INFO, "[fedshield] node %d's reply to round %d would now be too stale; no longer waited for",
                e.sent[mid], e.round)

    def _collect(self, rnd: int, sent: dict[str, int], pushed_at: float) -> dict[str, Any]:
        """The round's replies to ``sent`` (pushed from ``pushed_at`` on), checked and added; the row's fields."""
        s = self.cfg.server
        sent_at = self.clock.now()
        exp = RoundExpectation(round=rnd, version=self.version, numel=self.numel, max_examples=s.max_examples,
                               max_bytes=self.max_update_bytes, max_norm=s.max_update_norm, codec=self.codec,
                               codec_header=self.codec_header, sent=sent, sent_at=sent_at)
        slow_exp = exp if self.slow_link is None else dataclasses.replace(  # shares sent and replied with exp
            exp, codec=self.slow_link[0], codec_header=self.slow_link[1], max_bytes=self.slow_link[2], replied=exp.replied)
        exp_for = {mid: slow_exp if node in self._slow_nodes else exp for mid, node in sent.items()}
        self._prune_late()
        slots = max(1, len(sent) + len(self._late))  # carried stragglers may join this round's sum
        acc = (self.dp.make_aggregator(self.numel, self.device, slots) if self.dp is not None
               else self.cfg.aggregation.make_aggregator(self.numel, self.device, slots))
        norms: list[float] = []
        local_eps: list[float] = []
        rejected: Counter[str] = Counter()
        loss, bytes_up, update_bytes, replies = LossMean(), 0, 0, 0
        weight_total = 0.0  # the weights added (examples, staleness-scaled): an edge aggregator's weight upward
        pending = dict.fromkeys(sent)  # ordered: in-process engines then add in send order
        deadline = deadline_of(self.grid, pushed_at, sent_at, s.round_timeout)
        late_in, stalenesses, closed_early = 0, [], False
        # Under a robust rule a node is one row: its carried late reply and its fresh one would be two (as FedBuff)
        one_each = self.cfg.aggregation.aggregator != "mean"
        claimed: set[int] = set()

        def reject(rej: RejectedReply) -> None:
            rejected[rej.rule] += 1
            log(WARNING, "[fedshield] round %d: rejected reply from node %d (%s): %s", rnd, rej.node_id, rej.rule, rej.detail)

        while pending:
            batch: list[tuple[Message, RoundExpectation | None, ValidReply, float, RoundExpectation]] = []
            for reply in pull_bounded(self.grid, list(pending) + list(self._late), self.clock, deadline):
                mid = reply.metadata.reply_to_message_id
                late_exp = self._late.get(mid)
                asked = (late_exp or exp_for.get(mid, exp)).sent.get(mid)
                if asked is None or reply.has_error() or reply.metadata.src_node_id == asked:
                    # the message is answered; a reply from another node (refused below) leaves it open for its own
                    if self._late.pop(mid, None) is None:
                        pending.pop(mid, None)
                replies += 1
                nbytes = message_nbytes(reply)
                bytes_up += nbytes  # what came up, refused or not
                update_bytes += update_nbytes(reply)
                try:
                    ok_exp = late_exp or exp_for.get(mid, exp)
                    ok = validate_reply(reply, ok_exp, check_norm=False, nbytes=nbytes)
                    # Under central DP every client weighs 1: its influence on the sum is then at most the clip norm.
                    weight = 1.0 if self.dp is not None else float(ok.num_examples)
                    if late_exp is not None:  # a straggler from an earlier round: weighted by its staleness
                        weight *= staleness_factor(self.staleness_fn, self.version - late_exp.version,
                                                   self.cfg.asynchrony.max_staleness, ok.node_id)
                except RejectedReply as rej:
                    reject(rej)
                    continue
                batch.append((reply, late_exp, ok, weight, ok_exp))
            # the norm rules, checked while adding: this pull's replies in one pass over the sum (under a robust rule,
            # a node's second reply in the pull waits for its first's outcome, and is refused if that was added)
            settled: list[tuple[tuple[Any, ...], Any]] = []
            while batch:
                now, later, seen = [], [], set()
                for item in batch:
                    node = item[2].node_id
                    if one_each and node in claimed:
                        reject(RejectedReply(node, "duplicate-contributor", "a node adds at most one update to a round "
                                             f"under aggregator = {self.cfg.aggregation.aggregator!r}; this round has one "
                                             "of it"))
                        continue
                    (later if one_each and node in seen else now).append(item)
                    seen.add(node)
                added = add_replies(acc, [(ok, weight, ok_exp) for _, _, ok, weight, ok_exp in now])
                claimed.update(ok.node_id for ok in added if not isinstance(ok, RejectedReply))
                settled += zip(now, added, strict=True)
                batch = later
            for (reply, late_exp, _, weight, _), ok in settled:
                if isinstance(ok, RejectedReply):
                    reject(ok)
                    continue
                weight_total += weight
                if late_exp is not None:
                    stalenesses.append(self.version - late_exp.version)
                    late_in += 1
                norms.append(ok.norm)
                took = self.clock.now() - (late_exp or exp).sent_at  # a carried reply: from its own round's send
                metrics = reply.content.metric_records[METRICS]
                self.profiles.update(ok.node_id, metrics, took)
                if late_exp is None:
                    self.profiles.observe_epochs(ok.node_id, took, self._epochs.get(ok.node_id, 1), metrics.get(CLIENT_TIME))
                self.profiles.participated(ok.node_id)
                if ok.local_epsilon is not None:
                    local_eps.append(ok.local_epsilon)
                loss.add(ok)
            if pending and s.close_after_replies and acc.count - late_in >= s.close_after_replies:  # its own replies
                closed_early = True
                log(INFO, "[fedshield] round %d: %d updates in; closing, %d late replies %s", rnd, acc.count, len(pending),
                    "carried into later rounds" if s.late_replies == "carry" else "dropped")
                break
            if pending and self.clock.now() >= deadline:
                log(WARNING, "[fedshield] round %d: deadline of %.1f s passed with %d replies missing", rnd, s.round_timeout, len(pending))
                break
            if pending:  # not past the deadline: a reply after it is late, not counted in this round
                self.clock.sleep(min(s.poll_interval, max(0.0, deadline - self.clock.now())))
        for mid in pending:  # no reply in time: the elapsed time is a lower bound on this node's round trip
            self.profiles.observe_time(sent[mid], self.clock.now() - sent_at)
            if not closed_early:  # it missed the deadline (a round closed early says nothing of the rest)
                self.profiles.observe_missed(sent[mid], self.clock.now() - sent_at, self._epochs.get(sent[mid], 1))
            if s.late_replies == "carry":
                self._late[mid] = exp_for[mid]
        extra: dict[str, Any] = {}
        need = self.cfg.aggregation.min_updates()  # (Krum's rules, the trimmed mean; as acc.min_updates or more)
        if self.dp is not None:  # noise is added even to an empty sum: the release is private either way
            extra["clip"] = self.dp.clip
            # divided by a public count fixed before the run, never the drawn or online one (which reveals who took part)
            self._step(rnd, self.dp.release(acc, self.dp_divisor, rnd), extra)
            self.dp.after_round(self._rate, norms, self.dp_divisor)
            extra["epsilon"] = self.dp.epsilon
            weight_total = float(self.dp_divisor)  # the noised sum was divided by this public count
        elif acc.count >= need:
            self._step(rnd, acc.result(), extra)
        elif acc.count:  # (Krum's rules, the trimmed mean: fewer updates than it needs, after rejections or dropouts)
            extra["too_few_updates"] = need
            log(WARNING, "[fedshield] round %d: %d valid update(s), fewer than the %d aggregator = %r needs; the "
                "global model is unchanged", rnd, acc.count, need, self.cfg.aggregation.aggregator)
        else:
            log(WARNING, "[fedshield] round %d: no valid update; the global model is unchanged", rnd)
        if local_eps:
            extra["local_epsilon_max"] = max(local_eps)
        if self.cfg.server.work_deadline > 0:
            extra["reduced_work"] = sum(1 for n in sent.values() if self._epochs[n] < self.cfg.train.local_epochs)
        if stalenesses:
            extra.update({"late_accepted": late_in, "mean_staleness": sum(stalenesses) / len(stalenesses)})
        return {**extra, "weight_total": weight_total, "replies": replies, "accepted": acc.count, "rejected": sum(rejected.values()), "late": len(pending),
                "rejected_by_rule": dict(rejected), "bytes_up": bytes_up, "update_bytes_up": update_bytes,
                "train_loss": loss.value}

    def run_round(self, rnd: int) -> dict[str, Any]:
        start = self.clock.now()
        nodes = self._wait_for_nodes()
        busy = {e.sent[m] for m, e in self._late.items()}  # still training for an earlier round
        idle = [n for n in nodes if n not in busy] if busy else nodes
        # Under secagg-pipeline the round's nodes were picked, and set up, during the previous round;
        # one gone offline since is a dropout the protocol recovers from.
        selected = self.secure.planned(rnd) if self.secure is not None else None
        if selected is None:
            selected = self.select(idle if len(idle) >= self.cfg.server.min_nodes else nodes, rnd)
        # q: fraction-train under secret Poisson sampling (central DP), else 1 (no amplification claimed)
        self._rate = self.cfg.dp_sampling_rate()
        self._online = len(nodes)
        if self.dp is not None:
            self.dp.check_budget(self._rate)  # before any update is asked for (a pipelined setup releases nothing)
        row: dict[str, Any] = {"round": rnd, "nodes_online": len(nodes), "selected": len(selected)}
        if self.secure is not None:
            pipeline = self.cfg.secure.secagg_pipeline and rnd < self.cfg.server.num_rounds
            update, secure_row = self.secure.run(rnd, selected, self.select(nodes, rnd + 1) if pipeline else None)
            row.update(secure_row)
            if update is not None:
                self._step(rnd, update, row)
            if isinstance(self.dp, DistributedDp) and self.secure.unmasked:
                # the coordinator saw the noised sum once it was unmasked, even if a check after that
                # failed the round: account for the noise it had
                self.dp.after_secure_round(self._rate, self.secure.unmasked, len(selected))
            if isinstance(self.dp, DistributedDp):
                row["epsilon"] = self.dp.epsilon
        else:
            pushed_at = self.clock.now()  # a remote grid's round-timeout counts from here
            sent, row["bytes_down"] = self._send(rnd, selected)
            row.update(self._collect(rnd, sent, pushed_at))
        row.update(self.evaluate_at(rnd))
        every = self.cfg.server.federated_eval_every
        if every and (rnd % every == 0 or rnd == self.cfg.server.num_rounds):
            from .evaluation import federated_evaluate

            row.update(federated_evaluate(self, rnd, selected if selected else nodes))
        row["version"] = self.version
        row["round_time_s"] = self.clock.now() - start
        row.update(self._run_times(row["round_time_s"]))
        return row

    def evaluate_at(self, rnd: int) -> dict[str, Any]:
        """``evaluate`` in the rounds ``central-eval-every`` asks for (and the last); nan accuracy and loss in the
        others."""
        every = self.cfg.server.central_eval_every
        if rnd >= self.cfg.server.num_rounds or (every and rnd % every == 0):
            return self.evaluate()
        return {"test_accuracy": float("nan"), "test_loss": float("nan")}

    def evaluate(self) -> dict[str, Any]:
        """The global model on the task's test data, as a row's fields: ``test_accuracy`` (nan if the task has
        none), ``test_loss`` and, where the task's ``evaluate`` gives more (a regression's rmse, a language
        model's perplexity), ``test_metrics``: those by name."""
        self.layout.load(self.model, self.weights)
        # as a client's reply sends them
        values = metric_values(evaluated(self.task, self.model, self.task.test_set, "the coordinator's test data"))
        self._eval_names.update(k for k, v in values.items() if not math.isnan(v))
        return eval_fields(values)

    def _check_evaluate(self) -> None:
        """The task's evaluate before round 1, on 8 test examples, then (where those fail: a metric that needs
        both classes, a sorted test set) on all of them: a task whose evaluate fails (a model whose output the
        default metrics cannot read) stops here in one line, not after the first round's training."""
        test = self.task.test_set
        try:
            evaluated(self.task, self.model, test.take(slice(0, 8)), "8 test examples")
        except ClientError:
            evaluated(self.task, self.model, test, "the coordinator's test data (before round 1)")

    @property
    def eval_names(self) -> frozenset[str]:
        """The metric names this run's task's ``evaluate`` has given on the coordinator (loss, accuracy where it has
        one, its others), over every central evaluation of this session (a metric may have no value on some
        weights); one is run first where none has been. Federated evaluation averages these and no other name a
        client sends (one client's made-up metric, or an accuracy for a regression, would be a run's figure)."""
        if not self._eval_names:
            self.evaluate()
        return frozenset(self._eval_names)

    def _last_federated_eval(self) -> dict[str, Any]:
        """The summary's federated evaluation: the last row that has one (none when the run had none)."""
        rows = [r for r in self.history if r.get("fed_eval_nodes")]
        if not rows:
            return {}
        return {"final_fed_eval_accuracy": rows[-1].get("fed_eval_accuracy"),
                "final_fed_eval_loss": rows[-1].get("fed_eval_loss"),
                "final_fed_eval_metrics": rows[-1].get("fed_eval_metrics", {}), "fed_eval_round": rows[-1]["round"]}

    def _spent(self, key: str) -> float:
        """The last row's ``key`` (``wall_time_s``, ``sim_time_s``): seconds the run had spent by then, 0 before
        its first row or when that row has no such time."""
        return float(self.history[-1].get(key) or 0.0) if self.history else 0.0

    def _wall_time(self) -> float:
        return self.wall_before + time.monotonic() - self.wall_start

    def _run_times(self, round_time_s: float) -> dict[str, float]:
        """A new row's times since the run began, earlier sessions included: ``wall_time_s``, this session's
        wall seconds plus those the checkpoint's last row had when it resumed, and on a simulation's clock
        ``sim_time_s``, the previous row's plus this round's. A wall clock's rows get no ``sim_time_s``: their
        plots are against wall time."""
        times = {"wall_time_s": self._wall_time()}
        if self.simulated:
            times["sim_time_s"] = self._spent("sim_time_s") + round_time_s
        return times

    def record(self, rnd: int, row: dict[str, Any]) -> None:
        """Round ``rnd`` done: its row in the history, its refusals counted, the checkpoint and the live state."""
        self.rejections.update(row["rejected_by_rule"])
        self.history.append(row)
        self.round = rnd
        self._checkpoint()
        self.live.round(row)

    @recorded
    def run(self) -> dict[str, Any]:
        """Run the remaining rounds; write the run directory; return the summary."""
        total = self.cfg.server.num_rounds
        self.run_dir.write_json(CONFIG_FILE, self.cfg.to_mapping())
        for rnd in range(self.round + 1, total + 1):
            try:
                row = self.run_round(rnd)
            except BudgetExhausted as exc:
                self.status = "budget-exhausted"
                log(WARNING, "[fedshield] stopping before round %d: %s", rnd, exc)
                break
            self.record(rnd, row)
            log(INFO, "[fedshield] %s", format_row(row, total))
            if self.on_round:
                self.on_round(row)
        return self.finish()

    def finish(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else {}
        if last and not _evaluated(last):
            # stopped between central-eval-every's rounds (its budget): the last row is evaluated, before the plots
            last.update(self.evaluate())
        # metrics.csv again: a run stopped between its last checkpoint and this file's write had nothing left
        # to train when resumed, and its last row stayed missing
        self.run_dir.write_metrics(self.history)
        self.layout.load(self.model, self.weights)
        self.run_dir.save_model({k: v.detach().cpu() for k, v in self.model.state_dict().items()})
        if self.history:
            self.run_dir.plot(self.history, f"{self.cfg.task.label}: {{metric}} and loss per round")
            self.run_dir.plot_accuracy_vs_time({self.run_dir.path.name: self.history}, f"{self.cfg.task.label}: {{metric}} over time")
            if self.cfg.privacy.dp != "none":
                self.run_dir.plot_epsilon(self.history, f"{self.cfg.task.label}: privacy spent ({self.cfg.privacy.dp} DP)")
        summary = {
            "status": self.status, "rounds": self.round, "version": self.version, "task": self.cfg.task.task,
            "final_test_accuracy": last.get("test_accuracy"), "final_test_loss": last.get("test_loss"),
            "final_test_metrics": last.get("test_metrics", {}),
            **self._last_federated_eval(),
            "total_bytes_down": sum(r["bytes_down"] for r in self.history),
            "total_bytes_up": sum(r["bytes_up"] for r in self.history),
            # a row from before update bytes were counted apart: its bytes_up (all it counted then was the updates)
            "total_update_bytes_up": sum(r.get("update_bytes_up", r["bytes_up"]) for r in self.history),
            "rejected_total": sum(self.rejections.values()), "rejected_by_rule": dict(self.rejections),
            "wall_time_s": self._wall_time(), "num_parameters": self.numel,
            "run_dir": str(self.run_dir.path),
            "rounds_without_updates": sum(1 for r in self.history if r.get("accepted", 1) == 0 or r.get("too_few_updates")
                                          or r.get("non_finite_aggregate")),
        }
        asked = any(r.get("selected", 1) for r in self.history)  # (an empty secret Poisson sample asks no one)
        if self.history and summary["rounds_without_updates"] == len(self.history) and asked and self.status == "completed":
            # a run that learned nothing is a failure, with its reasons: not "run complete" and exit 0
            summary["status"] = self.status = NO_UPDATES
            summary["failure"] = no_updates_reason(summary["rejected_by_rule"])
            log(WARNING, "[fedshield] %s", summary["failure"])
        if self.secure is not None:
            summary.update({"secure_aggregation": self.cfg.secure.secure_aggregation,
                            "secagg_failed_rounds": sum(1 for r in self.history if r.get("secagg_failure"))})
        if self.dp is not None:
            summary.update({"epsilon": self.dp.epsilon, "delta": self.cfg.privacy.dp_delta,
                            "accountant": self.dp.cfg.accountant,  # (distributed DP: always rdp)
                            "epsilon_by_accountant": self.dp.epsilon_by_accountant(),
                            "noise_multiplier": self.dp.z, "privacy_guarantee": self.dp.describe()})
        elif self.cfg.privacy.dp == "local":
            eps = [r["local_epsilon_max"] for r in self.history if "local_epsilon_max" in r]
            summary.update({"local_epsilon_max": max(eps) if eps else None, "delta": self.cfg.privacy.dp_delta,
                            "privacy_guarantee": "example-level DP-SGD on each client (Opacus, "
                            f"{self.cfg.privacy.accountant.upper()} accountant per client); the largest epsilon any "
                            f"client reported is {max(eps) if eps else float('nan'):.3g} "
                            f"at delta {self.cfg.privacy.dp_delta:g}. The coordinator sees clients' noised updates."})
        self.run_dir.write_json(SUMMARY, summary)
        if summary["status"] != NO_UPDATES:
            log(INFO, "[fedshield] run complete: %s after %d rounds; results in %s", result_text(summary),
                self.round, self.run_dir.path)
        return summary
