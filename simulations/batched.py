"""Batched local training: the K clients of a round that share a model, trained together as one torch computation.

The one-by-one loop (``Task.train``: SGD with momentum over each client's shuffled mini-batches, plus FedProx's
proximal term) is rewritten over parameters stacked along a new leading axis K, with
``torch.func.functional_call`` + ``vmap`` + ``grad_and_value``; the result equals training the clients one by
one within float tolerance (summation order differs, nothing else):

- each client draws ``torch.randperm(n_k, generator=generators[k])`` once per epoch, as the loop does, so its
  batches are exactly the loop's, in order, and its generator ends in the same state (codecs draw from it next);
- a client's last batch, smaller than ``batch_size``, is padded with its own examples and masked out of the loss
  (a mean over the real examples, as the loop's batch mean);
- a client whose epoch has ended takes no step: clients are sorted by size, so those still training at step s
  are a prefix of the chunk and only that prefix is computed and updated (the "active" mask as a slice);
- SGD's update is torch.optim.SGD's (dampening 0, no Nesterov): the momentum buffer is the first gradient, then
  ``buf = momentum * buf + grad``; ``p -= lr * buf`` (``p -= lr * grad`` with momentum 0).

The loss is computed per example (``task.loss`` on a batch of one, vmapped), so a task's ``loss`` must be a pure
function of (output, target) whose batch value is the mean of its per-example values (cross-entropy, MSE, token
cross-entropy over sequences of equal length are). :func:`batched_supported` says which models qualify.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_map

from clients import Dataset, Task, TrainSettings

DEFAULT_CHUNK = 512  # clients trained at once: 3 stacked states (weights, gradients, momentum) of
# chunk x numel float32 each, ~20 MB apiece for the digits MLP (9,610 parameters); 256-512 ran fastest on CPU


def batched_supported(task: Task, model: nn.Module) -> str | None:
    """None when ``task``'s ``model`` can be trained by :func:`train_batched`, else a one-line reason."""
    name = type(task).__name__
    if type(task).train is not Task.train:
        return (f"task {name} brings its own train: only the default loop (Task.train) can be batched; its clients "
                "train one at a time")
    buffer = next((n for n, _ in model.named_buffers()), None)
    if buffer is not None:
        return (f"the model has buffers ({buffer!r}): BatchNorm's running statistics cannot be updated inside vmap, "
                "and padding a client's last batch would change its batch statistics")
    norm = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)), None)
    if norm is not None:
        return (f"the model normalises by batch statistics ({norm!r}): padding a client's last batch would change "
                "them")
    drop = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0), None)
    if drop is not None:
        return (f"the model draws random numbers in training ({drop!r}, dropout): the one-by-one loop draws them "
                "from torch's global generator in client order, which a batched step cannot reproduce")
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameters (SGD refuses an empty parameter list)"
    if task.layout().local:
        return (f"task {name} keeps entries on each client ({task.layout().local[0]!r}): their per-client state is "
                "not in the global weights")
    return None


