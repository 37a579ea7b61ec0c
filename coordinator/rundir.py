"""The run directory: checkpoint, metrics.csv, summary.json, the model and plots.

Files are written atomically (temp file + rename), so a crash never leaves a
half-written checkpoint; a restart resumes from the last complete round.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import fcntl
import hashlib
import io
import json
import math
import os
import re
import tempfile
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from privacy import make_dir, write_atomic

from ._errors import CoordinatorError

CHECKPOINT, METRICS, SUMMARY, MODEL, PLOT, CONFIG = (
    "checkpoint.pt", "metrics.csv", "summary.json", "model.pt", "accuracy.png", "config.json",
)
METRIC_FIELDS = [
    "round", "version", "nodes_online", "selected", "replies", "accepted", "rejected", "late",
    "test_accuracy", "test_loss", "train_loss", "bytes_down", "bytes_up", "update_bytes_up",
    "round_time_s", "wall_time_s", "rejected_by_rule", "epsilon", "local_epsilon_max", "clip",
    "sim_time_s", "mean_staleness", "secagg_degree", "secagg_threshold", "secagg_survivors", "secagg_dropped",
    "secagg_server_s", "secagg_shares_left_out", "secagg_stage_s", "secagg_pipelined", "secagg_failure", "late_accepted", "reduced_work",
    "too_few_updates", "non_finite_aggregate", "fed_eval_nodes", "fed_eval_missing", "fed_eval_examples",
    "fed_eval_loss", "fed_eval_accuracy", "fed_eval_rejected", "weight_total", "test_metrics", "fed_eval_metrics",
    "stray_replies",
]
EPSILON_PLOT = "epsilon.png"
TIME_PLOT = "accuracy_vs_time.png"
STATUS = "status.json"  # the run's live state (coordinator.live), rewritten as it goes
TENSORBOARD = "tensorboard"  # TensorBoard event files, one scalar per numeric row field per round (coordinator.live)


def time_axis(rows: list[dict[str, Any]]) -> list[float]:
    """Seconds since the run started at each round's end: simulated time where the rows have it, else the
    rounds' own durations summed (wall time on a real clock)."""
    out, t = [], 0.0
    for r in rows:
        t = float(r["sim_time_s"]) if r.get("sim_time_s") is not None else t + float(r["round_time_s"])
        out.append(t)
    return out


def is_simulated(rows: list[dict[str, Any]]) -> bool:
    """True when the rows carry simulated time (the virtual engine), False for a real clock."""
    return bool(rows) and rows[-1].get("sim_time_s") is not None


def time_label(runs: list[list[dict[str, Any]]]) -> str:
    """What :func:`time_axis` measures for these runs, in words."""
    kinds = {is_simulated(rows) for rows in runs}
    if kinds == {True}:
        return "simulated on the virtual engine"
    if kinds == {False}:
        return "rounds' wall time summed"
    return "simulated on the virtual engine, else rounds' wall time summed"


def finite(value: Any) -> bool:
    """A finite int or float (not a bool): a figure that has a value."""
    return _number(value) and math.isfinite(value)


def first_metric(metrics: Any) -> tuple[str, float] | None:
    """The one of a task's own metrics (``test_metrics``, ``fed_eval_metrics``) that is shown where the task has no
    accuracy: the first by name with a value (by name, as summary.json and metrics.csv keep them, so every place
    shows the same one); None where there is none."""
    if isinstance(metrics, dict):
        return next(((k, v) for k, v in sorted(metrics.items()) if finite(v)), None)
    return None


def shown_metric(accuracy: object, metrics: object, loss: object) -> tuple[str, float] | None:
    """What a result shows where it has no accuracy: the task's ``first_metric``, else its loss (a task whose
    evaluate gives nothing more); None when accuracy is there or nothing is."""
    if finite(accuracy):
        return None
    return first_metric(metrics) or (("loss", float(loss)) if finite(loss) else None)


def headline_metric(rows: list[dict[str, Any]]) -> str:
    """What the plots show per round: ``accuracy`` where a row has one, else ``first_metric``'s name of the first
    row that has one (a regression's rmse), else ``accuracy`` (nothing evaluated yet)."""
    if any(finite(r.get("test_accuracy")) for r in rows):
        return "accuracy"
    return next((named[0] for r in rows if (named := first_metric(r.get("test_metrics")))), "accuracy")


