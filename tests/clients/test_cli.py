"""``fedshield data export`` (clients.cli.export_partitions): checked before anything is created."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from clients import ClientError
from clients.cli import export_partitions
from simulations.cli import main


@pytest.mark.parametrize("n", [0, -2])
def test_export_refuses_no_partitions_and_creates_nothing(tmp_path, n):
    with pytest.raises(ClientError, match=f"--num-partitions must be >= 1. Found {n}."):
        export_partitions("digits", n, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_export_too_many_partitions_leaves_no_empty_directory(tmp_path):
    with pytest.raises(ClientError, match="num-partitions must be"):
        export_partitions("digits", 5000, str(tmp_path / "deep" / "out"))
    assert list(tmp_path.iterdir()) == []


def test_export_of_a_tasks_own_split_checks_each_part_before_writing(tmp_path):
    """A task's own client_data that leaves a partition empty wrote an empty client-K.npz, found only when an
    agent loaded it (a review); the task's own refusal is one line too."""
    (tmp_path / "t.py").write_text(
        "import numpy as np\nfrom torch import nn\nfrom clients import Dataset, Task\n"
        "class Halves(Task):\n    num_classes = 2\n"
        "    def build_model(self):\n        return nn.Linear(3, 2)\n"
        "    def load_data(self):\n        x = np.ones((8, 3), np.float32)\n"
        "        return Dataset(x, np.arange(8) % 2), Dataset(x[:2], np.arange(2))\n"
        "    def client_data(self, pid, num):\n        return Dataset(self.train_set.x[pid:4], self.train_set.y[pid:4])\n")
    with pytest.raises(ClientError, match="partition 4.* must hold n > 0 examples"):
        export_partitions(f"{tmp_path / 't.py'}:Halves", 5, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    recommender = str(Path(__file__).resolve().parents[2] / "examples" / "tasks" / "recommender.py") + ":Recommender"
    with pytest.raises(ClientError, match="partitions must number 1 to 400 .*Found partition 0 of 401"):
        export_partitions(recommender, 401, str(tmp_path / "out"))


def test_export_into_a_file_or_under_one(tmp_path):
    f = tmp_path / "coordinator.toml"
    f.write_text("[run]\n")
    with pytest.raises(ClientError, match="--out must be a directory. Found a file at .*coordinator.toml"):
        export_partitions("digits", 3, str(f))
    with pytest.raises(ClientError, match="--out .*sub must be a writable directory. Found: Not a directory"):
        export_partitions("digits", 3, str(f / "sub"))
    assert f.read_text() == "[run]\n" and sorted(p.name for p in tmp_path.iterdir()) == ["coordinator.toml"]


def test_export_writes_every_partition(tmp_path):
    paths = export_partitions("digits", 3, str(tmp_path / "a" / "b"), partitioning="iid")
    assert [p.name for p in paths] == ["client-0.npz", "client-1.npz", "client-2.npz"]
    sizes = [len(np.load(p)["y"]) for p in paths]
    assert min(sizes) > 0 and max(sizes) - min(sizes) <= 1


def test_a_failed_write_removes_what_it_made(tmp_path, monkeypatch):
    import clients.cli as cli

    calls = []

    def flaky_save(path, data, spec=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(path))
        np.savez(path, x=data.x, y=data.y)

    monkeypatch.setattr(cli, "save_npz", flaky_save)
    with pytest.raises(ClientError, match="No space left on device"):
        export_partitions("digits", 3, str(tmp_path / "new" / "out"), partitioning="iid")
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["--num-partitions", "0"], ["--num-partitions", "-2"], ["--num-partitions", "5000"]])
def test_cli_bad_partition_count_is_one_line_exit_2_and_no_directory(tmp_path, capsys, args):
    out = tmp_path / "d"
    assert main(["data", "export", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedshield: error: ") and "num-partitions" in err[0]
    assert not out.exists()


def test_cli_export_onto_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "coordinator.toml"
    f.write_text("x")
    assert main(["data", "export", "--num-partitions", "3", "--out", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedshield: error: --out must be a directory. Found a file at {f}."]


class _FakeSuperNode:
    """A finished SuperNode process whose log is ``lines``."""

    def __init__(self, lines):
        self.stdout = iter(lines)
        self.returncode = 0
        self.pid = -1

    def wait(self):
        return 0


_SERVED_THEN_GONE = [
    "INFO :      Receiving: train message (ID: 5de1)\n", "INFO :      Sent successfully\n",
    "INFO :      Receiving: evaluate message (ID: 77aa)\n", "INFO :      Sent successfully\n",
    "WARNING :   Giving up reconnection after 4.42 seconds and 4 tries.\n",
    "ERROR :     [Errno 111] Connection refused\n",
    "Exception ignored in: <module 'threading' from '/usr/lib/python3.11/threading.py'>\n",
    "Traceback (most recent call last):\n", '  File "threading.py", line 1590, in _shutdown\n',
    "SystemExit: 0\n", "INFO:     Finished server process [21880]\n",
]


def test_watch_counts_answered_messages_and_hides_flowers_shutdown_traceback(capsys, monkeypatch):
    from clients import supervisor

    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    seen = supervisor._watch(_FakeSuperNode(_SERVED_THEN_GONE))
    assert (seen.exit_code, seen.refusal, seen.served) == (305, None, 2)
    err = capsys.readouterr().err
    # the run's normal end: the agent's own line says the coordinator went away after N answers
    assert "Giving up reconnection" not in err and "Connection refused" not in err
    assert "Traceback" not in err and "Exception ignored" not in err and "SystemExit" not in err
    assert "Finished server process" not in err  # the node's Runtime API server: plumbing
    lost = [*_SERVED_THEN_GONE[:5], "ERROR :     [Errno -3] Temporary failure in name resolution\n"]
    supervisor._watch(_FakeSuperNode(lost))  # another error after serving: the only clue to a network fault, shown
    err = capsys.readouterr().err
    assert "Giving up reconnection" not in err and "Temporary failure in name resolution" in err
    seen = supervisor._watch(_FakeSuperNode(_SERVED_THEN_GONE[4:]))  # a node that never served: Flower's lines stay
    assert (seen.exit_code, seen.served) == (305, 0)
    err = capsys.readouterr().err
    assert "Giving up reconnection" in err and "Connection refused" in err


@pytest.mark.parametrize("level", ["WARNING", "error"])
def test_a_quieter_flwr_log_level_hides_the_node_s_info_lines_but_not_what_the_agent_reads_in_them(
        capsys, monkeypatch, level):
    """FLWR_LOG_LEVEL=WARNING silenced the node's INFO lines, which this agent counts: a node that had answered its
    run's messages then ended with 'could not connect to the coordinator' and exit 1. The node now logs INFO
    always, and the agent echoes what the user's level asks for."""
    from clients import supervisor

    monkeypatch.setenv("FLWR_LOG_LEVEL", level)
    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    assert supervisor.node_env() == {"FLWR_LOG_LEVEL": "INFO"}
    seen = supervisor._watch(_FakeSuperNode(_SERVED_THEN_GONE))
    assert (seen.exit_code, seen.served) == (305, 2)
    err = capsys.readouterr().err
    assert "Receiving" not in err and "Sent successfully" not in err
    assert "Connection refused" not in err and "Giving up reconnection" not in err  # (the run's end: see above)
    assert supervisor._ended(seen, 1) == 0


@pytest.mark.parametrize("level", ["", "DEBUG", "info", "nonsense"])
def test_the_node_keeps_the_user_s_flwr_log_level_when_it_shows_info(monkeypatch, level):
    from clients import supervisor

    monkeypatch.setenv("FLWR_LOG_LEVEL", level)
    assert supervisor.node_env() == {}


def test_watch_leaves_out_the_nodes_plumbing_and_keeps_flowers_own_lines(capsys, monkeypatch):
    """A failed connection printed ~24 lines before the agent's one diagnosis (a newcomer's walkthrough): the
    Runtime API server's start and stop lines and Flower's SuperExec warning are not the owner's business."""
    from clients import supervisor

    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    plumbing = ["INFO:     Started server process [8043]\n", "INFO:     Waiting for application startup.\n",
                "INFO :      FastAPI lifespan: startup\n", "INFO:     Application startup complete.\n",
                "INFO:     Uvicorn running on http://127.0.0.1:49081 (Press CTRL+C to quit)\n",
                "WARNING :   EXPERIMENTAL: SuperExec authentication is experimental and may change in future releases.\n",
                "INFO:     Shutting down\n", "INFO:     Waiting for application shutdown.\n",
                "INFO :      FastAPI lifespan: shutdown\n", "INFO:     Application shutdown complete.\n",
                "INFO:     Finished server process [8043]\n"]
    kept = ["INFO :      Starting Flower SuperNode\n", "ERROR :     SSL/TLS handshake error detected.\n",
            "ERROR :     Exit Code: 305\n", "Failed to initialize the connection to the SuperLink.\n",
            "INFO:     Shutting down the worker\n"]  # (plumbing only as its whole line)
    seen = supervisor._watch(_FakeSuperNode(plumbing[:6] + kept + plumbing[6:]))
    err = capsys.readouterr().err
    assert seen.exit_code == 305 and err.splitlines() == [k.rstrip("\n") for k in kept], err


def test_watch_sees_a_refusal_before_anything_was_served(monkeypatch):
    from clients import supervisor

    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    seen = supervisor._watch(_FakeSuperNode(["ERROR : Request failed [code: 2004]\n"]))
    assert (seen.refusal, seen.served) == (2004, 0)


def test_a_clientapp_that_failed_on_one_message_does_not_stop_the_agent(monkeypatch):
    """A ClientApp that raised (a malformed message, a bad data file) logs "Exit Code: 800" from its
    own process; the agent took that for the SuperNode's end and stopped the node 5 s later."""
    from clients import supervisor

    started = []
    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: started.append(a) or type("T", (), {"start": lambda self: None})())
    lines = ["INFO :      Receiving: train message (ID: 5de1)\n",
             "clients._errors.ClientError: codec record must describe a known codec\n",
             "ERROR :     Exit Code: 800\n", "INFO :      Sent successfully\n",
             "INFO :      Receiving: train message (ID: 6ab2)\n", "INFO :      Sent successfully\n"]
    seen = supervisor._watch(_FakeSuperNode(lines))
    assert (seen.exit_code, seen.refusal, seen.served) == (None, None, 2) and started == []
    seen = supervisor._watch(_FakeSuperNode(["ERROR :     Exit Code: 305\n"]))  # the SuperNode's own: still the end
    assert seen.exit_code == 305 and len(started) == 1


def test_text_quoting_flowers_exit_words_does_not_stop_the_agent(monkeypatch):
    """A refused message's error quotes the coordinator's value ("Exit Code: 302", "[code: 2004]"); in
    the ClientApp's traceback (and its exception line) that is text, not Flower's exit or refusal:
    the node stays in the run. Flower's own lines (with colours) still end it."""
    from clients import supervisor

    started = []
    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: started.append(a) or type("T", (), {"start": lambda self: None})())
    lines = ["\x1b[91mERROR \x1b[0m:      ClientApp raised an exception\n", "Traceback (most recent call last):\n",
             '  File "client_app.py", line 9, in run_train\n', "    raise ClientError(f'... Found {x!r}')\n",
             "clients._errors.ClientError: codec must be one of ['dense']. Found 'Exit Code: 302'.\n",
             "INFO :      Sent successfully\n", "Traceback (most recent call last):\n", "  File \"x.py\", line 1\n",
             "clients._errors.ClientError: codec must be one of ['dense']. Found 'x [code: 2004] Giving up reconnection'.\n",
             "INFO :      quoted: Exit Code: 302\n", "INFO :      Sent successfully\n",
             # the ClientApp's own line for a refused message (an error reply, no traceback) quotes values too
             "\x1b[93mWARNING \x1b[0m:   [fedshield] node refused a message: codec must be one of ['dense']. Found "
             "'[code: 2004]'.\n",
             "WARNING :   [fedshield] node refused a message: codec must be one of ['dense']. Found 'Exit Code: 302'.\n"]
    seen = supervisor._watch(_FakeSuperNode(lines))
    assert (seen.exit_code, seen.refusal, seen.served) == (None, None, 2) and started == []
    seen = supervisor._watch(_FakeSuperNode(["\x1b[91mERROR \x1b[0m:      Exit Code: 302\n"]))
    assert seen.exit_code == 302 and len(started) == 1


def _agent_error(tmp_path, capsys, *args) -> list[str]:
    assert main(["agent", "start", "--coordinator", "127.0.0.1:1", "--insecure", *args]) == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("x, y, rule", [
    (np.zeros((20, 5)), np.zeros(20, int), "x must have shape (n, 64)"),  # no task takes 5 features
    (np.full((20, 64), 1e39), np.zeros(20, int), "x must be finite as float32"),  # finite in float64, inf in float32
    (np.zeros((20, 64)), np.full(20, 12), "y must hold integer labels in [0, 10)"),
    (np.zeros((20, 64)), np.zeros(20), "y must hold integer labels"),
])
@pytest.mark.filterwarnings("error::RuntimeWarning")  # the refusal says it all: no numpy overflow warning first
def test_agent_refuses_data_that_fits_no_task_before_it_starts(tmp_path, capsys, x, y, rule):
    """Such a file used to pass the agent's checks: it connected, and the ClientApp failed with a
    traceback once training started. Now one line names what each task needs, before anything starts."""
    np.savez(tmp_path / "d.npz", x=x, y=y)
    err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "d.npz"))
    assert len(err) == 2 and err[0].startswith("fedshield agent: WARNING: --insecure")
    assert err[1].startswith("fedshield: error: --data ") and "must fit a fedshield task" in err[1] and rule in err[1]


