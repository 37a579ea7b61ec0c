"""Live metrics of a run, written as each round ends: ``status.json`` and TensorBoard event files.

``status.json`` (atomic, beside the checkpoint) says where the run is now: waiting for nodes, running round N,
or ended (completed, failed and why); the last round's figures and the run's totals. ``fedshield coordinator
start`` serves it on 127.0.0.1 (``coordinator.status``), ``fedshield report`` and ``fedshield runs`` read it.
It holds counts and metrics only: no keys, no updates, no node ids.

``tensorboard/`` holds one scalar per numeric row field per round (step = round). A resumed run rewrites the
event files from its checkpoint's history (the history is the truth: rounds a killed session wrote to
TensorBoard but not to its checkpoint are trained again), so each tag holds one series without duplicates; the
new file also tells a TensorBoard already watching to purge what it had from that step on.

Neither may fail a run: a file that cannot be written is one warning, and that writer stops for the run.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from logging import WARNING
from pathlib import Path
from typing import Any

from flwr.common.logger import log

from privacy import write_atomic

from .rundir import STATUS, TENSORBOARD

STATUS_FORMAT = 1
RECENT_ROUNDS = 50  # rows status.json keeps for the page's chart
ENDED = ("completed", "budget-exhausted", "no-updates", "failed", "interrupted", "stopped")
# a row's fields that are not a scalar worth a chart (the round is the step; strings and flags are left out)
_NOT_SCALARS = {"round"}
# a row's fields status.json's "last_round" keeps (what the page and ``fedshield report`` show)
_LAST_ROUND = ("round", "version", "nodes_online", "selected", "replies", "accepted", "rejected", "late",
               "test_accuracy", "test_loss", "train_loss", "bytes_down", "bytes_up", "update_bytes_up",
               "round_time_s", "wall_time_s", "sim_time_s", "epsilon", "local_epsilon_max", "clip", "mean_staleness",
               "fed_eval_nodes", "fed_eval_accuracy", "fed_eval_loss", "fed_eval_rejected", "secagg_survivors",
               "secagg_dropped", "secagg_failure", "rejected_by_rule", "test_metrics", "fed_eval_metrics")
_RECENT = ("round", "test_accuracy", "test_loss", "test_metrics", "accepted", "rejected", "epsilon")


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def row_scalars(row: dict[str, Any], rules: set[str] | None = None) -> dict[str, float]:
    """A row's scalars as TensorBoard tags: each finite number under its field's name, a mapping of numbers
    (``secagg_stage_s``) as ``field/key``, and ``rejected_by_rule`` as ``rejected/<rule>``: every rule in
    ``rules`` (those seen so far in the run, updated here) at 0 where this round refused none, so each
    series runs on without gaps."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in _NOT_SCALARS:
            continue
        if key == "rejected_by_rule" and isinstance(value, dict):
            if rules is not None:
                rules.update(k for k in value if isinstance(k, str))
            for rule in sorted(rules if rules is not None else value):
                n = value.get(rule, 0)
                if _number(n):
                    out[f"rejected/{rule}"] = float(n)
        elif isinstance(value, dict):
            out.update({f"{key}/{k}": float(v) for k, v in value.items() if isinstance(k, str) and _number(v)})
        elif _number(value):
            out[key] = float(value)
    return out


