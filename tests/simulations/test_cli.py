"""``fedshield simulate`` (simulations.cli.main) on bad files and odd run directories: one line, exit 2; resume
and comparison output that says what happened."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from coordinator import RunDirectory
from coordinator.progress import RoundProgress, format_row
from coordinator.rundir import CHECKPOINT, LOCK, SUMMARY
from simulations import cli
from simulations.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "scenarios"
SMALL = ["--set", "simulation.num-supernodes=4", "--set", "run.min-nodes=4"]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedshield: error: "), err
    return err[0]


def _row(rnd: int, sim_time: float | None = None) -> dict:
    row = {"round": rnd, "test_accuracy": 0.5 + rnd / 100, "test_loss": 1.0, "accepted": 4, "selected": 4, "rejected": 0,
           "bytes_down": 123456, "bytes_up": 123456, "round_time_s": 2.0}
    if sim_time is not None:
        row["sim_time_s"] = sim_time
    return row


def _fake_run(path: Path, rounds: int, simulated: bool = False, summary: bool = True) -> None:
    """A run directory whose checkpoint holds ``rounds`` finished rounds, and (``summary``) the summary a
    finished run writes (nothing else of a real run)."""
    rows = [_row(r, 10.0 * r if simulated else None) for r in range(1, rounds + 1)]
    RunDirectory(path).save_checkpoint({"round": rounds, "version": rounds, "weights": torch.zeros(1), "history": rows,
                                        "optimizer": {}, "rejections": {}, "fingerprint": {}})
    if summary:
        RunDirectory(path).write_json(SUMMARY, {"final_test_accuracy": rows[-1]["test_accuracy"], "rounds": rounds})


def test_a_flag_and_a_set_override_of_the_same_key_must_agree(tmp_path, capsys):
    """``--rounds 2 --set run.num-rounds=3`` ran 2 rounds and dropped the other silently."""
    run = ["simulate", "--engine", "inprocess", "--run-dir", str(tmp_path / "r"), "--quiet"]
    assert main([*run, "--rounds", "2", "--set", "run.num-rounds=3"]) == 2
    assert "--rounds and --set run.num-rounds must agree (or give one). Found 2 and 3." in _one_error_line(capsys)
    assert main([*run, "--set", "simulation.engine=virtual"]) == 2
    assert "--engine and --set simulation.engine must agree" in _one_error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_a_device_this_machine_lacks_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    """It was found while the workflow set up: after the run directory was made (left empty) and, on
    Flower's engine, after Ray had started (about 9 s)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = ["simulate", "--rounds", "1", "--run-dir", str(tmp_path / "r"), "--quiet"]
    assert main([*run, "--set", 'run.device="cuda"']) == 2
    assert _one_error_line(capsys).endswith("error: run.device must name an available device. Found 'cuda', but CUDA is not "
                                            "present (use 'cpu' or 'auto').")
    monkeypatch.setenv("FEDSHIELD_DEVICE", "cuda:1")
    assert main(run) == 2
    assert "FEDSHIELD_DEVICE must name an available device" in _one_error_line(capsys)
    assert not (tmp_path / "r").exists()


def test_too_few_nodes_online_on_the_virtual_engine_says_why_and_what_to_change(tmp_path, capsys):
    """The default scenario asks for all 20 nodes; the virtual engine's default tiers keep each online
    with probability 0.8-1 (16.7 expected): the error names the tiers' availability and the fix."""
    run = ["simulate", "--engine", "virtual", "--rounds", "1", "--run-dir", str(tmp_path / "r"), "--quiet"]
    assert main(run) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the run's banner, then the error
    assert len(err) == 2 and err[0].startswith("fedshield simulate: scenario 'default', engine virtual")
    line = err[1]
    assert line.startswith("fedshield: error: ") and "min-nodes=20 nodes must be online within wait-nodes-timeout=120.0 s. Found " in line
    assert line.endswith("16.7 of 20 nodes on average here; lower run.min-nodes (--set run.min-nodes=N), or raise "
                         "run.wait-nodes-timeout (each window draws afresh) or the tiers' availability.")
    assert main([*run[:-3], "--run-dir", str(tmp_path / "r2"), "--quiet", "--set", "run.min-nodes=10"]) == 0


