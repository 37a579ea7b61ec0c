"""Frozen, validated configuration shared by the coordinator and the clients.

Configuration arrives as flat kebab-case mappings (Flower's ``run_config``, a
TOML table, a ``ConfigRecord``). :func:`build_config` turns one into a frozen
dataclass once, at the edge; code below never reads raw dicts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from aggregation._errors import shown, shown_key

from ._errors import ConfigError

T = TypeVar("T")


MAX_NOISE_MULTIPLIER = 1e6  # local DP-SGD's noise multiplier: the accountant's sigma**2 overflows far past it,
# and epsilon is already flat there
MIN_NOISE_MULTIPLIER = 1e-3  # central DP's: below, epsilon overflows to infinity within a few rounds
MIN_LOCAL_NOISE_MULTIPLIER = 1e-6  # local DP-SGD's: tests of clipping alone use it; below ~1e-154 opacus's RDP
# arithmetic divides by a sigma**2 that underflowed to zero (a ledger holding such an event could not be charged)


def kebab(name: str) -> str:
    return name.replace("_", "-")


def parse_toml(text: str, source: str) -> dict[str, Any]:
    """``text`` read as TOML, or ConfigError naming ``source``. tomllib raises TOMLDecodeError for bad syntax,
    and also a plain ValueError (an integer past Python's 4300 digits) or RecursionError (arrays nested
    thousands deep): each is one line, not a traceback."""
    import tomllib

    try:
        return tomllib.loads(text)
    except RecursionError:
        raise ConfigError(f"{source} must be valid TOML. Found arrays or tables nested too deep.") from None
    except ValueError as exc:  # TOMLDecodeError included
        raise ConfigError(f"{source} must be valid TOML. Found error: {shown(str(exc), 200)}.") from None


def check(ok: bool, key: str, rule: str, found: Any) -> None:
    """Raise ``ConfigError("<key> must <rule>. Found <found>.")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} must {rule}. Found {shown(found)}.")


def renamed_key(message: str, names: Mapping[str, str]) -> str:
    """``message`` ("<key> must ...") with its leading key named as the caller's user knows it (``names``:
    key -> name, such as a command's flag); unchanged when the key is not in ``names``."""
    key, sep, rest = message.partition(" ")
    return f"{names[key]}{sep}{rest}" if key in names else message


def resolve_path(value: Any, key: str, base: Path | None = None) -> Path:
    """``value`` as an absolute path, ``~`` and ``~user`` expanded, relative to ``base`` (default: the
    working directory). One ConfigError naming ``key`` for a value that is not a string, holds a NUL
    character, names an unknown user (never a directory literally named ``~user``) or cannot be resolved."""
    check(isinstance(value, str), key, "be a path (a string)", value)
    check("\0" not in value, key, "not contain a NUL character", value)
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):  # expanduser leaves '~user' as it is when there is no such user (or no HOME)
        user = value[1:].split(os.sep, 1)[0]
        raise ConfigError(f"{key} must start with an existing user's home directory. Found {shown(value)}: "
                          + (f"no user {shown(user)}." if user else "no home directory (HOME is not set)."))
    try:
        q = Path(expanded)
        return (q if q.is_absolute() or base is None else base / q).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, a vanished working directory
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{key} must be a path that can be resolved. Found {shown(value)}: {reason}.") from None


def _coerce(value: Any, typ: Any, key: str) -> Any:
    if isinstance(typ, str):  # postponed annotation
        typ = {"int": int, "float": float, "str": str, "bool": bool}.get(typ, typ)
    if typ is bool:
        check(isinstance(value, bool), key, "be true or false", value)
        return value
    if typ is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        ok = ok or (isinstance(value, float) and value.is_integer())
        check(ok, key, "be an integer", value)
        return int(value)
    if typ is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        check(ok and math.isfinite(float(value)), key, "be a finite number", value)
        return float(value)
    if typ is str:
        check(isinstance(value, str), key, "be a string", value)
        check("\0" not in value, key, "not contain a NUL character", value)
        return value
    return value


def config_keys(cls: type) -> list[str]:
    return sorted(kebab(f.name) for f in dataclasses.fields(cls))


_KEY_ALIASES = {"learning-rate": "lr", "rounds": "num-rounds", "epochs": "local-epochs", "clients": "num-supernodes",
                "num-clients": "num-supernodes"}


def unknown_key(prefix: str, key: Any, known: Iterable[str]) -> ConfigError:
    """The error for an unknown key: the closest known one when there is one (a typo, or snake_case), else
    every known key."""
    import difflib

    known = sorted(known)
    close = difflib.get_close_matches(str(key).replace("_", "-"), known, n=1, cutoff=0.85) if isinstance(key, str) else []
    alias = _KEY_ALIASES.get(str(key).replace("_", "-"))
    if alias in known:  # another library's name for it (learning-rate was "close" to clip-learning-rate)
        close = [alias]
    hint = f"Did you mean {close[0]}?" if close else f"Known keys: {', '.join(known)}."
    return ConfigError(f"{prefix}{shown_key(key)} is not a known key. {hint}")


@functools.lru_cache(maxsize=64)
def _type_hints(cls: type) -> dict[str, Any]:
    """``typing.get_type_hints`` once per class (it re-evaluates every annotation: ~0.2 ms a call)."""
    return typing.get_type_hints(cls)


