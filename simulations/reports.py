"""``fedshield runs`` and ``fedshield report``: what run directories hold, read back without running anything.

A run directory is one with ``summary.json``, ``checkpoint.pt`` or ``status.json`` (a run that failed before
its first round has only that). Its status comes from, in order: a process
holding its lock (running), the ``status.json`` its workflow rewrote as it went, its summary; a run whose last
word says it was still going, and that no process holds, was interrupted (killed, or its machine stopped).
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coordinator.live import ENDED
from coordinator.rundir import CHECKPOINT, CONFIG, LOCK, METRICS, STATUS, SUMMARY, shown_metric

MAX_DEPTH = 4  # how deep under DIR ``fedshield runs`` looks (a comparison's runs are two levels down)


class ReportError(Exception):
    """A run directory, or a directory of them, that cannot be read as one."""


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _cell(text: str) -> Any:
    """A metrics.csv value as the row held it: a number, a mapping (JSON), None for an empty cell."""
    if text == "":
        return None
    if text[0] == "{":
        try:
            return json.loads(text)
        except ValueError:
            return text
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False}.get(text, text)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.csv's rows with their values typed (empty cells left out); [] when there is none."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            return [{k: _cell(v) for k, v in row.items() if k and v not in (None, "")} for row in csv.DictReader(fh)]
    except (OSError, csv.Error, UnicodeDecodeError):
        return []


def _result(accuracy: float | None, metrics: dict[str, Any], loss: float | None = None) -> str:
    """A run's accuracy for the table, else the task's ``first_metric`` as ``name=value`` (``rmse=0.912``: one
    word, as every cell), else its loss (``loss=0.2451``: a task whose evaluate gives nothing more), else ``-``."""
    named = shown_metric(accuracy, metrics, loss)
    return f"{named[0]}={named[1]:.4g}".replace(" ", "_") if named else _f(accuracy, ".4f")


def _named(metrics: Any) -> str:
    """A row's task metrics (``test_metrics``, ``fed_eval_metrics``) in words: ``rmse 0.9123, mae 0.71``."""
    if not isinstance(metrics, dict):
        return ""
    return ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())[:8] if _number(v))


def lock_holder(run_dir: Path) -> int | None:
    """The process holding ``run_dir``'s lock (a run going on there), or None. From /proc/locks (Linux), which
    lists flock holders; elsewhere, the pid the lock file names if that process exists. Reads only: taking the
    lock to test it could make a run starting that moment fail."""
    lock = run_dir / LOCK
    try:
        st = lock.stat()
        text = lock.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None  # a finished run removes it
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        table = None
    if table is not None:
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in table.splitlines():
            parts = line.split()
            if "FLOCK" in parts and len(parts) >= 6 and parts[-3] == dev:
                return int(parts[-4]) if parts[-4].isdigit() else -1
        return None
    if not text.isdigit():
        return None
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return int(text)


