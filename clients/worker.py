"""The warm agent's ClientApp worker: one long-lived process that serves every message of its SuperNode.

Interpreter, torch, fedshield, the agent's task and its data are loaded once, before the node joins
the federation; then the worker acquires the SuperNode's tasks over its Runtime API (as Flower's
SuperExec does) and runs fedshield's ClientApp on each in this process (as ``flwr-clientapp`` does for
one message and exits). Flower's own process-per-message path spent ~7 s a message importing.

It always runs the installed fedshield ClientApp: a run's FAB is never installed nor its code loaded, so a
coordinator cannot make a device run other code. While a message is being handled its token and
metadata sit in ``inflight``; a worker restarted after a crash or a hang (``clients.supervisor``) answers
that message with an error reply, so the coordinator sees a failed reply at once and the SuperNode,
which serves one message at a time, goes on.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from .flower_pins import AUTH_METHOD, patch_worker, pinned, write_atomically

from .supervisor import INFLIGHT, NODE_FILE, READY, RELEASED, RUNTIME, SECRET

CLIENTAPP = "clients.client_app:app"
IDLE_POLL = 1.0  # seconds between an idle worker's task requests (a message wakes it at once)


def _log(text: str) -> None:
    print(f"fedshield agent: {text}", file=sys.stderr, flush=True)


def warm_up(node_config: dict) -> None:
    """Load what a message needs before the first one: the ClientApp's imports, the agent's task and data."""
    from clients.client_app import NODE_TASK, torch_threads  # noqa: F401  (torch, flwr, fedshield)
    from clients import ClientError
    from clients.config import TaskSpec
    from clients.data import client_data
    from clients.tasks import Task, load_task

    torch_threads()
    own = str(node_config.get(NODE_TASK, "builtin"))
    if own != "builtin":
        task = load_task(TaskSpec(task=own), data="data-path" not in node_config)
        if type(task).train is not Task.train:  # an own loop likely uses torch.optim, whose first step imports
            import torch._dynamo  # noqa: F401   torch._dynamo (~2 s, 71 MB); fedshield's default loop does not
        try:  # the run's spec (data seed, split) comes with the first message: a mismatch is refused then
            client_data(task, node_config)
        except ClientError:
            pass


class Worker:
    def __init__(self, state_dir: Path, poll: float, site_socket: str = "", release_after: float = 0.0) -> None:
        self.dir, self.poll = state_dir, poll
        self.release_after = release_after  # seconds without a message after which it exits (0: never)
        self.site_socket = site_socket  # an edge aggregator's: messages go to its site ServerApp (coordinator.site)
        self.secret = (state_dir / SECRET).read_bytes()
        self.runtime, self.client = "", None  # its SuperNode's Runtime API, once connect() found it

    def _address(self) -> str:
        """The Runtime API address the agent's current SuperNode wrote once it listened ('' while none runs)."""
        try:
            return (self.dir / RUNTIME).read_text().strip()
        except FileNotFoundError:
            return ""

    def connect(self) -> None:
        """Wait, quietly, until the agent's SuperNode listens (the agent starts one once this worker is READY, and
        again under --rejoin, each on a port of its own), then talk to it."""
        while True:
            address = self._address()
            host, _, port = address.rpartition(":")
            if port.isdigit():
                try:
                    socket.create_connection((host, int(port)), timeout=1).close()
                    break
                except OSError:
                    pass
            time.sleep(max(self.poll, 0.05))
        if self.client is not None:
            self.client.close()
        self.runtime = address
        self.client = self._client()  # (bound to self.runtime)

    def moved(self) -> bool:
        """Whether the SuperNode this worker talks to was replaced (or is gone, the next one not up yet)."""
        return self._address() != self.runtime

    def _client(self, token: str | None = None):
        interceptors = [pinned("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor")(
            component_name="flwr-clientapp" if token else "SuperExec")]
        if token:
            interceptors.append(pinned("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor")(token))
        else:
            interceptors.append(pinned("flwr.supercore.interceptors", "SuperExecAuthHttpInterceptor")(
                master_secret=self.secret, protected_methods=[AUTH_METHOD]))
        return pinned("flwr.supercore.runtime", "RuntimeHttpClient").from_server_address(
            server_address=self.runtime, insecure=True, root_certificates=None, interceptors=interceptors,
            retry_invoker=retries(self.moved))

    def acquire(self) -> str | None:
        request = pinned("flwr.proto.runtime_pb2", "AcquireTaskRequest")(
            supported_task_types=[pinned("flwr.supercore.constant", "TaskType").CLIENT_APP])
        res = self.client.AcquireTask(request)
        return res.token if res.HasField("task") and res.token else None

    def answer_lost(self) -> None:
        """The message a dead predecessor held: an error reply and a failed task, so the node goes on."""
        path = self.dir / INFLIGHT
        if not path.exists():
            return
        self.connect()
        try:
            record = json.loads(path.read_text())
            proto = pinned("flwr.proto.message_pb2", "Message").FromString(base64.b64decode(record["message"]))
            message = pinned("flwr.common.serde", "message_from_proto")(proto)
            message.metadata.__dict__["_message_id"] = record["message_id"]
            client = self._client(record["token"])
            try:
                self._finish(client, message, None, record.get("reason", "the ClientApp worker died"))
            finally:
                client.close()
            _log(f"answered the {message.metadata.message_type} message the previous worker held with an "
                 f"error reply ({record.get('reason', 'it died')}).")
        except Exception as exc:  # noqa: BLE001  (its token may have expired: the SuperNode then replies itself)
            _log(f"could not answer the message the previous worker held ({type(exc).__name__}: {exc}); "
                 "Flower's task expiry answers it.")
        path.unlink(missing_ok=True)

    @staticmethod
    def _finish(client, message, context, reason: str | None, reply=None) -> None:
        """Push ``reply`` (an error reply when ``reason``) and the task's final status and context, through
        ``client`` (bound to the task's token)."""
        from flwr.app import Message
        from flwr.app.error import Error

        sub = pinned("flwr.common.constant", "SubStatus")
        if reason is not None:
            code = pinned("flwr.common.constant", "ErrorCode").CLIENT_APP_RAISED_EXCEPTION
            reply = Message(Error(code=code, reason=reason), reply_to=message)
        pinned("flwr.supernode.runtime.run_clientapp", "push_message")(
            client, reply, context if context is not None else _context_of(message))
        pinned("flwr.supernode.runtime.run_clientapp", "push_task_output")(
            client, context, sub.FAILED if reason is not None else sub.COMPLETED, reason or "")

    def serve(self, token: str) -> None:
        """One task: pull its message and context, run the ClientApp here, push the reply and context."""
        from clients.client_app import app

        client = self._client(token)
        heartbeat = pinned("flwr.supercore.heartbeat", "HeartbeatSender")(task_heartbeat(client))
        heartbeat.start()
        message = context = None
        try:
            message, context, run, fab = pinned("flwr.supernode.runtime.run_clientapp", "pull_task_input")(client)
            self._hold(token, message)
            reason = None
            try:
                _check_fab(fab)
                if self.site_socket:  # (the site refuses what it does not answer: anything but train messages)
                    from coordinator.site import forward

                    reply = forward(self.site_socket, message)
                else:
                    reply = app(message=message, context=context)
            except Exception as exc:  # noqa: BLE001  (as flwr-clientapp: an error reply, the node goes on)
                reason = f"{type(exc).__name__}: {exc}"
                _log(f"the ClientApp raised {reason}")
                reply = None
            self._finish(client, message, context, reason, reply)
        finally:
            heartbeat.stop()
            client.close()
            (self.dir / INFLIGHT).unlink(missing_ok=True)

    def _hold(self, token: str, message) -> None:
        """Write the message being handled (token and metadata, no content) where a successor finds it."""
        proto = pinned("flwr.common.serde", "message_to_proto")(
            pinned("flwr.app.message", "remove_content_from_message")(message))
        write_atomically(str(self.dir / INFLIGHT), json.dumps({
            "token": token, "message_id": message.metadata.message_id, "started": time.time(), "pid": os.getpid(),
            "message": base64.b64encode(proto.SerializeToString()).decode()}))

    def run(self) -> None:
        (self.dir / READY).write_text(str(os.getpid()))
        self.connect()  # the supervisor starts the SuperNode now
        # Idle, it asks for a task every IDLE_POLL s at most; the supervisor wakes it (SIGUSR1, set up in main) as
        # soon as its SuperNode has received a message (10 workers asking every 20 ms took a core of two).
        wait, last = self.poll, time.monotonic()
        while True:
            asked = time.monotonic()
            try:
                token = self.acquire()
            except Exception:  # noqa: BLE001  (the SuperNode not up yet, or restarting)
                token = None
                if self.moved():  # a new SuperNode (--rejoin): its address, then its tasks at once
                    self.connect()
                    wait = self.poll
                    continue
            if token:
                try:
                    self.serve(token)
                except Exception as exc:  # noqa: BLE001  (its node went away mid-message: the worker stays warm)
                    _log(f"lost the message it was handling: its SuperNode stopped answering "
                         f"({type(exc).__name__}: {str(exc)[:200]}); waiting for the next.")
                wait, last = self.poll, time.monotonic()
            elif self.release_after and asked - last >= self.release_after:
                self.release(asked)
                return
            else:
                signal.sigtimedwait({signal.SIGUSR1}, wait)
                wait = min(IDLE_POLL, wait * 2)

    def release(self, asked: float) -> None:
        """Exit to free the memory an idle worker holds (torch, the task, its data). ``RELEASED`` gets when it last
        asked for a task: the supervisor starts a new worker for a message stored after that. The supervisor's
        wake-up for that message may come while this process exits (which takes a while with torch loaded), when
        Python has put SIGUSR1's default action (exit) back: ignored from here on."""
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        write_atomically(str(self.dir / RELEASED), repr(asked))
        _log(f"no message for {self.release_after:g} s: the ClientApp worker stopped to free its memory; the next "
             "message starts it again (--release-worker-after).")


