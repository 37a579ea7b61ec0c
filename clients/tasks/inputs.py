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
MAX_INPUTS = 64  # named inputs a dataset or data file may hold


def names_shown(names: Any, limit: int = 4) -> str:
    """Input names for a message: the first ``limit``, each cut to 40 characters (a file's member names come from
    whoever wrote it), with how many there are when more."""
    names = [str(n) for n in names]
    cut = ", ".join(repr(n if len(n) <= 40 else n[:40] + "...") for n in names[:limit])
    return cut + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def signature_misfit(model: Any, names: Any) -> str | None:
    """Why named inputs ``names`` do not fit ``model``'s forward (names it does not take, arguments it needs that
    are not among them), or None (they fit, or the forward takes ``**kwargs`` or hides its signature)."""
    import inspect

    from torch import nn

    if isinstance(model, nn.Module) and (type(model).__call__ is not nn.Module.__call__ or model._forward_pre_hooks):
        return None  # (its own __call__ or a pre-hook may rename or pack the inputs before forward sees them)
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    unknown = sorted(set(names) - {p.name for p in params if p.kind in keyword})
    missing = [p.name for p in params if p.kind in keyword and p.default is p.empty and p.name not in set(names)]
    if not unknown and not missing:
        return None
    said = [f"it takes no {names_shown(unknown)}" if unknown else "", f"it needs {names_shown(missing)}" if missing else ""]
    return f"{type(model).__name__}.forward: " + "; ".join(w for w in said if w)


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


__all__ = ["MAX_INPUTS", "Inputs", "call_args", "concat", "forward", "leaves", "named", "names_shown", "repeat",
           "signature_misfit", "take", "to_tensors", "unsqueeze"]