# ----------------------------------------------------------------------------- file-system problems


def test_run_dir_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("")
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--run-dir", str(f), "--quiet"]) == 2
    assert f"Found a file at {f}" in _one_error_line(capsys)
    assert main(["simulate", "--rounds", "1", "--run-dir", str(f / "sub"), "--quiet"]) == 2
    assert f"Found a file at {f}" in _one_error_line(capsys)
    assert main(["simulate", str(EXAMPLES / "default.toml"), str(EXAMPLES / "synthetic-iid.toml"), "--rounds", "1",
                 "--run-dir", str(f), "--quiet"]) == 2  # a comparison's parent
    assert f"Found a file at {f}" in _one_error_line(capsys)
    assert f.read_text() == ""


def test_corrupt_checkpoint_in_run_dir(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / CHECKPOINT).write_text("junk\n")
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--run-dir", str(d), "--quiet"]) == 2
    line = _one_error_line(capsys)
    assert f"{d / CHECKPOINT} is not a fedshield checkpoint" in line and "move it away or pick another --run-dir" in line
    assert sorted(p.name for p in d.iterdir()) == [CHECKPOINT]  # nothing ran


def test_scenario_that_is_not_utf8(tmp_path, capsys):
    p = tmp_path / "binary.toml"
    p.write_bytes(b"\xff\xfe[run]\n")
    assert main(["simulate", str(p)]) == 2
    assert "must be UTF-8 text (TOML). Found byte 0xff at offset 0" in _one_error_line(capsys)


def test_scenario_that_is_a_directory(tmp_path, capsys):
    d = tmp_path / "adir.toml"
    d.mkdir()
    assert main(["simulate", str(d)]) == 2
    line = _one_error_line(capsys)
    assert "a directory" in line and "no such file" not in line
    assert main(["simulate", str(tmp_path / "nope.toml")]) == 2
    assert "no such file" in _one_error_line(capsys)


def test_any_other_os_error_is_one_line(monkeypatch, capsys):
    def boom(args):
        raise PermissionError(13, "Permission denied", "/somewhere/ca.key")

    monkeypatch.setattr(cli, "_certs_init", boom)
    assert main(["certs", "init", "x"]) == 2
    assert _one_error_line(capsys) == "fedshield: error: /somewhere/ca.key: Permission denied."


def test_a_text_file_that_is_not_utf8_anywhere_is_one_line(monkeypatch, capsys):
    import simulations.scenario

    def loader(path, overrides):
        b"\xc3(".decode("utf-8")

    monkeypatch.setattr(simulations.scenario, "load_scenario", loader)
    assert main(["simulate", "--quiet"]) == 2
    assert "must be UTF-8 text. Found byte 0xc3 at offset 0" in _one_error_line(capsys)


# ----------------------------------------------------------------------------- resume and comparison


@pytest.mark.parametrize("requested", [2, 3])
def test_resume_with_no_rounds_left_says_so_and_trains_nothing(tmp_path, capsys, requested):
    d = tmp_path / "q1"
    _fake_run(d, 3)
    before = (d / CHECKPOINT).read_bytes()
    assert main(["simulate", "--engine", "inprocess", "--rounds", str(requested), "--run-dir", str(d)]) == 0
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert f"already holds 3 rounds (>= the {requested} requested); nothing trained" in err[0]
    assert "--rounds N with N > 3" in err[0]
    assert "after 3 rounds (none trained now)" in captured.out
    assert (d / CHECKPOINT).read_bytes() == before and sorted(p.name for p in d.iterdir() if p.name != LOCK) == [CHECKPOINT, SUMMARY]


