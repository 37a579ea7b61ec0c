"""Tasks: the user's model and data behind one interface (:class:`Task`), chosen by name or import path.

``task`` is a built-in name (``digits``, ``synthetic``), ``package.module:ClassName`` (importable), or
``path/to/file.py:ClassName`` (a file, resolved against the working directory).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import traceback
from functools import lru_cache
from pathlib import Path

import torch

from .._errors import ClientError, ConfigError
from ..config import BUILTIN_TASKS, TaskSpec
from .base import Dataset, Task, timed_train
from .digits import DigitsTask
from .layout import Entry, ModelLayout
from .synthetic import SyntheticTask

_TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "synthetic": SyntheticTask}
_REGISTERED: dict[str, type[Task]] = {}  # classes handed over in this process (a notebook's), by their path


def task_name(cls: type[Task]) -> str:
    """``module:QualName`` for a Task subclass, registered in this process so that ``get_task`` finds it
    even where its module cannot be imported by name (``__main__``, a notebook): the in-process and virtual
    engines run there; Flower's engine and agents import by path, so they need an importable class."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task must be a subclass of clients.Task or its import path. Found {type(cls).__name__}.")
    attr = cls.__qualname__ if cls.__qualname__.isidentifier() else f"{cls.__name__}_{id(cls):x}"  # (a nested class)
    name = f"{cls.__module__}:{attr}"
    _REGISTERED[name] = cls
    task_class.cache_clear()
    return name


def _import_module(where: str, name: str):
    if where.endswith(".py"):
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise ConfigError(f"task {name!r} must name an existing Python file. Found no file {str(path)!r}.")
        mod_name = "fedshield_task_" + hashlib.sha256(str(path).encode()).hexdigest()[:16]
        if mod_name in sys.modules:
            return sys.modules[mod_name]
        if str(path.parent) not in sys.path:  # its own modules beside it import (after anything installed: a file
            sys.path.append(str(path.parent))  # there named like a package fedshield uses shadows nothing)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except BaseException:
            sys.modules.pop(mod_name, None)
            raise
        return module
    return importlib.import_module(where)


@lru_cache(maxsize=32)
def task_class(name: str) -> type[Task]:
    """The Task subclass ``name`` names; ConfigError (one line) when it does not import or is no Task."""
    if name in _TASKS or name in _REGISTERED:
        return _TASKS.get(name) or _REGISTERED[name]
    where, _, attr = name.rpartition(":")
    try:
        module = _import_module(where, name)
    except ConfigError:
        raise
    except Exception as exc:  # the user's module: any error it raises while importing is one line
        raise ConfigError(f"task {name!r} must import. Found {type(exc).__name__}: {str(exc)[:300]}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        found = "nothing" if cls is None else type(cls).__name__
        raise ConfigError(f"task {name!r} must name a subclass of clients.Task in {where}. Found {found} "
                          f"under {attr!r}.")
    return cls


@lru_cache(maxsize=8)
def get_task(spec: TaskSpec) -> Task:
    """The task for ``spec`` (cached per process: data is loaded once)."""
    cls = task_class(spec.task)
    try:
        return cls(spec)
    except ClientError:
        raise
    except Exception as exc:  # the user's constructor
        raise ConfigError(f"task {spec.task!r} must build. Found {type(exc).__name__}: {str(exc)[:300]}") from None


def load_task(spec: TaskSpec, data: bool = True) -> Task:
    """``get_task(spec)`` with its data loaded and model layout derived: every error a user's task can make
    before training (import, data, model) comes here as one ConfigError line. ``data=False``: a device that
    trains on its own file never loads the task's datasets (sklearn and the whole digits set were ~90 MB of
    an agent's worker)."""
    task = get_task(spec)
    try:
        if data:
            task.train_set  # noqa: B018 (loads and checks the data)
        layout = task.layout()
    except ClientError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's data or model: any error it raises is one line
        raise task_code_error(spec, "load its data and build its model", exc) from None
    if not layout.numel:
        raise ConfigError(f"task {spec.task!r} must have something to federate. Found no trainable parameter or "
                          "floating buffer" + (": every parameter is frozen (requires_grad=False); set "
                                               "federate_frozen = True to federate them" if layout.fixed else ""))
    return task


def task_code_error(spec: TaskSpec, what: str, exc: BaseException) -> ConfigError:
    """One line for an exception a task's own code raised: what it had to do, the exception and the innermost
    place it came from (``file:line, in function``)."""
    frames = traceback.extract_tb(exc.__traceback__)
    # the innermost frame of the task's own code (not torch's, numpy's, nor fedshield's default loops), else the last
    own = [f for f in frames if not _library(f.filename)] or frames
    where = f" ({Path(own[-1].filename).name}:{own[-1].lineno}, in {own[-1].name})" if own else ""
    text = str(exc).split("\n", 1)[0]
    text = text if len(text) <= 300 else f"{text[:300]}..."
    return ConfigError(f"task {spec.task!r} must {what}. Found {type(exc).__name__}: {text}{where}")


def _library(filename: str) -> bool:
    """Whether a traceback frame's file is an installed library's or fedshield's task machinery."""
    path = Path(filename).resolve()
    return any(part in ("site-packages", "dist-packages") for part in path.parts) or path.parent == _HERE


_HERE = Path(__file__).resolve().parent
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)  # (torch.OutOfMemoryError: >= 2.5)


def evaluated(task: Task, model, data: Dataset, where: str) -> dict:
    """``task.evaluate(model, data)``, its failure as one line (``task_code_error``) saying it ran ``where``, and
    its result checked to be a dict."""
    try:
        out = task.evaluate(model, data)
    except (ClientError, _OUT_OF_MEMORY):  # (memory is the machine's, not the task's)
        raise
    except Exception as exc:  # noqa: BLE001 - the user's evaluate: any error it raises is one line
        raise task_code_error(task.spec, f"evaluate the model on {where}", exc) from None
    if not isinstance(out, dict):
        raise ConfigError(f"task {task.spec.task!r}: evaluate must return a dict of metrics. Found "
                          f"{type(out).__name__}.")
    return out


def check_any_task(data: Dataset, source: str) -> None:
    """That ``data`` fits at least one built-in task (an agent started without --task does not know which one
    the coordinator runs); else one ClientError naming what each task needs."""
    errors = []
    for cls in _TASKS.values():
        try:
            cls.check_data(data, cls.name)
            return
        except ClientError as exc:
            errors.append(str(exc).rstrip("."))
    raise ClientError(f"{source} must fit a fedshield task. Found it fits none: {'; '.join(errors)}")


def max_partitions() -> int:
    """The most partitions any built-in task's training data splits into (one example each; the agent does
    not know which task, nor which partitioning, the coordinator will run)."""
    return max(len(get_task(TaskSpec(task=name)).train_set) for name in _TASKS)


__all__ = ["Dataset", "DigitsTask", "Entry", "ModelLayout", "SyntheticTask", "Task", "check_any_task", "evaluated",
           "get_task", "load_task", "max_partitions", "task_class", "task_code_error", "task_name", "timed_train"]
