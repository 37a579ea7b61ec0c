"""``fedshield aggregator start`` on bad input: one line, before any process starts."""

from __future__ import annotations

import pytest

from tests.integration.procs import free_port
from privacy import init_certificates, new_node_key
from simulations.cli import main


def _config(tmp_path, upstream: str, run: str = "") -> str:
    init_certificates(tmp_path / "site-certs")
    new_node_key(tmp_path / "keys" / "c0")
    (tmp_path / "site.toml").write_text(f"""
[coordinator]
port = {free_port()}
certs-dir = "site-certs"
enrolled-keys = ["keys/c0.pub"]

[run]
min-nodes = 1
{run}

[upstream]
{upstream}
""")
    return str(tmp_path / "site.toml")


@pytest.mark.parametrize(("upstream", "run", "message"), [
    ('coordinator = "127.0.0.1:9092"\nkey = "keys/c0"', "", "upstream.root-cert must be given unless --insecure"),
    ('coordinator = "127.0.0.1:9092"\nroot-cert = "nope.crt"\nkey = "keys/c0"', "", "root certificate"),
    ('coordinator = "127.0.0.1:9092"\nroot-cert = "site-certs/ca.crt"\nkey = "keys/nope"', "", "node key"),
    ('coordinator = "nowhere"', "", "HOST:PORT"),
    ('coordinator = "127.0.0.1:9092"\nbogus = 1', "", "upstream.bogus"),
    ('coordinator = "127.0.0.1:9092"', 'workflow = "fedbuff"\nbuffer-size = 1\nconcurrency = 1',
     "run.workflow must be 'sync'"),
    ('coordinator = "127.0.0.1:9092"\nroot-cert = "site-certs/ca.crt"\nkey = "keys/c0"', 'run-dir = "site.toml/run"',
     "run.run-dir must be a directory"),
])
def test_bad_aggregator_input_is_one_line_before_anything_starts(tmp_path, capsys, monkeypatch, upstream, run, message):
    import coordinator.service as service

    monkeypatch.setattr(service.Coordinator, "start_superlink", lambda self: pytest.fail("a SuperLink was started"))
    assert main(["aggregator", "start", "--config", _config(tmp_path, upstream, run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fedshield: error: ") and message in err[-1] and "Traceback" not in "".join(err), err
