"""fedshield's ClientApp: load the global model, train locally, reply with the delta."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import time
import zlib
from logging import WARNING
from typing import Any

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from aggregation import AggregationError, array_to_tensor, get_device, tensor_to_array
from aggregation._errors import shown

from ._errors import ClientError
from .data import client_data, client_eval_data
from .ledger import OWNER_DELTA, STATE_DIR, LedgerFile, check_owner_limits, ledger_key, owner_limits
from .profile import measure_profile
from .config import build_config
from .protocol import ARRAYS as ARRAYS_NAME
from .protocol import CONFIG as CONFIG_NAME
from .protocol import (CLIENT_TIME, CODEC, EVAL_PREFIX, LOCAL_DP, MAX_METRIC, METRICS, WEIGHTS, TrainInstruction, codec_from_record, metric_values, parse_train_message, record_of,
                       train_reply_content)
from .config import BUILTIN_TASKS, TaskSpec
from .tasks import Task, evaluated, load_task
from .tasks.base import augmented, augments
from .tasks.layout import frozen_match
from .training import train_local

app = ClientApp()

THREADS_VAR = "FEDSHIELD_TORCH_THREADS"


def torch_threads() -> int | None:
    """``FEDSHIELD_TORCH_THREADS`` as a thread count (None: unset, torch's default); ClientError if it is
    not an integer in [1, 1024] (``fedshield agent start`` checks it before the SuperNode starts)."""
    raw = os.environ.get(THREADS_VAR, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit() and 1 <= int(raw) <= 1024):
        raise ClientError(f"{THREADS_VAR} must be an integer in [1, 1024]. Found {shown(raw, 40)}.")
    return int(raw)


try:
    _threads = torch_threads()
except ClientError:  # reported by the agent's own check; the ClientApp still loads with torch's default
    _threads = None
if _threads:
    torch.set_num_threads(_threads)


RESIDUAL = "fedshield.residual"
DP_LEDGER = "fedshield.local-dp-ledger"
LOCAL_STATE = "fedshield.local-state"  # what the task keeps on the client (FedBN's statistics, integer buffers)
NODE_TASK = "task"  # node config: the task an agent trains ("builtin": any built-in one); absent in simulation


def node_task(spec: TaskSpec, node_config) -> TaskSpec:
    """The task this node trains for a message naming ``spec``: an agent's own (``--task``), whose class name
    the message must name (its path differs between machines), else the message's. A coordinator cannot make
    an agent import a module the agent's owner did not name."""
    own = node_config.get(NODE_TASK)
    if own is None:
        return spec
    own = str(own)
    if own == "builtin":
        if spec.task not in BUILTIN_TASKS:
            raise ClientError(f"this node trains built-in tasks only (started without --task). Found the coordinator's "
                              f"task {shown(spec.task, 200)}: start the agent with --task naming it.")
        return spec
    if spec.task.rpartition(":")[2] != own.rpartition(":")[2]:
        raise ClientError(f"this node trains task {shown(own, 200)}. Found the coordinator's task {shown(spec.task, 200)}.")
    return dataclasses.replace(spec, task=own)


def train_with_local_dp(model, data, instr, record, context: Context, task: Task) -> dict[str, float]:
    """DP-SGD with Opacus; this client's privacy ledger persists in Context.state across rounds.

    The sampling and noise generator is seeded from the OS, never from anything the
    coordinator knows (a known seed would let it replay and remove the noise).
    """
    from .dp_training import LocalDpSettings, planned_epsilon, train_local_dp

    dp = build_config(LocalDpSettings, dict(record), "local-dp")
    check_owner_limits(context.node_config, dp.noise_multiplier)
    min_noise, max_eps = owner_limits(context.node_config)
    if min_noise > 0 or math.isfinite(max_eps):
        # The owner's limits are the device's, not the coordinator's: Poisson sampling (what the accountant
        # assumes) and epsilon at the owner's delta, whatever the coordinator's record says.
        dp = dataclasses.replace(dp, delta=min(dp.delta, OWNER_DELTA), poisson_sampling=True)
    store = (LedgerFile(context.node_config[STATE_DIR], ledger_key(instr.task.task, data, context.node_config))
             if STATE_DIR in context.node_config else None)
    with store.locked() if store is not None else contextlib.nullcontext():
        ledger = record_of(context.state, DP_LEDGER, ConfigRecord)
        state = store.load() if store is not None else None  # the device's file outlives this run's Context
        if state is None and ledger is not None:
            state = json.loads(str(ledger["state"]))
        if math.isfinite(max_eps):
            after = planned_epsilon(state, dp, instr.train, len(data))
            if after > max_eps:
                raise ClientError(f"this round would bring this data's local epsilon to {after:.4g}, past its owner's "
                                  f"--max-local-epsilon {max_eps:g}: refused before training.")
        augment = functools.partial(augmented, task) if augments(task) else None
        _, stats, state = train_local_dp(model, data, instr.train, dp, None, state, loss_fn=task.loss, augment=augment)
        if store is not None:
            store.save(state)
    context.state[DP_LEDGER] = ConfigRecord({"state": json.dumps(state)})
    # no train-loss: an exact statistic of the private data, which the noise does not cover, would reach the coordinator
    return {"train-time-s": stats["train-time-s"], "local-epsilon": stats["epsilon"]}


def encode_with_feedback(codec, delta: torch.Tensor, context: Context, gen: torch.Generator):
    """Encode ``delta`` plus the residual kept from earlier rounds; keep the new residual.

    The residual (error feedback) lives in the node's Context.state, which Flower
    keeps on the device between rounds of a run; it never leaves the client.
    """
    residual = None
    saved = record_of(context.state, RESIDUAL, ArrayRecord)
    if saved is not None:
        try:
            residual = array_to_tensor(saved["r"], "float32", delta.numel()).clone()
        except AggregationError:
            residual = None  # another model or codec: start afresh
    encoded, new_residual = codec.encode(delta, residual, gen)
    if new_residual is None:
        context.state.pop(RESIDUAL, None)
    else:
        context.state[RESIDUAL] = ArrayRecord({"r": tensor_to_array(new_residual)})
    return encoded


def training_identity(context: Context) -> int:
    """What keys a node's training randomness: its partition, else its data file, else its node id.

    Keyed by the data (not the node id the SuperLink hands out), a rerun on the same
    data draws the same batches.
    """
    if "partition-id" in context.node_config:
        return int(context.node_config["partition-id"])
    if "data-path" in context.node_config:
        return zlib.crc32(str(context.node_config["data-path"]).encode())
    return int(context.node_id)


def global_weights(msg: Message, context: Context, private: bool, memo: dict | None = None):
    """The message's instruction, this node's task and layout, and the global weights, checked:
    ``(instr, task, layout, weights)``. ``memo`` (a batch of messages held in this process, sharing their
    records): each distinct (config, weights) pair is parsed and checked once, not once per node."""
    if memo is not None:
        content = msg.content
        key = (id(content.get(CONFIG_NAME)), id(content.get(ARRAYS_NAME)), private,
               str(context.node_config.get(NODE_TASK)))
        if key not in memo:
            memo[key] = global_weights(msg, context, private)
        return memo[key]
    instr, arrays = parse_train_message(msg)
    task = load_task(node_task(instr.task, context.node_config), data="data-path" not in context.node_config)
    layout = task.layout(private)
    numel = layout.numel  # before the model is built: a huge one asked with a short array is refused
    try:
        weights = array_to_tensor(arrays[WEIGHTS], "float32", numel)
    except AggregationError as exc:  # a refusal, not an exception past the ClientApp
        raise ClientError(f"'weights' must be the task's {numel} float32 parameters: {exc}") from None
    if not bool(torch.isfinite(weights).all()):  # else a whole round of training ends in a NaN update
        raise ClientError("the global model must hold only finite values. Found NaN or infinity in 'weights'.")
    if (layout.fixed or instr.frozen) and not frozen_match(task.frozen_summary(instr.seed, private), instr.frozen):
        raise ClientError(f"task {task.spec.task!r}: the frozen parameters this node builds "
                          f"({', '.join(layout.fixed[:3]) or 'none'}{' ...' if len(layout.fixed) > 3 else ''}) differ "
                          "from the coordinator's: build them from torch's seeded generator or the same file "
                          "everywhere, or set federate_frozen = True")
    return instr, task, layout, weights


def global_model(msg: Message, context: Context, private: bool):
    """``global_weights`` and this node's model loaded with them and its own kept entries (FedBN's statistics):
    ``(instr, task, layout, weights, model)``."""
    instr, task, layout, weights = global_weights(msg, context, private)
    return instr, task, layout, weights, global_model_from(task, layout, weights, context, private, instr.seed)


def global_model_from(task: Task, layout, weights: torch.Tensor, context: Context, private: bool, seed: int):
    """The task's model on the training device, loaded with ``weights`` and the node's kept entries (before its
    first round, the task's ``initial_local(seed)``)."""
    model = task.build(private).to(get_device()) if private else task.working_model(get_device())
    layout.load(model, weights)
    if layout.local:
        # (a kept entry missing or that no longer fits starts anew, never from the last node's value)
        layout.load_local(model, kept_entries(context), start=task.initial_local(seed, private))
    return model


def kept_entries(context: Context) -> dict[str, torch.Tensor]:
    """What this node keeps of its model between rounds (``layout.kept``: FedBN's statistics, integer
    buffers), as its last training left it, flat (``layout.load_local`` gives each its shape; read-only views of
    the record: copy before writing); empty before its first round."""
    kept = record_of(context.state, LOCAL_STATE, ArrayRecord)
    out: dict[str, torch.Tensor] = {}
    for name, array in (kept or {}).items():
        try:  # as keep_entries writes them: flat npy, read at the header's offset (Flower's np.load parsed
            out[name] = array_to_tensor(array, array.dtype)  # each header anew: 2.9 ms a ResNet's client)
        except AggregationError:  # another dtype, or a record from before: Flower's reader
            out[name] = torch.from_numpy(array.numpy().copy()).reshape(-1)
    return out


def keep_entries(context: Context, entries: dict[str, torch.Tensor]) -> None:
    """Keep ``entries`` (``layout.local_state``'s) in the node's Context, each one flat."""
    arrays = {}
    for name, tensor in entries.items():
        if tensor.dtype == torch.bfloat16:  # (not in numpy: as float32, exact, cast back on load)
            tensor = tensor.float()
        try:
            arrays[name] = tensor_to_array(tensor)
        except AggregationError:  # another dtype outside the wire's (float64, bool...): Flower's own form
            arrays[name] = Array(tensor.detach().cpu().reshape(-1).numpy())
    context.state[LOCAL_STATE] = ArrayRecord(arrays)


@dataclasses.dataclass
class UpdateJob:
    """One node's train message, checked and ready to train: what training needs and what its reply reports."""

    instr: TrainInstruction
    task: Task
    data: Any
    weights: torch.Tensor
    generator: torch.Generator
    start: float


def start_update(msg: Message, context: Context, memo: dict | None = None) -> UpdateJob:
    """A non-private train message's job: instruction, task, data, weights and the node's training generator
    (keyed by its data, so a rerun draws the same batches). The batched engine trains many such jobs at once."""
    start = time.perf_counter()
    instr, task, _, weights = global_weights(msg, context, private=False, memo=memo)
    data = client_data(task, context.node_config)
    check_owner_limits(context.node_config, None)
    return UpdateJob(instr, task, data, weights, training_generator(instr, context), start)


def training_generator(instr: TrainInstruction, context: Context) -> torch.Generator:
    """The node's generator for a round's batches and codec draws, keyed by run seed, round and its data."""
    return torch.Generator().manual_seed(hash((instr.seed, instr.round, training_identity(context))) & 0x7FFFFFFF)


def update_metrics(job: UpdateJob, delta: torch.Tensor, stats: dict[str, float], context: Context) -> dict[str, int | float]:
    """The reply's metrics for a trained job; ClientError when training diverged."""
    if not bool(torch.isfinite(delta).all()):  # refused here, not as an encoder's exception past the ClientApp
        raise ClientError("training diverged: the update holds NaN or infinity (a global model or learning rate "
                          "too large for this data).")
    data = job.data
    return {
        "num-examples": len(data),
        "base-version": job.instr.version,
        **({"train-loss": float(stats["train-loss"])} if "train-loss" in stats else {}),
        "train-time-s": float(stats["train-time-s"]),
        **({"local-epsilon": float(stats["local-epsilon"])} if "local-epsilon" in stats else {}),
        # the batch training used: the coordinator's batch-size is capped by this node's data (a 65536-row
        # synthetic batch of a wide model took gigabytes where training itself took one batch of 155)
        **measure_profile(job.task, get_device(), batch_size=min(job.instr.train.batch_size, len(data)),
                          node_config=context.node_config, data=data),
        CLIENT_TIME: time.perf_counter() - job.start,
    }


def local_update(msg: Message, context: Context) -> tuple[torch.Tensor, dict[str, int | float], torch.Generator]:
    """Train on the node's data from the message's global model; return the delta (new - old) and metrics."""
    local_dp = record_of(msg.content, LOCAL_DP, ConfigRecord)
    if local_dp is None:
        job = start_update(msg, context)
        instr, task, weights = job.instr, job.task, job.weights
        layout = task.layout()
        model = global_model_from(task, layout, weights, context, private=False, seed=instr.seed)
        stats = train_local(model, job.data, instr.train, job.generator, task)
    else:
        start = time.perf_counter()
        instr, task, layout, weights, model = global_model(msg, context, private=True)
        data = client_data(task, context.node_config)
        job = UpdateJob(instr, task, data, weights, training_generator(instr, context), start)
        stats = train_with_local_dp(model, data, instr, local_dp, context, task)
    if layout.fixed and (name := layout.changed_fixed(model, task.initial_local(instr.seed, local_dp is not None))):
        raise ClientError(f"task {task.spec.task!r}: parameter {name!r} was frozen when built (requires_grad=False), "
                          "so it stays off the wire, but training changed it: set federate_frozen = True on the task")
    if layout.kept:
        keep_entries(context, layout.local_state(model))
    delta = layout.flatten(model).cpu().sub_(weights)
    return delta, update_metrics(job, delta, stats, context), job.generator


def run_train(msg: Message, context: Context) -> Message:
    """Handle one train message: the whole client-side round."""
    start = time.perf_counter()
    # the codec record is checked before training: a bad one refused after it wasted the round (and,
    # under local DP, charged its steps to the node's budget for a reply never sent)
    codec = codec_from_record(record_of(msg.content, CODEC, ConfigRecord))
    delta, metrics, gen = local_update(msg, context)
    return train_reply(msg, context, codec, delta, metrics, gen, start)


def train_reply(msg: Message, context: Context, codec, delta: torch.Tensor, metrics: dict[str, int | float],
                gen: torch.Generator, start: float) -> Message:
    """The reply to a train message: ``delta`` encoded by ``codec`` with the node's error feedback, and metrics."""
    encoded = encode_with_feedback(codec, delta, context, gen)
    metrics[CLIENT_TIME] = time.perf_counter() - start
    return Message(train_reply_content(encoded, metrics), reply_to=msg)


def refusal(msg: Message, exc: ClientError) -> Message:
    """A message this node refuses (its owner's limits, a malformed instruction): an error reply with the
    reason, and one line in the node's log. Raised instead, Flower logged a traceback in the node's log
    every round, and the coordinator read ``<class 'clients._errors.ClientError'>`` before the reason."""
    log(WARNING, "[fedshield] node refused a message: %s", exc)
    return Message(error=Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"refused by the node: {exc}"),
                   reply_to=msg)


