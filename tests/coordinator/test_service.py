"""coordinator.service without starting Flower: the port check and the SuperLink log summary."""

from __future__ import annotations

import logging
import socket
import sys

import pytest

from coordinator import CoordinatorError
from coordinator.service import Coordinator, load_coordinator_config


def _config(tmp_path, port: int):
    path = tmp_path / "coordinator.toml"
    path.write_text(f'[coordinator]\nhost = "127.0.0.1"\nport = {port}\n\n[run]\nnum-rounds = 1\n')
    return load_coordinator_config(path)


def test_a_port_someone_listens_on_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as other:  # another coordinator's SuperLink, say
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        coord = Coordinator(_config(tmp_path, port), insecure=True)
        with pytest.raises(CoordinatorError, match=f"coordinator.port {port} on 127.0.0.1 must be free. Found it in use"):
            coord.start_superlink()
    assert coord.superlink is None, "no SuperLink is started on a port in use"


def test_a_port_in_use_is_the_only_line_not_after_the_starting_banner(tmp_path, capsys):
    from simulations.cli import main

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        _config(tmp_path, port)
        assert main(["coordinator", "start", "--config", str(tmp_path / "coordinator.toml"), "--insecure"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("fedshield coordinator: WARNING")]
    assert len(lines) == 1 and lines[0].startswith(f"fedshield: error: coordinator.port {port} on 127.0.0.1 must be free")


def test_a_free_port_passes_the_check(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    Coordinator(_config(tmp_path, port), insecure=True).check_port_free()


def test_log_tail_names_the_error_line_without_colour_codes_and_points_at_the_log(tmp_path):
    coord = Coordinator(_config(tmp_path, 9), insecure=True)
    coord.log_path.parent.mkdir(parents=True)
    coord.log_path.write_text("\x1b[92mINFO \x1b[0m:      Starting\n"
                              "\x1b[91mERROR \x1b[0m:     [Errno 98] error while attempting to bind: address already in use\n"
                              "\x1b[92mINFO \x1b[0m:      SuperLinkLifespan: stop\n\n")
    tail = coord._log_tail()
    assert "\x1b" not in tail and "[Errno 98]" in tail and "SuperLinkLifespan" not in tail
    assert tail.endswith(f"(full log: {coord.log_path})")


def test_run_dir_flag_is_relative_to_the_working_directory_and_the_file_s_to_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "coordinator.toml").write_text('[run]\nnum-rounds = 1\nrun-dir = "from-file"\n')
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert load_coordinator_config(conf / "coordinator.toml").run.server.run_dir == str(conf / "from-file")
    flag = load_coordinator_config(conf / "coordinator.toml", run_dir="myrun")
    assert flag.run.server.run_dir == str(work / "myrun")
    # an empty flag counts as unset (it was the working directory itself), as simulate's does
    assert load_coordinator_config(conf / "coordinator.toml", run_dir="").run.server.run_dir == str(conf / "from-file")


def _record(exc: Exception) -> logging.LogRecord:
    try:
        raise exc
    except Exception:  # noqa: BLE001 - the record Flower's run_serverapp makes
        return logging.LogRecord("flwr", logging.ERROR, __file__, 1, "%s raised an exception", ("ServerApp",),
                                 sys.exc_info())


def test_serverapp_stopping_with_a_fedshield_error_is_logged_as_one_line():
    from coordinator.server_app import OneLineErrors

    assert any(isinstance(f, OneLineErrors) for f in logging.getLogger("flwr").filters)
    rec = _record(CoordinatorError("min-nodes=3 nodes must be online within wait-nodes-timeout=5.0 s. Found 0."))
    assert OneLineErrors().filter(rec) and rec.exc_info is None
    formatted = logging.Formatter().format(rec)
    assert formatted == "ServerApp stopped: min-nodes=3 nodes must be online within wait-nodes-timeout=5.0 s. Found 0."
    bug = _record(ValueError("a bug"))
    assert OneLineErrors().filter(bug) and bug.exc_info is not None, "anything else keeps its traceback"
    assert "Traceback" in logging.Formatter().format(bug)


@pytest.mark.parametrize("case", ["file", "bad-checkpoint"])
def test_a_run_dir_that_cannot_be_used_is_one_error_before_the_superlink_starts(tmp_path, capsys, case):
    """It used to be found by the ServerApp, after the SuperLink had started, keys were enrolled and
    the run submitted: Flower's exit-code block, then a generic failure, about 17 s later."""
    from simulations.cli import main

    (tmp_path / "c.toml").write_text('[coordinator]\nport = 1\nstate-dir = "st"\n[run]\nrun-dir = "rd"\nmin-nodes = 1\n')
    if case == "file":
        (tmp_path / "rd").write_text("x")
    else:
        (tmp_path / "rd").mkdir()
        (tmp_path / "rd" / "checkpoint.pt").write_bytes(b"junk")
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), "--insecure"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fedshield: error: ") and ("must be a directory" if case == "file" else
                                                       "is not a fedshield checkpoint") in err[-1]
    assert not (tmp_path / "st").exists()  # nothing started, nothing made


def test_state_dir_and_config_encoding_errors_name_what_is_wrong(tmp_path, capsys):
    """A state-dir that is a file used to end with '...: File exists.' after the SuperLink line; a
    config that is not UTF-8 with 'a file must be UTF-8 text' and no file name."""
    from simulations.cli import main

    (tmp_path / "c.toml").write_text(f'[coordinator]\nport = {_free_port()}\nstate-dir = "c.toml"\n[run]\nmin-nodes = 1\n')
    assert main(["coordinator", "start", "--config", str(tmp_path / "c.toml"), "--insecure"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"fedshield: error: coordinator.state-dir must be a directory. Found a file at {tmp_path / 'c.toml'}."
    (tmp_path / "bad.toml").write_bytes(b"\xff\xfe")
    assert main(["coordinator", "start", "--config", str(tmp_path / "bad.toml"), "--insecure"]) == 2
    assert "bad.toml' must be UTF-8 text (TOML). Found byte 0xff at offset 0." in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
