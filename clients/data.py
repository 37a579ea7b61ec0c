"""Where a client's training data comes from: its own .npz file or a task partition."""

from __future__ import annotations

import math
import os
import zipfile
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._errors import ClientError
from .tasks import Dataset, Task
from .tasks.inputs import MAX_INPUTS, names_shown

_CACHE: OrderedDict[tuple, Dataset] = OrderedDict()  # least recently used first
_CACHE_SIZE = 10_000  # clients' data kept in a process: a simulated population of a million samples 10k a round


def _cached(key: tuple, make) -> Dataset:
    """``make()`` cached under ``key``, the cache bounded to the ``_CACHE_SIZE`` most recently used entries."""
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    data = _CACHE[key] = make()
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return data


_NAMED = "x."  # an .npz member holding one of several named inputs: x.<name>


def load_npz(path: str | os.PathLike) -> Dataset:
    """Read ``x`` (n, ...), or named inputs ``x.<name>`` (n, ...) each, and ``y`` (n, ...) from an .npz file (never
    unpickles)."""
    p = Path(path)
    if not p.is_file():
        raise ClientError(f"data path must be an existing .npz file. Found {str(p)!r} "
                          f"({'a directory' if p.is_dir() else 'no such file'}).")
    try:
        with open(p, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ClientError(f"data file must be a readable .npz. Found {p}: {exc.strerror or exc}.") from None
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # numpy would try it as .npy or a pickle first
        what = "a single .npy array" if magic == b"\x93NUM" else "empty" if not magic else "not a zip archive"
        raise ClientError(f"data file must be a readable .npz (a zip archive of arrays 'x' and 'y'). "
                          f"Found {p}: {what}.")
    try:
        loaded = np.load(p, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ClientError(f"data file must be a readable .npz. Found {p}: {exc}.") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise ClientError(f"data file must be an .npz archive with arrays 'x' and 'y'. Found a single array in {p}.")
    with loaded as npz:
        inputs = sorted(k for k in npz.files if k.startswith(_NAMED))  # named inputs: x.<name> each
        if ("x" not in npz.files and not inputs) or "y" not in npz.files or ("x" in npz.files and inputs):
            raise ClientError("data file must hold arrays 'x' and 'y' (or named inputs 'x.NAME' instead of 'x'). "
                              f"Found [{names_shown(sorted(npz.files), 8)}] in {p}.")
        if len(inputs) > MAX_INPUTS:  # (before any is read: each costs a member's header and array)
            raise ClientError(f"data file must hold at most {MAX_INPUTS} named inputs. Found {len(inputs)} in {p}.")
        try:
            for name in (*(inputs or ["x"]), "y"):
                _check_declared_size(npz, name, p)
            x = {k[len(_NAMED):]: np.asarray(npz[k]) for k in inputs} if inputs else np.asarray(npz["x"])
            return Dataset(x, np.asarray(npz["y"]))
        except ClientError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, MemoryError) as exc:
            raise ClientError(f"data file must be a readable .npz. Found {p}: {exc or type(exc).__name__}.") from None


def _check_declared_size(npz: "np.lib.npyio.NpzFile", name: str, p: Path) -> None:
    """An array's header must not declare more bytes than its member holds: numpy allocates the
    declared shape before reading, so a corrupt or hostile file could ask for petabytes."""
    member = f"{name}.npy"
    if member not in npz.zip.namelist():  # numpy also lists a member stored as plain 'x' (review helper-59)
        raise ClientError(f"data file must store its arrays as members {name}.npy (as numpy.savez writes them). "
                          f"Found members {sorted(npz.zip.namelist())[:8]} in {p}.")
    info = npz.zip.getinfo(member)
    with npz.zip.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fh)
    declared = math.prod(shape) * dtype.itemsize
    if declared > info.file_size:
        raise ClientError(f"data file must hold the arrays its headers declare. Found {p}: {name!r} declares shape "
                          f"{shape} ({declared} bytes) in a member of {info.file_size} bytes.")


# What fixes a task's train/test split (TaskSpec fields): an exported partition records them, and a coordinator
# whose split differs is refused (its test examples would be trained on: 292 of 360 with data-seed 0 vs 1).
SPLIT_FIELDS = ("task", "data_seed", "synthetic_alpha", "synthetic_beta")


