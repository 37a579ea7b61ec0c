"""``fedshield simulate`` on Flower's simulation engine (Ray), as a user runs it."""

from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from coordinator import RunDirectory
from coordinator.rundir import CHECKPOINT, METRICS, MODEL, PLOT, SUMMARY

from .procs import free_port, wait_for

pytestmark = [pytest.mark.integration]


def _simulate(fedshield_bin, tmp_path, *args, timeout=280, env=None):
    """``fedshield simulate`` in a session of its own and with its own FLWR_HOME; its whole process group (Ray's
    gcs, raylet and workers) is killed when it has ended, or when the test fails or times out (subprocess.run
    killed only the direct child: its Ray daemons were left behind)."""
    proc = subprocess.Popen([fedshield_bin, "simulate", "--quiet", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), **(env or {})})
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.timeout(300)
def test_small_scenario_accuracy_band(tmp_path, fedshield_bin):
    scenario = tmp_path / "small.toml"
    scenario.write_text("""
[simulation]
name = "small"
num-supernodes = 6

[run]
num-rounds = 4
min-nodes = 6
task = "digits"
partitioning = "dirichlet"
dirichlet-alpha = 0.5
""")
    out = _simulate(fedshield_bin, tmp_path, str(scenario), "--run-dir", "run")
    assert out.returncode == 0, out.stderr[-3000:]
    run = tmp_path / "run"
    for name in (CHECKPOINT, METRICS, SUMMARY, MODEL, PLOT):
        assert (run / name).is_file(), name
    summary = json.loads((run / SUMMARY).read_text())
    # Lower bound: it learned. Upper bound: a 4-round non-IID run does not reach a perfect score.
    assert 0.85 <= summary["final_test_accuracy"] <= 0.99
    rows = list(csv.DictReader(open(run / METRICS)))
    assert [int(r["round"]) for r in rows] == [1, 2, 3, 4]
    assert all(int(r["bytes_up"]) > 0 and int(r["bytes_down"]) > 0 for r in rows)
    assert "final test accuracy" in out.stdout


@pytest.mark.timeout(300)
def test_topk_codec_with_error_feedback_under_flower_engine(tmp_path, fedshield_bin):
    """Compressed replies and the clients' error-feedback state (Context.state) under Ray actors."""
    out = _simulate(fedshield_bin, tmp_path, "--run-dir", "topk", "--rounds", "5",
                    "--set", "simulation.num-supernodes=6", "--set", "run.min-nodes=6",
                    "--set", 'run.codec="topk"', "--set", "run.topk-ratio=0.05")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = list(csv.DictReader(open(tmp_path / "topk" / METRICS)))
    assert all(int(r["accepted"]) == 6 and int(r["rejected"]) == 0 for r in rows)
    assert all(int(r["bytes_down"]) > 10 * int(r["bytes_up"]) for r in rows)
    acc = json.loads((tmp_path / "topk" / SUMMARY).read_text())["final_test_accuracy"]
    assert 0.60 <= acc <= 0.99


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_scenario_reaches_090(tmp_path, fedshield_bin):
    """The README's main command on its default scenario (digits, 20 clients, Dirichlet 0.5, 20 rounds)."""
    out = _simulate(fedshield_bin, tmp_path, "--run-dir", "default")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "default" / SUMMARY).read_text())
    assert summary["rounds"] == 20
    assert 0.90 <= summary["final_test_accuracy"] <= 0.995


def test_bad_input_is_one_line(tmp_path, fedshield_bin):
    closed = free_port()  # nothing listens there
    for args in (["nope.toml"], ["--set", "run.lr=-1"], ["--set", "run.bogus=1"], ["--rounds", "0"],
                 ["--set", f'simulation.ray-address="127.0.0.1:{closed}"']):
        out = _simulate(fedshield_bin, tmp_path, *args, timeout=60)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("fedshield: error:"), out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, to", [("SIGINT", "other"), ("SIGTERM", "other"), ("SIGTERM", "main"), ("SIGTERM", "group")])