class TensorBoardLog:
    """``RUN_DIR/tensorboard``: a SummaryWriter opened at the first row of a session, flushed after each round.
    Any failure (no ``tensorboard`` package, a full disk) is one warning; nothing more is written this run."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: Any = None
        self._failed = self._opened = False
        self._rules: set[str] = set()

    def _fail(self, exc: BaseException) -> None:
        self._failed = True
        log(WARNING, "[fedshield] TensorBoard files in %s are not written from here on (the run goes on): %s: %s",
            self.path, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        self._close_quietly()

    def _close_quietly(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - already failing: the warning said so
                pass

    def open(self, history: list[dict[str, Any]]) -> None:
        """Start this session's event file: the old ones removed, ``history`` (a resumed run's rows) written
        again. purge_step (the first step written) tells a TensorBoard that read the old files to drop them."""
        if self._failed:
            return
        self._opened = True
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.path.mkdir(exist_ok=True)
            for old in self.path.glob("events.out.tfevents.*"):
                if old.is_file() and not old.is_symlink():
                    old.unlink()
            first = int(history[0]["round"]) if history else 1
            self._writer = SummaryWriter(log_dir=str(self.path), purge_step=first)
            for row in history:
                self._add(row)
            self._writer.flush()
        except Exception as exc:  # noqa: BLE001 - a dashboard's file must not fail the run
            self._fail(exc)

    def _add(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        for tag, value in row_scalars(row, self._rules).items():
            self._writer.add_scalar(tag, value, step)

    def add(self, row: dict[str, Any]) -> None:
        if not self._opened:  # a new run's first round (a run that fails before it leaves no files)
            self.open([])
        if self._writer is None or self._failed:
            return
        try:
            self._add(row)
            self._writer.flush()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def close(self) -> None:
        if self._writer is None or self._failed:
            return
        try:
            self._writer.close()
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)
        self._writer = None


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class LiveRecorder:
    """A workflow's live outputs: ``start`` before the first round, ``waiting`` as rounds start, ``round``
    after each round's checkpoint, then ``finish`` (the summary) or ``fail`` (the exception). Everything here
    is best-effort: an error writing is one warning per file, never the run's failure."""

    def __init__(self, workflow: Any) -> None:
        cfg = workflow.cfg
        self.path: Path = workflow.run_dir.path
        self.total = cfg.server.num_rounds
        self.tensorboard = TensorBoardLog(self.path / TENSORBOARD)
        self._status_failed = False
        self._history: list[dict[str, Any]] = workflow.history
        self._last: dict[str, Any] = {}
        self._totals: dict[str, Any] = {"accepted": 0, "rejected": 0, "bytes_down": 0, "bytes_up": 0,
                                        "rejected_by_rule": Counter()}
        for row in self._history:
            self._count(row)
        self._base = {
            "format": STATUS_FORMAT, "run_dir": str(self.path), "task": cfg.task.task, "num_rounds": self.total,
            "workflow": cfg.asynchrony.workflow, "dp": cfg.privacy.dp, "min_nodes": cfg.server.min_nodes,
            "secure_aggregation": cfg.secure.secure_aggregation,
            "delta": cfg.privacy.dp_delta if cfg.privacy.dp != "none" else None,
        }
        self._state: dict[str, Any] = {}

    # -- events --------------------------------------------------------------
    def start(self) -> None:
        if self._history:  # resumed: its rounds so far written again at once
            self.tensorboard.open(self._history)
        self._write("starting", round_in_progress=None, nodes_online=None)

    def waiting(self, online: int, need: int, rnd: int) -> None:
        """As a round waits for nodes (``online`` of ``need``), then as it starts: written when either changes."""
        state = ("waiting-for-nodes" if online < need else "running", online, rnd)
        if state != self._state.get("_key"):
            self._write(state[0], round_in_progress=rnd, nodes_online=online, _key=state)

    def round(self, row: dict[str, Any]) -> None:
        self._count(row)
        self.tensorboard.add(row)
        self._write("running", round_in_progress=None, nodes_online=row.get("nodes_online"), _key=None)

    def finish(self, summary: dict[str, Any]) -> None:
        self.tensorboard.close()
        extra = {"failure": summary["failure"]} if summary.get("failure") else {}
        self._write(str(summary.get("status", "completed")), round_in_progress=None, _key=None, **extra)

    def fail(self, exc: BaseException) -> None:
        self.tensorboard.close()
        from .workflow import RunInterrupted

        interrupted = isinstance(exc, KeyboardInterrupt | RunInterrupted)
        text = str(exc).strip().splitlines()
        why = text[0][:500] if text else type(exc).__name__
        self._write("interrupted" if interrupted else "failed", round_in_progress=None, _key=None,
                    failure=why)

    # -- the file ------------------------------------------------------------
    def _count(self, row: dict[str, Any]) -> None:
        t = self._totals
        for key in ("accepted", "rejected", "bytes_down", "bytes_up"):
            if _number(row.get(key)):
                t[key] += row[key]
        t["rejected_by_rule"].update({k: v for k, v in (row.get("rejected_by_rule") or {}).items() if _number(v)})

    def _write(self, state: str, **fields: Any) -> None:
        self._state.update(fields)
        rows = self._history
        last = rows[-1] if rows else {}
        eps = [r["epsilon"] for r in rows if _number(r.get("epsilon"))]
        local = [r["local_epsilon_max"] for r in rows if _number(r.get("local_epsilon_max"))]
        doc = {
            **self._base, "state": state, "updated_at": _now(), "round": int(last.get("round", 0)),
            "round_in_progress": self._state.get("round_in_progress"),
            "nodes_online": self._state.get("nodes_online", last.get("nodes_online")),
            "epsilon": eps[-1] if eps else None, "local_epsilon_max": max(local) if local else None,
            "last_round": {k: last[k] for k in _LAST_ROUND if k in last},
            "totals": {**self._totals, "rejected_by_rule": dict(self._totals["rejected_by_rule"])},
            "recent": [{k: r.get(k) for k in _RECENT} for r in rows[-RECENT_ROUNDS:]],
        }
        if self._state.get("failure"):
            doc["failure"] = self._state["failure"]
        self._state["state"] = state
        if self._status_failed:
            return
        try:
            text = json.dumps(_finite(doc), indent=1, sort_keys=True, default=_plain)
            write_atomic(self.path / STATUS, (text + "\n").encode())
        except (OSError, TypeError, ValueError) as exc:
            self._status_failed = True
            log(WARNING, "[fedshield] %s is not written from here on (the run goes on): %s", self.path / STATUS,
                getattr(exc, "strerror", None) or exc)