def metric_series(rows: list[dict[str, Any]], name: str) -> list[float]:
    """Each row's test ``name`` (``headline_metric``'s), nan where the row has none."""
    if name == "accuracy":
        return [r.get("test_accuracy", math.nan) for r in rows]
    return [(r.get("test_metrics") or {}).get(name, math.nan) for r in rows]


def _pyplot() -> Any:
    """matplotlib's pyplot, headless, drawing text as given: a title or label comes from a run
    directory's or scenario's name, and mathtext would read a '$' in it as a formula (a parse error
    after the run had trained)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def _plain(text: str) -> str:
    """``text`` with what a font cannot take (a path's undecodable bytes, kept as surrogates) replaced."""
    return str(text).encode("utf-8", "replace").decode("utf-8")


# What resuming reads from a checkpoint: its type, and the rule in words.
_CHECKPOINT_PARTS = {"version": (int, "an int"), "weights": (torch.Tensor, "a 1-D floating tensor"),
                     "optimizer": (dict, "a dict"), "history": (list, "a list of rows"), "rejections": (dict, "a dict"),
                     "fingerprint": (dict, "a dict")}


def weights_sha256(weights: torch.Tensor) -> str:
    """SHA-256 of a flat tensor's bytes (a checkpoint's weights; shortened, a model version in the logs)."""
    return hashlib.sha256(memoryview(weights.detach().cpu().contiguous().view(torch.uint8).numpy())).hexdigest()


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


# A history row's values that the plots, the summary and a resumed run read (None allowed where marked)
_ROW_NUMBERS = {"test_accuracy": False, "test_loss": False, "round_time_s": False, "bytes_down": False,
                "bytes_up": False, "sim_time_s": True, "wall_time_s": True, "epsilon": True}


def _inconsistency(state: dict[str, Any]) -> str | None:
    """What in a checkpoint (its parts' types already checked) disagrees with the rest, or None."""
    w, rnd, fp = state["weights"], state["round"], state["fingerprint"]
    if "numel" in fp and fp["numel"] != w.numel():  # (before hashing: a bomb of weights is refused cheaply)
        return f"{w.numel()} weights for a model of {fp['numel']}"
    digest = state.get("weights-sha256")
    if digest is not None and digest != weights_sha256(w):  # absent from checkpoints of earlier fedshield versions
        return "its weights do not match their SHA-256: changed or damaged since it was written"
    if not bool(torch.isfinite(w).all()):
        return "its weights hold NaN or infinity"
    if rnd < 0 or state["version"] < 0:
        return f"round {rnd} and version {state['version']} must be >= 0"
    rows = [row.get("round") for row in state["history"]]
    if not all(isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= rnd for r in rows):
        return f"every history row must name a round in [1, {rnd}]"
    if any(b <= a for a, b in zip(rows, rows[1:])):
        return "the history's rounds must increase row by row (no round twice)"
    for row in state["history"]:
        for key, optional in _ROW_NUMBERS.items():
            value = row.get(key)
            if not (_number(value) or (optional and value is None)):
                return f"round {row['round']}'s {key} must be a number. Found {str(value)[:20]!r}"
        for key in ("test_metrics", "fed_eval_metrics"):  # a task's own metrics, by name, where it gives any
            value = row.get(key, {})
            if not (isinstance(value, dict) and all(isinstance(k, str) and _number(v) for k, v in value.items())):
                return f"round {row['round']}'s {key} must map names to numbers. Found {str(value)[:20]!r}"
    if not all(isinstance(k, str) for k in state["rejections"]):
        return "rejection counts must be keyed by rule names"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in state["rejections"].values()):
        return "rejection counts must be integers >= 0"
    for key in ("privacy", "profiles", "engine", "extra"):
        if not isinstance(state.get(key, {}), dict):
            return f"{key!r} must be a dict"
    return None


def _check_stored(path: Path) -> None:
    """torch.save stores a checkpoint's entries uncompressed: a compressed entry (a 2 MB file that inflated to
    5.7 GB before its size was checked) is refused before torch.load reads anything. Not a zip, or unreadable:
    torch.load's to refuse."""
    try:
        with zipfile.ZipFile(path) as archive:
            packed = [i.filename for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED]
    except (zipfile.BadZipFile, ValueError, EOFError, OSError):
        return
    if packed:
        raise CoordinatorError(f"{path} is not a fedshield checkpoint (entry {packed[0][:60]!r} is compressed, as "
                               "torch.save never writes; it could inflate to any size); move it away or pick another "
                               "--run-dir.")


