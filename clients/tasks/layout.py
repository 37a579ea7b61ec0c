"""A model's layout: which of its state travels as the one flat float32 update, and in what order.

Derived once from the model (on torch's meta device where it can be), so the wire and the aggregation
core see one flat tensor whatever the module: parameters, and floating-point buffers such as BatchNorm's
running statistics unless the task keeps them local (FedBN). Integer buffers and the entries a task keeps
local never leave the client; the client keeps them between rounds. Frozen parameters (``requires_grad=False``
when built) stay off the wire unless the task federates them: every model takes them from the run seed's build.
BatchNorm's ``num_batches_tracked``, which torch reads only when the layer's momentum is None, is kept only for
such layers.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Entry:
    """One state-dict tensor in the flat vector: its name, shape, dtype and place."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    numel: int
    buffer: bool


@dataclass(frozen=True)
class ModelLayout:
    """The federated entries (in state-dict order) and the names each client keeps for itself."""

    entries: tuple[Entry, ...]
    # off the wire: integer buffers, what the task keeps local, and ``fixed``; every model loads them from its
    # node's kept values (``kept``), else from where a node starts (``Task.initial_local``)
    local: tuple[str, ...]
    # frozen parameters (requires_grad=False when built), among ``local``: every model takes them from the run
    # seed's build and no client keeps a copy (a fine-tuned model's backbone: nothing to average, and it was sent
    # down and its zero delta up every round)
    fixed: tuple[str, ...] = ()
    # federated running variances of normalisation layers (BatchNorm's running_var): a sum of deltas that is not
    # their plain mean (a stale FedBuff reply, a codec's error, an optimizer's step, DP noise) can take one below 0,
    # where the layer evaluates to NaN; the coordinator keeps them at 0 or above
    nonneg: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return self.entries[-1].offset + self.entries[-1].numel if self.entries else 0

    @property
    def kept(self) -> tuple[str, ...]:
        """What each client keeps between rounds: ``local`` less ``fixed``."""
        fixed = set(self.fixed)
        return tuple(name for name in self.local if name not in fixed)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    @classmethod
    def of(cls, model: nn.Module, federate_buffers: bool = True, keep_local: tuple[str, ...] = (),
           federate_frozen: bool = False) -> "ModelLayout":
        """The layout of ``model``: every parameter (not ``federate_frozen``: every trainable one) and
        (``federate_buffers``) floating buffer, less the state-dict names matching a ``keep_local`` glob; a tensor
        tied under two names counts once."""
        params = {id(p) for p in model.parameters()}
        frozen = set() if federate_frozen else {id(p) for p in model.parameters() if not p.requires_grad}
        # BatchNorm's batch count is read only under momentum=None (a cumulative average): elsewhere it is kept
        # nowhere, so such a model leaves nothing on its clients (nothing held per client, nothing checkpointed)
        unused = {id(m.num_batches_tracked) for m in model.modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.num_batches_tracked is not None
                  and m.momentum is not None}
        variances = {id(m.running_var) for m in model.modules()
                     if isinstance(m, nn.modules.batchnorm._NormBase) and m.running_var is not None}
        entries: list[Entry] = []
        nonneg: list[str] = []
        local: list[str] = []
        fixed: list[str] = []
        seen: set[int] = set()
        offset = 0
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            if id(t) in unused and not any(fnmatch.fnmatchcase(name, pat) for pat in keep_local):
                continue
            buffer = id(t) not in params
            kept = any(fnmatch.fnmatchcase(name, pat) for pat in keep_local)
            if not t.is_floating_point() or (buffer and not federate_buffers) or kept or id(t) in frozen:
                local.append(name)
                if id(t) in frozen and t.is_floating_point() and not kept:
                    fixed.append(name)
                continue
            entries.append(Entry(name, tuple(t.shape), t.dtype, offset, t.numel(), buffer))
            offset += t.numel()
            if id(t) in variances:
                nonneg.append(name)
        return cls(tuple(entries), tuple(local), tuple(fixed), tuple(nonneg))

    def buffer_ranges(self) -> list[int]:
        """``[offset, length, ...]`` of the federated buffers in the flat vector, adjacent entries merged."""
        out: list[int] = []
        for e in self.entries:
            if not e.buffer:
                continue
            if out and out[-2] + out[-1] == e.offset:
                out[-1] += e.numel
            else:
                out += [e.offset, e.numel]
        return out

    def index(self, names: tuple[str, ...] | None = None, buffers: bool = False) -> torch.Tensor:
        """The flat vector's positions of the entries named (or of every buffer): an int64 index, empty if none."""
        picked = [e for e in self.entries if (e.buffer if buffers else e.name in (names or ()))]
        if not picked:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.arange(e.offset, e.offset + e.numel) for e in picked])

    def _tensors(self, model: nn.Module) -> list[torch.Tensor]:
        state = model.state_dict(keep_vars=True)
        try:
            return [state[e.name] for e in self.entries]
        except KeyError as exc:
            raise ValueError(f"model must have the layout's entry {exc.args[0]!r}. Found another model.") from None

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """The federated entries as one new flat float32 tensor (on the model's device)."""
        tensors = self._tensors(model)
        if not tensors:
            return torch.zeros(0)
        return torch.cat([t.detach().reshape(-1).float() for t in tensors])

    @torch.no_grad()
    def load(self, model: nn.Module, flat: torch.Tensor) -> None:
        """Copy ``flat`` into the model's federated entries (cast to each entry's dtype). Copies, never
        aliases: ``flat`` may be backed by a received message's bytes."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat weights must have {self.numel} elements. Found {flat.numel()}.")
        for t, e in zip(self._tensors(model), self.entries, strict=True):
            t.copy_(flat[e.offset:e.offset + e.numel].view(e.shape))

    def local_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The entries each client keeps (``kept``; copies, on CPU)."""
        state = model.state_dict()
        return {name: state[name].detach().cpu().clone() for name in self.kept}

    def changed_fixed(self, model: nn.Module, start: dict[str, torch.Tensor]) -> str | None:
        """The first ``fixed`` entry whose value in ``model`` is no longer ``start``'s (a loop that unfroze it),
        or None."""
        state = model.state_dict()
        return next((name for name in self.fixed if name in start
                     and not torch.equal(state[name].detach().cpu(), start[name].to(state[name].dtype))), None)

    @torch.no_grad()
    def load_local(self, model: nn.Module, saved: dict[str, torch.Tensor],
                   start: dict[str, torch.Tensor] | None = None) -> None:
        """Restore a client's kept entries, flat or shaped (those of the right size and dtype, a floating one
        cast to the model's); one missing or that does not fit from ``start`` (where the client starts), else
        it stays as the model holds it."""
        state = model.state_dict(keep_vars=True)
        for name in self.local:
            t, v = state.get(name), saved.get(name)
            if t is not None and (v is None or not fits(v, t)):
                v = (start or {}).get(name)
            if t is not None and v is not None and fits(v, t):
                t.copy_(v.reshape(t.shape))


