"""The coordinator's status page: a small HTTP server on 127.0.0.1 serving a run directory's ``status.json``.

``GET /status.json``: the file the run's workflow rewrites as it goes (``coordinator.live``); ``GET /``: a page
rendering it, refreshing itself every few seconds (no script, no external file); anything else 404. Bound to
127.0.0.1 only, and answering only requests addressed to 127.0.0.1 or localhost (a web page elsewhere cannot
read it through a DNS name rebound to this host). It serves counts and metrics only: no keys, no updates.
"""

from __future__ import annotations

import html
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ._errors import CoordinatorError
from .live import ENDED
from .rundir import STATUS, finite, headline_metric, metric_series

HOST = "127.0.0.1"
REFRESH_S = 3
_LOCAL_NAMES = {"127.0.0.1", "localhost"}


def _waiting(run_dir: Path) -> dict[str, Any]:
    return {"state": "starting", "run_dir": str(run_dir), "round": 0}


def load_status(run_dir: Path) -> tuple[bytes, dict[str, Any]]:
    """status.json's bytes and object; a run that has written none yet: ``{"state": "starting"}``."""
    try:
        raw = (run_dir / STATUS).read_bytes()
        doc = json.loads(raw)
        if isinstance(doc, dict):
            return raw, doc
    except (OSError, ValueError):
        pass
    doc = _waiting(run_dir)
    return json.dumps(doc).encode(), doc


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


def _mb(value: Any) -> str:
    return f"{value / 1e6:.2f} MB" if isinstance(value, int | float) else "-"