def _plain(obj: Any) -> Any:
    """A value json cannot take (a numpy or torch number) as a float, else its text."""
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


def _finite(obj: Any) -> Any:
    """JSON without NaN or infinity (which a browser's JSON.parse refuses): None instead."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class _NoLive:
    """What a workflow records to outside ``run`` (a test driving rounds itself): nothing."""

    def waiting(self, online: int, need: int, rnd: int) -> None:
        pass

    def round(self, row: dict[str, Any]) -> None:
        pass


NO_LIVE = _NoLive()


def recorded(run: Any) -> Any:
    """Decorates a workflow's ``run``: live outputs started before it, finished with its summary, or failed
    with its exception (which propagates unchanged)."""
    import functools

    @functools.wraps(run)
    def wrapper(self: Any) -> dict[str, Any]:
        self.live = LiveRecorder(self)
        self.live.start()
        try:
            summary = run(self)
        except BaseException as exc:
            self.live.fail(exc)
            raise
        self.live.finish(summary)
        return summary

    return wrapper


def write_status(run_dir: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as ``run_dir``'s status.json (atomically; ``updated_at`` set); an OSError as raised."""
    doc = {**doc, "updated_at": _now()}
    write_atomic(Path(run_dir) / STATUS, (json.dumps(_finite(doc), indent=1, sort_keys=True, default=_plain)
                                          + "\n").encode())


def announce_start(run_dir: Path, cfg: Any, resumed: bool) -> None:
    """``coordinator start``, before its SuperLink starts: status.json says "starting" (a resumed run keeps the
    figures its last session wrote; a new one drops whatever an earlier attempt there left)."""
    doc = (read_status(run_dir) or {}) if resumed else {}
    doc.pop("failure", None)
    doc.update({"format": STATUS_FORMAT, "state": "starting", "run_dir": str(run_dir), "task": cfg.task.task,
                "num_rounds": cfg.server.num_rounds, "min_nodes": cfg.server.min_nodes, "round_in_progress": None,
                "workflow": cfg.asynchrony.workflow, "dp": cfg.privacy.dp})
    doc.setdefault("round", 0)
    write_status(run_dir, doc)


def mark_ended(run_dir: Path, state: str, failure: str = "") -> None:
    """After ``coordinator start`` stopped its SuperLink (and so the ServerApp): a status.json still saying the
    run goes on (the ServerApp killed, or never started) says ``state`` instead, with ``failure``. One that
    already ended is left as the run wrote it. Nothing on an OSError: this is the coordinator's way out."""
    doc = read_status(run_dir)
    if doc is None or doc.get("state") in ENDED:
        return
    doc.update({"state": state, "round_in_progress": None})
    if failure:
        doc["failure"] = failure
    try:
        write_status(run_dir, doc)
    except OSError:
        pass


def read_status(run_dir: Path) -> dict[str, Any] | None:
    """A run directory's status.json, or None when it has none or it is not a JSON object."""
    try:
        doc = json.loads((Path(run_dir) / STATUS).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