def answer(handler, msg: Message, context: Context) -> Message:
    """``handler``'s reply, or the node's refusal when it raises ClientError."""
    try:
        return handler(msg, context)
    except ClientError as exc:
        return refusal(msg, exc)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return answer(run_train, msg, context)


def run_evaluate(msg: Message, context: Context) -> Message:
    """Handle one evaluate message: the task's evaluate of the global model on this node's held-out data."""
    _, task, _, _, model = global_model(msg, context, private=False)
    data = client_eval_data(task, context.node_config)
    out = evaluated(task, model, data, "this node's held-out data")
    metrics: dict[str, int | float] = {"num-examples": len(data)}
    for key, value in metric_values(out).items():  # as the coordinator records its own evaluation's
        if math.isfinite(value) and abs(value) <= MAX_METRIC:  # (one without a usable value on this node's data: left
            # out, not the whole reply, which the coordinator would refuse)
            metrics[f"{EVAL_PREFIX}{key}"] = value
    return Message(RecordDict({METRICS: MetricRecord(metrics)}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return answer(run_evaluate, msg, context)


@app.train("secagg")
def train_secagg(msg: Message, context: Context) -> Message:
    """One stage of a SecAgg+ round (see clients/secure.py)."""
    from .secure import run_secagg_stage

    return answer(run_secagg_stage, msg, context)