@dataclass
class RunInfo:
    """One run directory's state and final figures, as ``fedshield runs`` lists them."""

    path: Path
    status: str
    rounds: int
    num_rounds: int | None
    test_accuracy: float | None
    fed_accuracy: float | None
    epsilon: float | None
    wall_time_s: float | None
    modified: float
    failure: str = ""
    summary: dict[str, Any] = field(default_factory=dict)
    live: dict[str, Any] = field(default_factory=dict)
    test_metrics: dict[str, Any] = field(default_factory=dict)  # the task's own, shown where it has no accuracy
    fed_metrics: dict[str, Any] = field(default_factory=dict)
    test_loss: float | None = None  # shown where there is neither accuracy nor a metric of the task's
    fed_loss: float | None = None


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def run_info(run_dir: Path, rows: list[dict[str, Any]] | None = None) -> RunInfo:
    """``run_dir``'s status and figures (``rows``: its history when the caller has it, else metrics.csv's)."""
    summary = _json(run_dir / SUMMARY) or {}
    live = _json(run_dir / STATUS) or {}
    rows = read_metrics(run_dir / METRICS) if rows is None else rows
    last = rows[-1] if rows else dict(live.get("last_round") or {})
    rounds = max([int(x) for x in (last.get("round"), live.get("round"), summary.get("rounds")) if _number(x)] or [0])
    # the summary speaks for the run only if no round came after it (a resumed run killed midway: the old one)
    current = bool(summary) and _number(summary.get("rounds")) and summary["rounds"] >= rounds \
        and _mtime(run_dir / SUMMARY) >= _mtime(run_dir / CHECKPOINT) - 1.0
    holder = lock_holder(run_dir)
    failure = ""
    if holder is not None:
        status = str(live.get("state")) if live.get("state") in ("starting", "waiting-for-nodes", "running") else "running"
    elif live.get("state") in ENDED and (not summary or _mtime(run_dir / STATUS) >= _mtime(run_dir / SUMMARY) - 1.0):
        status = str(live["state"])
        failure = str(live.get("failure") or "")
    elif current:
        status = str(summary.get("status", "completed"))
    else:
        status = "interrupted"  # its last word says it was going on, and no process holds it
    failure = failure or (str(summary.get("failure") or "") if current else "")
    fed = next((r.get("fed_eval_accuracy") for r in reversed(rows) if _number(r.get("fed_eval_accuracy"))), None)
    if current and _number(summary.get("final_fed_eval_accuracy")):
        fed = summary["final_fed_eval_accuracy"]
    eps = next((r.get("epsilon") for r in reversed(rows) if _number(r.get("epsilon"))), live.get("epsilon"))
    if current and _number(summary.get("epsilon")):
        eps = summary["epsilon"]
    elif eps is None:
        local = [r["local_epsilon_max"] for r in rows if _number(r.get("local_epsilon_max"))]
        eps = max(local) if local else (summary.get("local_epsilon_max") if current else None)
    acc = last.get("test_accuracy") if _number(last.get("test_accuracy")) else None
    if current and _number(summary.get("final_test_accuracy")):
        acc = summary["final_test_accuracy"]
    wall = summary.get("wall_time_s") if current else last.get("wall_time_s")
    modified = max(_mtime(run_dir / name) for name in (SUMMARY, CHECKPOINT, STATUS, METRICS))
    total = live.get("num_rounds") if _number(live.get("num_rounds")) else None
    if total is None:
        total = (_json(run_dir / CONFIG) or {}).get("num-rounds")
    named = last.get("test_metrics") or (summary.get("final_test_metrics") if current else None) or {}
    fed_named = next((r["fed_eval_metrics"] for r in reversed(rows) if isinstance(r.get("fed_eval_metrics"), dict)), {})
    loss = summary.get("final_test_loss") if current and _number(summary.get("final_test_loss")) else last.get("test_loss")
    fed_loss = next((r.get("fed_eval_loss") for r in reversed(rows) if _number(r.get("fed_eval_loss"))), None)
    if current and _number(summary.get("final_fed_eval_loss")):
        fed_loss = summary["final_fed_eval_loss"]
    return RunInfo(run_dir, status, rounds, int(total) if _number(total) else None, acc, fed,
                   eps if _number(eps) else None, wall if _number(wall) else None, modified, failure, summary, live,
                   named if isinstance(named, dict) else {}, fed_named, loss if _number(loss) else None,
                   fed_loss if _number(fed_loss) else None)


def find_runs(top: Path) -> list[Path]:
    """Run directories at or under ``top`` (at most MAX_DEPTH levels down; not inside one another)."""
    found: list[Path] = []
    for here, dirs, files in os.walk(top, onerror=None):
        path = Path(here)
        if SUMMARY in files or CHECKPOINT in files or STATUS in files:
            found.append(path)
            dirs[:] = []
            continue
        depth = len(path.relative_to(top).parts)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "tensorboard") if depth < MAX_DEPTH else []
    return found


