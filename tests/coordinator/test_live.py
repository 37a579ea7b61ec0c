"""Live metrics: status.json and TensorBoard event files written as rounds end, and the status page's server."""

from __future__ import annotations

import http.client
import json
import logging
import sys
import urllib.error
import urllib.request

import pytest

from coordinator import CoordinatorError, RunConfig, RunDirectory, SyncWorkflow
from coordinator.live import announce_start, mark_ended, read_status, row_scalars
from coordinator.rundir import STATUS, TENSORBOARD
from coordinator.status import StatusServer, render_page
from simulations.inprocess import InProcessGrid

from .helpers import mixed, stock_flower_bad


def cfg(**kw) -> RunConfig:
    return RunConfig.from_mapping({"num-rounds": 2, "min-nodes": 2, "task": "digits", "seed": 0, **kw})


def honest():
    from clients.client_app import app

    return app


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in run_dir/tensorboard as TensorBoard reads it: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / TENSORBOARD), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_writes_its_status_and_one_scalar_per_row_field_per_round(tmp_path):
    grid = InProcessGrid(mixed({1001}, stock_flower_bad("nan")), 3)  # node 1001 replies with NaN: refused each round
    summary = SyncWorkflow(cfg(), grid, RunDirectory(tmp_path)).run()

    status = json.loads((tmp_path / STATUS).read_text())
    assert status["state"] == "completed" and status["round"] == 2 and status["num_rounds"] == 2
    assert status["nodes_online"] == 3 and status["round_in_progress"] is None
    assert status["totals"]["rejected_by_rule"] == {"non-finite": 2} and status["totals"]["accepted"] == 4
    assert status["totals"]["bytes_up"] == summary["total_bytes_up"]
    assert status["last_round"]["test_accuracy"] == pytest.approx(summary["final_test_accuracy"])
    assert [r["round"] for r in status["recent"]] == [1, 2]
    assert "weights" not in json.dumps(status) and "key" not in json.dumps(status)  # counts and metrics only

    series = scalars(tmp_path)
    for tag in ("test_accuracy", "test_loss", "train_loss", "bytes_up", "bytes_down", "round_time_s", "accepted",
                "rejected", "rejected/non-finite", "nodes_online", "wall_time_s"):
        assert [step for step, _ in series[tag]] == [1, 2], tag
    assert series["rejected/non-finite"] == [(1, 1.0), (2, 1.0)]
    assert series["test_accuracy"][-1][1] == pytest.approx(summary["final_test_accuracy"])
    assert "round" not in series  # the step, not a series


def test_a_resumed_run_leaves_one_series_per_tag_without_duplicates(tmp_path):
    SyncWorkflow(cfg(), InProcessGrid(honest(), 2), RunDirectory(tmp_path)).run()
    # a session killed after writing round 3 to TensorBoard but before its checkpoint: round 3 is trained again
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tmp_path / TENSORBOARD)) as stale:
        stale.add_scalar("test_accuracy", -1.0, 3)
    resumed = SyncWorkflow(cfg(**{"num-rounds": 4}), InProcessGrid(honest(), 2), RunDirectory(tmp_path))
    assert resumed.round == 2
    summary = resumed.run()

    series = scalars(tmp_path)
    assert [step for step, _ in series["test_accuracy"]] == [1, 2, 3, 4]
    assert all(value >= 0 for _, value in series["test_accuracy"])  # the stale round 3 is gone
    assert series["test_accuracy"][-1][1] == pytest.approx(summary["final_test_accuracy"])
    assert all([s for s, _ in v] == sorted(set(s for s, _ in v)) for v in series.values())
    assert len(list((tmp_path / TENSORBOARD).glob("events.out.tfevents.*"))) == 1
    assert read_status(tmp_path)["round"] == 4


def test_central_dp_epsilon_reaches_status_and_tensorboard(tmp_path):
    SyncWorkflow(cfg(dp="central", **{"dp-noise-multiplier": 1.0, "dp-clip": 1.0}), InProcessGrid(honest(), 2),
                 RunDirectory(tmp_path)).run()
    status = read_status(tmp_path)
    series = scalars(tmp_path)
    assert status["dp"] == "central" and status["delta"] == 1e-5
    assert [s for s, _ in series["epsilon"]] == [1, 2]
    assert status["epsilon"] == pytest.approx(series["epsilon"][-1][1], rel=1e-6) and status["epsilon"] > 0


def test_a_run_that_fails_says_so_in_its_status(tmp_path):
    with pytest.raises(CoordinatorError, match="min-nodes"):
        SyncWorkflow(cfg(**{"min-nodes": 3, "wait-nodes-timeout": 0.3}), InProcessGrid(honest(), 2),
                     RunDirectory(tmp_path)).run()
    status = read_status(tmp_path)
    assert status["state"] == "failed" and "min-nodes=3" in status["failure"] and status["nodes_online"] == 2


def test_tensorboard_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails: as without the package
    with caplog.at_level(logging.WARNING):
        summary = SyncWorkflow(cfg(), InProcessGrid(honest(), 2), RunDirectory(tmp_path)).run()
    assert summary["status"] == "completed" and read_status(tmp_path)["state"] == "completed"
    warnings = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(warnings) == 1 and "the run goes on" in warnings[0].getMessage()