def train_batched(task: Task, global_flat: torch.Tensor, datasets: list[Dataset], settings: TrainSettings,
                  generators: list[torch.Generator], *,
                  chunk: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Train K clients from ``global_flat`` as ``task.train`` trains each one, ``chunk`` clients at a time.

    Parameters
    ----------
    task, global_flat
        The task, and the global model as its layout's flat float32 vector; its device is the device used.
    datasets, generators
        Client k's data and its own CPU generator (distinct objects: each is advanced as the loop would).
    settings
        Local epochs, batch size, learning rate, momentum and FedProx's ``proximal_mu``.
    chunk
        Clients trained in one computation (memory grows with it; results do not change).

    Returns
    -------
    (deltas, losses)
        ``(K, numel)`` float32 deltas (trained minus global) and the ``(K,)`` float64 train losses (the mean
        over examples of each batch's mean loss, weighted by batch size, as ``Task.train`` reports).
    """
    model = _checked_model(task, global_flat, datasets, generators, chunk)
    sizes = np.array([len(d) for d in datasets], dtype=np.int64)
    order = np.argsort(-sizes, kind="stable")  # largest first: the clients still training form a prefix
    deltas = torch.empty(len(datasets), task.layout().numel, dtype=torch.float32, device=global_flat.device)
    losses = torch.zeros(len(datasets), dtype=torch.float64, device=global_flat.device)
    for start in range(0, len(order), chunk):
        ks = order[start:start + chunk]
        d, loss = _train_chunk(task, model, global_flat, [datasets[k] for k in ks], settings,
                               [generators[k] for k in ks])
        where = torch.as_tensor(ks, device=global_flat.device)
        deltas[where], losses[where] = d, loss
    return deltas, losses


def _checked_model(task: Task, global_flat: torch.Tensor, datasets: list[Dataset], generators: list[torch.Generator],
                   chunk: int) -> nn.Module:
    """The task's model on ``global_flat``'s device, in training mode, once the inputs are checked."""
    if len(datasets) != len(generators):
        raise ValueError(f"datasets and generators must have one entry per client. Found {len(datasets)} and "
                         f"{len(generators)}.")
    if len({id(g) for g in generators}) != len(generators):
        raise ValueError("generators must be distinct objects, one per client (the loop would draw a shared one's "
                         "permutations in client order). Found one object given twice.")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1. Found {chunk}.")
    if global_flat.dtype != torch.float32 or global_flat.numel() != task.layout().numel:
        raise ValueError(f"global_flat must be the task's {task.layout().numel} float32 weights. Found "
                         f"{global_flat.numel()} {global_flat.dtype}.")
    with torch.random.fork_rng(devices=[]):  # the model's own initial values are never used
        model = task.build().to(global_flat.device)
    reason = batched_supported(task, model)
    if reason is not None:
        raise ValueError(f"task {type(task).__name__} cannot be trained batched: {reason}.")
    return model.train()


def _initial_state(task: Task, model: nn.Module, global_flat: torch.Tensor,
                   m: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable entries stacked m times, frozen entries once), each cast to its entry's dtype as the loop's
    ``layout.load`` casts it."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    stacked, frozen = {}, {}
    for e in task.layout().entries:
        value = global_flat[e.offset:e.offset + e.numel].view(e.shape).to(e.dtype)
        if e.name in trainable:
            stacked[e.name] = value.expand(m, *e.shape).clone()
        else:
            frozen[e.name] = value
    return stacked, frozen


def _client_step(task: Task, model: nn.Module, frozen: dict[str, torch.Tensor]):
    """vmap(grad_and_value) of one client's batch loss: (params, x (B, ...), y (B, ...), mask (B,)) -> (grads,
    the mean loss over the batch's real examples)."""

    def example_loss(out, y):  # task.loss on a batch of one: a per-example value
        return task.loss(tree_map(lambda t: t.unsqueeze(0), out), y.unsqueeze(0))

    def batch_loss(params, x, y, mask):
        out = torch.func.functional_call(model, {**params, **frozen}, (x,))
        per = torch.func.vmap(example_loss)(out, y)
        if per.shape != mask.shape:
            raise ValueError(f"task {type(task).__name__}'s loss must return one scalar for a batch. Found shape "
                             f"{tuple(per.shape[1:])} for a batch of one.")
        # padded rows are real examples of the client (finite values), masked out of the mean
        return torch.where(mask, per, 0).sum() / mask.sum()

    return torch.func.vmap(torch.func.grad_and_value(batch_loss))


def _epoch_batches(perms: list[torch.Tensor], offsets: torch.Tensor, steps: int,
                   batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices into the chunk's concatenated data, ``(m, steps, batch)``, and the mask of real examples: client
    k's row is ``perms[k] + offsets[k]`` in order, padded with its first example."""
    sizes = torch.tensor([len(p) for p in perms], device=offsets.device)
    slots = torch.arange(steps * batch, device=offsets.device)
    mask = slots < sizes[:, None]
    index = offsets[:, None].expand(len(perms), steps * batch).clone()
    index[mask] = torch.cat(perms).to(offsets.device) + offsets.repeat_interleave(sizes)  # row-major: each in order
    return index.view(len(perms), steps, batch), mask.view(len(perms), steps, batch)


@torch.no_grad()
def _sgd_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], bufs: dict[str, torch.Tensor],
              m: int, settings: TrainSettings, anchor: dict[str, torch.Tensor]) -> None:
    """torch.optim.SGD's step on the first ``m`` clients' stacked tensors, FedProx's gradient added first."""
    for name, g in grads.items():
        p = params[name][:m]
        if settings.proximal_mu > 0:  # d/dp of mu/2 ||p - p_global||^2
            g = g + settings.proximal_mu * (p - anchor[name])
        if settings.momentum > 0:
            if name not in bufs:  # SGD's first step (every client with data takes it): the buffer is the gradient
                bufs[name] = g  # (a fresh tensor from grad_and_value: SGD's clone is not needed)
            else:
                g = bufs[name][:m].mul_(settings.momentum).add_(g)
        p.add_(g, alpha=-settings.lr)


def _train_chunk(task: Task, model: nn.Module, global_flat: torch.Tensor, datasets: list[Dataset],
                 settings: TrainSettings, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (deltas, losses); ``datasets`` sorted by size, largest first."""
    device, m = global_flat.device, len(datasets)
    x = torch.from_numpy(np.ascontiguousarray(np.concatenate([d.x for d in datasets]))).to(device)
    y = torch.from_numpy(np.ascontiguousarray(np.concatenate([d.y for d in datasets]))).to(device)
    sizes = [len(d) for d in datasets]
    offsets = torch.tensor(np.cumsum([0, *sizes[:-1]]), dtype=torch.long, device=device)
    steps = [math.ceil(n / settings.batch_size) for n in sizes]
    active = [sum(s > i for s in steps) for i in range(max(steps, default=0))]  # clients still training at step i
    params, frozen = _initial_state(task, model, global_flat, m)
    anchor = {k: v[0].clone() for k, v in params.items()} if settings.proximal_mu > 0 else {}
    step, bufs = _client_step(task, model, frozen), {}
    total = torch.zeros(m, dtype=torch.float64, device=device)
    for _ in range(settings.local_epochs):
        perms = [torch.randperm(n, generator=g) for n, g in zip(sizes, generators, strict=True)]
        index, mask = _epoch_batches(perms, offsets, len(active), settings.batch_size)
        for i, a in enumerate(active):
            rows, real = index[:a, i], mask[:a, i]
            grads, loss = step({k: v[:a] for k, v in params.items()}, x[rows], y[rows], real)
            _sgd_step(params, grads, bufs, a, settings, anchor)
            total[:a] += loss.double() * real.sum(1)
    seen = torch.tensor(sizes, dtype=torch.float64, device=device) * settings.local_epochs
    return _deltas(task, params, frozen, global_flat, m), total / seen.clamp(min=1)


def _deltas(task: Task, params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], global_flat: torch.Tensor,
            m: int) -> torch.Tensor:
    """The chunk's flat trained weights, in the layout's order and as float32 (as ``layout.flatten``), minus
    ``global_flat``."""
    parts = [params[e.name].reshape(m, -1).float() if e.name in params
             else frozen[e.name].reshape(1, -1).float().expand(m, -1) for e in task.layout().entries]
    return torch.cat(parts, dim=1).sub_(global_flat)