def build_config(cls: type[T], mapping: Mapping[str, Any], where: str = "", *, strict: bool = True) -> T:
    """Build the frozen dataclass ``cls`` from a kebab-case mapping.

    Unknown keys are an error when ``strict`` (a typo must not be ignored
    silently); missing keys take the dataclass defaults. Types are checked
    here, value rules in the dataclass's ``__post_init__``.
    """
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"[{where or cls.__name__}] must be a table. Found {type(mapping).__name__} {mapping!r:.40}.")
    hints = _type_hints(cls)
    fields = {kebab(f.name): f for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(mapping) - set(fields))
    if strict and unknown:
        raise unknown_key(prefix, unknown[0], fields)
    kwargs = {}
    for key, field in fields.items():
        if key in mapping:
            typ = hints[field.name]
            if isinstance(typ, types.UnionType):
                typ = next(t for t in typing.get_args(typ) if t is not type(None))
            kwargs[field.name] = _coerce(mapping[key], typ, prefix + key)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{prefix}{exc}") from None


def to_mapping(obj: Any) -> dict[str, Any]:
    """A frozen config as a flat kebab-case dict (for records, TOML and JSON)."""
    return {kebab(f.name): getattr(obj, f.name) for f in dataclasses.fields(obj)}


BUILTIN_TASKS = ("digits", "synthetic")
# A user's task: "package.module:ClassName" or "path/to/file.py:ClassName"
_TASK_PATH = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*|[^:\0\n]+\.py):[A-Za-z_][A-Za-z0-9_]*")
PARTITIONINGS = ("iid", "dirichlet", "sample")  # sample: each client draws client-examples with replacement


def resolve_task(value: Any, base: Path | None = None) -> Any:
    """A ``path/to/file.py:Class`` task with its file made absolute against ``base`` (default: the working
    directory), so every process (Ray's actors, a ClientApp) finds it; any other value unchanged."""
    if not isinstance(value, str) or ".py:" not in value or _TASK_PATH.fullmatch(value) is None:
        return value
    where, _, attr = value.rpartition(":")
    return f"{resolve_path(where, 'task', base)}:{attr}"


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """Which task (model + data) a run trains, and how its data is split."""

    task: str = "digits"
    partitioning: str = "dirichlet"
    dirichlet_alpha: float = 0.5
    data_seed: int = 0
    synthetic_alpha: float = 1.0
    synthetic_beta: float = 1.0
    hidden_units: int = 128  # the digits MLP's hidden width (64-h-10: 75h + 10 parameters)
    client_examples: int = 20  # partitioning "sample": examples each client draws (a population larger than the data)

    @property
    def label(self) -> str:
        """The task as a title shows it: a built-in name, or a user task's class name."""
        return self.task.rpartition(":")[2]

    def __post_init__(self) -> None:
        check(self.task in BUILTIN_TASKS or (len(self.task) <= 1024 and _TASK_PATH.fullmatch(self.task) is not None),
              "task", f"be one of {list(BUILTIN_TASKS)}, package.module:ClassName or path/to/file.py:ClassName",
              self.task)
        check(self.partitioning in PARTITIONINGS, "partitioning", f"be one of {list(PARTITIONINGS)}", self.partitioning)
        check(0 < self.dirichlet_alpha <= 1e6, "dirichlet-alpha", "be in (0, 1e6]", self.dirichlet_alpha)
        check(0 <= self.data_seed < 2**32, "data-seed", "be in [0, 2**32)", self.data_seed)
        # FedProx's settings are 0-1; past 1e3 the data degenerates (one label, or x overflowing to inf)
        check(0 <= self.synthetic_alpha <= 1e3, "synthetic-alpha", "be in [0, 1000]", self.synthetic_alpha)
        check(0 <= self.synthetic_beta <= 1e3, "synthetic-beta", "be in [0, 1000]", self.synthetic_beta)
        check(1 <= self.hidden_units <= 1 << 20, "hidden-units", "be in [1, 1048576]", self.hidden_units)
        check(1 <= self.client_examples <= 1_000_000, "client-examples", "be in [1, 1000000]", self.client_examples)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Local training settings sent to clients each round."""

    local_epochs: int = 3
    batch_size: int = 16
    lr: float = 0.1
    momentum: float = 0.9
    proximal_mu: float = 0.0  # FedProx's mu: the local objective adds mu / 2 * ||w - w_global||^2 (0: FedAvg)

    def __post_init__(self) -> None:
        check(1 <= self.local_epochs <= 1000, "local-epochs", "be in [1, 1000]", self.local_epochs)
        check(1 <= self.batch_size <= 65536, "batch-size", "be in [1, 65536]", self.batch_size)
        check(0 < self.lr <= 100, "lr", "be in (0, 100]", self.lr)
        check(0 <= self.momentum < 1, "momentum", "be in [0, 1)", self.momentum)
        check(0 <= self.proximal_mu <= 1e4, "proximal-mu", "be in [0, 10000] (0: plain FedAvg)", self.proximal_mu)


def split_mapping(mapping: Mapping[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Split one flat mapping into the parts that belong to each dataclass."""
    parts: list[dict[str, Any]] = []
    for cls in classes:
        keys = set(config_keys(cls))
        parts.append({k: v for k, v in mapping.items() if k in keys})
    return parts