def retries(moved=lambda: False):
    """Flower's HTTP retry invoker for the Runtime API, except that a 401 (a task token its node no longer knows:
    the node restarted under --rejoin) fails the call instead of sending this process SIGINT, which in
    ``flwr-clientapp`` ends a one-message process and here killed the warm worker (exit 130); and that a call
    whose SuperNode ``moved()`` (gone, or replaced by one on another port) fails instead of retrying for ever."""
    import httpx

    invoker = pinned("flwr.supercore.retry", "make_simple_http_retry_invoker")()
    flowers = invoker.should_giveup

    def should_giveup(exc: Exception) -> bool:
        if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code == httpx.codes.UNAUTHORIZED:
            return True
        if isinstance(exc, httpx.TransportError) and moved():
            return True
        return flowers(exc)

    invoker.should_giveup = should_giveup
    return invoker


def task_heartbeat(client):
    """Flower's ``make_task_heartbeat_fn_http``, less its ``signal.raise_signal(SIGINT)`` when the node says the task
    is gone (a node restarted under --rejoin): in ``flwr-clientapp``, which serves one message, that ends the
    process; here it killed the warm worker (exit 130, a torch import to replace it). The lost task's reply then
    fails to push, which ``Worker.run`` logs and goes on from."""
    import httpx

    request = pinned("flwr.proto.runtime_pb2", "SendTaskHeartbeatRequest")()

    def beat() -> bool:
        try:
            client.SendTaskHeartbeat(request)
        except httpx.TransportError:
            return False  # (retried by HeartbeatSender)
        except httpx.HTTPStatusError as err:
            return err.response.status_code not in (httpx.codes.SERVICE_UNAVAILABLE, httpx.codes.GATEWAY_TIMEOUT)
            # (those two retried, as Flower's; any other: the task is gone)
        return True

    return beat


