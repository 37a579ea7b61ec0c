"""Start real processes for integration tests and always stop them (by process group)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from clients.cli import free_port  # noqa: F401  (the tests' ports, as the benchmarks')


class Procs:
    """Each process runs in its own session; ``stop_all`` kills every group it started."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.env = {**os.environ, "FLWR_DISABLE_UPDATE_CHECK": "1", "FEDSHIELD_DEVICE": "cpu", **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, cmd: list[str], cwd: Path | None = None, env: dict[str, str] | None = None,
              interruptible: bool = False) -> subprocess.Popen:
        """``interruptible``: SIGINT at its default in the child (Python's KeyboardInterrupt), even where
        this test run inherited it ignored (a shell's background job: ``bash .ci/run &``)."""
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed when the test ends
        restore = (lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if interruptible else None
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})},
                                start_new_session=True, preexec_fn=restore)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:  # children left behind in the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=10)

    def stop_together(self, names: list[str] | None = None, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        """Signal every named (default: every) running group at once, then stop each as ``stop`` does.

        Processes that take seconds to shut down (SuperNodes) then do so in parallel.
        """
        names = list(self.procs) if names is None else names
        for name in names:
            proc = self.procs[name]
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    pass
        for name in names:
            self.stop(name, sig, timeout)


def running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def wait_for(predicate, timeout: float, what: str, interval: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (Linux)."""
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def agent_child(pid: int, role: str) -> int | None:
    """A warm agent's SuperNode (``role="supernode"``) or ClientApp worker (``"worker"``), by its command line."""
    mark = {"supernode": "flower_pins.py supernode", "worker": "-m clients.worker"}[role]
    found = [c for c in children(pid) if mark in cmdline(c)]
    return found[0] if found else None