FROZEN_STATS = 6  # numbers per frozen entry in a summary: mean, RMS and the values at 4 fixed places
FROZEN_RTOL = 1e-4  # of the entry's RMS: one build's float noise (CPU kernels, thread counts) passes, another build not


def frozen_summary(values: list[torch.Tensor]) -> tuple[float, ...]:
    """``FROZEN_STATS`` numbers per tensor (float64): its mean, its RMS and its first, two inner and last values:
    what the coordinator sends for its frozen entries, to be compared with :func:`frozen_match`, not for equality
    (initialisers give other bits on other CPUs: AVX-512 or not, ARM; orthogonal_ with other thread counts)."""
    out: list[float] = []
    for t in values:
        v = t.detach().reshape(-1).to("cpu", torch.float64)
        n = v.numel()
        if n == 0:
            out += [0.0] * FROZEN_STATS
            continue
        out += [float(v.mean()), float(v.square().mean().sqrt()), *(float(v[i]) for i in (0, n // 3, 2 * n // 3, n - 1))]
    return tuple(out)


def frozen_match(mine: tuple[float, ...], theirs: tuple[float, ...]) -> bool:
    """Whether two :func:`frozen_summary` describe the same values: the same length, and each number within
    ``FROZEN_RTOL`` of its entry's RMS."""
    if len(mine) != len(theirs):
        return False
    for k in range(0, len(mine), FROZEN_STATS):
        a, b = mine[k:k + FROZEN_STATS], theirs[k:k + FROZEN_STATS]
        scale = FROZEN_RTOL * max(abs(a[1]), abs(b[1]), 1e-30)
        if any(not abs(x - y) <= scale for x, y in zip(a, b, strict=True)):
            return False
    return True


def fits(saved: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether a kept entry can be restored into ``target``: the same size, and the same dtype or both
    floating point (kept as float32 where the wire lacks the model's dtype, bfloat16)."""
    return saved.numel() == target.numel() and (saved.dtype == target.dtype or (
        saved.is_floating_point() and target.is_floating_point()))


__all__ = ["FROZEN_STATS", "Entry", "ModelLayout", "fits", "frozen_match", "frozen_summary"]
