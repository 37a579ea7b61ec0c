"""The client's side of a SecAgg+ round, one Flower message per stage.

Between stages the client's secrets (its two private keys, its self-mask seed,
the shares it holds) live in the node's ``Context.state``, which Flower keeps
on the device for the run; they are never logged or sent anywhere else, and
they are deleted when the round's unmask stage is answered.
"""

from __future__ import annotations

import math
from logging import WARNING

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.logger import log

from aggregation import array_to_tensor, tensor_to_array
from privacy import PrivacyError, clip_scale, skellam_noise
from privacy.secagg.inputs import encode_input, input_length, secagg_weight, shared_subset
from privacy.secagg.protocol import PublicKeys, SecAggClient, SecAggParams

from ._errors import ClientError
from .profile import PROFILE_KEYS
from .protocol import ARRAYS, CONFIG, MASKED, METRICS, SECAGG, SECAGG_KEYS, SECAGG_SHARES, node_map

STATE = "fedshield.secagg"
RESIDUAL = "fedshield.secagg-residual"
LAST_INPUT = "fedshield.secagg-last-input"  # the last round this node sent a masked input for
_PLAN = ("numel", "sparse-ratio", "subset-seed", "weighting", "max-weight")


def _reply(msg: Message, stage: str, rnd: int, **records) -> Message:
    content = RecordDict({SECAGG: ConfigRecord({"stage": stage, "round": rnd}), **records})
    return Message(content, reply_to=msg)


def _masked_input(msg: Message, context: Context, client: SecAggClient, plan: dict) -> Message:
    from .client_app import local_update

    config = msg.content.config_records.get(CONFIG)
    if config is None or config.get("round") != client.params.round:
        raise ClientError(f"secagg masked-input must train for round {client.params.round}, the round set up.")
    client.receive_shares(node_map(msg.content.config_records.get(SECAGG_SHARES), SECAGG_SHARES))
    delta, metrics, _ = local_update(msg, context)
    numel = int(plan["numel"])
    if delta.numel() != numel:
        raise ClientError(f"the model has {delta.numel()} parameters; the round was set up for {numel}.")
    subset = shared_subset(plan["subset-seed"], numel, float(plan["sparse-ratio"]))
    residual = None
    if subset is None:
        values = delta
    else:  # error feedback: what this round does not send is added to the next update
        if RESIDUAL in context.state.array_records:
            delta = delta + array_to_tensor(context.state.array_records[RESIDUAL]["r"], "float32", numel)
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
        context.state.array_records.pop(RESIDUAL, None)
    else:
        context.state.array_records[RESIDUAL] = ArrayRecord({"r": tensor_to_array(residual)})
    if clipped:  # stated here, on the client: per-client counts are not sent (they depend on the data)
        log(WARNING, "[fedshield] secagg round %d: clipped %d of %d coordinates to +-secagg-clip=%g",
            client.params.round, clipped, values.numel(), client.params.clip)
    # Only what the coordinator must see in the clear: the model version, the example count when it
    # weights the mean (and the coordinator checks their sum), and the device profile (hardware, not data).
    public = {"base-version", *PROFILE_KEYS} | ({"num-examples"} if plan["weighting"] == "num-examples" and "dp-mu"
                                                not in plan else set())
    out = {k: v for k, v in metrics.items() if k in public}
    return _reply(msg, "masked-input", client.params.round, **{ARRAYS: ArrayRecord({MASKED: Array(masked)}),
                                                             METRICS: MetricRecord(out)})


def run_secagg_stage(msg: Message, context: Context) -> Message:
    """Answer one stage; a message out of order, for another round or malformed raises (an error reply)."""
    rec = msg.content.config_records.get(SECAGG)
    if rec is None or not isinstance(rec.get("stage"), str) or not isinstance(rec.get("round"), int):
        raise ClientError(f"secagg message must carry a '{SECAGG}' record with stage and round.")
    stage, rnd = str(rec["stage"]), int(rec["round"])
    me = int(context.node_id)
    try:
        if stage == "setup":
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
            subset = shared_subset(plan["subset-seed"], plan["numel"], float(plan["sparse-ratio"]))
            if input_length(plan["numel"], subset) != params.dim:
                raise ClientError(f"secagg vector length {params.dim} does not match the model and sparse ratio.")
            done = context.state.config_records.get(LAST_INPUT, {}).get("round", -1)
            # A second instance of a round it already sent input for is refused (and masked-input checks that it
            # trains for the round set up). This stops replays of one round; differencing sums across rounds
            # with different survivors remains possible for any SecAgg (the threat model is a semi-honest server).
            if params.round <= done:
                raise ClientError(f"secagg setup for round {params.round} refused: this node already sent its masked "
                                  f"input for round {done}.")
            client, keys = SecAggClient.setup(me, params)
            context.state.config_records[STATE] = ConfigRecord({**client.to_fields(), **{f"plan.{k}": v for k, v in plan.items()}})
            return _reply(msg, stage, rnd, **{SECAGG_KEYS: ConfigRecord({str(me): keys.to_bytes()})})
        saved = context.state.config_records.get(STATE)
        if saved is None:
            raise ClientError(f"secagg {stage!r} message arrived but this node has no round in progress.")
        client = SecAggClient.from_fields(dict(saved))
        plan = {k[5:]: v for k, v in saved.items() if k.startswith("plan.")}
        if rnd != client.params.round:
            raise ClientError(f"secagg message is for round {rnd}; this node is in round {client.params.round}.")
        if stage == "share-keys":
            keys = {v: PublicKeys.from_bytes(v, b) for v, b in node_map(msg.content.config_records.get(SECAGG_KEYS),
                                                                          SECAGG_KEYS).items()}
            cts = client.share_keys(keys)
            reply = _reply(msg, stage, rnd, **{SECAGG_SHARES: ConfigRecord({str(v): ct for v, ct in cts.items()})})
        elif stage == "masked-input":
            reply = _masked_input(msg, context, client, plan)
            context.state.config_records[LAST_INPUT] = ConfigRecord({"round": client.params.round})
        elif stage == "unmask":
            surv, drop = rec.get("survivors"), rec.get("dropped")
            if not isinstance(surv, list) or not isinstance(drop, list):
                raise ClientError("secagg unmask must list survivors and dropped nodes.")
            shares = client.unmask([int(v) for v in surv], [int(v) for v in drop])
            reply = _reply(msg, stage, rnd, **{SECAGG_SHARES: ConfigRecord(shares)})
        else:
            raise ClientError(f"secagg stage must be one of setup, share-keys, masked-input, unmask. Found {stage[:20]!r}.")
    except PrivacyError as exc:
        raise ClientError(f"secagg {stage}: {exc}") from None
    if client.stage == "done":
        context.state.config_records.pop(STATE, None)  # the round's secrets are no longer needed
    else:
        context.state.config_records[STATE] = ConfigRecord({**client.to_fields(), **{f"plan.{k}": v for k, v in plan.items()}})
    return reply