def _chart(recent: list[dict[str, Any]]) -> str:
    """Test accuracy per round as an inline SVG polyline, or a task's own metric where it has no accuracy (the
    plots' ``headline_metric``, scaled to its range); empty without two evaluated rounds."""
    rows = [r for r in recent if isinstance(r, dict) and isinstance(r.get("round"), int)]
    try:
        name = headline_metric(rows)
        pts = [(r["round"], y) for r, y in zip(rows, metric_series(rows, name), strict=True) if finite(y)]
    except (AttributeError, TypeError):  # (status.json is a file: a damaged one shows no chart)
        return ""
    if len(pts) < 2:
        return ""
    x0, x1 = pts[0][0], pts[-1][0]
    lo, hi = (0.0, 1.0) if name == "accuracy" else (min(y for _, y in pts), max(y for _, y in pts))
    w, h = 480, 120
    coords = " ".join(f"{(x - x0) / max(1, x1 - x0) * (w - 10) + 5:.1f},"
                      f"{(1 - min(max((y - lo) / ((hi - lo) or 1.0), 0), 1)) * (h - 10) + 5:.1f}" for x, y in pts)
    label = html.escape(f"test {name}")
    span = "" if name == "accuracy" else f" ({lo:.4g} to {hi:.4g})"
    return (f'<h2>Test {html.escape(name)}{span}, rounds {x0}-{x1}</h2><svg width="{w}" height="{h}" role="img" '
            f'aria-label="{label} per round"><rect width="{w}" height="{h}" fill="#f6f6f6"/>'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{coords}"/></svg>')


def render_page(doc: dict[str, Any]) -> str:
    """The status page for a status.json object (every value escaped)."""
    e = html.escape
    last = doc.get("last_round") or {}
    totals = doc.get("totals") or {}
    state = str(doc.get("state", "unknown"))
    rnd = doc.get("round", 0)
    progress = f"{rnd}/{doc.get('num_rounds', '?')}"
    if doc.get("round_in_progress"):
        progress += f" (round {doc['round_in_progress']} in progress)"
    privacy = "-"
    if doc.get("epsilon") is not None:
        privacy = f"epsilon {_fmt(doc['epsilon'], '.4g')} at delta {_fmt(doc.get('delta'), 'g')} ({doc.get('dp')} DP)"
    elif doc.get("local_epsilon_max") is not None:
        privacy = f"largest client epsilon {_fmt(doc['local_epsilon_max'], '.4g')} (local DP)"
    rows = [
        ("state", state), ("run directory", doc.get("run_dir")), ("task", doc.get("task")),
        ("rounds done", progress),
        ("nodes online", f"{_fmt(doc.get('nodes_online'))} (min {_fmt(doc.get('min_nodes'))})"),
        ("test accuracy", f"{_fmt(last.get('test_accuracy'), '.4f')} (loss {_fmt(last.get('test_loss'), '.4f')})"),
        ("train loss", _fmt(last.get("train_loss"), ".4f")),
        ("federated accuracy", _fmt(last.get("fed_eval_accuracy"), ".4f")),
        ("last round", f"accepted {_fmt(last.get('accepted'))} of {_fmt(last.get('replies'))} replies, rejected "
                       f"{_fmt(last.get('rejected'))}, {_fmt(last.get('round_time_s'), '.2f')} s"),
        ("whole run", f"accepted {_fmt(totals.get('accepted'))}, rejected {_fmt(totals.get('rejected'))}; "
                      f"down {_mb(totals.get('bytes_down'))}, up {_mb(totals.get('bytes_up'))}"),
        ("privacy spent", privacy),
        ("updated", doc.get("updated_at")),
    ]
    for key, label, after in (("test_metrics", "test metrics", "test accuracy"),
                              ("fed_eval_metrics", "federated metrics", "federated accuracy")):
        if isinstance(last.get(key), dict) and last[key]:  # the task's own (a regression's rmse): after accuracy
            at = next(i for i, (k, _) in enumerate(rows) if k == after) + 1
            rows.insert(at, (label, ", ".join(f"{k} {_fmt(v, '.4g')}" for k, v in sorted(last[key].items())[:8])))
    if doc.get("failure"):
        rows.insert(1, ("failure", doc["failure"]))
    table = "".join(f"<tr><th>{e(k)}</th><td>{e(_fmt(v))}</td></tr>" for k, v in rows)
    by_rule = totals.get("rejected_by_rule") or {}
    rules = "".join(f"<tr><td>{e(str(k))}</td><td>{e(_fmt(v))}</td></tr>"
                    for k, v in sorted(by_rule.items(), key=lambda kv: -kv[1] if isinstance(kv[1], int) else 0))
    rules_html = (f"<h2>Rejected replies by rule</h2><table><tr><th>rule</th><th>replies</th></tr>{rules}</table>"
                  if rules else "")
    refresh = "" if state in ENDED else f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    return (f"<!doctype html><html><head><meta charset=\"utf-8\">{refresh}<title>fedshield: {e(state)} "
            f"{e(progress)}</title><style>body{{font-family:sans-serif;margin:2em}}th{{text-align:left;"
            "padding-right:1em}td{padding-right:1em}</style></head><body><h1>fedshield run</h1>"
            f"<table>{table}</table>{rules_html}{_chart(doc.get('recent') or [])}"
            f"<p><a href=\"/status.json\">status.json</a></p></body></html>")


class _Handler(BaseHTTPRequestHandler):
    server_version = "fedshield-status"
    sys_version = ""
    run_dir: Path  # set on the subclass each server makes

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass  # no line per request on the coordinator's output

    def _send(self, code: int, body: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
        if host not in _LOCAL_NAMES:
            self._send(403, b"forbidden: address this page as 127.0.0.1 or localhost\n", "text/plain; charset=utf-8")
            return
        path = self.path.split("?", 1)[0]
        if path == "/status.json":
            raw, _ = load_status(self.run_dir)
            self._send(200, raw, "application/json")
        elif path in ("/", "/index.html"):
            _, doc = load_status(self.run_dir)
            self._send(200, render_page(doc).encode("utf-8"), "text/html; charset=utf-8")
        else:
            self._send(404, b"not found\n", "text/plain; charset=utf-8")

    do_HEAD = do_GET


class StatusServer:
    """``StatusServer(run_dir, port).start()`` serves ``run_dir``'s status on 127.0.0.1:``port`` (0: a free
    port; ``port`` then says which) from a daemon thread until ``stop()``."""

    def __init__(self, run_dir: str | Path, port: int = 0) -> None:
        handler = type("StatusHandler", (_Handler,), {"run_dir": Path(run_dir)})
        try:
            self._httpd = ThreadingHTTPServer((HOST, port), handler)
        except OSError as exc:
            raise CoordinatorError(f"coordinator.status-port {port} on {HOST} must be free. Found: "
                                   f"{exc.strerror or exc}; pick another port, 0 for a free one, or -1 for no status "
                                   "page.") from None
        self._httpd.daemon_threads = True
        self.port: int = self._httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/"

    def start(self) -> "StatusServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fedshield-status", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> "StatusServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