def finished_summary(run_dir: str | os.PathLike, done: int, wanted: int) -> dict[str, Any] | None:
    """The summary of a run directory whose checkpoint holds ``done >= wanted`` rounds, when it is that
    checkpoint's (``done`` rounds): nothing is left to train (its ``failure``, if any, is the run's result).
    Else None: a run stopped after its last checkpoint and before its summary resumes to write it."""
    if done < wanted:
        return None
    try:
        summary = json.loads((Path(run_dir) / SUMMARY).read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("rounds") == done else None


def check_run_dir(run_dir: Path, flag: str = "--run-dir") -> tuple[int, dict[str, Any] | None]:
    """Before a run starts: the rounds ``run_dir``'s checkpoint holds (0 when new) and the checkpoint.
    One CoordinatorError, leaving nothing behind, when a file is in the way, the directory cannot be made or
    written to (probed: a directory or a file made and removed at once), or the checkpoint is not one."""
    from clients.cli import missing_ancestor

    top = missing_ancestor(run_dir)
    existing = run_dir if top is None else top.parent  # what mkdir -p would build on
    if not existing.is_dir():
        raise CoordinatorError(f"{flag} must be a directory. Found a file at {existing}; pick another {flag}.")
    if top is not None and top.is_symlink():
        raise CoordinatorError(f"{flag} {run_dir} must be creatable. Found {top}, a link to {os.readlink(top)}, which "
                               f"does not exist; pick another {flag}.")
    # A probe, removed at once: a directory that cannot be made or written to (/proc/x, a read-only mount) fails
    # here, before a SuperLink starts or a run is announced, not at the first round's write.
    try:
        if top is not None:
            top.mkdir()
            top.rmdir()
        else:
            tempfile.TemporaryFile(dir=run_dir).close()
    except OSError as exc:
        raise CoordinatorError(f"{flag} {run_dir} must be {'creatable' if top is not None else 'writable'}. Found: "
                               f"{exc.strerror or exc} ({top or run_dir}); pick another {flag}.") from None
    if not (run_dir / CHECKPOINT).exists():
        results = [name for name in (METRICS, SUMMARY, MODEL) if (run_dir / name).exists()]
        if results:  # a run's results without the checkpoint to resume it: starting afresh would overwrite them
            raise CoordinatorError(f"{flag} {run_dir} holds results ({', '.join(results)}) but no {CHECKPOINT} to "
                                   f"resume from; pick another {flag}, or move them away to start a new run there.")
        return 0, None
    ckpt = RunDirectory(run_dir).load_checkpoint()
    assert ckpt is not None  # the file exists: a checkpoint, or the CoordinatorError above
    return int(ckpt["round"]), ckpt


LOCK = ".fedshield.lock"
# write_atomic's temporary names (".NAME.<16 hex>.tmp") for the files a run writes here
_STALE = re.compile(r"\.(" + "|".join(map(re.escape, (CHECKPOINT, METRICS, SUMMARY, MODEL, PLOT, CONFIG, EPSILON_PLOT,
                                                          TIME_PLOT, STATUS))) + r")\.[0-9a-f]{16}\.tmp")
_HELD: dict[Path, int] = {}  # run directory -> the open lock file this process holds (released when it exits)
LOCK_WAIT_S = 30.0  # how long a coordinator (and its ServerApp) waits for the ServerApp of a killed one to let go


def lock_run_dir(run_dir: str | os.PathLike, flag: str = "--run-dir", wait: float = 0.0,
                 on_wait: Callable[[str], None] | None = None) -> bool:
    """Make ``run_dir`` and hold its lock (an flock on LOCK, beside the checkpoint) until this process exits or
    ``unlock_run_dir``; a CoordinatorError naming the holder when another process has it after ``wait`` seconds
    (``on_wait`` gets the holder's pid once, when the wait starts).
    Two runs in one directory resumed each other's checkpoints, mixed their metrics, spent DP noise twice on the
    same data, and failed on each other's files (a review). ``fedshield simulate`` takes it for its runs; under
    ``coordinator start`` the ServerApp's process does (the coordinator only probes it before it starts: killed
    outright, it would free the directory while its ServerApp still wrote there)."""
    path = Path(run_dir).expanduser().resolve()
    if path in _HELD:
        return False  # this process holds it already (fedshield simulate, for its ServerApp)
    make_dir(path, "run directory", CoordinatorError, hint=f"; pick another {flag}")
    try:
        fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise CoordinatorError(f"{flag} {path} must let this run make its lock file {LOCK}. Found: "
                               f"{exc.strerror or exc}; pick another {flag}.") from None
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _same_file(fd, path / LOCK):
                break
            # its holder removed the file as it let go (a finished run leaves none): lock the one there now
            os.close(fd)
            fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            continue
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # no locking there (NFS without lockd, ...)
                os.close(fd)
                raise CoordinatorError(f"{flag} {path} must be on a file system that can lock files. Found: "
                                       f"{exc.strerror or exc} (locking {LOCK}); pick another {flag}.") from None
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            if time.monotonic() >= deadline:
                os.close(fd)
                raise CoordinatorError(f"{flag} {path} must not be in use by another run. Found it held by process "
                                       f"{holder or '(unknown)'}; wait for that run to end, or pick another "
                                       f"{flag}.") from None
            if on_wait is not None:
                on_wait(holder or "(unknown)")
                on_wait = None
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _HELD[path] = fd
    for stale in path.iterdir():  # write_atomic's temporary files of this directory's files, left by a killed write
        if _STALE.fullmatch(stale.name):
            try:
                if stale.is_file() and not stale.is_symlink():
                    stale.unlink()
            except OSError:
                pass
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
    except OSError:
        return False


def unlock_run_dir(run_dir: str | os.PathLike, remove: bool = False) -> None:
    """Let go of a lock ``lock_run_dir`` took (nothing if this process holds none there); ``remove``: delete the
    lock file first, while still holding it (a finished run leaves none behind; a process waiting on the removed
    file notices and locks the new one)."""
    path = Path(run_dir).expanduser().resolve()
    fd = _HELD.pop(path, None)
    if fd is not None:
        if remove:
            with contextlib.suppress(OSError):
                (path / LOCK).unlink()
        os.close(fd)


def _integer_ticks():
    """Round numbers on a round axis (matplotlib's default put ticks at 1.5, 2.5 for short runs)."""
    from matplotlib.ticker import MaxNLocator

    return MaxNLocator(integer=True)


class RunDirectory:
    """All files of one run live under ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path).expanduser().resolve()
        make_dir(self.path, "run directory", CoordinatorError, hint="; pick another run-dir")

    def file(self, name: str) -> Path:
        return self.path / name

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        buf = io.BytesIO()
        w = state.get("weights")
        torch.save({**state, **({"weights-sha256": weights_sha256(w)} if isinstance(w, torch.Tensor) else {})}, buf)
        write_atomic(self.file(CHECKPOINT), buf.getvalue())

    def load_checkpoint(self) -> dict[str, Any] | None:
        """The last saved state, or None when there is none; a file that is not one is a CoordinatorError."""
        path = self.file(CHECKPOINT)
        if not path.exists():
            return None
        _check_stored(path)
        try:
            with warnings.catch_warnings():  # (torch warns of a plain pickle before refusing it: the refusal is the line)
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location="cpu", weights_only=True)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EISDIR):
                raise CoordinatorError(f"checkpoint {path} must be readable. Found: {exc.strerror or exc}.") from None
            raise CoordinatorError(f"{path} is not a fedshield checkpoint (truncated or corrupted: "
                                   f"{exc.strerror or exc}); move it away or pick another --run-dir.") from None
        except Exception as exc:  # torch/pickle raise many kinds (UnpicklingError, RuntimeError, EOFError, KeyError...)
            text = str(exc).strip().splitlines()
            with open(path, "rb") as f:
                magic = f.read(4)
            if magic != b"PK\x03\x04":  # torch.save writes a zip archive; torch calls any other file's failure a
                reason = "not a zip archive, as torch.save writes"  # weights-only refusal
            elif "Weights only load failed" in str(exc):  # torch's long explanation: what it means here, in a few words
                reason = "it holds objects other than tensors and plain data, which are not unpickled"
            else:
                reason = f"{type(exc).__name__}: {text[0][:100]}" if text else type(exc).__name__
            raise CoordinatorError(f"{path} is not a fedshield checkpoint (torch.load failed: {reason}); "
                                   "move it away or pick another --run-dir.") from None
        if not isinstance(state, dict) or not isinstance(state.get("round"), int):
            raise CoordinatorError(f"{path} is not a fedshield checkpoint (no round number in it); "
                                   "move it away or pick another --run-dir.")
        for key, (typ, what) in _CHECKPOINT_PARTS.items():  # all of it checked before any of it is used
            value = state.get(key)
            ok = isinstance(value, typ) and not isinstance(value, bool)
            if ok and key == "weights":  # float32, as saved: a float16 model was resumed, then refused by every client
                ok = value.dim() == 1 and value.dtype == torch.float32 and value.numel() > 0
            if ok and key == "history":
                ok = all(isinstance(row, dict) for row in value)
            if not ok:
                raise CoordinatorError(f"{path} is not a complete fedshield checkpoint ({key!r} is missing or not "
                                       f"{what}); move it away or pick another --run-dir.")
        problem = _inconsistency(state)
        if problem:
            raise CoordinatorError(f"{path} is not a consistent fedshield checkpoint ({problem}); move it away or "
                                   "pick another --run-dir.")
        return state

    def write_json(self, name: str, obj: Any) -> None:
        write_atomic(self.file(name), (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=METRIC_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:  # a mapping-valued column (rejected_by_rule, secagg_stage_s) is one JSON object
            writer.writerow({k: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v
                             for k, v in {"rejected_by_rule": {}, **row}.items()})
        write_atomic(self.file(METRICS), buf.getvalue().encode())

    def save_model(self, state_dict: dict[str, torch.Tensor]) -> None:
        buf = io.BytesIO()
        torch.save(state_dict, buf)
        write_atomic(self.file(MODEL), buf.getvalue())

    def plot_epsilon(self, rows: list[dict[str, Any]], title: str) -> None:
        """``epsilon.png``: privacy spent per round (central epsilon and/or clients' largest)."""
        plt = _pyplot()

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        title = _plain(title)
        for key, label in (("epsilon", "central epsilon"), ("local_epsilon_max", "largest client epsilon")):
            pts = [(r["round"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=label)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(_integer_ticks())
        ax.set_ylabel("epsilon")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # no epsilon reported (every reply refused): no empty legend
            ax.legend()
        self._save(fig, EPSILON_PLOT)

    def plot_accuracy_vs_time(self, runs: dict[str, list[dict[str, Any]]], title: str) -> None:
        """``accuracy_vs_time.png``: test accuracy (``headline_metric``'s, named for ``{metric}`` in ``title``) against
        (simulated) time, one line per run."""
        plt = _pyplot()

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        name = headline_metric([r for rows in runs.values() for r in rows])
        title = _plain(title.replace("{metric}", name))
        for label, rows in runs.items():
            if rows:
                ax.plot(time_axis(rows), metric_series(rows, name), "o-", markersize=3, label=_plain(label))
        ax.set_xlabel(f"time (s; {time_label([rows for rows in runs.values() if rows])})")
        ax.set_ylabel(f"test {name}")
        if name == "accuracy":
            ax.set_ylim(0, 1)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        self._save(fig, TIME_PLOT)

    def _save(self, fig: Any, name: str) -> None:
        import matplotlib.pyplot as plt

        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        write_atomic(self.file(name), buf.getvalue())  # a temporary file of its own, as every other file here

    def plot(self, rows: list[dict[str, Any]], title: str) -> None:
        """``accuracy.png``: test accuracy (``headline_metric``'s, named for ``{metric}`` in ``title``) and loss per
        round."""
        plt = _pyplot()

        rounds = [r["round"] for r in rows]
        name = headline_metric(rows)
        title = _plain(title.replace("{metric}", name))
        fig, ax1 = plt.subplots(figsize=(7, 4), dpi=100)
        ax1.plot(rounds, metric_series(rows, name), "o-", color="tab:blue", label=_plain(f"test {name}"))
        ax1.set_xlabel("round")
        ax1.xaxis.set_major_locator(_integer_ticks())
        ax1.set_ylabel(_plain(f"test {name}"), color="tab:blue")
        if name == "accuracy":
            ax1.set_ylim(0, 1)
        ax2 = ax1.twinx()
        ax2.plot(rounds, [r["test_loss"] for r in rows], "s--", color="tab:red", label="test loss")
        ax2.set_ylabel("test loss", color="tab:red")
        ax1.set_title(title)
        ax1.grid(alpha=0.3)
        self._save(fig, PLOT)
