"""fedshield's ClientApp: load the global model, train locally, reply with the delta."""

from __future__ import annotations

import os
import time

import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from aggregation import array_to_tensor, get_device, tensor_to_array

from .data import client_data
from .protocol import WEIGHTS, parse_train_message, train_reply_content
from .tasks import get_task
from .training import flat_params, load_flat, train_local

app = ClientApp()

_threads = os.environ.get("FEDSHIELD_TORCH_THREADS")
if _threads:
    torch.set_num_threads(max(1, int(_threads)))


def run_train(msg: Message, context: Context) -> Message:
    """Handle one train message: the whole client-side round."""
    start = time.perf_counter()
    instr, arrays = parse_train_message(msg)
    task = get_task(instr.task)
    data = client_data(task, context.node_config)
    device = get_device()
    model = task.build_model().to(device)
    numel = sum(p.numel() for p in model.parameters())
    weights = array_to_tensor(arrays[WEIGHTS], "float32", numel)
    load_flat(model, weights)
    who = int(context.node_config.get("partition-id", context.node_id))
    gen = torch.Generator().manual_seed(hash((instr.seed, instr.round, who)) & 0x7FFFFFFF)
    stats = train_local(model, data, instr.train, gen)
    delta = flat_params(model).cpu().sub_(weights)
    metrics = {
        "num-examples": len(data),
        "base-version": instr.version,
        "train-loss": float(stats["train-loss"]),
        "train-time-s": float(stats["train-time-s"]),
        "client-time-s": time.perf_counter() - start,
    }
    return Message(train_reply_content(tensor_to_array(delta), metrics), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return run_train(msg, context)
