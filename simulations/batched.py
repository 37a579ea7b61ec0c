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
  ``buf = momentum * buf + grad``; ``p -= lr * buf`` (``p -= lr * grad`` with momentum 0);
- a model with buffers (BatchNorm's running statistics and batch count, any other) or BatchNorm layers gets
  every buffer stacked per client (updated in place inside vmap, as each client's own module would be) and no
  padding: each epoch's full batches go one step at a time over the clients that have one (a prefix: clients
  are sorted by their full batches), then each client's partial last batch, those of one size in one
  computation (gathered by index and written back), so batch statistics are each client's own and a step is
  computed on real examples only; with BatchNorm a last batch of one joins the batch before it, as in the loop;
- an embedding with ``sparse=True`` gradients is run with dense ones (the same values: vmap's autograd has no
  sparse tensors, and the loop's SGD, momentum included, steps a sparse gradient to what a dense one gives);
- the entries a client keeps (``layout().kept``: integer buffers, FedBN's statistics, ``keep_local`` names)
  start from the client's kept values (``kept``) and are handed back after training, as the ClientApp keeps them.

The loss is computed per example (``task.loss`` on a batch of one, vmapped), so a task's ``loss`` must be a pure
function of (output, target) whose batch value is the mean of its per-example values (cross-entropy, MSE, token
cross-entropy over sequences of equal length are). :func:`batched_supported` says which models qualify.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from clients import Dataset, Task, TrainSettings
from clients.tasks.base import augments, normalises_by_batch
from clients.tasks.inputs import call_args, concat, take, to_tensors, unsqueeze
from clients.tasks.layout import fits

DEFAULT_CHUNK = 512  # clients trained at once: 3 stacked states (weights, gradients, momentum) of
# chunk x numel float32 each, ~20 MB apiece for the digits MLP (9,610 parameters); 256-512 ran fastest on CPU


def batched_supported(task: Task, model: nn.Module) -> str | None:
    """None when ``task``'s ``model`` can be trained by :func:`train_batched`, else a one-line reason."""
    name = type(task).__name__
    if type(task).train is not Task.train:
        return (f"task {name} brings its own train: only the default loop (Task.train) can be batched; its clients "
                "train one at a time")
    if augments(task):
        return (f"task {name} augments its batches (Task.augment) with each client's generator, which a step batched "
                "over clients cannot reproduce")
    norm = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                 and m.track_running_stats and m.momentum is None), None)
    if norm is not None:
        return (f"BatchNorm {norm!r} has momentum=None (a cumulative average): it reads its batch count as a Python "
                "number, which a step batched over clients cannot")
    drop = next((n for n, m in model.named_modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0), None)
    if drop is not None:
        return (f"the model draws random numbers in training ({drop!r}, dropout): the one-by-one loop draws them "
                "from torch's global generator, seeded per client and round, which a batched step cannot reproduce")
    emb = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding | nn.EmbeddingBag)
                and (m.max_norm is not None or m.scale_grad_by_freq)), None)
    if emb is not None:
        what = ("renormalises the rows it reads in place (max_norm)" if emb[1].max_norm is not None else
                "scales its gradient by how often a batch reads each row (scale_grad_by_freq)")
        return (f"embedding {emb[0]!r} {what}, which a step batched over clients (each example's loss apart) "
                "cannot reproduce")
    bag = next((n for n, m in model.named_modules() if isinstance(m, nn.EmbeddingBag) and m.sparse
                and m.mode == "max"), None)
    if bag is not None:  # the loop refuses it (torch: "max mode does not support sparse weights"): so must this
        return f"EmbeddingBag {bag!r} has mode='max' with sparse gradients, which torch does not train"
    if not any(p.requires_grad for p in model.parameters()):
        return "the model has no trainable parameters (SGD refuses an empty parameter list)"
    return None


