"""``fedshield runs`` and ``fedshield report``: run directories read back, one error line for bad input."""

from __future__ import annotations

import json
import os

import pytest

from coordinator import RunConfig, RunDirectory, SyncWorkflow
from coordinator import rundir
from coordinator.live import read_status
from simulations.cli import main
from simulations.inprocess import InProcessGrid
from tests.coordinator.helpers import mixed, stock_flower_bad


def _run(path, rounds=2, **kw):
    cfg = RunConfig.from_mapping({"num-rounds": rounds, "min-nodes": 2, "task": "digits", "seed": 0, **kw})
    return SyncWorkflow(cfg, InProcessGrid(mixed({1001}, stock_flower_bad("nan")), 3), RunDirectory(path)).run()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """runs/ with a finished plain run, a finished central-DP run (in a comparison's folder) and an interrupted one."""
    top = tmp_path_factory.mktemp("runs")
    _run(top / "plain")
    _run(top / "compare-x" / "dp", dp="central", **{"dp-noise-multiplier": 1.0, "dp-clip": 1.0})
    _run(top / "killed", rounds=1)
    status = read_status(top / "killed")  # as a session killed while it ran leaves it
    (top / "killed" / rundir.STATUS).write_text(json.dumps({**status, "state": "running"}))
    (top / "killed" / rundir.SUMMARY).unlink()
    (top / "empty-dir").mkdir()
    for age, name in ((300, "compare-x/dp"), (200, "plain"), (100, "killed")):  # oldest first in the listing
        for f in (top / name).iterdir():
            os.utime(f, (f.stat().st_mtime - age, f.stat().st_mtime - age))
    return top


def test_runs_lists_each_run_directory_with_its_figures_oldest_first(runs, capsys):
    assert main(["runs", str(runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STATUS", "ROUNDS", "TEST", "FED", "EPSILON", "WALL", "MODIFIED"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["compare-x/dp", "plain", "killed"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["plain"][1:3] == ["completed", "2/2"] and rows["plain"][5] == "-"  # no DP: no epsilon
    assert rows["compare-x/dp"][1] == "completed" and float(rows["compare-x/dp"][5]) > 0
    assert rows["killed"][1:3] == ["interrupted", "1/1"]
    summary = json.loads((runs / "plain" / rundir.SUMMARY).read_text())
    assert rows["plain"][3] == f"{summary['final_test_accuracy']:.4f}"


def test_a_run_going_on_is_listed_as_running(runs, capsys):
    rundir.lock_run_dir(runs / "killed")  # this process now holds it, as a run's process would
    try:
        assert main(["runs", str(runs / "killed")]) == 0
    finally:
        rundir.unlock_run_dir(runs / "killed")
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["killed", "running"]


@pytest.mark.parametrize("where", ["missing", "file"])
def test_runs_of_a_directory_that_is_not_one_is_one_line(tmp_path, capsys, where):
    path = tmp_path / "x"
    if where == "file":
        path.write_text("")
    assert main(["runs", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedshield: error: DIR must be a directory. Found ")


def test_runs_of_a_directory_without_runs_says_so(runs, capsys):
    assert main(["runs", str(runs / "empty-dir")]) == 0
    assert "no run directories under" in capsys.readouterr().err


def test_report_summarises_the_run_and_writes_its_plots_again(runs, capsys):
    for name in (rundir.PLOT, rundir.TIME_PLOT):
        (runs / "plain" / name).unlink()
    assert main(["report", str(runs / "plain")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((runs / "plain" / rundir.SUMMARY).read_text())
    assert "status    completed" in out and "rounds    2 of 2" in out and "task      digits" in out
    assert f"test {summary['final_test_accuracy']:.4f} after round 2" in out
    assert "replies   accepted 4, rejected 2: non-finite 2" in out
    assert "privacy   none" in out and "time      wall" in out
    for name in (rundir.PLOT, rundir.TIME_PLOT):
        assert (runs / "plain" / name).is_file()
    assert not (runs / "plain" / rundir.EPSILON_PLOT).exists()


def test_report_of_a_dp_run_gives_its_epsilon_and_plots_it(runs, capsys):
    (runs / "compare-x" / "dp" / rundir.EPSILON_PLOT).unlink()
    assert main(["report", str(runs / "compare-x" / "dp")]) == 0
    out = capsys.readouterr().out
    eps = json.loads((runs / "compare-x" / "dp" / rundir.SUMMARY).read_text())["epsilon"]
    assert f"privacy   central DP: epsilon {eps:.4g} at delta 1e-05 after round 2 (pld accountant" in out
    assert (runs / "compare-x" / "dp" / rundir.EPSILON_PLOT).is_file()


def test_report_of_an_interrupted_run_reads_its_checkpoint(runs, capsys):
    assert main(["report", "--no-plots", str(runs / "killed")]) == 0
    out = capsys.readouterr().out
    assert "status    interrupted" in out and "rounds    1 of 1" in out and "plots" not in out


def test_report_of_a_failed_run_gives_its_failure(tmp_path, capsys):
    with pytest.raises(Exception, match="min-nodes"):
        _run(tmp_path, **{"min-nodes": 4, "wait-nodes-timeout": 0.2})
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [rundir.CONFIG, rundir.STATUS]
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "status    failed" in out and "failure   min-nodes=4 nodes must be online" in out
    assert "plots     none (no round finished)" in out


@pytest.mark.parametrize("what", ["no-results", "missing", "bad-checkpoint"])
def test_report_of_a_directory_without_a_run_is_one_line(tmp_path, capsys, what):
    path = tmp_path / "r"
    if what != "missing":
        path.mkdir()
    if what == "bad-checkpoint":
        (path / rundir.CHECKPOINT).write_bytes(b"not a checkpoint")
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedshield: error: ") and "Traceback" not in err
