"""The client's side of a SecAgg+ round, one Flower message per stage.

Between stages the client's secrets (its two private keys, its self-mask seed,
the shares it holds) live in the node's ``Context.state``, one record per round
(``state_name``; a pipelined run holds the next round's beside this one's), which
Flower keeps on the device for the run; they are never logged or sent anywhere
else, and they are deleted when the round's unmask stage is answered, or when a
message of a later round arrives (the round was abandoned). A node set up for a
round it then takes no part in keeps that round's keys until such a message or
the end of the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from logging import WARNING

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from aggregation import array_to_tensor, tensor_to_array
from aggregation._errors import shown
from privacy import PrivacyError, clip_scale, skellam_noise
from privacy.secagg.inputs import encode_input, input_length, secagg_weight, shared_subset
from privacy.secagg.protocol import MAX_DIM, PublicKeys, SecAggClient, SecAggParams

from ._errors import ClientError
from .profile import PROFILE_KEYS
from .protocol import (ARRAYS, CONFIG, MASKED, METRICS, NEXT, NEXT_KEYS, NEXT_SHARES, SECAGG,
                       SECAGG_KEYS, SECAGG_SHARES, SECAGG_UNOPENED, node_map, record_of,
                       records_of)

STATE = "fedshield.secagg"
RESIDUAL = "fedshield.secagg-residual"
LAST_INPUT = "fedshield.secagg-last-input"  # the last round this node sent a masked input for
_PLAN = ("numel", "sparse-ratio", "subset-seed", "weighting", "max-weight")
MAX_NEIGHBOURS = 10_000  # a complete graph of 10^4 nodes: far past what a round of SecAgg+ can serve


def state_name(rnd: int) -> str:
    """Where round ``rnd``'s secrets live in ``Context.state`` (two rounds at most: one pipelined ahead)."""
    return f"{STATE}:{rnd}"


def _forget_rounds(context: Context, which: Callable[[int], bool]) -> None:
    """Drop the saved secrets (``state_name``) of every round ``r`` for which ``which(r)``."""
    for name in [k for k in records_of(context.state, ConfigRecord) if k.startswith(STATE + ":")]:
        if which(int(name.rsplit(":", 1)[1])):
            context.state.pop(name)


def _masked_input(msg: Message, context: Context, client: SecAggClient, plan: dict) -> dict:
    from .client_app import local_update

    config = record_of(msg.content, CONFIG, ConfigRecord)
    if config is None or config.get("round") != client.params.round:
        raise ClientError(f"secagg masked-input must train for round {client.params.round}, the round set up.")
    unopened = client.receive_shares(node_map(record_of(msg.content, SECAGG_SHARES, ConfigRecord), SECAGG_SHARES))
    for u, why in sorted(unopened.items()):  # named in the reply; this node holds none of u's shares
        log(WARNING, "[fedshield] secagg round %d: left out node %d's shares: %s", client.params.round, u, why)
    delta, metrics, _ = local_update(msg, context)
    numel = int(plan["numel"])
    if delta.numel() != numel:
        raise ClientError(f"the model has {delta.numel()} parameters; the round was set up for {numel}.")
    subset = shared_subset(plan["subset-seed"], numel, float(plan["sparse-ratio"]))
    residual = None
    if subset is None:
        values = delta
    else:  # error feedback: what this round does not send is added to the next update
        saved = record_of(context.state, RESIDUAL, ArrayRecord)
        if saved is not None:
            delta = delta + array_to_tensor(saved["r"], "float32", numel)
        values = delta[subset]
        residual = delta
        residual[subset] = 0.0
    if "dp-mu" in plan:  # distributed DP: bound this client's influence, then noise its share
        norm = float(values.norm())
        values = values * clip_scale(norm, float(plan["dp-clip"]))
        q, clipped = encode_input(values, 1.0, client.params)
        q[:-1] += skellam_noise(q.numel() - 1, float(plan["dp-mu"]))
    else:
        weight = 1.0 if plan["weighting"] == "uniform" else secagg_weight(int(metrics["num-examples"]), int(plan["max-weight"]))
        q, clipped = encode_input(values, weight, client.params)
    masked = client.mask(q)
    if residual is None:  # the residual changes only once the input is on its way
        context.state.pop(RESIDUAL, None)
    else:
        context.state[RESIDUAL] = ArrayRecord({"r": tensor_to_array(residual)})
    if clipped:  # stated here, on the client: per-client counts are not sent (they depend on the data)
        log(WARNING, "[fedshield] secagg round %d: clipped %d of %d coordinates to +-secagg-clip=%g",
            client.params.round, clipped, values.numel(), client.params.clip)
    # Only what the coordinator must see in the clear: the model version, the example count when it
    # weights the mean (and the coordinator checks their sum), and the device profile (hardware, not data).
    public = {"base-version", *PROFILE_KEYS} | ({"num-examples"} if plan["weighting"] == "num-examples" and "dp-mu"
                                                not in plan else set())
    out = {k: v for k, v in metrics.items() if k in public}
    reply = {ARRAYS: ArrayRecord({MASKED: Array(masked)}), METRICS: MetricRecord(out)}
    if unopened:
        reply[SECAGG_UNOPENED] = ConfigRecord({str(u): b"" for u in sorted(unopened)})
    return reply


