"""Scenario engines and workflow selection through the same entry point users call."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from clients import ConfigError
from simulations import load_scenario, run_scenario

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
EXAMPLE_TEXT = (EXAMPLES / "tiered-virtual.toml").read_text()


def _scn(engine: str, **run):
    over = {"simulation.engine": engine, "simulation.num-supernodes": 10, "run.num-rounds": 6, "run.min-nodes": 4,
            "run.round-timeout": 30.0}
    over.update({f"run.{k}": v for k, v in run.items()})
    return load_scenario(None, over)


def test_virtual_engine_fedbuff_records_simulated_time_and_staleness(tmp_path):
    s = run_scenario(_scn("virtual", workflow="fedbuff", **{"buffer-size": 3, "concurrency": 6}), tmp_path,
                     show_progress=False)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert len(rows) == 6 and s["rounds"] == 6
    sim = [float(r["sim_time_s"]) for r in rows]
    assert sim == sorted(sim) and sim[-1] > 0
    assert all(r["mean_staleness"] != "" for r in rows)
    assert 0.5 <= s["final_test_accuracy"] <= 0.99


@pytest.mark.parametrize(("nodes", "min_nodes", "fraction", "first", "total", "engine", "codec"),
                         [(6, 3, 0.5, 2, 4, "virtual", "dense"), (4, 2, 1.0, 1, 3, "virtual", "dense"),
                          (4, 2, 1.0, 2, 3, "virtual", "topk"), (4, 2, 1.0, 2, 3, "inprocess", "sign")])
def test_a_resumed_fast_engine_run_replays_the_uninterrupted_one(tmp_path, nodes, min_nodes, fraction, first, total,
                                                             engine, codec):
    """The virtual engine's clock started again at 0 on resume, and each node's draws (compute noise,
    dropout) from its first message again: round 3 of 2 rounds + a resume to 4 took 300 s with 2 updates
    where 4 rounds straight took 9.4 s with 3. Then (second case): a reply no one awaited any more still
    woke the clock in the uninterrupted run, not in the resumed one, and every later sim_time_s was 0.04 s off.
    Codecs with error feedback (last cases, both fast engines): the clients' residuals started again at zero."""
    import torch

    def scn(rounds):
        return load_scenario(None, {"simulation.engine": engine, "simulation.num-supernodes": nodes,
                                    "run.min-nodes": min_nodes, "run.local-epochs": 1, "run.fraction-train": fraction,
                                    "run.num-rounds": rounds, "run.codec": codec})

    run_scenario(scn(total), tmp_path / "straight", show_progress=False)
    run_scenario(scn(first), tmp_path / "resumed", show_progress=False)
    run_scenario(scn(total), tmp_path / "resumed", show_progress=False)
    keys = ["round", "nodes_online", "selected", "replies", "accepted", "late", "test_accuracy"]
    keys += ["round_time_s", "sim_time_s"] if engine == "virtual" else []  # wall time in-process
    straight, resumed = ([{k: r[k] for k in keys} for r in csv.DictReader(open(tmp_path / d / "metrics.csv"))]
                         for d in ("straight", "resumed"))
    assert len(straight) == total and resumed == straight
    assert any(r["late"] != "0" for r in straight[:first]) or nodes == 4  # a node still busy when the first session ended
    for name, value in torch.load(tmp_path / "straight" / "model.pt").items():
        assert torch.equal(torch.load(tmp_path / "resumed" / "model.pt")[name], value), name


def test_a_resumed_in_process_fedbn_run_keeps_each_nodes_statistics(tmp_path):
    """FedBN: each node's BatchNorm statistics and batch count live in its Context only; a resume had started
    them again as built, so the federated evaluation (eval mode: the running statistics) after the resume
    differed from the uninterrupted run's."""
    task = str(Path(__file__).resolve().parents[2] / "examples" / "tasks" / "cnn_digits.py") + ":CnnDigitsFedBN"

    def scn(rounds):
        return load_scenario(None, {"simulation.engine": "inprocess", "simulation.num-supernodes": 4,
                                    "run.min-nodes": 4, "run.local-epochs": 1, "run.num-rounds": rounds,
                                    "run.task": task, "run.federated-eval-every": 1})

    run_scenario(scn(3), tmp_path / "straight", show_progress=False)
    run_scenario(scn(2), tmp_path / "resumed", show_progress=False)
    run_scenario(scn(3), tmp_path / "resumed", show_progress=False)
    keys = ["round", "accepted", "fed_eval_nodes", "fed_eval_loss", "fed_eval_accuracy"]
    straight, resumed = ([{k: r[k] for k in keys} for r in csv.DictReader(open(tmp_path / d / "metrics.csv"))]
                         for d in ("straight", "resumed"))
    assert len(straight) == 3 and straight[-1]["fed_eval_nodes"] == "4"
    assert resumed == straight


def test_unknown_workflow_is_one_clear_error():
    with pytest.raises(ConfigError, match="workflow must be one of"):
        _scn("virtual", workflow="async")