def check_dir(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        found = "a file" if p.exists() else "no such directory"
        raise ReportError(f"{what} must be a directory. Found {found}: {str(p)!r}.")
    return p


def list_runs(top: str) -> list[RunInfo]:
    """Every run directory under ``top`` with its figures, oldest first (the newest is the last line)."""
    root = check_dir(top, "DIR")
    return sorted((run_info(p) for p in find_runs(root)), key=lambda r: (r.modified, str(r.path)))


def _f(value: Any, spec: str) -> str:
    return format(value, spec) if _number(value) else "-"


def _duration(seconds: Any) -> str:
    if not _number(seconds):
        return "-"
    s = float(seconds)
    return f"{s:.1f}s" if s < 60 else f"{int(s // 60)}m{int(s % 60):02d}s" if s < 3600 else \
        f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def format_runs(runs: list[RunInfo], top: str) -> str:
    """A plain, aligned table (one run a line; nothing wraps or is cut, piped or not)."""
    root = Path(top).expanduser()
    head = ("RUN", "STATUS", "ROUNDS", "TEST", "FED", "EPSILON", "WALL", "MODIFIED")
    lines = [head]
    for r in runs:
        name = str(r.path.relative_to(root)) if r.path != root else r.path.name or str(r.path)
        rounds = f"{r.rounds}/{r.num_rounds}" if r.num_rounds else str(r.rounds)
        lines.append((name, r.status, rounds, _result(r.test_accuracy, r.test_metrics, r.test_loss),
                      _result(r.fed_accuracy, r.fed_metrics, r.fed_loss),
                      _f(r.epsilon, ".3g"), _duration(r.wall_time_s),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(r.modified))))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in lines)


# -- report ------------------------------------------------------------------
def _history(run_dir: Path) -> list[dict[str, Any]]:
    """The rounds: the checkpoint's history (checked as a resume checks it), else metrics.csv's."""
    if (run_dir / CHECKPOINT).is_file():
        from coordinator import RunDirectory

        ckpt = RunDirectory(run_dir).load_checkpoint()
        return list(ckpt["history"]) if ckpt else []
    return read_metrics(run_dir / METRICS)


def _mb(n: Any) -> str:
    return f"{n / 1e6:.2f} MB" if _number(n) else "-"