def _save(context: Context, client: SecAggClient, plan: dict) -> None:
    context.state[state_name(client.params.round)] = ConfigRecord(
        {**client.to_fields(), **{f"plan.{k}": v for k, v in plan.items()}})


def _check_plan_size(numel: int, ratio: object, dim: int) -> None:
    """``numel`` and ``sparse-ratio`` must agree with the vector length ``dim`` (already checked) before
    the subset is drawn: drawing it expands a keystream of ``numel`` words (~13 bytes each), so an
    unchecked numel of 2^31 took gigabytes of an edge device's memory before the length was compared.
    Under sparsification the subset's size is binomial: ``dim - 1`` must lie within 10 standard
    deviations (plus 10) of ``ratio * numel``."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise ClientError(f"secagg setup's sparse-ratio must be a number in (0, 1]. Found {shown(ratio, 40)}.")
    if not 1 <= numel <= MAX_DIM:
        raise ClientError(f"secagg setup's numel must be in [1, {MAX_DIM}]. Found {numel}.")
    want = dim - 1
    spread = 10 * math.sqrt(numel * ratio) + 10 if ratio < 1 else 0
    if abs(want - ratio * numel) > spread:
        raise ClientError(f"secagg vector length {dim} does not match numel = {numel} at sparse-ratio = {ratio:g}.")


def _setup(rec: ConfigRecord, context: Context, me: int) -> dict[str, ConfigRecord]:
    params = SecAggParams.from_fields(dict(rec))
    plan = {k: rec.get(k) for k in _PLAN}
    if "dp-mu" in rec:  # distributed DP: clip, then add this client's share of Skellam noise
        dp = {"dp-clip": rec.get("dp-clip"), "dp-mu": rec.get("dp-mu")}
        if not all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in dp.values()):
            raise ClientError("secagg setup's dp-clip and dp-mu must be finite numbers > 0.")
        plan.update(dp)
    if (not isinstance(plan["numel"], int) or not isinstance(plan["subset-seed"], bytes)
            or plan["weighting"] not in ("uniform", "num-examples")
            or not isinstance(plan["max-weight"], int) or plan["max-weight"] < 1):
        raise ClientError("secagg setup must carry numel, subset-seed, weighting and max-weight.")
    _check_plan_size(plan["numel"], plan["sparse-ratio"], params.dim)  # before any keystream is expanded
    if params.degree > MAX_NEIGHBOURS:  # each costs two key agreements, a Shamir share and a model-sized mask
        raise ClientError(f"secagg setup asks this node for {params.degree} neighbours; a node takes at most "
                          f"{MAX_NEIGHBOURS}.")
    subset = shared_subset(plan["subset-seed"], plan["numel"], float(plan["sparse-ratio"]))
    if input_length(plan["numel"], subset) != params.dim:
        raise ClientError(f"secagg vector length {params.dim} does not match the model and sparse ratio.")
    done = (record_of(context.state, LAST_INPUT, ConfigRecord) or {}).get("round", -1)
    # A second instance of a round it already sent input for is refused (and masked-input checks that it
    # trains for the round set up). This stops replays of one round; differencing sums across rounds
    # with different survivors remains possible for any SecAgg (the threat model is a semi-honest server).
    if params.round <= done:
        raise ClientError(f"secagg setup for round {params.round} refused: this node already sent its masked "
                          f"input for round {done}.")
    client, keys = SecAggClient.setup(me, params)  # fresh keys: a round set up again forgets the old ones
    # An honest run never sets a round up below one it already holds: a coordinator sending setups in descending
    # order (400, 399, ...) had every one kept (review helper-59). Past this, at most this round and the one
    # before it remain (the run_secagg_stage cleanup drops older ones), as state_name promises.
    _forget_rounds(context, lambda r: r > params.round)
    _save(context, client, plan)
    return {SECAGG_KEYS: ConfigRecord({str(me): keys.to_bytes()})}


def _answer(msg: Message, context: Context, rec: ConfigRecord, keys: ConfigRecord | None) -> dict[str, ConfigRecord]:
    """One stage of one round (``rec``: its header); returns the reply's records under their plain names."""
    stage, rnd, me = str(rec["stage"]), int(rec["round"]), int(context.node_id)
    if stage == "setup":
        return _setup(rec, context, me)
    saved = record_of(context.state, state_name(rnd), ConfigRecord)
    if saved is None:
        raise ClientError(f"secagg {shown(stage, 40)} message for round {rnd} arrived but this node has not set that "
                          "round up.")
    client = SecAggClient.from_fields(dict(saved))
    plan = {k[5:]: v for k, v in saved.items() if k.startswith("plan.")}
    if rnd != client.params.round:
        raise ClientError(f"secagg message is for round {rnd}; the state saved for it is round {client.params.round}.")
    if stage == "share-keys":
        pub = {v: PublicKeys.from_bytes(v, b) for v, b in node_map(keys, SECAGG_KEYS).items()}
        out = {SECAGG_SHARES: ConfigRecord({str(v): ct for v, ct in client.share_keys(pub).items()})}
    elif stage == "masked-input":
        out = _masked_input(msg, context, client, plan)
        context.state[LAST_INPUT] = ConfigRecord({"round": client.params.round})
    elif stage == "unmask":
        surv, drop = rec.get("survivors"), rec.get("dropped")
        if not all(isinstance(x, list) and all(type(v) is int for v in x) for x in (surv, drop)):
            raise ClientError("secagg unmask must list survivors and dropped nodes by their integer ids.")
        out = {SECAGG_SHARES: ConfigRecord(client.unmask(surv, drop))}
    else:
        raise ClientError(f"secagg stage must be one of setup, share-keys, masked-input, unmask. Found {stage[:20]!r}.")
    if client.stage == "done":
        context.state.pop(state_name(rnd), None)  # the round's secrets are no longer needed
    else:
        _save(context, client, plan)
    return out