def test_ctrl_c_stops_a_flower_engine_run_at_once_and_saves_no_more_rounds(tmp_path, procs, fedshield_bin, sig, to):
    """Ctrl-C reaches only the main thread; the ServerApp's thread must stop too (it used to run on,
    saving empty rounds with no clients, and the process never exited).

    The signal is sent to one of the process's other threads (Ray's, gRPC's, Flower's workers), the
    case that once let a run go on to its last round: the main thread, waiting on a lock, was not
    woken, and the KeyboardInterrupt raised at the end was lost in Ray's shutdown. SIGTERM ends the
    run the same way (it was Ray's native stack dump and an abort, exit 134); sent to the main thread, as
    ``kill`` usually lands, it took Ray's handler (sys.exit), and the process hung at exit on a Flower worker."""
    import ctypes
    import signal

    signum = getattr(signal, sig)

    proc = procs.start("simulate", [fedshield_bin, "simulate", "--rounds", "60", "--quiet", "--run-dir", "run"], cwd=tmp_path,
                       interruptible=True)
    metrics = tmp_path / "run" / METRICS
    deadline = time.monotonic() + 200
    while not metrics.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert metrics.exists(), procs.log("simulate")[-3000:]
    def takes_sigint(tid: int) -> bool:  # some of Ray's threads block it; a signal sent to one would wait there
        try:
            status = open(f"/proc/{proc.pid}/task/{tid}/status").read()
        except FileNotFoundError:  # the thread has just ended
            return False
        return not int(status.split("SigBlk:")[1].split()[0], 16) & (1 << (signum - 1))

    others = sorted(t for t in map(int, os.listdir(f"/proc/{proc.pid}/task")) if t != proc.pid and takes_sigint(t))
    assert others, "Flower's engine runs threads beside the main one"
    if to == "group":  # as timeout(1), systemd or kill -TERM -PGID: the client actors get it too
        os.killpg(proc.pid, signum)
    else:
        target = proc.pid if to == "main" else others[len(others) // 2]
        assert ctypes.CDLL(None, use_errno=True).tgkill(proc.pid, target, signum) == 0
    assert procs.wait("simulate", timeout=45) == 130, procs.log("simulate")[-3000:]
    rounds_then = len(list(csv.DictReader(open(metrics))))
    assert rounds_then < 60
    time.sleep(2)
    assert len(list(csv.DictReader(open(metrics)))) == rounds_then, "no round is saved after the interrupt"
    assert "fedshield: interrupted" in procs.log("simulate")
    assert "SIGTERM received" not in procs.log("simulate")
    assert "Traceback" not in procs.log("simulate"), "the actors' deaths logged by Flower, after the stop"


def _gcs_token(session: int) -> str:
    """RAY_AUTH_TOKEN from the environment of the GCS server that process session ``session`` started."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getsid(int(pid)) != session or b"gcs_server" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ProcessLookupError):
            continue
        return next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RAY_AUTH_TOKEN=")), "")
    raise AssertionError("the run's GCS server was not found")


@pytest.mark.timeout(300)
def test_the_ray_a_run_starts_refuses_callers_without_its_token(procs, fedshield_bin):
    """Ray's GCS, raylet and actors listen on every interface of the machine, and Ray starts with
    authentication off: without fedshield's token anyone who could reach the GCS port could run
    code as this user. While a Flower-engine run goes on, a caller holding no token (none in its
    environment, none under its home) is refused by the run's GCS."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="fs-ray-", dir="/tmp"))  # Ray's socket paths: < 108 bytes
    try:
        run = ray_tmp / "run"
        sim = procs.start("simulate", [fedshield_bin, "simulate", "--quiet", "--rounds", "200", "--run-dir", str(run),
                                       "--set", "simulation.num-supernodes=4", "--set", "run.min-nodes=4"],
                          cwd=ray_tmp, env={"RAY_TMPDIR": str(ray_tmp)})
        wait_for(lambda: (run / METRICS).exists() or sim.poll() is not None, 200, "a first round")
        assert sim.poll() is None, procs.log("simulate")[-3000:]
        ports = list(ray_tmp.glob("ray/session_latest/gcs_server_port_*"))
        assert len(ports) == 1, "the run's Ray must write its GCS port under RAY_TMPDIR"
        gcs = f"127.0.0.1:{int(ports[0].read_text())}"
        home = ray_tmp / "home"  # no ~/.ray/auth_token there
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {"HOME": str(home)}
        out = subprocess.run([str(Path(fedshield_bin).with_name("ray")), "status", "--address", gcs],
                             capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode != 0 and "InvalidAuthToken" in out.stdout + out.stderr, (out.stdout + out.stderr)[-2000:]
        assert sim.poll() is None, "a refused caller must not disturb the run"
        token = _gcs_token(sim.pid)  # what Ray's processes got from the run's environment
        assert len(token) == 64
        logs = [procs.log("simulate"), *(p.read_text(errors="replace") for p in ray_tmp.rglob("*.log") if p.is_file()),
                *(p.read_text(errors="replace") for p in ray_tmp.rglob("*.out") if p.is_file())]
        assert not any(token in text for text in logs), "the token must never be logged"
    finally:
        procs.stop_all()
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.timeout(420)
def test_simulate_joins_an_existing_ray_cluster_and_ends_cleanly_when_it_dies(procs, fedshield_bin):
    """Past one machine: a Ray head started on its own (``ray start --head``, as on a cluster's first
    machine) and ``fedshield simulate`` with ``ray-address`` pointing at it. The run must join that
    cluster (its driver's log lands in the head's session directory) rather than start its own.

    Then the head dies mid-run (its whole process group killed, as when its machine goes down). The
    run used to go on asking dead actors, a traceback per message, until Ray's core ended the
    process a minute later (exit 1, no word on what was saved). It must end within seconds with one
    line saying where the cluster stopped answering, which rounds are saved and how to resume, save
    no round after, and resume from there once a head answers at that address again.

    The cluster runs as README tells operators to run one: with Ray's token authentication on
    (``RAY_AUTH_MODE=token`` and one ``RAY_AUTH_TOKEN`` on every machine and for the run)."""
    import secrets

    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    port = free_port()
    address = f'simulation.ray-address="127.0.0.1:{port}"'
    small = ["--set", address, "--set", "simulation.num-supernodes=4", "--set", "run.min-nodes=4"]
    # Not under tmp_path: Ray's unix socket paths (under --temp-dir) must stay below 108 bytes.
    ray_tmp = Path(tempfile.mkdtemp(prefix="fs-ray-", dir="/tmp"))

    def start_head(name: str) -> None:
        procs.start(name, [str(Path(fedshield_bin).with_name("ray")), "start", "--head", "--block",
                           "--node-ip-address=127.0.0.1", f"--port={port}", "--num-cpus=2",
                           "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={ray_tmp / name}"],
                    cwd=ray_tmp, env=auth)
        wait_for(lambda: "Ray runtime started" in procs.log(name) or procs.procs[name].poll() is not None,
                 120, "the Ray head")
        assert procs.procs[name].poll() is None, procs.log(name)[-3000:]

    def rounds_saved() -> int:
        return len(list(csv.DictReader(open(metrics)))) if metrics.exists() else 0

    try:
        start_head("head")
        run = ray_tmp / "run"
        metrics = run / METRICS
        sim = procs.start("simulate", [fedshield_bin, "simulate", "--quiet", "--rounds", "400", "--run-dir", str(run),
                                       *small], cwd=ray_tmp, env=auth)
        wait_for(lambda: rounds_saved() >= 3 or sim.poll() is not None, 200, "three rounds on the cluster")
        assert sim.poll() is None, procs.log("simulate")[-3000:]
        assert list((ray_tmp / "head").glob("session_*/logs/python-core-driver-*")), \
            "the simulation's Ray driver did not connect to the cluster started above"

        procs.stop("head", sig=signal.SIGKILL)  # the head's machine goes down
        assert procs.wait("simulate", timeout=90) == 2, procs.log("simulate")[-3000:]
        log = procs.log("simulate")
        errors = [line for line in log.splitlines() if line.startswith("fedshield: error:")]
        assert len(errors) == 1, log[-3000:]
        assert f"the Ray cluster stopped answering at 127.0.0.1:{port}" in errors[0]
        saved = int(RunDirectory(run).load_checkpoint()["round"])
        assert saved >= 3 and rounds_saved() == saved
        assert f"rounds 1-{saved} are saved in {run}" in errors[0] and f"--run-dir {run}" in errors[0]

        start_head("head-again")  # the cluster is back at the same address: the run resumes there
        out = _simulate(fedshield_bin, ray_tmp, "--rounds", str(saved + 1), "--run-dir", str(run), *small, timeout=240, env=auth)
        assert out.returncode == 0, out.stderr[-3000:]
        assert f"resuming after round {saved}" in out.stderr
        assert json.loads((run / SUMMARY).read_text())["rounds"] == saved + 1
        assert list((ray_tmp / "head-again").glob("session_*/logs/python-core-driver-*"))
        assert procs.procs["head-again"].poll() is None, "the run must leave the cluster it joined running"
    finally:
        procs.stop_all()
        shutil.rmtree(ray_tmp, ignore_errors=True)