def _sum(rows: list[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in rows if _number(r.get(key)))


def report(path: str, plots: bool = True) -> str:
    """``fedshield report``'s text for the run directory ``path``; with ``plots``, its plots written again
    from its rounds (accuracy.png, accuracy_vs_time.png, and epsilon.png for a DP run)."""
    run_dir = check_dir(path, "RUN_DIR").resolve()
    if not any((run_dir / name).is_file() for name in (SUMMARY, CHECKPOINT, STATUS)):
        raise ReportError(f"RUN_DIR must hold a run's results ({SUMMARY}, {CHECKPOINT} or {STATUS}). Found none in "
                          f"{str(run_dir)!r}; `fedshield runs` lists the run directories under a directory.")
    rows = _history(run_dir)
    info = run_info(run_dir, rows)
    s, config = info.summary, _json(run_dir / CONFIG) or {}
    last = rows[-1] if rows else {}
    task = s.get("task") or config.get("task") or info.live.get("task") or "?"
    dp = config.get("dp") or info.live.get("dp") or "none"
    out = [f"run       {run_dir}", f"status    {info.status}"]
    if info.failure:
        out.append(f"failure   {info.failure}")
    total = f" of {info.num_rounds}" if info.num_rounds else ""
    out.append(f"rounds    {info.rounds}{total}" + (f" (model version {last['version']})" if "version" in last else ""))
    params = f" ({s['num_parameters']:,} parameters)" if _number(s.get("num_parameters")) else ""
    extra = [f"{k} {config[k]}" for k in ("workflow", "aggregator", "codec") if config.get(k)]
    out.append(f"task      {task}{params}" + (f"; {', '.join(extra)}" if extra else ""))
    if rows:
        accs = [(r["test_accuracy"], r["round"]) for r in rows if _number(r.get("test_accuracy"))]
        top = max(accs) if accs else None
        best = f"; best {top[0]:.4f} at round {top[1]}" if top else ""
        out.append(f"accuracy  test {_f(last.get('test_accuracy'), '.4f')} after round {last.get('round')}{best}")
        fed = [r for r in rows if _number(r.get("fed_eval_accuracy"))]
        if fed:
            out.append(f"          federated {fed[-1]['fed_eval_accuracy']:.4f} (loss {_f(fed[-1].get('fed_eval_loss'), '.4f')}) "
                       f"at round {fed[-1]['round']}, {fed[-1].get('fed_eval_nodes', '?')} nodes")
        named = []  # the task's own (a regression's rmse, a language model's perplexity)
        if _named(last.get("test_metrics")):
            named.append(f"test {_named(last['test_metrics'])} after round {last.get('round')}")
        fed = next((r for r in reversed(rows) if _named(r.get("fed_eval_metrics"))), None)
        if fed:
            named.append(f"federated {_named(fed['fed_eval_metrics'])} at round {fed['round']}")
        if named:
            out.append(f"metrics   {'; '.join(named)}")
        out.append(f"losses    test {_f(last.get('test_loss'), '.4f')}, train {_f(last.get('train_loss'), '.4f')} "
                   "(last round)")
        out.append(f"bytes     down {_mb(_sum(rows, 'bytes_down'))}, up {_mb(_sum(rows, 'bytes_up'))} "
                   f"(updates {_mb(sum(r.get('update_bytes_up', r.get('bytes_up', 0)) or 0 for r in rows))})")
        replies = f"accepted {int(_sum(rows, 'accepted'))}, rejected {int(_sum(rows, 'rejected'))}"
        by_rule: dict[str, int] = {}
        for r in rows:
            for rule, n in (r.get("rejected_by_rule") or {}).items():
                by_rule[rule] = by_rule.get(rule, 0) + (n if _number(n) else 0)
        if by_rule:
            replies += ": " + ", ".join(f"{rule} {n}" for rule, n in sorted(by_rule.items(), key=lambda kv: (-kv[1], kv[0])))
        out.append(f"replies   {replies}")
    else:
        out.append("accuracy  - (no round finished)")
    eps = [r for r in rows if _number(r.get("epsilon"))]
    local = [r["local_epsilon_max"] for r in rows if _number(r.get("local_epsilon_max"))]
    if eps:
        acct = s.get("accountant") or config.get("accountant") or "?"
        delta = s.get("delta", config.get("dp-delta"))
        both = s.get("epsilon_by_accountant") or {}
        others = "; " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(both.items()) if _number(v)) if both else ""
        out.append(f"privacy   {dp} DP: epsilon {eps[-1]['epsilon']:.4g} at delta {_f(delta, 'g')} after round "
                   f"{eps[-1]['round']} ({acct} accountant{others})")
    elif local:
        out.append(f"privacy   local DP: largest client epsilon {max(local):.4g} at delta {_f(config.get('dp-delta'), 'g')}")
    elif dp != "none":
        out.append(f"privacy   {dp} DP: no epsilon recorded")
    else:
        out.append("privacy   none (no differential privacy)")
    wall = s.get("wall_time_s") if info.summary and info.rounds == s.get("rounds") else last.get("wall_time_s")
    times = [f"wall {_duration(wall)}"]
    if _number(last.get("sim_time_s")):
        times.append(f"simulated {_duration(last['sim_time_s'])}")
    if rows:
        times.append(f"{_sum(rows, 'round_time_s') / len(rows):.2f} s a round")
    out.append(f"time      {', '.join(times)}")
    if plots:
        out.append(f"plots     {', '.join(write_plots(run_dir, rows, task, dp, config)) or 'none (no round finished)'}")
    return "\n".join(out)


def write_plots(run_dir: Path, rows: list[dict[str, Any]], task: str, dp: str, config: dict[str, Any]) -> list[str]:
    """The run's plots, (re)written with RunDirectory's own methods; the names written."""
    if not rows:
        return []
    from coordinator import RunDirectory
    from coordinator.rundir import EPSILON_PLOT, PLOT, TIME_PLOT

    label = str(task).rpartition(":")[2]  # as TaskSpec.label
    rd = RunDirectory(run_dir)
    rd.plot(rows, f"{label}: {{metric}} and loss per round")
    rd.plot_accuracy_vs_time({run_dir.name: rows}, f"{label}: {{metric}} over time")
    names = [PLOT, TIME_PLOT]
    if dp != "none" or any(_number(r.get("epsilon")) or _number(r.get("local_epsilon_max")) for r in rows):
        rd.plot_epsilon(rows, f"{label}: privacy spent ({dp} DP)")
        names.append(EPSILON_PLOT)
    return [str(run_dir / n) for n in names]