def test_another_scenarios_run_directory_is_refused_not_reported_as_this_ones(tmp_path, capsys):
    """It printed the digits run's accuracy as the synthetic scenario's result ("none trained now")."""
    d = tmp_path / "a1"
    small = ["--engine", "inprocess", "--quiet", "--set", "simulation.num-supernodes=3", "--set", "run.min-nodes=2",
             "--set", "run.local-epochs=1", "--rounds", "1", "--run-dir", str(d)]
    assert main(["simulate", *small]) == 0
    capsys.readouterr()
    before = (d / CHECKPOINT).read_bytes()
    assert main(["simulate", str(EXAMPLES / "synthetic-iid.toml"), *small]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "must hold a checkpoint of this configuration" in err[0]
    assert "task = 'digits' there, 'synthetic' now" in err[0] and (d / CHECKPOINT).read_bytes() == before


def _recording_runs(monkeypatch) -> list[Path]:
    seen: list[Path] = []
    monkeypatch.setattr("simulations.runner.run_scenario",
                        lambda scn, run_dir, show_progress=True: seen.append(Path(run_dir)) or
                        {"final_test_accuracy": None, "rounds": 0, "run_dir": str(run_dir)})
    return seen


def test_a_run_stopped_after_its_last_checkpoint_is_finished_not_skipped(tmp_path, monkeypatch, capsys):
    """Stopped between the last round's checkpoint and its summary (Ctrl-C, a full disk): a rerun said
    "nothing trained, its results are unchanged" and never wrote summary.json, model.pt or the plots."""
    d = tmp_path / "q2"
    _fake_run(d, 3, summary=False)
    seen = _recording_runs(monkeypatch)
    assert main(["simulate", "--engine", "inprocess", "--rounds", "3", "--run-dir", str(d), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert seen == [d] and "nothing trained" not in captured.err
    assert "final test accuracy n/a after 0 rounds" in captured.out  # no accuracy: said so, not a TypeError


def test_a_tilde_in_the_run_dir_is_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    seen = _recording_runs(monkeypatch)
    scn = tmp_path / "t.toml"
    scn.write_text('[run]\nrun-dir = "~/runs/tilde"\n')
    assert main(["simulate", str(scn), "--engine", "inprocess", "--rounds", "1", "--quiet"]) == 0
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--quiet", "--run-dir", "~/flag"]) == 0
    assert seen == [tmp_path / "home" / "runs" / "tilde", tmp_path / "home" / "flag"]
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("where", [["--run-dir", "~nouserxx9/r"], ["--set", 'run.run-dir="~nouserxx9/r"'],
                                   [str(EXAMPLES / "default.toml"), str(EXAMPLES / "synthetic-iid.toml"),
                                    "--run-dir", "~nouserxx9/r"]])
def test_a_run_dir_under_an_unknown_users_home_is_one_line(where, capsys):
    """It was a RuntimeError traceback ("Could not determine home directory")."""
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--quiet", *where]) == 2
    assert "home directory. Found '~nouserxx9/r': no user 'nouserxx9'" in _one_error_line(capsys)


def test_a_flower_engine_run_is_not_resumed_with_another_node_count(tmp_path):
    """The check compared the node count only for fedshield's engines: a Flower-engine run of 2 clients
    resumed with 6, its data split changed mid-run. (A checkpoint from before it was recorded is let by.)"""
    from clients.tasks import get_task
    from coordinator import CoordinatorError
    from coordinator.workflow import run_fingerprint
    from simulations.scenario import load_scenario

    def scn(n):
        return load_scenario(None, {"simulation.engine": "flower", "simulation.num-supernodes": n, "run.min-nodes": 2})

    numel = sum(p.numel() for p in get_task(scn(2).run.task).build_model().parameters())
    ckpt = {"fingerprint": run_fingerprint(scn(2).run, numel, 2)}
    cli._check_same_run(scn(2), ckpt, tmp_path)
    with pytest.raises(CoordinatorError, match="nodes = 2 there, 6 now"):
        cli._check_same_run(scn(6), ckpt, tmp_path)
    cli._check_same_run(scn(6), {"fingerprint": run_fingerprint(scn(2).run, numel)}, tmp_path)  # none recorded


def test_comparison_labels_time_by_what_it_measures(tmp_path, capsys):
    parent = tmp_path / "cmp"
    _fake_run(parent / "default", 2, simulated=False)
    _fake_run(parent / "synthetic-iid", 2, simulated=True)
    assert main(["simulate", str(EXAMPLES / "default.toml"), str(EXAMPLES / "synthetic-iid.toml"), "--rounds", "2",
                 "--run-dir", str(parent), "--quiet"]) == 0
    out = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert "time 4.0 s (rounds' wall time summed)" in out["default"]
    assert "virtual" not in out["default"]
    assert "time 20.0 s (simulated on the virtual engine)" in out["synthetic-iid"]


def test_comparison_rows_are_the_scenarios_even_where_their_run_dirs_share_a_name(tmp_path, capsys):
    """Runs keyed by their directory's own name: p1/out and p2/out became one line of the plot and two
    rows that both showed the second run's time."""
    files = []
    for name, sub, simulated in (("a", "p1", False), ("b", "p2", True)):
        _fake_run(tmp_path / sub / "out", 2, simulated=simulated)
        files.append(tmp_path / f"{name}.toml")
        files[-1].write_text(f'[simulation]\nname = "{name}"\nengine = "inprocess"\n[run]\n'
                             f'run-dir = "{tmp_path / sub / "out"}"\n')
    assert main(["simulate", *map(str, files), "--rounds", "2", "--quiet"]) == 0
    out = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert sorted(out) == ["a", "b"]
    assert "time 4.0 s (rounds' wall time summed)" in out["a"]
    assert "time 20.0 s (simulated on the virtual engine)" in out["b"]


def test_a_comparison_s_errors_name_the_scenario_file_before_any_run(tmp_path, monkeypatch, capsys):
    seen = _recording_runs(monkeypatch)
    ok, big, bad = tmp_path / "ok.toml", tmp_path / "big.toml", tmp_path / "bad.toml"
    ok.write_text('[simulation]\nengine = "inprocess"\n')
    big.write_text('[simulation]\nengine = "inprocess"\nnum-supernodes = 2000\n')
    bad.write_text('[run]\nnum-round = 3\n')
    assert main(["simulate", str(ok), str(big), "--rounds", "1", "--run-dir", str(tmp_path / "c")]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"fedshield: error: {big}: simulation.num-supernodes must be in [1, ")
    assert main(["simulate", str(ok), str(bad), "--rounds", "1", "--run-dir", str(tmp_path / "c")]) == 2
    assert _one_error_line(capsys).startswith(f"fedshield: error: {bad}: run.num-round is not a known key")
    assert seen == [] and not (tmp_path / "c").exists()


# ----------------------------------------------------------------------------- progress lines


def test_round_lines_do_not_wrap_when_not_a_terminal():
    buf = io.StringIO()
    console = Console(file=buf, width=80)  # a file: not a terminal, rich's default width
    row = _row(12, sim_time=1.0) | {"epsilon": 1.234}
    line = format_row(row, 100)
    assert len(line) > 80
    with RoundProgress(100, "t", console=console) as prog:
        prog.update(row)
    assert line in buf.getvalue().splitlines()


def test_round_lines_do_not_wrap_on_redirected_stderr(capsys):
    row = _row(3)
    with RoundProgress(3, "default (inprocess)") as prog:  # its own Console on sys.stderr, captured: not a TTY
        prog.update(row)
    assert format_row(row, 3) in capsys.readouterr().err.splitlines()


def test_simulate_to_a_pipe_then_resume_with_fewer_rounds(tmp_path):
    """The real command twice, output piped: whole round lines; then a rerun asking fewer rounds trains nothing."""
    def run(*args):
        return subprocess.run([sys.executable, "-m", "simulations.cli", "simulate", "--engine", "inprocess", *SMALL,
                               "--run-dir", "q", *args], cwd=tmp_path, capture_output=True, text=True, timeout=600)

    first = run("--rounds", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    rounds = [line for line in first.stderr.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in rounds] == ["1/2", "2/2"]
    assert all(line.endswith(" s") and " up " in line for line in rounds), rounds
    summary = (tmp_path / "q" / SUMMARY).read_text()
    again = run("--rounds", "1", "--quiet")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already holds 2 rounds (>= the 1 requested); nothing trained" in again.stderr
    assert "after 2 rounds" in again.stdout
    assert (tmp_path / "q" / SUMMARY).read_text() == summary


def test_simulate_uses_the_scenario_s_run_dir_unless_the_flag_is_given(tmp_path, monkeypatch):
    from simulations import cli

    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr("simulations.runner.run_scenario",
                        lambda scn, run_dir, show_progress=True: seen.append(Path(run_dir)) or
                        {"final_test_accuracy": 0.5, "rounds": 1, "run_dir": str(run_dir)})
    base = ["simulate", "--engine", "inprocess", "--rounds", "1", "--quiet"]
    assert cli.main([*base, "--set", "run.run-dir=from-set"]) == 0
    assert cli.main([*base, "--set", "run.run-dir=from-set", "--run-dir", "from-flag"]) == 0
    assert seen == [tmp_path / "from-set", tmp_path / "from-flag"]  # relative to the working directory


def test_a_comparison_refuses_one_run_dir_for_two_scenarios(tmp_path, monkeypatch, capsys):
    from simulations import cli

    monkeypatch.chdir(tmp_path)
    default = Path(cli.__file__).resolve().parents[1] / "examples" / "scenarios" / "default.toml"
    rc = cli.main(["simulate", str(default), str(default), "--rounds", "1", "--set", "run.run-dir=same"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "run.run-dir must differ between the scenarios of a comparison" in err[0]


def test_a_bad_torch_threads_variable_is_one_line_for_simulate_too(monkeypatch, capsys):
    """The agent refused it; simulate's ClientApp silently kept torch's default."""
    monkeypatch.setenv("FEDSHIELD_TORCH_THREADS", "abc")
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--quiet"]) == 2
    assert "FEDSHIELD_TORCH_THREADS must be an integer in [1, 1024]. Found 'abc'." in _one_error_line(capsys)


def test_a_task_that_does_not_import_is_its_own_line_and_a_partition_error_names_the_client_count(tmp_path, capsys):
    """The partition hint ("Each simulated client gets one partition...") followed import errors too."""
    argv = ["simulate", "--engine", "inprocess", "--rounds", "1", "--quiet", "--run-dir", str(tmp_path / "r"), *SMALL]
    assert main([*argv, "--set", 'run.task="no_such_module_xyz:Task"']) == 2
    line = _one_error_line(capsys)
    assert line.endswith("Found ModuleNotFoundError: No module named 'no_such_module_xyz'"), line
    assert main([*argv, "--set", "simulation.num-supernodes=5000", "--set", "run.min-nodes=5000"]) == 2
    line = _one_error_line(capsys)
    assert "simulation.num-supernodes" in line and "Each simulated client gets one partition" in line, line


@pytest.mark.parametrize("value", ["9" * 5000, "[" * 3000])
def test_toml_that_python_cannot_read_is_one_line_in_scenarios_and_set_values(tmp_path, capsys, value):
    (tmp_path / "s.toml").write_text(f"[run]\nlr = {value}\n")
    assert main(["simulate", str(tmp_path / "s.toml"), "--quiet"]) == 2
    assert "must be valid TOML" in _one_error_line(capsys)
    assert main(["simulate", "--engine", "inprocess", "--set", f"run.lr={value}", "--quiet"]) == 2  # a string, refused
    assert "run.lr must be" in _one_error_line(capsys)


def test_a_set_value_with_a_line_break_is_refused_not_read_as_two_keys(capsys):
    """Read as TOML, the second line set a key of its own, silently dropped."""
    assert main(["simulate", "--engine", "inprocess", "--set", "run.lr=0.1\nv2 = 5", "--quiet"]) == 2
    assert "must be one line" in _one_error_line(capsys)


def test_a_run_is_not_resumed_on_another_engine(tmp_path):
    """Virtual -> in-process mixed simulated and wall time in one history; the other way failed on the clock."""
    from clients.tasks import get_task
    from coordinator import CoordinatorError
    from coordinator.workflow import run_fingerprint
    from simulations.scenario import load_scenario

    def scn(engine):
        return load_scenario(None, {"simulation.engine": engine, "simulation.num-supernodes": 4, "run.min-nodes": 2})

    numel = sum(p.numel() for p in get_task(scn("virtual").run.task).build_model().parameters())
    ckpt = {"fingerprint": run_fingerprint(scn("virtual").run, numel, 4, "virtual")}
    cli._check_same_run(scn("virtual"), ckpt, tmp_path)
    with pytest.raises(CoordinatorError, match="engine = 'virtual' there, 'inprocess' now"):
        cli._check_same_run(scn("inprocess"), ckpt, tmp_path)
    cli._check_same_run(scn("inprocess"), {"fingerprint": run_fingerprint(scn("virtual").run, numel, 4)}, tmp_path)


def test_an_engine_run_records_its_engine(tmp_path):
    small = ["--set", "simulation.num-supernodes=4", "--set", "run.min-nodes=2"]
    assert main(["simulate", "--engine", "virtual", "--rounds", "1", "--run-dir", str(tmp_path / "v"), "--quiet",
                 *small]) == 0
    assert RunDirectory(tmp_path / "v").load_checkpoint()["fingerprint"]["engine"] == "virtual"
    assert main(["simulate", "--engine", "inprocess", "--rounds", "2", "--run-dir", str(tmp_path / "v"), "--quiet",
                 *small]) == 2


def test_a_bad_kernels_variable_is_one_line_before_a_run_directory_is_made(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEDSHIELD_KERNELS", "bogus")
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--run-dir", str(tmp_path / "r"), "--quiet"]) == 2
    assert "FEDSHIELD_KERNELS must be" in _one_error_line(capsys) and not (tmp_path / "r").exists()


def test_a_checkpoint_that_is_not_a_zip_archive_says_so(tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    (d / CHECKPOINT).write_text("junk\n")
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--run-dir", str(d), "--quiet"]) == 2
    assert "not a zip archive" in _one_error_line(capsys)


@pytest.mark.parametrize("argv", [["certs", "init", ""], ["keys", "new", " "], ["data", "export", "--num-partitions", "2",
                                  "--out", ""], ["agent", "start", "--coordinator", "127.0.0.1:9", "--state-dir", ""]])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "must be a path" in _one_error_line(capsys)


@pytest.mark.parametrize("extra", [["--set", 'run.aggregator="median"'], ["--set", 'run.aggregator="krum"', "--set", "run.krum-f=1"]])
def test_fedbuff_under_a_rule_taking_one_update_per_node_needs_buffer_size_nodes(capsys, extra):
    """Found only after the stall timeout (420 s by default) before."""
    assert main(["simulate", "--engine", "inprocess", "--set", "simulation.num-supernodes=3", "--set", "run.min-nodes=2",
                 "--set", 'run.workflow="fedbuff"', "--set", "run.buffer-size=5", *extra, "--quiet"]) == 2
    assert "simulation.num-supernodes must be >= run.buffer-size = 5 (a FedBuff release under " in _one_error_line(capsys)


def test_a_run_dir_that_exists_but_cannot_be_written_or_is_empty_is_one_line(capsys):
    assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--run-dir", "/proc/self", "--quiet"]) == 2
    assert "must be writable. Found: No such file or directory (/proc/" in _one_error_line(capsys)  # resolved
    with pytest.raises(SystemExit):
        main(["simulate", "--run-dir", ""])
    assert "must be a path" in _one_error_line(capsys)


def test_a_run_dir_another_run_holds_is_refused_in_one_line(tmp_path, capsys):
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", "import time; from coordinator.rundir import lock_run_dir; "
                               f"lock_run_dir({str(tmp_path / 'run')!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["simulate", "--engine", "inprocess", "--rounds", "1", "--run-dir", str(tmp_path / "run"),
                     "--quiet"]) == 2
        assert f"must not be in use by another run. Found it held by process {holder.pid}" in _one_error_line(capsys)
    finally:
        holder.kill()
        holder.wait()


def test_a_fedbuff_row_counts_its_replies_not_the_messages_sent_in_its_window():
    """A release takes replies to messages sent in earlier windows: "accepted 2/0" (review helper-55)."""
    sync = format_row(_row(3), 10)
    assert " accepted 4/4 " in sync
    fedbuff = format_row(_row(3) | {"replies": 3, "selected": 0, "accepted": 2, "mean_staleness": 0.5, "workflow": "fedbuff"}, 10)
    assert " accepted 2 of 3 replies (sent 0) " in fedbuff
    carried = format_row(_row(3) | {"replies": 23, "selected": 30, "accepted": 23, "mean_staleness": 0.5}, 10)
    assert " accepted 23/30 " in carried  # a synchronous round with late replies carried has a staleness too


def test_a_run_in_which_every_reply_was_refused_fails_with_the_reasons(tmp_path, capsys):
    """Every client's training diverges (its task makes NaN weights), so every reply is a refusal: the run is no
    success (exit 2, status no-updates, the refusals counted in the one line), not 'final test accuracy'."""
    bad = tmp_path / "diverging.py"
    bad.write_text("import torch\nfrom clients.tasks import DigitsTask\n\nclass Diverging(DigitsTask):\n"
                   "    def train(self, model, data, settings, generator):\n"
                   "        with torch.no_grad():\n            for p in model.parameters():\n"
                   "                p.fill_(float('nan'))\n")
    code = main(["simulate", str(EXAMPLES / "default.toml"), "--engine", "inprocess", "--rounds", "2", "--quiet",
                 "--run-dir", str(tmp_path / "run"), "--set", f"run.task={bad}:Diverging", *SMALL])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("fedshield simulate: scenario 'default'") and len(err) == 2, err  # its start, then why
    line = err[1]
    assert code == 2 and line.startswith("fedshield: error: no round aggregated an update") and "8 error-reply" in line
    import json

    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert summary["status"] == "no-updates" and summary["rounds_without_updates"] == 2


def test_privacy_plan_prints_the_smallest_noise_under_each_accountant(capsys):
    assert main(["privacy", "plan", "--epsilon", "3", "--delta", "1e-5", "--rounds", "20", "--sampling-rate", "0.2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("target epsilon 3 at delta 1e-05, 20 rounds at sampling rate 0.2")
    z = {line.split(":")[0].strip(): float(line.split("noise multiplier ")[1].split()[0]) for line in out[1:3]}
    assert set(z) == {"pld", "rdp"} and z["pld"] < z["rdp"] and "less noise than rdp" in out[3]


@pytest.mark.parametrize("argv", [
    ["--epsilon", "-1", "--rounds", "20", "--sampling-rate", "0.2"],
    ["--epsilon", "1", "--rounds", "0", "--sampling-rate", "0.2"],
    ["--epsilon", "1", "--rounds", "20", "--sampling-rate", "1.5"],
    ["--epsilon", "1", "--rounds", "20", "--sampling-rate", "0.2", "--delta", "2"],
    ["--epsilon", "0.001", "--rounds", "1000", "--sampling-rate", "1", "--accountant", "rdp"],
])
def test_privacy_plan_bad_input_is_one_line(argv, capsys):
    try:
        code = main(["privacy", "plan", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "" and len(err) == 1 and err[0].startswith("fedshield: error: "), err


def test_bare_fedshield_prints_its_commands(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: fedshield") and all(c in err for c in ("simulate", "coordinator", "agent", "report"))