def test_row_scalars_names_rules_and_keeps_each_rule_series_going():
    rules: set[str] = set()
    first = row_scalars({"round": 1, "test_accuracy": 0.5, "rejected_by_rule": {"stale-version": 2}, "flag": True,
                         "secagg_stage_s": {"setup": 0.1}, "secagg_failure": "why", "epsilon": None,
                         "test_loss": float("nan")}, rules)
    assert first == {"test_accuracy": 0.5, "rejected/stale-version": 2.0, "secagg_stage_s/setup": 0.1}
    assert row_scalars({"round": 2, "rejected_by_rule": {}}, rules) == {"rejected/stale-version": 0.0}


def _get(url: str, host: str | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def test_status_server_serves_the_file_and_the_page_and_nothing_else(tmp_path):
    SyncWorkflow(cfg(), InProcessGrid(mixed({1001}, stock_flower_bad("nan")), 3), RunDirectory(tmp_path)).run()
    with StatusServer(tmp_path, 0) as server:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/"
        code, kind, body = _get(server.url + "status.json")
        assert code == 200 and kind == "application/json"
        assert json.loads(body) == json.loads((tmp_path / STATUS).read_text())
        code, kind, body = _get(server.url)
        page = body.decode()
        assert code == 200 and kind.startswith("text/html")
        assert "completed" in page and "2/2" in page and "non-finite" in page and "<svg" in page
        assert "http-equiv=\"refresh\"" not in page  # an ended run's page stops refreshing
        assert "<script" not in page and "http://" not in page.replace(server.url, "")  # nothing external
        assert _get(server.url + "checkpoint.pt")[0] == 404
        assert _get(server.url + "../status.json")[0] == 404
        assert _get(f"http://localhost:{server.port}/status.json")[0] == 200
        assert _get(server.url, host="evil.example:80")[0] == 403  # a DNS name rebound to 127.0.0.1
        port = server.port
    with pytest.raises(OSError):  # stopped: nothing listens there any more
        http.client.HTTPConnection("127.0.0.1", port, timeout=2).request("GET", "/")


def test_the_page_before_the_run_writes_anything_and_while_it_runs(tmp_path):
    with StatusServer(tmp_path) as server:
        code, _, body = _get(server.url + "status.json")
        assert code == 200 and json.loads(body)["state"] == "starting"
        announce_start(tmp_path, cfg(), resumed=False)
        assert json.loads(_get(server.url + "status.json")[2])["num_rounds"] == 2
        page = _get(server.url)[2].decode()
        assert "starting" in page and "http-equiv=\"refresh\"" in page


def test_a_port_in_use_is_one_error_line(tmp_path):
    with StatusServer(tmp_path) as server, pytest.raises(CoordinatorError, match=r"status-port .* must be free"):
        StatusServer(tmp_path, server.port)


def test_the_coordinator_marks_a_run_it_stopped_unless_the_run_said_how_it_ended(tmp_path):
    announce_start(tmp_path, cfg(), resumed=False)
    mark_ended(tmp_path, "stopped", "the coordinator stopped before the run ended")
    assert read_status(tmp_path)["state"] == "stopped"
    mark_ended(tmp_path, "failed", "other")  # already ended: left as it is
    assert read_status(tmp_path)["failure"] == "the coordinator stopped before the run ended"


def test_the_page_escapes_what_it_shows():
    page = render_page({"state": "failed", "failure": "<script>alert(1)</script>", "run_dir": "/a&b",
                        "totals": {"rejected_by_rule": {"<b>rule</b>": 1}}})
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;b&gt;rule" in page and "/a&amp;b" in page


def test_the_page_shows_a_tasks_own_metrics_after_its_accuracy():
    page = render_page({"state": "running", "last_round": {"round": 2, "test_accuracy": float("nan"), "test_loss": 0.5,
                                                           "test_metrics": {"rmse": 0.7071, "<i>mae</i>": 0.5},
                                                           "fed_eval_metrics": {"rmse": 0.75}}})
    assert page.index("test accuracy") < page.index("test metrics") < page.index("train loss")
    assert "&lt;i&gt;mae&lt;/i&gt; 0.5, rmse 0.7071" in page and "<i>" not in page  # by name, escaped
    assert page.index("federated accuracy") < page.index("federated metrics") and "rmse 0.75" in page


def test_the_pages_chart_draws_a_tasks_own_metric_where_it_has_no_accuracy():
    nan = float("nan")
    recent = [{"round": r, "test_accuracy": nan, "test_metrics": {"rmse": 2.0 / r}} for r in (1, 2, 3)]
    page = render_page({"state": "running", "recent": recent})
    assert "<h2>Test rmse (0.6667 to 2), rounds 1-3</h2>" in page and page.count("<polyline") == 1
    assert "<polyline" not in render_page({"state": "running", "recent": [{"round": 1, "test_metrics": [1]}] * 3})
    assert "<polyline" not in render_page({"state": "running", "recent": [{"round": 1}, {"round": 2}]})  # (damaged)
