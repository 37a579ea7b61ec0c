"""A synchronous round under SecAgg+: four stages of Flower messages on the workflow's Grid.

The coordinator here only relays public keys and ciphertexts, sums masked
vectors in the ring, and unmasks the sum; it never holds one client's update.
Every reply is checked (the same envelope rules as plain rounds, then the
protocol's own rules); a rejected or missing reply makes that node a dropout,
which the protocol recovers from while enough neighbours survive. When it
cannot, the round ends with a clear reason and the global model is unchanged.
Nothing secret is logged: keys, shares, masks and masked vectors never reach a
log line (tests scan the logs).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log

from aggregation import tensor_to_array
from clients.protocol import (
    ARRAYS,
    CONFIG,
    MASKED,
    MESSAGE_TYPE_SECAGG,
    METRICS,
    SECAGG,
    SECAGG_KEYS,
    SECAGG_SHARES,
    TrainInstruction,
    WEIGHTS,
    message_nbytes,
    node_map,
)
from privacy import PrivacyError
from privacy.secagg import SEED_BYTES
from privacy.secagg.inputs import decode_sum, input_length, secagg_weight, shared_subset
from privacy.secagg.protocol import (
    PublicKeys,
    SecAggAborted,
    SecAggParams,
    SecAggRejected,
    SecAggServer,
    ring_dtype,
)

from clients._errors import ClientError, ConfigError

from ._errors import CoordinatorError
from .privacy_policy import DistributedDp
from .validation import RejectedReply, check_base_version, check_envelope, check_num_examples

if TYPE_CHECKING:
    from .workflow import SyncWorkflow

Handler = Callable[[int, Message], None]


class SecureRound:
    """Runs the four SecAgg+ stages of one round for a :class:`SyncWorkflow`."""

    def __init__(self, wf: "SyncWorkflow") -> None:
        self.wf = wf
        self.settings = wf.cfg.secure

    # -- transport ---------------------------------------------------------------------------
    def _exchange(self, rnd: int, stage: str, contents: dict[int, RecordDict], timeout: float, handle: Handler,
                  stats: dict[str, Any]) -> None:
        """Send one stage's messages; hand each valid reply to ``handle`` (which records what it accepts)."""
        grid, clock = self.wf.grid, self.wf.clock
        started = clock.now()
        msgs = [Message(content, dst_node_id=node, message_type=MESSAGE_TYPE_SECAGG, group_id=str(rnd),
                        ttl=timeout + 60.0) for node, content in contents.items()]
        ids = list(grid.push_messages(msgs))
        sent = {mid: m.metadata.dst_node_id for mid, m in zip(ids, msgs, strict=False)}
        stats["bytes_down"] += sum(message_nbytes(m) for m in msgs[:len(ids)])
        rejected: Counter[str] = stats["rejected_by_rule"]
        accepted: set[int] = set()
        pending = dict.fromkeys(sent)
        deadline = clock.now() + timeout
        while pending:
            for reply in grid.pull_messages(list(pending)):
                mid = reply.metadata.reply_to_message_id
                if pending.pop(mid, "gone") == "gone":
                    continue  # not ours or already seen: Grid ids are unique, nothing to count
                node = sent[mid]
                stats["replies"] += 1
                try:
                    self._check_envelope(reply, node, rnd, stage)
                    t0 = time.perf_counter()
                    handle(node, reply)
                    stats["server_s"][stage] = stats["server_s"].get(stage, 0.0) + time.perf_counter() - t0
                except (SecAggRejected, RejectedReply) as rej:
                    rejected[rej.rule] += 1
                    log(WARNING, "[fedshield] round %d secagg %s: rejected node %d (%s): %s", rnd, stage, node,
                        rej.rule, rej.detail)
                    continue
                except (PrivacyError, ValueError, TypeError, KeyError, OverflowError) as exc:
                    # Anything else a reply's content provokes is that node's fault, never the run's end.
                    rejected["malformed"] += 1
                    log(WARNING, "[fedshield] round %d secagg %s: rejected node %d (malformed): %s", rnd, stage, node,
                        type(exc).__name__)
                    continue
                accepted.add(node)
                stats["bytes_up"] += message_nbytes(reply)
            if pending and clock.now() >= deadline:
                log(WARNING, "[fedshield] round %d secagg %s: %d of %d nodes did not answer within %.1f s",
                    rnd, stage, len(pending), len(sent), timeout)
                break
            if pending:
                clock.sleep(self.wf.cfg.server.poll_interval)
        stats["stage_s"][stage] = round(clock.now() - started, 4)
        log(INFO, "[fedshield] round %d secagg %s: %d of %d nodes in %.2f s", rnd, stage, len(accepted), len(contents),
            stats["stage_s"][stage])

    @staticmethod
    def _check_envelope(reply: Message, node: int, rnd: int, stage: str) -> None:
        check_envelope(reply, node, rnd)
        rec = reply.content.config_records.get(SECAGG)
        if rec is None or rec.get("round") != rnd:
            raise SecAggRejected(node, "wrong-round", f"reply's {SECAGG} record must belong to round {rnd}")
        if rec.get("stage") != stage:
            raise SecAggRejected(node, "wrong-stage", f"reply must answer stage {stage!r}; found "
                                                      f"{str(rec.get('stage'))[:20]!r} (replayed or out of order)")

    @staticmethod
    def _node_map(reply: Message, name: str, node: int) -> dict[int, bytes]:
        rec = reply.content.config_records.get(name)
        if rec is None:
            raise SecAggRejected(node, "missing-record", f"reply must hold a '{name}' record")
        try:
            return node_map(rec, name)
        except ClientError as exc:
            raise SecAggRejected(node, "bad-share", str(exc)) from None

    # -- the round ---------------------------------------------------------------------------
    def run(self, rnd: int, selected: list[int]) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Run the stages; return the weighted mean update (None if the round failed) and the round's row."""
        wf, st = self.wf, self.settings
        numel = wf.numel
        stats: dict[str, Any] = {"replies": 0, "bytes_up": 0, "bytes_down": 0, "rejected_by_rule": Counter(),
                                 "server_s": {}, "stage_s": {}}
        subset_seed = os.urandom(SEED_BYTES)
        subset = shared_subset(subset_seed, numel, st.secagg_sparse_ratio)
        dp = wf.dp if isinstance(wf.dp, DistributedDp) else None
        dp_plan: dict[str, float] = {}
        try:  # parameters that cannot work for this many nodes fail the round, not the run
            k, t = st.graph(len(selected))
            params = SecAggParams.create(rnd, selected, degree=k, threshold=t, bits=st.secagg_bits,
                                         clip=st.secagg_clip, dim=input_length(numel, subset))
            if dp is not None:  # each client clips and adds its share of the noise
                dp.check_headroom(st.secagg_clip, len(selected))
                clip, mu = dp.client_noise(len(selected), params.step, params.dim - 1)
                dp_plan = {"dp-clip": clip, "dp-mu": mu}
        except (ConfigError, PrivacyError, CoordinatorError) as exc:
            log(WARNING, "[fedshield] round %d: secure aggregation cannot run with %d nodes: %s; the global model is "
                "unchanged", rnd, len(selected), exc)
            return None, {"replies": 0, "accepted": 0, "rejected": 0, "late": len(selected), "rejected_by_rule": {},
                          "bytes_up": 0, "bytes_down": 0, "train_loss": float("nan"), "secagg_survivors": 0,
                          "secagg_dropped": 0, "secagg_failure": str(exc)}
        server = SecAggServer(params, wf.device)
        weights: dict[int, float] = {}  # what each survivor's weight must be (public: uniform, or its example count)
        update = None
        reason = ""
        timeout = st.secagg_stage_timeout
        by_examples = st.secagg_weighting == "num-examples" and dp is None
        try:
            setup = ConfigRecord({"stage": "setup", **params.to_fields(), "numel": numel, "sparse-ratio": st.secagg_sparse_ratio,
                                  "subset-seed": subset_seed, "weighting": st.secagg_weighting,
                                  "max-weight": st.secagg_max_weight, **dp_plan})

            def on_keys(node: int, reply: Message) -> None:
                keys = self._node_map(reply, SECAGG_KEYS, node)
                if set(keys) != {node}:
                    raise SecAggRejected(node, "unknown-sender", "a node may advertise only its own keys")
                server.on_keys(node, PublicKeys.from_bytes(node, keys[node]))

            self._exchange(rnd, "setup", {n: RecordDict({SECAGG: setup}) for n in selected}, timeout, on_keys, stats)

            requests = server.share_keys_requests()
            self._exchange(rnd, "share-keys", {
                n: RecordDict({SECAGG: ConfigRecord({"stage": "share-keys", "round": rnd}),
                               SECAGG_KEYS: ConfigRecord({str(v): pk.to_bytes() for v, pk in keys.items()})})
                for n, keys in requests.items()}, timeout,
                lambda node, reply: server.on_shares(node, self._node_map(reply, SECAGG_SHARES, node)), stats)

            requests3 = server.masked_input_requests()
            instr = TrainInstruction(round=rnd, version=wf.version, seed=wf.cfg.server.seed, task=wf.cfg.task,
                                     train=wf.cfg.train)
            train = {ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(wf.weights)}), CONFIG: instr.to_record()}
            max_bytes = params.dim * ring_dtype(params.bits).itemsize + 1024

            def on_masked(node: int, reply: Message) -> None:
                arrays = reply.content.array_records.get(ARRAYS)
                metrics = reply.content.metric_records.get(METRICS)
                if arrays is None or MASKED not in arrays or metrics is None:
                    raise SecAggRejected(node, "missing-record", f"reply must hold '{ARRAYS}'/'{MASKED}' and '{METRICS}'")
                array = arrays[MASKED]
                if len(array.data) > max_bytes:
                    raise SecAggRejected(node, "oversized", f"masked input must be <= {max_bytes} bytes; "
                                                            f"found {len(array.data)}")
                weight = 1.0
                if by_examples:  # the count is public (it weights the mean); the coordinator checks the sum of them
                    weight = secagg_weight(check_num_examples(node, metrics, wf.cfg.server.max_examples),
                                           st.secagg_max_weight)
                check_base_version(node, metrics, wf.version)
                try:
                    vector = array.numpy()
                except Exception:  # noqa: BLE001 - any undecodable payload is the client's fault
                    raise SecAggRejected(node, "bad-array", "masked input is not a decodable array") from None
                server.add_masked(node, vector)
                weights[node] = weight

            self._exchange(rnd, "masked-input", {
                n: RecordDict({SECAGG: ConfigRecord({"stage": "masked-input", "round": rnd}),
                               SECAGG_SHARES: ConfigRecord({str(u): ct for u, ct in cts.items()}), **train})
                for n, cts in requests3.items()}, wf.cfg.server.round_timeout, on_masked, stats)

            if dp is not None and len(server.survivors) < dp.min_survivors(len(selected)):
                raise SecAggAborted(f"distributed DP needs >= {dp.min_survivors(len(selected))} survivors for its noise "
                                    f"(secagg-dropout-rate={st.secagg_dropout_rate:g}); only {len(server.survivors)} "
                                    "sent masked inputs, so nothing is unmasked or released")
            requests4 = server.unmask_requests()
            self._exchange(rnd, "unmask", {
                n: RecordDict({SECAGG: ConfigRecord({"stage": "unmask", "round": rnd, "survivors": surv, "dropped": drop})})
                for n, (surv, drop) in requests4.items()}, timeout,
                lambda node, reply: server.on_unmask(node, {k: v for k, v in (reply.content.config_records.get(SECAGG_SHARES)
                                                                               or {}).items()}), stats)
            t0 = time.perf_counter()
            result = server.finish()
            weighted, weight = decode_sum(result)
            stats["server_s"]["finish"] = time.perf_counter() - t0
            # The weight coordinate and every value are bounded for honest clients; a client that sent
            # out-of-range ring elements shows here, and the round fails instead of scaling the model.
            expected = sum(weights[u] for u in result.survivors)
            slack = len(result.survivors) * params.step / params.clip + 1e-9
            if not abs(weight - expected) <= slack:
                raise SecAggAborted(f"the survivors' summed weight {weight:.6g} must be {expected:.6g}: a client sent an "
                                    "out-of-range weight")
            mean64 = weighted / weight
            bound = params.clip + len(result.survivors) * params.step / weight
            if float(mean64.abs().max()) > bound:
                raise SecAggAborted(f"the unmasked mean must lie within +-secagg-clip={params.clip:g}; found "
                                    f"{float(mean64.abs().max()):.4g}: a client sent out-of-range ring elements (or "
                                    "the DP noise wrapped the ring)")
            update = torch.zeros(numel, dtype=torch.float32, device=wf.device)
            mean = mean64.to(torch.float32).to(wf.device)
            if subset is None:
                update.copy_(mean)
            else:
                update[subset.to(wf.device)] = mean
            survivors, dropped = result.survivors, result.dropped
        except SecAggAborted as exc:
            reason = str(exc)
            log(WARNING, "[fedshield] round %d: secure aggregation failed: %s; the global model is unchanged", rnd, reason)
            survivors, dropped = tuple(sorted(server.survivors)), ()
        rejected = stats["rejected_by_rule"]
        row = {
            "replies": stats["replies"], "accepted": len(survivors) if update is not None else 0,
            "rejected": sum(rejected.values()), "late": len(selected) - len(survivors), "rejected_by_rule": dict(rejected),
            "bytes_up": stats["bytes_up"], "bytes_down": stats["bytes_down"],
            "train_loss": float("nan"),  # a client's own loss is not sent under secure aggregation
            "secagg_degree": params.degree, "secagg_threshold": params.threshold, "secagg_survivors": len(survivors),
            "secagg_dropped": len(dropped),
            "secagg_server_s": round(sum(stats["server_s"].values()), 4),
            "secagg_stage_s": dict(stats["stage_s"]),  # each stage's time, from sending to its last reply
        }
        if reason:
            row["secagg_failure"] = reason
        return update, row