def _context_of(message):
    from flwr.app import Context, RecordDict

    return Context(run_id=message.metadata.run_id, node_id=message.metadata.dst_node_id, node_config={},
                   state=RecordDict(), run_config={})


_FAB_APPS: dict[str, object] = {}  # FAB hash -> the ClientApp it names (unzipped once per run, not per message)


def _check_fab(fab) -> None:
    """The run's FAB must name fedshield's ClientApp: this worker runs only that, whatever the FAB holds."""
    if fab.hash_str not in _FAB_APPS:
        config = pinned("flwr.common.config", "get_fab_config")(fab.content)
        _FAB_APPS[fab.hash_str] = config.get("tool", {}).get("flwr", {}).get("app", {}).get(
            "components", {}).get("clientapp")
    named = _FAB_APPS[fab.hash_str]
    if named != CLIENTAPP:
        raise RuntimeError(f"this agent runs fedshield's ClientApp ({CLIENTAPP}) only. Found a run whose app names "
                           f"{str(named)[:200]!r}.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.worker")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--task", default="", help="the agent's task class, imported while the agent checks inputs")
    parser.add_argument("--poll", type=float, default=0.02)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGUSR1, lambda *_: None)  # the supervisor's wake-up: never the default action (exit)
    # Its only connection is to its own SuperNode on 127.0.0.1: a retry there is that node starting or stopping,
    # which the supervisor reports in words; Flower's retry warnings, one per attempt, are left out.
    logging.getLogger("flwr").addFilter(lambda record: not str(record.msg).startswith(
        ("Connection attempt failed", "Giving up reconnection")))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # taken by sigtimedwait in Worker.run
    import clients.client_app  # noqa: F401  (torch, flwr, fedshield: the slow part, overlapping the agent's checks)

    if args.task:
        from clients.tasks import task_class

        try:
            task_class(args.task)  # its module's import (a slow device's may take minutes)
        except Exception:  # noqa: BLE001  (the agent's checks say what is wrong, in one line)
            pass
    node = args.state_dir / NODE_FILE
    while not node.exists():  # written once the agent's checks passed (else the agent stops this process)
        time.sleep(args.poll)
    plan = json.loads(node.read_text())
    from flwr.common.config import parse_config_args

    node_config = parse_config_args([plan["node-config"]]) if plan["node-config"] else {}
    patch_worker()
    worker = Worker(args.state_dir, args.poll, plan.get("site-socket", ""), float(plan.get("release-after", 0.0)))
    worker.answer_lost()  # a predecessor's message first: it needs flwr only, not the task
    if not worker.site_socket:  # (an aggregator's worker trains nothing: its site's clients do)
        warm_up(node_config)
    worker.run()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