def test_over_selection_closes_the_round_when_enough_updates_are_in(tmp_path):
    from clients.client_app import app
    from coordinator import RunConfig, RunDirectory, SyncWorkflow
    from simulations import VirtualClock, VirtualGrid, tiered_profiles

    def run(name, **kw):
        cfg = RunConfig.from_mapping({"num-rounds": 3, "min-nodes": 4, "round-timeout": 60.0, **kw})
        clock = VirtualClock()
        grid = VirtualGrid(app, 12, clock, tiered_profiles(12, seed=0), seed=0)
        wf = SyncWorkflow(cfg, grid, RunDirectory(tmp_path / name), clock=clock)
        wf.run()
        return wf.history

    everyone = run("all")
    early = run("early", **{"close-after-replies": 4})
    assert all(r["accepted"] == 4 and r["late"] == r["selected"] - 4 - r["rejected"] for r in early)
    assert sum(r["round_time_s"] for r in early) < sum(r["round_time_s"] for r in everyone)


def test_scenario_tiers_drive_the_virtual_engine_and_bad_ones_are_one_line(tmp_path):
    from simulations.virtual import DEFAULT_TIERS

    scn = load_scenario(EXAMPLES / "tiered-virtual.toml")
    assert [(f, p) for f, p in scn.tiers] == [(f, p) for f, p in DEFAULT_TIERS]
    bad = tmp_path / "bad.toml"
    bad.write_text(EXAMPLE_TEXT.replace("sigma = 0.1", "sigma = -1.0"))
    with pytest.raises(ConfigError, match=r"tiers\[2\]: .*sigma"):
        load_scenario(bad)
    bad.write_text(EXAMPLE_TEXT.replace("sigma = 0.1", "speed = 3"))
    with pytest.raises(ConfigError, match=r"tiers\[2\]\.speed must be one of"):
        load_scenario(bad)


def test_simulate_compares_several_scenarios_with_one_accuracy_vs_time_plot(tmp_path):
    import subprocess
    import sys

    small = tmp_path / "small.toml"
    small.write_text(EXAMPLE_TEXT.replace("num-supernodes = 100", "num-supernodes = 10")
                     .replace("num-rounds = 30", "num-rounds = 2").replace("min-nodes = 30", "min-nodes = 6")
                     .replace("close-after-replies = 20", "close-after-replies = 4"))
    fedbuff = tmp_path / "fedbuff.toml"
    sync_only = re.compile(r"^(fraction-train|close-after-replies|late-replies) = .*$", re.M)  # refused under FedBuff
    fedbuff.write_text(sync_only.sub("", small.read_text().replace('name = "tiered-virtual"', 'name = "fedbuff"'))
                       .replace("min-nodes = 6", 'min-nodes = 6\nworkflow = "fedbuff"\nbuffer-size = 3\nconcurrency = 6'))
    out = subprocess.run([sys.executable, "-m", "simulations.cli", "simulate", str(small), str(fedbuff), "--quiet",
                          "--run-dir", str(tmp_path / "cmp")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "cmp" / "accuracy_vs_time.png").stat().st_size > 0
    for name in ("tiered-virtual", "fedbuff"):
        assert (tmp_path / "cmp" / name / "accuracy_vs_time.png").is_file()
        assert f"  {name}" in out.stdout


def test_more_clients_than_the_data_can_feed_is_one_error_before_any_round(tmp_path):
    scn = load_scenario(EXAMPLES / "tiered-virtual.toml", {"simulation.num-supernodes": 1000})
    with pytest.raises(ConfigError, match=r"simulation.num-supernodes must be in \[1, 718\]"):
        run_scenario(scn, tmp_path / "r", show_progress=False)
    assert not (tmp_path / "r" / "metrics.csv").exists()


def test_flower_engine_drops_only_flowers_run_simulation_deprecation_notice():
    import logging

    from simulations.runner import _not_for_our_users

    def record(msg, *args):
        return logging.LogRecord("flwr", logging.WARNING, __file__, 1, msg, args, None)

    notice = record("DEPRECATED FEATURE: %s", "The `run_simulation` function is deprecated and will be removed")
    assert _not_for_our_users(notice) is False
    assert _not_for_our_users(record("DEPRECATED FEATURE: %s", "something else")) is True
    assert _not_for_our_users(record("[fedshield] round %d", 3)) is True


def test_a_client_that_raises_is_logged_once_with_its_traceback_then_in_one_line(caplog):
    """A new user's own train raised: the in-process engine logged only repr(exc), not where (Flower's engine prints
    the traceback). The first of each error now comes with its traceback, the rest in one line."""
    import logging

    from flwr.app import ConfigRecord, Context, Message, RecordDict

    from simulations.inprocess import call_client, ensure_task_identity

    ensure_task_identity()

    def client(msg, ctx):
        raise ValueError("boom from my loop (fedshield test)")

    msg = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=1001, message_type="query")
    ctx = Context(run_id=1, node_id=1001, node_config={}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.WARNING):
        replies = [call_client(client, msg, ctx) for _ in range(2)]
    assert all(r.has_error() and "boom from my loop" in r.error.reason for r in replies)
    said = [r.getMessage() for r in caplog.records if "client raised" in r.getMessage()]
    assert len(said) == 2 and "Traceback" in said[0] and 'in client\n    raise ValueError' in said[0]
    assert "Traceback" not in said[1]