def _header(rec: ConfigRecord | None, name: str) -> tuple[str, int]:
    if rec is None or not isinstance(rec.get("stage"), str) or not isinstance(rec.get("round"), int):
        raise ClientError(f"secagg message must carry a '{name}' record with stage and round.")
    return str(rec["stage"]), int(rec["round"])


def run_secagg_stage(msg: Message, context: Context) -> Message:
    """Answer one stage (and a piggybacked stage of the next round, if the message carries one).

    A message out of order, for another round or malformed raises (an error reply). A piggybacked
    stage that is refused is logged and left out of the reply: the coordinator then runs the next
    round without this node, and this round's answer still goes back.
    """
    records = records_of(msg.content, ConfigRecord)
    stage, rnd = _header(records.get(SECAGG), SECAGG)
    _forget_rounds(context, lambda r: r < rnd)  # a round abandoned before its unmask stage: forget its secrets
    try:
        out = _answer(msg, context, records[SECAGG], records.get(SECAGG_KEYS))
    except PrivacyError as exc:
        raise ClientError(f"secagg {stage}: {exc}") from None
    content = RecordDict({SECAGG: ConfigRecord({"stage": stage, "round": rnd}), **out})
    if NEXT in records:
        try:
            stage2, rnd2 = _header(records[NEXT], NEXT)
            if rnd2 != rnd + 1 or stage2 not in ("setup", "share-keys") or stage not in ("masked-input", "unmask"):
                raise ClientError(f"a piggybacked secagg stage must be round {rnd + 1}'s setup or share-keys, sent "
                                  f"with round {rnd}'s masked-input or unmask. Found {stage2[:20]!r} of round {rnd2} "
                                  f"with {stage!r}.")
            out2 = _answer(msg, context, records[NEXT], records.get(NEXT_KEYS))
            content[NEXT] = ConfigRecord({"stage": stage2, "round": rnd2})
            for name, rec in out2.items():
                content[NEXT_KEYS if name == SECAGG_KEYS else NEXT_SHARES] = rec
        except Exception as exc:  # noqa: BLE001 - even one that exhausts memory (a coordinator's graph of 2**20
            # nodes): this round's answer, and the state it saved or deleted, stands whatever the next round's part holds
            log(WARNING, "[fedshield] secagg: the next round's stage sent with round %d's %s was refused: %s", rnd,
                stage, exc if isinstance(exc, ClientError | PrivacyError) else type(exc).__name__)
    return Message(content, reply_to=msg)