def save_npz(path: str | os.PathLike, data: Dataset, spec: Any = None) -> None:
    """``x`` and ``y``, and (``spec``: the TaskSpec it was split under) the ``SPLIT_FIELDS`` that fixed its split."""
    made_by = {f"split_{k}": np.asarray(getattr(spec, k)) for k in SPLIT_FIELDS} if spec is not None else {}
    inputs = {f"{_NAMED}{k}": v for k, v in data.x.items()} if isinstance(data.x, dict) else {"x": data.x}
    np.savez(path, **inputs, y=data.y, **made_by)


def _split_value(field: str, value: Any) -> Any:
    """A task file's path differs between the machine that exported and the one that trains (and between a
    relative and a resolved spelling): the split's task is its class name, as an agent's --task is matched."""
    return str(value).rpartition(":")[2] if field == "task" else value


def check_split(path: str | os.PathLike, spec: Any, fields: tuple[str, ...] = SPLIT_FIELDS,
                against: str = "in this run") -> None:
    """ClientError when the .npz at ``path`` records a split (``save_npz``'s ``split_*``) other than ``spec``'s
    (in ``fields``): its examples may be the run's test examples. A file without them (the owner's own data)
    passes. ``against``: what ``spec`` is, in the message."""
    try:  # (the owner's file: a record that is not one number or name is refused, not a traceback)
        with np.load(path, allow_pickle=False) as npz:
            recorded = {k: npz[f"split_{k}"].item() for k in SPLIT_FIELDS if f"split_{k}" in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ClientError(f"data file {path} must record its split (split_{'/'.join(SPLIT_FIELDS)}) as single "
                          f"values, as fedshield data export writes them. Found: {exc}.") from None
    wrong = [f"{k.replace('_', '-')} {v!r} there, {getattr(spec, k)!r} {against}" for k, v in recorded.items()
             if k in fields and _split_value(k, v) != _split_value(k, getattr(spec, k))]
    if wrong:
        raise ClientError(f"data file {path} was exported from another split of the task ({'; '.join(wrong)}): its "
                          "examples may be the coordinator's test examples. Export it again with the run's task and "
                          "data-seed (fedshield data export --task ... --seed ...).")


def client_data(task: Task, node_config: Mapping[str, Any]) -> Dataset:
    """The training data of this node, from ``node_config``.

    ``data-path`` (an .npz file) wins; otherwise ``partition-id`` and
    ``num-partitions`` pick a share of the task's built-in training set.
    """
    if "data-path" in node_config:
        path = str(node_config["data-path"])

        def load() -> Dataset:
            data = task.check_data(load_npz(path), path)
            check_split(path, task.spec)
            return data
        return _cached((task.spec, "path", path), load)
    try:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ClientError(
            "node config must give data-path, or partition-id and num-partitions. "
            f"Found keys {sorted(node_config)}."
        ) from None
    def make() -> Dataset:
        data = task.client_data(pid, num)
        if type(task).client_data is Task.client_data:  # a share of the training set, checked as a whole
            return data
        return task.check_data(data, f"task {task.spec.task!r} client {pid}'s data")
    return _cached((task.spec, pid, num), make)


def client_eval_data(task: Task, node_config: Mapping[str, Any]) -> Dataset:
    """This node's held-out data for federated evaluation: ``eval-data-path`` (an .npz file), else for a
    ``partition-id`` node its share of the task's test set (``Task.client_eval_data``). A node with its own
    training file and no evaluation file has none: ClientError (its agent takes ``--eval-data``)."""
    if "eval-data-path" in node_config:
        path = str(node_config["eval-data-path"])
        return _cached((task.spec, "eval-path", path), lambda: task.check_data(load_npz(path), path))
    if "data-path" in node_config:
        raise ClientError("this node holds no evaluation data: start its agent with --eval-data FILE.npz.")
    try:
        pid, num = int(node_config["partition-id"]), int(node_config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ClientError("node config must give eval-data-path, or partition-id and num-partitions. "
                          f"Found keys {sorted(node_config)}.") from None
    return _cached((task.spec, "eval", pid, num), lambda: task.check_data(
        task.client_eval_data(pid, num), f"task {task.spec.task!r} client {pid}'s evaluation data"))