def test_agent_refuses_data_exported_for_another_task_before_it_starts(tmp_path, capsys):
    """Digits exported for the built-in MLP fit the CNN's shape checks, so an agent with --task CnnDigits started and
    each reply was then refused. Now the file's recorded task is checked against --task before the node starts
    (only the task: the run's data-seed is the coordinator's to say, checked per message)."""
    import argparse
    from pathlib import Path

    from clients.cli import _data_config, export_partitions

    export_partitions("digits", 2, str(tmp_path / "data"))
    cnn = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "cnn_digits.py"
    err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "data" / "client-0.npz"), "--task", f"{cnn}:CnnDigits")
    assert len(err) == 2 and err[1].startswith("fedshield: error: data file ") and (
        "exported from another split of the task (task 'digits' there, " in err[1]) and "in --task)" in err[1], err
    export_partitions(f"{cnn}:CnnDigits", 2, str(tmp_path / "cnn"), seed=1)  # another data-seed: the run's to say
    args = argparse.Namespace(data=str(tmp_path / "cnn" / "client-0.npz"), partition=None, task=f"{cnn}:CnnDigits",
                              eval_data=None)
    assert _data_config(args).startswith("data-path=")


def test_agent_port_out_of_range_or_in_use_is_one_line(tmp_path, capsys):
    import socket

    np.savez(tmp_path / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "d.npz"), "--port", "99999")
    assert err[-1] == "fedshield: error: --port must be in [1, 65535] (0: each node binds a free one). Found 99999."
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "d.npz"), "--port", str(port))
    assert err[-1].startswith(f"fedshield: error: --port {port} must be free on 127.0.0.1")


