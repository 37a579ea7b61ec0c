"""A task's inputs: one array, or named arrays (token ids and their mask, a user's and an item's ids with side
features) that share the leading example axis; the model's forward takes named ones as keyword arguments.

Every loop, engine and DP path goes through these helpers, so a model with several inputs needs nothing else.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

Inputs = Any  # np.ndarray | torch.Tensor | dict[str, np.ndarray | torch.Tensor]


def named(x: Inputs) -> bool:
    """Whether ``x`` is named inputs (a dict of arrays)."""
    return isinstance(x, dict)


def take(x: Inputs, index: Any) -> Inputs:
    """The examples ``index`` (indices, a mask or a slice) of every input."""
    return tree_map(lambda a: a[index], x)


def leaves(x: Inputs) -> list:
    """The arrays of ``x`` (one for a single input)."""
    return tree_leaves(x)


def to_tensors(x: Inputs, device: torch.device) -> Inputs:
    """``x``'s arrays as tensors on ``device`` (numpy arrays shared where they are already contiguous)."""
    return tree_map(lambda a: a.to(device) if isinstance(a, torch.Tensor)
                    else torch.from_numpy(np.ascontiguousarray(a)).to(device), x)


def concat(xs: list[Inputs]) -> Inputs:
    """The examples of several datasets' inputs, one after the other (numpy)."""
    if xs and named(xs[0]):
        return {k: np.concatenate([x[k] for x in xs]) for k in xs[0]}
    return np.concatenate(xs)


def repeat(x: Inputs, reps: int, size: int) -> Inputs:
    """``x``'s examples repeated ``reps`` times, the first ``size`` of them (numpy)."""
    return tree_map(lambda a: np.concatenate([a] * reps)[:size], x)


def forward(model: Any, x: Inputs) -> Any:
    """``model`` run on ``x``: named inputs as keyword arguments, one input as the argument."""
    return model(**x) if named(x) else model(x)


def call_args(x: Inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that ``forward`` passes (for ``torch.func.functional_call``)."""
    return ((), x) if named(x) else ((x,), {})


def unsqueeze(x: Inputs) -> Inputs:
    """One example's inputs as a batch of one (vmap's per-example functions)."""
    return tree_map(lambda t: t.unsqueeze(0), x)


__all__ = ["Inputs", "call_args", "concat", "forward", "leaves", "named", "repeat", "take", "to_tensors", "unsqueeze"]
