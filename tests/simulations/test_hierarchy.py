"""``fedshield simulate`` with edge aggregators (simulation.sites): the example two-level scenario end to end."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from simulations.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "scenarios" / "two-level.toml"


def test_the_two_level_example_learns_with_secagg_inside_each_site_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = ["simulate", str(EXAMPLE), "--run-dir", str(run_dir), "--quiet", "--set", "run.num-rounds=4"]
    assert main(args) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    # Band: 4 rounds of 30 clients behind 3 sites learn (> 0.75) without a perfect score (test leakage)
    assert 0.75 <= summary["final_test_accuracy"] <= 0.99 and summary["rounds"] == 4
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["accepted"]) for r in rows] == [3] * 4  # the coordinator's clients are the sites
    for k in range(3):
        site_rows = list(csv.DictReader((run_dir / "sites" / f"site-{k}" / "metrics.csv").open()))
        assert [int(r["secagg_survivors"]) for r in site_rows] == [10] * 4
        assert all(float(r["weight_total"]) > 0 for r in site_rows)
    # more rounds: the coordinator and every site go on from their checkpoints
    assert main([*args[:-1], "run.num-rounds=5"]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 5
    site_rows = list(csv.DictReader((run_dir / "sites" / "site-2" / "metrics.csv").open()))
    assert [int(r["round"]) for r in site_rows] == [1, 2, 3, 4, 5]


def test_local_dp_asked_by_the_sites_keeps_each_clients_ledger_in_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    scenario = tmp_path / "s.toml"
    scenario.write_text(EXAMPLE.read_text().replace('secure-aggregation = "secagg+"', 'dp = "local"\n'
                                                    'local-noise-multiplier = 1.0').replace("min-nodes = 8", "min-nodes = 3"))
    too_many = main(["simulate", str(scenario), "--run-dir", str(run_dir), "--quiet", "--set", "simulation.num-supernodes=8"])
    assert too_many == 2  # site.min-nodes = 3 > 8 // 3 clients in the smallest site: refused before anything runs
    assert main(["simulate", str(scenario), "--run-dir", str(run_dir), "--quiet", "--set", "run.num-rounds=1",
                 "--set", "simulation.num-supernodes=9", "--set", "run.local-epochs=1"]) == 0
    for k in range(3):
        row = next(csv.DictReader((run_dir / "sites" / f"site-{k}" / "metrics.csv").open()))
        assert 0 < float(row["local_epsilon_max"]) < 100 and int(row["accepted"]) == 3
    assert len(list((run_dir / "clients").glob("partition-*/*.json"))) == 9  # every client's own ledger