@pytest.mark.parametrize(("args", "line"), [
    (["--poll-interval", "0"], "--poll-interval must be in [0.01, 60] seconds. Found 0.0."),
    (["--idle-poll-interval", "0.1"], "--idle-poll-interval must be in [--poll-interval, 600] seconds. Found 0.1 "
                                      "(with --poll-interval 0.2)."),
    (["--idle-poll-interval", "nan"], "--idle-poll-interval must be in [--poll-interval, 600] seconds. Found nan "
                                      "(with --poll-interval 0.2)."),
    (["--release-worker-after", "-1"], "--release-worker-after must be a finite number of seconds >= 0 (0: never). "
                                       "Found -1.0."),
    (["--release-worker-after", "inf"], "--release-worker-after must be a finite number of seconds >= 0 (0: never). "
                                        "Found inf."),
])
def test_agent_poll_intervals_out_of_range_are_one_line(tmp_path, capsys, args, line):
    np.savez(tmp_path / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "d.npz"), *args)
    assert err[-1] == f"fedshield: error: {line}"


def test_a_long_poll_interval_alone_is_its_own_idle_interval(tmp_path, capsys):
    """(An aggregator's upward node may poll every 10 s: the idle default, 3 s, must not refuse it.)"""
    np.savez(tmp_path / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "d.npz"), "--poll-interval", "10")
    assert err[-1].startswith("fedshield: error: coordinator must be reachable at 127.0.0.1:1"), err


