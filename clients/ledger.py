"""A device's local-DP ledger on disk, and the owner's own limits on local DP.

Why on disk: the ledger in ``Context.state`` lives as long as one Flower run on one SuperNode. A
coordinator that restarts (a resumed run is a new Flower run) or an agent that restarts started a
fresh accountant on the same data, and ``local-epsilon`` then understated what the data had spent.
``fedshield agent start`` gives each node a ``state-dir``; the ledger is kept there, one file per
dataset, written atomically after every round. A data file's ledger is keyed by a hash of its
contents (the same data under another path shares it). A built-in partition's (``--partition``) is
keyed by the task alone, one ledger for every partition of its data in the state dir: which examples
a partition holds follows settings the coordinator sends (``data-seed``, ``partitioning``,
``dirichlet-alpha``), so keyed by its examples, a coordinator could change them for an overlapping
partition with a fresh ledger and train the shared examples past the owner's ``--max-local-epsilon``.

Why limits of the owner's own: under local DP the coordinator is the party the noise protects
against, yet it chooses the noise. ``--min-local-noise`` makes the device train only under local DP
with at least that noise multiplier (a coordinator that sends none, or less, is refused);
``--max-local-epsilon`` refuses a round that would take the data's epsilon past that bound,
decided before training from the planned steps.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from privacy import write_atomic

from ._errors import ClientError, ConfigError
from .tasks import Dataset

STATE_DIR, MIN_NOISE, MAX_EPSILON = "state-dir", "min-local-noise", "max-local-epsilon"
STATE_DIR_ENV = "FEDSHIELD_AGENT_STATE_DIR"  # the agent's --state-dir when the flag is not given
OWNER_DELTA = 1e-5  # the delta --max-local-epsilon is stated at (or the coordinator's, if smaller)
PREFIX = "local-dp-ledger-"


def data_key(data: Dataset) -> str:
    """A hash of the data's contents (shapes, dtypes, bytes)."""
    h = hashlib.sha256()
    inputs = sorted(data.x.items()) if isinstance(data.x, dict) else [("", data.x)]  # ("": one array, as ever)
    for key, a in (*inputs, ("", data.y)):
        h.update(f"{key}{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a.tobytes()))
    return h.hexdigest()[:32]


def ledger_key(task_name: str, data: Dataset, node_config: Mapping[str, Any]) -> str:
    """What a node's ledger is about: its data file's contents (``data_key``), or, for a built-in partition,
    the task whose data it is drawn from (see the module's docstring)."""
    if "data-path" in node_config:  # what client_data loads first
        return data_key(data)
    return f"task-{task_ledger_name(task_name)}"


def task_ledger_name(task_name: str) -> str:
    """A task's name as a file name: a built-in's or a module's (``digits``, ``mypkg.tasks:Cifar``) as it is; a task
    file's (``some/dir/mytask.py:Cnn``) by its file name, so the same file moved keeps its ledger (its path, with
    its slashes, named no file that could be made: every such round was refused)."""
    where, colon, attr = task_name.rpartition(":")
    if colon and where.endswith(".py"):
        task_name = f"{Path(where).name}:{attr}"
    return re.sub(r"[^A-Za-z0-9._:-]", "_", task_name)[:160]


_CONTENT_KEY = re.compile(r"[0-9a-f]{32}")


class LedgerFile:
    """The ledger under ``key`` (``ledger_key``) in ``state_dir`` (an accountant state, see ``dp_training``)."""

    def __init__(self, state_dir: str | os.PathLike, key: str) -> None:
        self.path = Path(state_dir) / f"{PREFIX}{key}.json"
        self._inherits = key.startswith("task-")

    def _legacy(self) -> list[Path]:
        """The ledgers keyed by contents in this state dir. Before 2026-12-04 a built-in partition's ledger was
        keyed by its examples too; a task's ledger starts from all of them (their histories composed: it may
        over-count, never under-count), so an upgrade does not start a partition's epsilon again at zero."""
        return sorted(p for p in self.path.parent.glob(f"{PREFIX}*.json")
                      if _CONTENT_KEY.fullmatch(p.name[len(PREFIX):-len(".json")]))

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold this dataset's lock (an flock on a file beside the ledger) from reading the ledger to
        writing it back: two trainings of the same data at once (two nodes, two runs) then charge it
        one after the other instead of one overwriting the other's charge."""
        try:
            fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise ClientError(f"local DP ledger lock {self.path.with_suffix('.lock')} must be creatable. "
                              f"Found: {exc.strerror or exc}.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def load(self) -> dict[str, Any] | None:
        """The stored state (None: no file yet). A file that cannot be read as a ledger is an error,
        not a fresh start: a lost ledger under-reports epsilon. A task's ledger not yet written starts from
        the ledgers keyed by contents (``_legacy``)."""
        if not self.path.exists():
            if not self._inherits:
                return None
            states = [self._read(p) for p in self._legacy()]
            if not states:
                return None
            return {**states[0], "history": [event for s in states for event in s["history"]]}
        return self._read(self.path)

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        from .dp_training import accountant_from_state

        try:
            state = json.loads(path.read_text(encoding="utf-8"))
            accountant_from_state(state)  # validates every event
        except (OSError, ValueError, RecursionError, ConfigError) as exc:  # RecursionError: deep nesting
            raise ClientError(f"local DP ledger {path} must be readable (a lost ledger under-reports epsilon; "
                              f"move it away only to start this data's accounting afresh). Found: {exc}") from None
        return state

    def save(self, state: Mapping[str, Any]) -> None:
        """Write ``state`` atomically (a crash leaves the old ledger or the new one, never half of one)."""
        try:
            write_atomic(self.path, json.dumps(state).encode("utf-8"), 0o600, exact=True)
        except OSError as exc:
            raise ClientError(f"local DP ledger {self.path} must be writable. Found: {exc.strerror or exc}.") from None


def owner_limits(node_config: Mapping[str, Any]) -> tuple[float, float]:
    """(min noise multiplier, max epsilon) the device's owner set (0 and inf: none)."""
    out = []
    for key, default in ((MIN_NOISE, 0.0), (MAX_EPSILON, math.inf)):
        value = node_config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise ClientError(f"node config {key} must be a number >= 0. Found {value!r}.")
        out.append(float(value))
    return out[0], out[1]


def check_owner_limits(node_config: Mapping[str, Any], noise_multiplier: float | None) -> None:
    """Refuse training that breaks the owner's ``min-local-noise``, or that would be without local
    DP under a ``max-local-epsilon`` (``noise_multiplier``: the coordinator's local DP noise, None
    when it sent no local DP). The epsilon bound itself is checked against the ledger before training."""
    min_noise, max_epsilon = owner_limits(node_config)
    if math.isfinite(max_epsilon) and STATE_DIR not in node_config:  # (fedshield agent always gives one)
        raise ClientError(f"this node's owner limits its local epsilon to {max_epsilon:g} (max-local-epsilon): that "
                          f"needs a {STATE_DIR} in its node config, where the ledger outlives the run. Found none (every "
                          "run would start from epsilon 0).")
    if noise_multiplier is None and math.isfinite(max_epsilon):  # no DP: an unbounded epsilon
        raise ClientError(f"this node trains only under local DP (its owner's --max-local-epsilon "
                          f"{max_epsilon:g}). Found no local DP in the coordinator's train message.")
    if min_noise > 0 and (noise_multiplier is None or noise_multiplier < min_noise):
        found = "no local DP" if noise_multiplier is None else f"noise multiplier {noise_multiplier:g}"
        raise ClientError(f"this node trains only under local DP with a noise multiplier >= {min_noise:g} (its "
                          f"owner's --min-local-noise). Found {found} in the coordinator's train message.")