def train_batched(task: Task, global_flat: torch.Tensor, datasets: list[Dataset], settings: TrainSettings,
                  generators: list[torch.Generator], *, chunk: int = DEFAULT_CHUNK,
                  kept: list[dict[str, torch.Tensor]] | None = None, seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
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
    kept
        One dict per client of the entries it keeps (``task.layout().kept``), as ``layout.local_state`` gives
        them (or flat); a name missing (or of another size or dtype) starts from ``task.initial_local(seed)``, as
        the ClientApp starts a node's first round. Each dict is replaced in place by the client's entries after
        training (CPU copies). None: every client starts from ``initial_local(seed)`` and nothing is handed back.
    seed
        The run's seed (``initial_local``'s).

    Returns
    -------
    (deltas, losses)
        ``(K, numel)`` float32 deltas (trained minus global) and the ``(K,)`` float64 train losses (the mean
        over examples of each batch's mean loss, weighted by batch size, as ``Task.train`` reports).
    """
    model = _checked_model(task, global_flat, datasets, generators, chunk)
    if kept is not None and len(kept) != len(datasets):
        raise ValueError(f"kept must have one dict per client. Found {len(kept)} for {len(datasets)} clients.")
    sizes = np.array([len(d) for d in datasets], dtype=np.int64)
    by_batch = normalises_by_batch(model)
    full, _ = _split(sizes, settings.batch_size, by_batch)
    # largest first (padded path: the clients still training form a prefix), by full batches (the exact path's)
    order = np.lexsort((-sizes, -full))
    deltas = torch.empty(len(datasets), task.layout().numel, dtype=torch.float32, device=global_flat.device)
    losses = torch.zeros(len(datasets), dtype=torch.float64, device=global_flat.device)
    for start in range(0, len(order), chunk):
        ks = order[start:start + chunk]
        d, loss = _train_chunk(task, model, global_flat, [datasets[k] for k in ks], settings,
                               [generators[k] for k in ks], None if kept is None else [kept[k] for k in ks], seed,
                               by_batch)
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
    for m in model.modules():  # the same gradient, dense: vmap's autograd has no sparse tensors (the loop's SGD
        if isinstance(m, nn.Embedding | nn.EmbeddingBag):  # steps a sparse one to the same values)
            m.sparse = False
    return model.train()


def _initial_state(task: Task, model: nn.Module, global_flat: torch.Tensor, m: int,
                   kept: list[dict[str, torch.Tensor]] | None, seed: int) -> tuple[dict, dict, dict]:
    """(trainable parameters stacked m times, buffers stacked m times, frozen parameters once): the layout's
    entries from ``global_flat`` cast to their dtype (as ``layout.load``), the kept ones from each client's
    ``kept`` dict where it holds them (as ``layout.load_local``), else from ``task.initial_local(seed)``, the
    rest as built."""
    layout = task.layout()
    federated = {e.name: global_flat[e.offset:e.offset + e.numel].view(e.shape).to(e.dtype) for e in layout.entries}
    local = set(layout.local)
    first = task.initial_local(seed) if local else {}  # a client's first start for what it keeps

    def stacked(name: str, built: torch.Tensor) -> torch.Tensor:
        value = federated.get(name, first.get(name, built).detach().to(built.device))  # (initial_local's: CPU)
        out = value.expand(m, *value.shape).clone()
        for k, saved in enumerate(kept or ()):
            v = saved.get(name) if name in local else None
            if v is not None and fits(v, built):  # (flat or shaped, as layout.load_local)
                out[k].copy_(v.reshape(built.shape))
        return out

    params, buffers, frozen = {}, {}, {}
    fixed = set(layout.fixed)
    for name, p in model.named_parameters():
        if p.requires_grad:
            params[name] = stacked(name, p)
        elif name in fixed:  # frozen and off the wire: the run seed's build, one copy for all
            frozen[name] = first[name].to(p.device, p.dtype)
        elif name in local:  # a frozen entry each client keeps for itself: its own value, never stepped
            buffers[name] = stacked(name, p)
        else:
            frozen[name] = federated.get(name, p.detach())
    for name, b in model.named_buffers():
        buffers[name] = stacked(name, b)
    return params, buffers, frozen


def _client_step(task: Task, model: nn.Module, frozen: dict[str, torch.Tensor]):
    """vmap(grad_and_value) of one client's batch loss: (params, buffers, x (B, ...), y (B, ...), mask (B,)) ->
    (grads, the mean loss over the batch's real examples); the buffers are updated in place."""

    def batch_loss(params, buffers, x, y, mask):
        out = torch.func.functional_call(model, {**params, **buffers, **frozen}, *call_args(x))
        parts, rebuilt = out, lambda o: o
        if dataclasses.is_dataclass(out) and not isinstance(out, type):  # an output object, which vmap cannot take:
            parts = {f.name: getattr(out, f.name) for f in dataclasses.fields(out) if f.init}  # its fields, put back
            rebuilt = lambda f: dataclasses.replace(out, **f)
        # task.loss on a batch of one: a per-example value
        per = torch.func.vmap(lambda o, yi: task.loss(rebuilt(unsqueeze(o)), yi.unsqueeze(0)))(parts, y)
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
              which: slice | torch.Tensor, settings: TrainSettings, anchor: dict[str, torch.Tensor]) -> None:
    """torch.optim.SGD's step on the clients ``which`` (a slice, or client indices) of the stacked tensors,
    FedProx's gradient added first; ``bufs``: the momentum buffers, zeros before a client's first step (then
    ``0 * momentum + grad`` is the gradient, as SGD's first step takes it)."""
    for name, g in grads.items():
        p = params[name][which]
        if settings.proximal_mu > 0:  # d/dp of mu/2 ||p - p_start||^2
            start = anchor[name] if anchor[name].dim() < params[name].dim() else anchor[name][which]
            g = g + settings.proximal_mu * (p - start)
        if settings.momentum > 0:
            g = bufs[name][which].mul_(settings.momentum).add_(g)
            if isinstance(which, torch.Tensor):  # (indexing copied it)
                bufs[name][which] = g
        p.add_(g, alpha=-settings.lr)
        if isinstance(which, torch.Tensor):
            params[name][which] = p


def _train_chunk(task: Task, model: nn.Module, global_flat: torch.Tensor, datasets: list[Dataset],
                 settings: TrainSettings, generators: list[torch.Generator],
                 kept: list[dict[str, torch.Tensor]] | None, seed: int, by_batch: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's (deltas, losses); ``datasets`` sorted by full batches then size, largest first; ``kept``
    replaced in place; ``by_batch``: the model normalises by batch (``normalises_by_batch``)."""
    device, m = global_flat.device, len(datasets)
    x = to_tensors(concat([d.x for d in datasets]), device)  # (named inputs: a dict of such tensors)
    y = to_tensors(np.concatenate([d.y for d in datasets]), device)
    sizes = np.array([len(d) for d in datasets], dtype=np.int64)
    offsets = torch.tensor(np.cumsum([0, *sizes[:-1]]), dtype=torch.long, device=device)
    batch = settings.batch_size
    steps = [math.ceil(n / batch) for n in sizes]
    active = [sum(s > i for s in steps) for i in range(max(steps, default=0))]  # clients still training at step i
    params, buffers, frozen = _initial_state(task, model, global_flat, m, kept, seed)
    # batch statistics (BatchNorm) or any buffer a forward may update from its batch: real examples only
    exact = bool(buffers) or by_batch
    # FedProx's anchor: the global weights (one row for all), or a kept entry's own start (a row per client)
    local = set(task.layout().local)
    anchor = ({k: v.clone() if k in local else v[0].clone() for k, v in params.items()}
              if settings.proximal_mu > 0 else {})
    step = _client_step(task, model, frozen)
    bufs = {k: torch.zeros_like(v) for k, v in params.items()} if settings.momentum > 0 else {}
    total = torch.zeros(m, dtype=torch.float64, device=device)
    full, last = _split(sizes, batch, by_batch)
    for _ in range(settings.local_epochs):
        perms = [torch.randperm(int(n), generator=g) for n, g in zip(sizes, generators, strict=True)]
        index, mask = _epoch_batches(perms, offsets, len(active), batch)
        if not exact:  # one computation a step: each client's last batch padded and masked out of its loss
            for i, a in enumerate(active):
                rows, real = index[:a, i], mask[:a, i]
                grads, loss = step({k: v[:a] for k, v in params.items()}, {}, take(x, rows), y[rows], real)
                _sgd_step(params, grads, bufs, slice(0, a), settings, anchor)
                total[:a] += loss.double() * real.sum(1)
            continue
        for i in range(int(full.max(initial=0))):  # full batches: the clients with one at step i are a prefix
            a = int((full > i).sum())
            rows = index[:a, i]
            grads, loss = step({k: v[:a] for k, v in params.items()}, {k: v[:a] for k, v in buffers.items()},
                               take(x, rows), y[rows], mask[:a, i])
            _sgd_step(params, grads, bufs, slice(0, a), settings, anchor)
            total[:a] += loss.double() * batch
        for r in np.unique(last[last > 0]).tolist():  # then each client's partial batch, those of one size together
            ks = np.flatnonzero(last == r)  # (after its full batches, as its own loop takes them)
            at = torch.as_tensor(ks, device=device)
            slots = torch.as_tensor(full[ks] * batch, device=device)[:, None] + torch.arange(r, device=device)
            rows = index.view(len(index), -1)[at[:, None], slots]  # (r may be batch + 1: a merged batch of one)
            sub = {k: v[at] for k, v in buffers.items()}  # (copies: written back after the step)
            grads, loss = step({k: v[at] for k, v in params.items()}, sub, take(x, rows), y[rows],
                               torch.ones(len(ks), r, dtype=torch.bool, device=device))
            for k, v in sub.items():
                buffers[k][at] = v
            _sgd_step(params, grads, bufs, at, settings, anchor)
            total[at] += loss.double() * r
    if kept is not None:
        for name in task.layout().kept:
            values = (params.get(name) if name in params else buffers.get(name))
            if values is not None:
                values = values.detach().cpu()
                for k, saved in enumerate(kept):
                    saved[name] = values[k].clone()
    seen = torch.tensor(sizes, dtype=torch.float64, device=device) * settings.local_epochs
    return _deltas(task, {**params, **buffers}, frozen, global_flat, m), total / seen.clamp(min=1)


def _split(sizes: np.ndarray, batch: int, merge_one: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each client's full batches and the size of its last partial one (0: none), as ``epoch_batches`` splits an
    epoch; ``merge_one`` (BatchNorm): a last batch of one joins the full batch before it (a batch + 1 one)."""
    full, last = sizes // batch, sizes % batch
    if merge_one:
        one = (last == 1) & (full >= 1)
        full, last = full - one, np.where(one, batch + 1, last)
    return full, last


def _deltas(task: Task, params: dict[str, torch.Tensor], frozen: dict[str, torch.Tensor], global_flat: torch.Tensor,
            m: int) -> torch.Tensor:
    """The chunk's flat trained weights, in the layout's order and as float32 (as ``layout.flatten``), minus
    ``global_flat``."""
    parts = [params[e.name].reshape(m, -1).float() if e.name in params
             else frozen[e.name].reshape(1, -1).float().expand(m, -1) for e in task.layout().entries]
    return torch.cat(parts, dim=1).sub_(global_flat)