@pytest.mark.parametrize(("args", "line"), [
    (["--coordinator", "127.0.0.1:\u00b2", "--partition", "0/2"], "--coordinator must be HOST:PORT. Found '127.0.0.1:\u00b2'."),
    (["--coordinator", "127.0.0.1:1", "--partition", "\u00b2/3"], "--partition must be ID/N with 0 <= ID < N <= 1000000"),
    (["--coordinator", "a..b:9092", "--partition", "0/2"], "coordinator must be reachable at a..b:9092. Found: "),
    (["--coordinator", "127.0.0.1:1", "--partition", "0/999999"], "--partition N must be <= 4800, the most partitions"),
])
def test_agent_address_and_partition_typos_are_one_line(capsys, args, line):
    """str.isdigit() took '\u00b2' (int() then raised), a host with an empty label raised UnicodeError,
    and N past every task's training set failed only in each round's ClientApp."""
    assert main(["agent", "start", "--insecure", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # after the --insecure warning where it got that far
    assert len(err) <= 2 and err[-1].startswith("fedshield: error: " + line), err


def test_agent_data_path_reaches_flower_unchanged_or_is_refused(tmp_path, capsys, monkeypatch):
    """The path went into Flower's node config as a TOML basic string: cut at a '"', "\\b" read as a
    backspace; every round then failed with "no such file"."""
    from flwr.common.config import parse_config_args

    from clients import cli

    monkeypatch.setattr(cli, "check_reachable", lambda host, port: None)
    odd = tmp_path / 'q"dir\\bx'
    odd.mkdir()
    np.savez(odd / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    from simulations.cli import build_parser

    args = build_parser().parse_args(["agent", "start", "--coordinator", "127.0.0.1:1", "--insecure",
                                      "--data", str(odd / "d.npz")])
    cmd = cli.supernode_command(args)
    node_config = cmd[cmd.index("--node-config") + 1]
    assert parse_config_args([node_config])["data-path"] == str((odd / "d.npz").resolve())
    quoted = tmp_path / "it's"
    quoted.mkdir()
    np.savez(quoted / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    err = _agent_error(tmp_path, capsys, "--data", str(quoted / "d.npz"))
    assert err[-1].startswith("fedshield: error: --data must be a path without ' or line breaks")


def test_agent_state_dir_that_cannot_be_resolved_is_one_line(tmp_path, capsys):
    np.savez(tmp_path / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    for state, rule in (("~nosuchuser_fs/agent", "must start with an existing user's home directory"),
                        (str(tmp_path / "loop" / "x"), "must be a path that can be resolved")):
        err = _agent_error(tmp_path, capsys, "--data", str(tmp_path / "d.npz"), "--state-dir", state)
        assert err[-1].startswith("fedshield: error: --state-dir ") and rule in err[-1], err


@pytest.mark.parametrize(("env", "line"), [
    ({"FEDSHIELD_DEVICE": "gpu"}, "FEDSHIELD_DEVICE must be 'auto', 'cpu' or 'cuda[:N]'. Found 'gpu'."),
    ({"FEDSHIELD_TORCH_THREADS": "two"}, "FEDSHIELD_TORCH_THREADS must be an integer in [1, 1024]. Found 'two'."),
])
def test_agent_checks_the_environment_its_clientapps_read_before_it_starts(monkeypatch, capsys, env, line):
    """Each failed in every round's ClientApp (the thread count at import), far from the cause."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert main(["agent", "start", "--insecure", "--coordinator", "127.0.0.1:1", "--partition", "0/2"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("fedshield: error: " + line)



def test_agent_passes_its_ledger_dir_and_owner_limits_to_its_clientapps(tmp_path, monkeypatch, capsys):
    from flwr.common.config import parse_config_args

    from clients import cli
    from simulations.cli import build_parser

    monkeypatch.setattr(cli, "check_reachable", lambda host, port: None)
    base = ["agent", "start", "--coordinator", "127.0.0.1:1", "--insecure", "--partition", "0/2"]
    args = build_parser().parse_args([*base, "--state-dir", str(tmp_path / "s"), "--min-local-noise", "1.5",
                                      "--max-local-epsilon", "8"])
    cmd = cli.supernode_command(args)
    node = parse_config_args([cmd[cmd.index("--node-config") + 1]])
    assert node == {"partition-id": 0, "num-partitions": 2, "task": "builtin", "min-local-noise": 1.5, "max-local-epsilon": 8.0,
                    "state-dir": str((tmp_path / "s").resolve())}
    assert (tmp_path / "s").is_dir()
    assert main([*base, "--min-local-noise", "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "fedshield: error: --min-local-noise must be a finite number >= 0 (0: none). Found -1.0.")


def test_a_negative_max_retries_is_refused_not_taken_as_zero(tmp_path, capsys):
    err = _agent_error(tmp_path, capsys, "--partition", "0/2", "--max-retries", "-5")
    assert err[-1] == "fedshield: error: --max-retries must be >= 0. Found -5."


@pytest.mark.parametrize(("args", "message"), [
    (["--alpha", "-1"], "--alpha must be in (0, 1e6]. Found -1.0."),
    (["--seed", "-1"], "--seed must be in [0, 2**32). Found -1."),
    (["--partitioning", "bogus"], "--partitioning must be one of ['iid', 'dirichlet', 'sample']. Found 'bogus'."),
    (["--task", "bogus"], "--task must be one of"),
])
def test_export_names_its_own_flags_in_errors(tmp_path, capsys, args, message):
    """Not the scenario keys the flags fill (``dirichlet-alpha``, ``data-seed``): the user typed --alpha."""
    assert main(["data", "export", "--num-partitions", "3", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedshield: error: {message}"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("given", "superlink"), [("[::1]:9092", "[::1]:9092"), ("127.0.0.1:9092", "127.0.0.1:9092"),
                                                  ("coord.example:443", "coord.example:443")])
def test_the_supernode_gets_the_coordinator_address_flower_can_parse(monkeypatch, given, superlink):
    """An IPv6 coordinator lost its brackets on the way to flower-supernode (``::1:9092``, which is not a URL's
    authority)."""
    from flwr.supercore.address import parse_address

    from clients import cli
    from simulations.cli import build_parser

    monkeypatch.setattr(cli, "check_reachable", lambda host, port: None)
    args = build_parser().parse_args(["agent", "start", "--coordinator", given, "--insecure", "--partition", "0/2"])
    cmd = cli.supernode_command(args)
    assert cmd[cmd.index("--superlink") + 1] == superlink
    assert parse_address(superlink)[0] == given.rpartition(":")[0].strip("[]")


_FAKE_NODE = r"""
import signal, sys, time
def on(signum, frame):  # what a ClientApp killed by SIGINT printed: a traceback
    if signum == signal.SIGINT:
        print("Traceback (most recent call last):\n  File 'x', line 1\nKeyboardInterrupt", flush=True)
    print("INFO:     Finished server process [1]", flush=True)
    sys.exit(0)
signal.signal(signal.SIGINT, on)
signal.signal(signal.SIGTERM, on)
print("INFO :      Sent successfully", flush=True)
open(sys.argv[1], "w").close()
time.sleep(60)
"""


def _fake_plan(tmp_path, node: list[str]):
    """A supervisor plan whose worker only says it is ready and waits, and whose node is ``node``."""
    import sys

    from clients import supervisor

    state = tmp_path / "state"
    state.mkdir()
    worker = [sys.executable, "-c", f"import time; open({str(state / 'ready')!r}, 'w').close(); time.sleep(60)"]
    return supervisor.Plan(supernode=node, worker=worker, state_dir=str(state))


@pytest.mark.parametrize("sig, code, word", [("SIGINT", 130, "interrupted"), ("SIGTERM", 0, "stopped")])
def test_an_interrupted_agent_stops_its_node_with_sigterm_and_says_so_in_one_line(tmp_path, capsys, monkeypatch,
                                                                                    sig, code, word):
    """Ctrl-C was passed on as SIGINT: the ClientApp running then printed a KeyboardInterrupt traceback, and the
    agent exited 0 without a line of its own (a README walk)."""
    import signal
    import sys
    import threading
    import time

    from clients import supervisor

    ready = tmp_path / "ready"
    plan = _fake_plan(tmp_path, [sys.executable, "-c", _FAKE_NODE, str(ready)])

    main_thread = threading.get_ident()

    def interrupt():  # to the main thread, as the kernel delivers a Ctrl-C to the single-threaded agent
        for _ in range(300):
            if ready.exists():
                break
            time.sleep(0.05)
        signal.pthread_kill(main_thread, getattr(signal, sig))

    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        assert supervisor.supervise(plan) == code
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert err.strip().splitlines()[-1] == (f"fedshield agent: {word}; the node left the federation after answering "
                                            "1 message.")


@pytest.mark.timeout(40)  # the node sleeps 60 s: waited out, the test times out
def test_a_second_ctrl_c_kills_a_node_that_hangs_on_its_way_out(tmp_path, capsys, monkeypatch):
    import signal
    import sys
    import threading
    import time

    from clients import supervisor

    ready = tmp_path / "ready"
    stuck = ("import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda s, f: None)\n"
             "print('INFO :      Sent successfully', flush=True)\nopen(sys.argv[1], 'w').close()\ntime.sleep(60)\n")
    plan = _fake_plan(tmp_path, [sys.executable, "-c", stuck, str(ready)])
    main_thread = threading.get_ident()

    def twice():
        for _ in range(300):
            if ready.exists():
                break
            time.sleep(0.05)
        signal.pthread_kill(main_thread, signal.SIGINT)
        time.sleep(0.5)
        signal.pthread_kill(main_thread, signal.SIGINT)

    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    threading.Thread(target=twice, daemon=True).start()
    try:
        assert supervisor.supervise(plan) == 130
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    assert "interrupted" in capsys.readouterr().err


def test_the_wait_for_a_coordinator_is_one_line_and_a_log_file_gets_no_colour_codes(capsys, monkeypatch):
    from clients import supervisor

    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    retry = "\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in {:.2f} seconds\n"
    lines = [retry.format(0.7), retry.format(1.3), "\x1b[92mINFO \x1b[0m:      Connection successful after 2.03 "
             "seconds and 3 tries.\n", retry.format(0.5), "INFO :      Sent successfully\n"]
    seen = supervisor._watch(_FakeSuperNode(lines))
    err = capsys.readouterr().err  # (pytest's capture is no terminal: as a log file)
    assert seen.served == 1 and "\x1b[" not in err
    assert err.count("waiting for the coordinator") == 2 and "retrying in" not in err  # once per wait
    assert "Connection successful after 2.03 seconds" in err


def test_a_port_the_user_gave_that_another_process_took_is_one_line(capsys, monkeypatch):
    """--port N bound by someone else by the time the node starts (it is checked free at start; under --rejoin
    each restart binds it again): Flower's traceback said 'failed to start', the agent 'see the log above'."""
    from clients import supervisor

    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    lines = ["INFO :      Starting Flower SuperNode\n",
             "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 37469): address already "
             "in use\n", "Traceback (most recent call last):\n", "  File \"x.py\", line 1, in <module>\n",
             "RuntimeError: SuperNode Runtime HTTP API failed to start.\n"]
    seen = supervisor._watch(_FakeSuperNode(lines))
    assert seen.taken == "127.0.0.1:37469"
    assert supervisor._ended(seen, 1) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fedshield: error: agent stopped (Flower exit code None): its Runtime API port 127.0.0.1:37469 is taken by "
        "another process (--port 37469: leave it out and each node binds a free one).")


_RELEASING_WORKER = """
import sys, time
from pathlib import Path
state = Path(sys.argv[1])
lives = state / "lives"
life = int(lives.read_text()) + 1 if lives.exists() else 1
lives.write_text(str(life))
(state / "ready").write_text("")
if life == 1:  # idle past its release time: it says when it last asked for a task, and exits
    time.sleep(0.3)
    (state / "released.tmp").write_text(repr(time.monotonic()))
    (state / "released.tmp").replace(state / "released")
    sys.exit(0)
time.sleep(60)
"""

_NODE_WITH_A_LATE_MESSAGE = """
import sys, time
from pathlib import Path
state = Path(sys.argv[1])
def received():
    (state / "received.tmp").write_text(repr(time.monotonic()))
    (state / "received.tmp").replace(state / "received")
received()  # a message before the worker's last request for a task (it took it): no new worker for it
time.sleep(1.5)
print("lives before the late message:", (state / "lives").read_text(), flush=True)
received()  # one after it
deadline = time.monotonic() + 20
while (state / "lives").read_text() != "2" and time.monotonic() < deadline:
    time.sleep(0.05)
print("INFO :      Sent successfully", flush=True)
"""


def test_a_released_worker_is_started_again_by_a_message_stored_after_its_last_request(tmp_path, capsys):
    """--release-worker-after: the worker exits when idle (no death: no backoff, no error reply) and is started
    again, once, when its SuperNode stores a message its last request for a task cannot have seen."""
    import sys

    from clients import supervisor

    state = tmp_path / "state"
    state.mkdir()
    plan = supervisor.Plan(supernode=[sys.executable, "-c", _NODE_WITH_A_LATE_MESSAGE, str(state)],
                           worker=[sys.executable, "-c", _RELEASING_WORKER, str(state)], state_dir=str(state))
    assert supervisor.supervise(plan) == 0
    err = capsys.readouterr().err
    assert "lives before the late message: 1" in err
    assert err.count("a message came: starting the ClientApp worker again.") == 1
    assert "died" not in err and not state.exists()


def test_the_wake_up_goes_only_to_a_ready_worker(tmp_path):
    """SIGUSR1's default action ends a process: a worker still importing (started again for a message, or after a
    crash) has no handler yet. The wake-up waits for READY, which the worker writes once it has one."""
    import signal
    import subprocess
    import sys
    import time

    from clients import supervisor

    state = tmp_path / "state"
    state.mkdir()
    workers = supervisor.Workers(supervisor.Plan(supernode=[], worker=[], state_dir=str(state)))
    workers.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # no handler: like one starting
    try:
        workers.wake()
        time.sleep(0.5)
        assert workers.proc.poll() is None
        (state / supervisor.READY).write_text("")  # (as if it had a handler: here, SIGUSR1 shows it was sent)
        workers.wake()
        assert workers.proc.wait(timeout=10) == -signal.SIGUSR1
    finally:
        workers.proc.kill()
        workers.proc.wait()


_LIVES = """
import sys
from pathlib import Path
count, runtime = Path(sys.argv[1]), Path(sys.argv[2])
life = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(life))
if runtime.exists():  # the last node's Runtime API address: gone before this one starts (the worker must wait)
    print("STALE ADDRESS", flush=True)
runtime.write_text(f"127.0.0.1:{40000 + life}")  # as a node does once it listens
lines = {1: ["INFO :      Sent successfully", "ERROR :     Exit Code: 305"],        # served, then the coordinator left
         2: ["ERROR :     Request failed [code: 2004]", "ERROR :     Exit Code: 305"],  # its restart not yet enrolled
         3: ["ERROR :     Request failed [code: 2004]", "ERROR :     Exit Code: 305"],
         4: ["INFO :      Sent successfully", "INFO :      Sent successfully", "ERROR :     Exit Code: 302"]}[life]
print("\\n".join(lines), flush=True)
sys.exit(1)
"""


def test_a_rejoin_agent_starts_its_node_again_until_a_local_fault_and_says_each_cause_once(tmp_path, capsys,
                                                                                          monkeypatch):
    """--rejoin: a coordinator that went away or refused the node (a restarted one re-enrolls its keys) is tried
    again with the worker kept warm; a fault of the device's own (an unreadable key: exit 302) still ends it."""
    import sys

    from clients import supervisor

    monkeypatch.setattr(supervisor, "REJOIN_FIRST", 0.05)
    monkeypatch.setattr(supervisor.threading, "Timer", lambda *a, **k: type("T", (), {"start": lambda self: None})())
    plan = _fake_plan(tmp_path, [sys.executable, "-c", _LIVES, str(tmp_path / "lives"),
                                 str(tmp_path / "state" / supervisor.RUNTIME)])
    plan.rejoin = True
    assert supervisor.supervise(plan) == 1
    assert (tmp_path / "lives").read_text() == "4"  # one SuperNode a life, the worker the same throughout
    err = capsys.readouterr().err
    assert "STALE ADDRESS" not in err  # each node's Runtime API address was removed before the next one started
    said = [line for line in err.splitlines() if line.startswith("fedshield")]
    assert said == [
        "fedshield agent: the coordinator went away after this node answered 1 message (its run ended, or it was "
        "stopped or restarted); waiting for it to come back; trying again every 60 s at most (--rejoin).",
        "fedshield agent: the coordinator refused this node: this node's key is not enrolled at the coordinator: add "
        "its .pub file to the coordinator's enrolled-keys; trying again every 60 s at most (--rejoin).",
        "fedshield: error: agent stopped (Flower exit code 302): the node key could not be read as an ECDSA OpenSSH "
        "private key."], said


def test_a_rejoin_agent_starts_while_its_coordinator_is_down_and_says_so(tmp_path, capsys):
    """Without --rejoin an unreachable coordinator is the agent's one error line; with it, a warning, and the
    plan starts the node again and again (a fleet that boots before its coordinator)."""
    import shutil

    import numpy as np

    from clients import ClientError, cli
    from simulations.cli import build_parser

    np.savez(tmp_path / "d.npz", x=np.zeros((20, 64)), y=np.zeros(20, int))
    from tests.integration.procs import free_port

    argv = ["agent", "start", "--coordinator", f"127.0.0.1:{free_port()}", "--insecure", "--data",
            str(tmp_path / "d.npz")]
    with pytest.raises(ClientError, match="coordinator must be reachable"):
        cli.agent_plan(build_parser().parse_args(argv))
    plan = cli.agent_plan(build_parser().parse_args([*argv, "--rejoin"]))
    shutil.rmtree(plan.state_dir)
    # each node binds a port the kernel picks as it binds (one picked up front was taken meanwhile, once: a bind
    # error ended the agent) and writes its address where the worker looks
    after = lambda flag: plan.supernode[plan.supernode.index(flag) + 1]  # noqa: E731
    assert after("--port") == "0" and after("--runtime-file") == f"{plan.state_dir}/runtime"
    assert plan.rejoin and "Found: Connection refused. The node joins once it is (--rejoin)." in capsys.readouterr().err
