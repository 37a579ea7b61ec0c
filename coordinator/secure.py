"""A synchronous round under SecAgg+: four stages of Flower messages on the workflow's Grid.

With ``secagg-pipeline`` (the default) the next round's first two stages ride on
this round's last two: round r+1's setup goes out with round r's masked-input
messages and its share-keys with round r's unmask messages (nodes picked for
round r+1 that are not in round r's stage get them as messages of their own,
sent at the same time). Round r+1 then starts at masked-input, so a round after
the first is two round trips, like a plain round's one plus the unmasking.
Each round keeps its own fresh keys, session id and graph; only the message
carrying them is shared. Round r+1's nodes are picked when round r starts.

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
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from aggregation import tensor_to_array
from clients.protocol import (
    ARRAYS,
    CONFIG,
    LOCAL_DP,
    MASKED,
    CONTENT_ERRORS,
    MESSAGE_TYPE_SECAGG,
    METRICS,
    NEXT,
    NEXT_KEYS,
    NEXT_SHARES,
    SECAGG,
    SECAGG_KEYS,
    SECAGG_SHARES,
    SECAGG_UNOPENED,
    WEIGHTS,
    message_nbytes,
    update_nbytes,
    node_map,
    record_of,
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
from .validation import (MAX_SIDE_BYTES, RejectedReply, check_base_version, check_envelope, check_num_examples,
                         deadline_of, pull_bounded, pushed)

if TYPE_CHECKING:
    from .workflow import SyncWorkflow

Handler = Callable[[int, Message, "_Ask"], None]

# What each stage's reply holds besides its SECAGG header record; anything else is refused unread.
_STAGE_RECORDS = {"setup": (SECAGG_KEYS,), "share-keys": (SECAGG_SHARES,), "unmask": (SECAGG_SHARES,),
                  "masked-input": (ARRAYS, METRICS, SECAGG_UNOPENED)}
_RIDING = {SECAGG: NEXT, SECAGG_KEYS: NEXT_KEYS, SECAGG_SHARES: NEXT_SHARES}  # a piggybacked stage's record names
_PER_NODE = 1024  # reply bytes allowed per node of the round: a ciphertext (share-keys) or a share (unmask), and its name


def _cap(stage: str, nodes: int, masked_bytes: int = 0) -> int:
    """Bytes a stage's reply may hold beyond ``MAX_SIDE_BYTES``: one entry per node of the round for the stages
    that send shares, and the masked vector (plus one name per node it could not open) for masked-input."""
    if stage == "masked-input":
        return masked_bytes + 32 * nodes
    return 0 if stage == "setup" else _PER_NODE * nodes


def _new_stats() -> dict[str, Any]:
    return {"replies": 0, "bytes_up": 0, "update_bytes_up": 0, "bytes_down": 0, "rejected_by_rule": Counter(),
            "server_s": {}, "stage_s": {}}


@dataclass
class _Ask:
    """One stage of one round, as asked of one node inside a message (alone, or riding on another round's)."""

    rnd: int
    stage: str
    handle: Handler
    stats: dict[str, Any]  # the counters of the round this stage belongs to
    rides: bool = False  # piggybacked: its header and records travel under the NEXT names
    cap: int = 0  # bytes its records may take in a reply, beyond MAX_SIDE_BYTES (see ``_cap``)

    def names(self) -> set[str]:
        """The records its part of a reply may hold (under the NEXT names when it rides)."""
        own = _STAGE_RECORDS[self.stage]
        if not self.rides:
            return {SECAGG, *own}
        return {_RIDING[n] for n in (SECAGG, *own)}

    def record(self, reply: Message, name: str) -> Any:
        if self.rides:
            name = _RIDING[name]
        return record_of(reply.content, name, ConfigRecord)


@dataclass
class _Round:
    """One round's public parameters and server state, made before its first message."""

    rnd: int
    selected: list[int]
    params: SecAggParams
    server: SecAggServer
    subset_seed: bytes
    dp_plan: dict[str, float]
    stats: dict[str, Any] = field(default_factory=_new_stats)
    pipelined: bool = False  # its setup and share-keys rode on the previous round's messages


class SecureRound:
    """Runs the SecAgg+ stages of each round for a :class:`SyncWorkflow` (and, pipelined, the next round's first two)."""

    def __init__(self, wf: "SyncWorkflow") -> None:
        self.wf = wf
        self.settings = wf.cfg.secure
        self.ahead: _Round | None = None  # the next round, already set up during this one
        self.unmasked = 0  # survivors whose sum the last round unmasked (0: nothing was unmasked)

    def planned(self, rnd: int) -> list[int] | None:
        """The nodes round ``rnd`` was set up for during the previous round (None: it was not)."""
        return list(self.ahead.selected) if self.ahead is not None and self.ahead.rnd == rnd else None

    # -- transport ---------------------------------------------------------------------------
    def _exchange(self, rnd: int, stage: str, contents: dict[int, RecordDict], timeout: float,
                  asks: dict[int, list[_Ask]], stats: dict[str, Any]) -> None:
        """Send one stage's messages; hand each reply's part for each ask to its handler.

        ``asks[node]`` lists what the node's message asks: its first entry names the round the
        message belongs to; a second one rides on it (the next round's stage). A handler records
        what it accepts; a rejected part is counted in its own round's ``stats``.
        """
        grid, clock = self.wf.grid, self.wf.clock
        started = clock.now()
        msgs = [Message(content, dst_node_id=node, message_type=MESSAGE_TYPE_SECAGG, group_id=str(asks[node][0].rnd),
                        ttl=timeout + 60.0) for node, content in contents.items()]
        ids = pushed(grid, msgs)
        sent = {mid: m.metadata.dst_node_id for mid, m in ids}
        stats["bytes_down"] += sum(message_nbytes(m) for _, m in ids)
        accepted: Counter[tuple[int, str]] = Counter()
        pending = dict.fromkeys(sent)
        # Messages of this stage keep the exchange open; one sent only to set a node up for the next round does
        # not: a node that has not answered it when this stage is done is left out of the next round.
        mains = {mid for mid, node in sent.items() if asks[node][0].rnd == rnd}
        deadline = deadline_of(grid, started, clock.now(), timeout)
        while pending.keys() & mains:
            for reply in pull_bounded(grid, list(pending), clock, deadline):
                mid = reply.metadata.reply_to_message_id
                if mid not in pending:
                    continue  # not ours or already seen: Grid ids are unique, nothing to count
                node = sent[mid]
                if reply.has_error() or reply.metadata.src_node_id == node:
                    del pending[mid]  # answered; one from another node (refused) leaves it open for its own
                stats["replies"] += 1
                size = message_nbytes(reply)
                stats["bytes_up"] += size  # every reply that came up, refused ones too
                stats["update_bytes_up"] += update_nbytes(reply)  # the masked vectors
                try:
                    check_envelope(reply, node, asks[node][0].rnd)
                    self._check_shape(node, reply, size, asks[node])
                except RejectedReply as rej:  # counted once, in the message's round; a stage riding on it is unanswered
                    self._reject(asks[node][0], node, rej.rule, rej.detail)
                    continue
                for ask in asks[node]:
                    if self._answer(ask, node, reply):
                        accepted[ask.rnd, ask.stage] += 1
            if not pending.keys() & mains:
                break
            if clock.now() >= deadline:
                log(WARNING, "[fedshield] round %d secagg %s: %d of %d nodes did not answer within %.1f s",
                    rnd, stage, len(pending.keys() & mains), len(mains), timeout)
                break
            clock.sleep(self.wf.cfg.server.poll_interval)
        stats["stage_s"][stage] = round(clock.now() - started, 4)
        asked = Counter((a.rnd, a.stage) for node_asks in asks.values() for a in node_asks)
        for (r, s), n in sorted(asked.items()):
            log(INFO, "[fedshield] round %d secagg %s: %d of %d nodes in %.2f s%s", r, s, accepted[r, s], n,
                stats["stage_s"][stage], "" if (r, s) == (rnd, stage) else f" (with round {rnd}'s {stage})")

    @staticmethod
    def _check_shape(node: int, reply: Message, size: int, asks: list[_Ask]) -> None:
        """Only the records its stages' replies hold, and within their bytes (``_cap``): a reply is refused
        whole, before any part is read, if it carries more (an extra record, or extra fields in one that is
        read, would otherwise ride along unchecked)."""
        allowed = set().union(*(a.names() for a in asks))
        extra = sorted(set(reply.content.keys()) - allowed)
        if extra:
            raise RejectedReply(node, "unexpected-record", f"reply must hold only {', '.join(sorted(allowed))}; "
                                f"found {', '.join(repr(k[:40]) for k in extra[:3])}")
        limit = MAX_SIDE_BYTES + sum(a.cap for a in asks)
        if size > limit:  # (``size``: its message_nbytes)
            raise RejectedReply(node, "oversized", f"reply must be <= {limit} bytes; found {size}")

    def _answer(self, ask: _Ask, node: int, reply: Message) -> bool:
        """Check and hand over one ask's part of a reply; False if it was rejected or left out."""
        rec = ask.record(reply, SECAGG)
        if ask.rides and rec is None:  # the node refused the piggybacked stage (and logged why): no answer, no fault
            return False
        try:
            if rec is None or rec.get("round") != ask.rnd:
                raise SecAggRejected(node, "wrong-round", f"reply's {SECAGG} record must belong to round {ask.rnd}")
            if rec.get("stage") != ask.stage:
                raise SecAggRejected(node, "wrong-stage", f"reply must answer stage {ask.stage!r}; found "
                                                          f"{str(rec.get('stage'))[:20]!r} (replayed or out of order)")
            t0 = time.perf_counter()
            ask.handle(node, reply, ask)
            ask.stats["server_s"][ask.stage] = ask.stats["server_s"].get(ask.stage, 0.0) + time.perf_counter() - t0
            return True
        except (SecAggRejected, RejectedReply) as rej:
            self._reject(ask, node, rej.rule, rej.detail)
        except (PrivacyError, *CONTENT_ERRORS) as exc:
            # Anything else a reply's content provokes is that node's fault, never the run's end.
            self._reject(ask, node, "malformed", type(exc).__name__)
        return False

    def _drop(self, nxt: _Round, stats: dict[str, Any], why: str) -> None:
        """Give up setting the next round up during this one (it will run all four stages); its rejections so
        far are counted in this round's row, whose messages carried them."""
        log(INFO, "[fedshield] round %d will be set up on its own: %s", nxt.rnd, why)
        stats["rejected_by_rule"].update(nxt.stats["rejected_by_rule"])

    @staticmethod
    def _reject(ask: _Ask, node: int, rule: str, detail: str) -> None:
        ask.stats["rejected_by_rule"][rule] += 1
        log(WARNING, "[fedshield] round %d secagg %s: rejected node %d (%s): %s", ask.rnd, ask.stage, node, rule, detail)

    @staticmethod
    def _node_map(rec: Any, name: str, node: int) -> dict[int, bytes]:
        if rec is None:
            raise SecAggRejected(node, "missing-record", f"reply must hold a '{name}' record")
        try:
            return node_map(rec, name)
        except ClientError as exc:
            raise SecAggRejected(node, "bad-share", str(exc)) from None

    # -- one round's stages ------------------------------------------------------------------
    def _prepare(self, rnd: int, selected: list[int]) -> _Round:
        """Parameters for ``selected``; raises (ConfigError, PrivacyError, CoordinatorError) if they cannot work."""
        wf, st = self.wf, self.settings
        subset_seed = os.urandom(SEED_BYTES)
        subset = shared_subset(subset_seed, wf.numel, st.secagg_sparse_ratio)
        k, t = st.graph(len(selected))
        params = SecAggParams.create(rnd, selected, degree=k, threshold=t, bits=st.secagg_bits, clip=st.secagg_clip,
                                     dim=input_length(wf.numel, subset))
        dp_plan: dict[str, float] = {}
        if isinstance(wf.dp, DistributedDp):  # each client clips and adds its share of the noise (the ring's room
            # for it was checked with the config, at min-nodes: no round selects fewer)
            clip, mu = wf.dp.client_noise(len(selected), params.step, params.dim - 1)
            dp_plan = {"dp-clip": clip, "dp-mu": mu}
        return _Round(rnd, list(selected), params, SecAggServer(params, wf.device), subset_seed, dp_plan)

    def _setup_record(self, r: _Round) -> ConfigRecord:
        st = self.settings
        return ConfigRecord({"stage": "setup", **r.params.to_fields(), "numel": self.wf.numel,
                             "sparse-ratio": st.secagg_sparse_ratio, "subset-seed": r.subset_seed,
                             "weighting": st.secagg_weighting, "max-weight": st.secagg_max_weight, **r.dp_plan})

    def _setup_ask(self, r: _Round) -> _Ask:
        def on_keys(node: int, reply: Message, ask: _Ask) -> None:
            keys = self._node_map(ask.record(reply, SECAGG_KEYS), SECAGG_KEYS, node)
            if set(keys) != {node}:
                raise SecAggRejected(node, "unknown-sender", "a node may advertise only its own keys")
            r.server.on_keys(node, PublicKeys.from_bytes(node, keys[node]))
        return _Ask(r.rnd, "setup", on_keys, r.stats)

    def _share_ask(self, r: _Round) -> _Ask:
        def on_shares(node: int, reply: Message, ask: _Ask) -> None:
            r.server.on_shares(node, self._node_map(ask.record(reply, SECAGG_SHARES), SECAGG_SHARES, node))
        return _Ask(r.rnd, "share-keys", on_shares, r.stats, cap=_cap("share-keys", len(r.selected)))

    @staticmethod
    def _keys_record(keys: dict[int, PublicKeys]) -> ConfigRecord:
        return ConfigRecord({str(v): pk.to_bytes() for v, pk in keys.items()})

    @staticmethod
    def _ride(contents: dict[int, RecordDict], asks: dict[int, list[_Ask]], header: ConfigRecord,
              keys: dict[int, ConfigRecord | None], ask: _Ask) -> None:
        """Put the next round's stage (``header``, and each node's ``keys`` record if any) into this stage's
        messages; a node without one gets a message of its own."""
        riding = replace(ask, rides=True)
        for node, rec in keys.items():
            if node in contents:
                contents[node][NEXT] = header
                if rec is not None:
                    contents[node][NEXT_KEYS] = rec
                asks[node].append(riding)
            else:
                contents[node] = RecordDict({SECAGG: header, **({SECAGG_KEYS: rec} if rec is not None else {})})
                asks[node] = [ask]

    # -- the round ---------------------------------------------------------------------------
    def run(self, rnd: int, selected: list[int], upcoming: list[int] | None = None
            ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """Run the round's stages; return the weighted mean update (None if the round failed) and its row.

        ``upcoming``: the nodes picked for round ``rnd + 1``, set up during this round (pipelining).
        """
        wf, st = self.wf, self.settings
        numel = wf.numel
        cur = self.ahead if self.ahead is not None and self.ahead.rnd == rnd and self.ahead.selected == selected else None
        self.ahead, self.unmasked = None, 0
        if cur is None:
            try:  # parameters that cannot work for this many nodes fail the round, not the run
                cur = self._prepare(rnd, selected)
            except (ConfigError, PrivacyError, CoordinatorError) as exc:
                log(WARNING, "[fedshield] round %d: secure aggregation cannot run with %d nodes: %s; the global model "
                    "is unchanged", rnd, len(selected), exc)
                return None, {"replies": 0, "accepted": 0, "rejected": 0, "late": len(selected), "rejected_by_rule": {},
                              "bytes_up": 0, "update_bytes_up": 0, "bytes_down": 0, "train_loss": float("nan"),
                              "secagg_survivors": 0,
                              "secagg_dropped": 0, "secagg_failure": str(exc)}
        nxt = None
        if upcoming:
            try:
                nxt = self._prepare(rnd + 1, upcoming)
            except (ConfigError, PrivacyError, CoordinatorError) as exc:
                log(INFO, "[fedshield] round %d will be set up on its own: %s", rnd + 1, exc)
        params, server, stats = cur.params, cur.server, cur.stats
        subset = shared_subset(cur.subset_seed, numel, st.secagg_sparse_ratio)
        dp = wf.dp if isinstance(wf.dp, DistributedDp) else None
        weights: dict[int, float] = {}  # what each survivor's weight must be (public: uniform, or its example count)
        update = None
        weight_total = 0.0
        reason = ""
        timeout = st.secagg_stage_timeout
        by_examples = st.secagg_weighting == "num-examples" and dp is None
        try:
            if not cur.pipelined:  # stages 1 and 2 on their own
                setup, ask = self._setup_record(cur), self._setup_ask(cur)
                self._exchange(rnd, "setup", {n: RecordDict({SECAGG: setup}) for n in selected}, timeout,
                               {n: [ask] for n in selected}, stats)
                requests, ask = server.share_keys_requests(), self._share_ask(cur)
                self._exchange(rnd, "share-keys", {
                    n: RecordDict({SECAGG: ConfigRecord({"stage": "share-keys", "round": rnd}),
                                   SECAGG_KEYS: self._keys_record(keys)}) for n, keys in requests.items()},
                    timeout, {n: [ask] for n in requests}, stats)

            requests3 = server.masked_input_requests()
            instr = wf.instruction(rnd)
            train = {ARRAYS: ArrayRecord({WEIGHTS: tensor_to_array(wf.weights)}), CONFIG: instr.to_record()}
            if wf.cfg.privacy.dp == "local":  # the clients train by DP-SGD inside the masked-input stage too
                train[LOCAL_DP] = ConfigRecord(wf.cfg.privacy.local_record())
            ring = ring_dtype(params.bits)
            max_bytes = params.dim * ring.itemsize + 1024

            def on_masked(node: int, reply: Message, ask: _Ask) -> None:
                arrays = record_of(reply.content, ARRAYS, ArrayRecord)
                metrics = record_of(reply.content, METRICS, MetricRecord)
                if arrays is None or MASKED not in arrays or metrics is None:
                    raise SecAggRejected(node, "missing-record", f"reply must hold '{ARRAYS}'/'{MASKED}' and '{METRICS}'")
                if len(arrays) != 1:  # nothing else is read: unchecked, an array of any size would ride along
                    raise SecAggRejected(node, "unexpected-record", f"'{ARRAYS}' must hold only '{MASKED}'; found "
                                                                    f"{len(arrays)} arrays")
                array = arrays[MASKED]
                if len(array.data) > max_bytes:
                    raise SecAggRejected(node, "oversized", f"masked input must be <= {max_bytes} bytes; "
                                                            f"found {len(array.data)}")
                if (array.stype, array.dtype, tuple(array.shape)) != ("numpy.ndarray", ring.name, (params.dim,)):
                    raise SecAggRejected(node, "bad-array", f"masked input must be declared a numpy.ndarray of "
                                                            f"{ring.name} and shape ({params.dim},)")
                weight = 1.0
                if by_examples:  # the count is public (it weights the mean); the coordinator checks the sum of them
                    weight = secagg_weight(check_num_examples(node, metrics, wf.cfg.server.max_examples),
                                           st.secagg_max_weight)
                check_base_version(node, metrics, wf.version)
                try:
                    vector = array.numpy()
                except Exception:  # noqa: BLE001 - any undecodable payload is the client's fault
                    raise SecAggRejected(node, "bad-array", "masked input is not a decodable array") from None
                unopened = record_of(reply.content, SECAGG_UNOPENED, ConfigRecord)  # shares it could not open
                unopened = () if unopened is None else self._node_map(unopened, SECAGG_UNOPENED, node)
                server.add_masked(node, vector, unopened)
                weights[node] = weight

            contents = {n: RecordDict({SECAGG: ConfigRecord({"stage": "masked-input", "round": rnd}),
                                       SECAGG_SHARES: ConfigRecord({str(u): ct for u, ct in cts.items()}), **train})
                        for n, cts in requests3.items()}
            ask = _Ask(rnd, "masked-input", on_masked, stats, cap=_cap("masked-input", len(selected), max_bytes))
            asks = {n: [ask] for n in contents}
            if nxt is not None:  # round rnd + 1's setup rides on this stage
                self._ride(contents, asks, self._setup_record(nxt), dict.fromkeys(nxt.selected), self._setup_ask(nxt))
            self._exchange(rnd, "masked-input", contents, wf.cfg.server.round_timeout, asks, stats)

            if dp is not None and len(server.survivors) < dp.min_survivors(len(selected)):
                raise SecAggAborted(f"distributed DP needs >= {dp.min_survivors(len(selected))} survivors for its noise "
                                    f"(secagg-dropout-rate={st.secagg_dropout_rate:g}); only {len(server.survivors)} "
                                    "sent masked inputs, so nothing is unmasked or released")
            requests4 = server.unmask_requests()

            def on_unmask(node: int, reply: Message, ask: _Ask) -> None:
                server.on_unmask(node, dict(ask.record(reply, SECAGG_SHARES) or {}))

            contents = {n: RecordDict({SECAGG: ConfigRecord({"stage": "unmask", "round": rnd, "survivors": surv,
                                                             "dropped": drop})})
                        for n, (surv, drop) in requests4.items()}
            ask = _Ask(rnd, "unmask", on_unmask, stats, cap=_cap("unmask", len(selected)))
            asks = {n: [ask] for n in contents}
            if nxt is not None:  # and its share-keys on this one
                try:
                    share = nxt.server.share_keys_requests()
                except SecAggAborted as exc:
                    self._drop(nxt, stats, str(exc))
                    nxt = None
                else:
                    self._ride(contents, asks, ConfigRecord({"stage": "share-keys", "round": rnd + 1}),
                               {n: self._keys_record(keys) for n, keys in share.items()}, self._share_ask(nxt))
            self._exchange(rnd, "unmask", contents, timeout, asks, stats)
            if nxt is not None:  # committed only if enough nodes shared keys for its masked-input stage to run
                try:
                    ready = nxt.server.sharers_ready()
                    if dp is not None and ready < dp.min_survivors(len(nxt.selected)):
                        raise SecAggAborted(f"only {ready} nodes shared keys; distributed DP needs >= "
                                            f"{dp.min_survivors(len(nxt.selected))} survivors")
                except SecAggAborted as exc:
                    self._drop(nxt, stats, str(exc))
                else:
                    nxt.pipelined, self.ahead = True, nxt
                nxt = None
            t0 = time.perf_counter()
            result = server.finish()
            self.unmasked = len(result.survivors)  # the coordinator has seen this (noised) sum, whatever follows
            weighted, weight = decode_sum(result)
            stats["server_s"]["finish"] = time.perf_counter() - t0
            # The weights are public (each reply's example count): the mean divides by their sum, and the
            # weight coordinate only checks it. Both it and every value are bounded for honest clients; a
            # client that sent out-of-range ring elements shows here, and the round fails instead of
            # scaling the model.
            expected = sum(weights[u] for u in result.survivors)
            slack = len(result.survivors) * params.step / params.clip + 1e-9  # the ring's worst-case rounding
            if not expected >= 4 * slack:
                raise SecAggAborted(f"the survivors' summed weight {expected:.6g} is within 4x of the ring's rounding "
                                    f"({slack:.3g}): the mean would be mostly rounding error; raise secagg-bits or "
                                    "lower secagg-max-weight")
            if not abs(weight - expected) <= slack:
                raise SecAggAborted(f"the survivors' summed weight {weight:.6g} must be {expected:.6g}: a client sent an "
                                    "out-of-range weight")
            mean64 = weighted / expected
            bound = params.clip + len(result.survivors) * params.step / expected
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
            # the weight the mean carries: the survivors' (capped) example counts, or their number if uniform
            weight_total = expected * (st.secagg_max_weight if by_examples else 1)
        except SecAggAborted as exc:
            if nxt is not None:  # this round ended before the next one's share-keys could ride on its unmask
                self._drop(nxt, stats, "this round failed before its unmask stage")
            reason = str(exc)
            log(WARNING, "[fedshield] round %d: secure aggregation failed: %s; the global model is unchanged", rnd, reason)
            survivors, dropped = tuple(sorted(server.survivors)), ()
        for node, why in server.left_out:  # disputed shares (the sender's fault or the dealer's): not a node refused
            log(WARNING, "[fedshield] round %d secagg: left out a share from node %d: %s", rnd, node, why)
        rejected = stats["rejected_by_rule"]
        row = {
            "replies": stats["replies"], "accepted": len(survivors) if update is not None else 0,
            "rejected": sum(rejected.values()), "late": len(selected) - len(survivors), "rejected_by_rule": dict(rejected),
            "bytes_up": stats["bytes_up"], "update_bytes_up": stats["update_bytes_up"], "bytes_down": stats["bytes_down"],
            "train_loss": float("nan"),  # a client's own loss is not sent under secure aggregation
            "secagg_degree": params.degree, "secagg_threshold": params.threshold, "secagg_survivors": len(survivors),
            "secagg_dropped": len(dropped), "secagg_shares_left_out": len(server.left_out),
            "secagg_server_s": round(sum(stats["server_s"].values()), 4),
            "secagg_stage_s": dict(stats["stage_s"]),  # each stage's time, from sending to its last reply
            "secagg_pipelined": cur.pipelined,  # its setup and share-keys rode on the previous round's messages
            "weight_total": weight_total,
        }
        if reason:
            row["secagg_failure"] = reason
        return update, row
