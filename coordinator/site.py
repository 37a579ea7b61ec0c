"""An edge aggregator's round: a site answers its coordinator's train message with one round over its own clients.

A site (a hospital, a factory, a cell tower) runs fedshield's synchronous round logic on its own clients,
with its own settings (``min-nodes``, ``round-timeout``, validation limits, codec, robust ``aggregator``,
SecAgg+, central DP), and replies upward as one client would: its aggregate update (new - old, encoded
with the codec the coordinator asked for, with error feedback kept at the site) and its weight, the total
weight its aggregate carries (its clients' example counts; under SecAgg+ with uniform weighting the
survivors' count; under central DP the public count its noised sum was divided by). The coordinator
treats a site like a client with that weight, so two-level FedAvg is flat FedAvg on the same updates
(``tests/coordinator/test_site.py``).

The coordinator's message sets the model, its version, the round and the clients' training settings
(``[train]``); everything else is the site's. A round in which the site aggregated nothing is an error
reply with the reasons: a dropped client for the coordinator, and its clients' work that round is lost.

Deployed (``fedshield aggregator start``, coordinator/aggregator.py), the site's ServerApp (``app`` here)
runs on the site's own SuperLink and serves :meth:`SiteWorkflow.serve` on a Unix socket in a 0700
directory; the aggregator's upward agent (a warm worker in forwarding mode, clients/worker.py) hands it
each message from the coordinator above and pushes its reply back up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import struct
import zlib
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.logger import log

from aggregation import AggregationError, array_to_tensor
from clients import ClientError
from clients.client_app import encode_with_feedback
from clients.config import check
from clients.protocol import (
    CLIENT_TIME,
    CODEC,
    MESSAGE_TYPE_TRAIN,
    WEIGHTS,
    codec_from_record,
    parse_train_message,
    record_of,
    train_reply_content,
)

from .workflow import SyncWorkflow, no_updates_reason

SITE_WEIGHT = "weight_total"  # a row's total weight of its aggregate: what the site reports upward as num-examples
SOCKET_KEY = "site-socket"  # the site ServerApp's run config: where it serves its upward agent
MAX_FRAME = 4 << 30  # a framed message on the site socket (a model of up to ~1G float32 parameters)


def from_above() -> tuple[str, ...]:
    """The run keys the coordinator's message sets for a site every round: the clients' training, the seed, the
    round. A site's config cannot set them, nor does its checkpoint's fingerprint hold them."""
    from clients.config import TrainSettings, config_keys

    return (*config_keys(TrainSettings), "seed", "num-rounds")


def check_site_config(cfg: Any, where: str) -> None:
    """A site runs synchronous rounds and evaluates nothing itself: one clear line otherwise."""
    check(cfg.asynchrony.workflow == "sync" and not cfg.server.federated_eval_every, f"{where}.workflow",
          "be 'sync' with federated-eval-every = 0 (a site answers each round from above with one round of its own)",
          cfg.asynchrony.workflow)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    """One length-prefixed frame; ConnectionError if the peer closed or the length is past MAX_FRAME."""
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ConnectionError("the peer closed the site socket mid-frame")
            buf += chunk
        return bytes(buf)

    (size,) = struct.unpack("!Q", exactly(8))
    if size > MAX_FRAME:
        raise ConnectionError(f"a site socket frame must be <= {MAX_FRAME} bytes. Found {size}.")
    return exactly(size)


class SiteWorkflow(SyncWorkflow):
    """A :class:`SyncWorkflow` whose rounds the coordinator above drives: :meth:`answer` runs one round on the
    site's clients from the coordinator's weights and returns the reply a client would send.

    The site's own evaluation is skipped (the coordinator evaluates the global model). Its run directory keeps
    its rows (``metrics.csv``) and a checkpoint per round (central DP's ledger, its clients' state).
    """

    def __init__(self, cfg, grid, run_dir, clock=None, name: str = "site") -> None:
        super().__init__(cfg, grid, run_dir, clock)
        self.name = name
        self._delta: torch.Tensor | None = None

    def _step(self, rnd: int, delta: torch.Tensor, row: dict[str, Any]) -> bool:
        """Keep the round's aggregate for the reply; the coordinator's optimizer, not the site's, applies it."""
        if not bool(torch.isfinite(delta).all()):
            row["non_finite_aggregate"] = True
            return False
        self._delta = delta
        return True

    def evaluate(self) -> dict[str, Any]:
        return {"test_accuracy": float("nan"), "test_loss": float("nan")}

    def _check_evaluate(self) -> None:
        """(Nothing: the coordinator above evaluates.)"""

    def fingerprint(self) -> dict[str, Any]:
        """The site's own settings only: the clients' training, the seed and the rounds come from the coordinator
        each round (a restarted aggregator resumes its site whatever they were)."""
        out = super().fingerprint()
        for key in (*from_above(), "frozen-check"):  # (it follows the seed)
            out.pop(key, None)
        return out

    def _instruction(self, msg: Message):
        """The coordinator's instruction and weights, checked against the site's task and model."""
        instr, arrays = parse_train_message(msg)
        own, asked = self.cfg.task.task.rpartition(":")[2], instr.task.task.rpartition(":")[2]
        if own != asked:
            raise ClientError(f"{self.name} aggregates task {self.cfg.task.task!r}. Found the coordinator's task "
                              f"{instr.task.task[:200]!r}.")
        try:
            weights = array_to_tensor(arrays[WEIGHTS], "float32", self.numel)
        except AggregationError as exc:
            raise ClientError(f"the coordinator's weights must fit {self.name}'s model: {exc}") from None
        if not bool(torch.isfinite(weights).all()):
            raise ClientError("the coordinator's weights must be finite")
        return instr, weights

    def answer(self, msg: Message, context: Context) -> Message:
        """One round on the site's clients for the coordinator's train message ``msg``; the site's reply."""
        if msg.metadata.message_type != MESSAGE_TYPE_TRAIN:
            raise ClientError(f"{self.name} answers train messages only (it holds no data of its own to evaluate "
                              f"on). Found {msg.metadata.message_type[:60]!r}.")
        instr, weights = self._instruction(msg)
        codec = codec_from_record(record_of(msg.content, CODEC, ConfigRecord))
        self.weights, self.version = weights.to(self.device), instr.version
        # the clients train as the coordinator says; the seed too, so a client's batches are the flat run's
        self.cfg = dataclasses.replace(self.cfg, train=instr.train,
                                       server=dataclasses.replace(self.cfg.server, seed=instr.seed))
        self.frozen = instr.frozen  # (its clients check their frozen entries against the coordinator's)
        self._delta = None
        row = self.run_round(instr.round)
        self.record(instr.round, row)
        self.run_dir.write_metrics(self.history)
        log(INFO, "[fedshield] %s: round %d: %d/%d updates aggregated, %d rejected, weight %g up, %.2f MB in, %.2f s",
            self.name, instr.round, row["accepted"], row["selected"], row["rejected"], row.get(SITE_WEIGHT, 0),
            row["bytes_up"] / 2**20, row["round_time_s"])
        weight = row.get(SITE_WEIGHT, 0)
        if self._delta is None or not weight:
            reason = no_updates_reason(row["rejected_by_rule"]) if row["rejected_by_rule"] else (
                f"{row['accepted']} of {row['selected']} clients' updates aggregated")
            log(WARNING, "[fedshield] %s: round %d aggregated nothing; its clients' work this round is lost (%s)",
                self.name, instr.round, reason)
            raise ClientError(f"{self.name} aggregated no update in round {instr.round}: {reason}")
        # keyed by the name's CRC: Python's str hash differs per process, so a rerun's codec draws did too
        gen = torch.Generator().manual_seed(hash((instr.seed, instr.round, zlib.crc32(self.name.encode()))) & 2**31 - 1)
        encoded = encode_with_feedback(codec, self._delta.detach().to("cpu", torch.float32), context, gen)
        loss = row.get("train_loss", float("nan"))
        metrics: dict[str, int | float] = {
            "num-examples": max(1, round(weight)), "base-version": instr.version,
            "train-time-s": float(row["round_time_s"]), CLIENT_TIME: float(row["round_time_s"]),
            "site-clients": int(row["accepted"]), "site-rejected": int(row["rejected"])}
        if math.isfinite(loss):
            metrics["train-loss"] = float(loss)
        return Message(train_reply_content(encoded, metrics), reply_to=msg)

    def serve(self, path: str | os.PathLike, stop: Any = None) -> None:
        """Answer the upward agent's messages on the Unix socket ``path`` (its directory must be the aggregator's,
        0700), one at a time, until ``stop`` (a threading.Event) is set. A request is a train message (Flower's
        protobuf), the answer the site's reply, or an error message naming what went wrong."""
        from flwr.app import Error
        from flwr.common.constant import ErrorCode
        from flwr.common.serde import message_from_proto, message_to_proto
        from flwr.proto.message_pb2 import Message as ProtoMessage

        path = Path(path)
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(path))
        path.chmod(0o600)
        server.listen(1)
        server.settimeout(0.5)
        context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})  # its EF residual
        log(INFO, "[fedshield] %s: serving its coordinator's rounds on %s", self.name, path)
        try:
            while stop is None or not stop.is_set():
                try:
                    conn, _ = server.accept()
                except TimeoutError:
                    continue
                with conn:
                    conn.settimeout(None)
                    try:
                        msg = message_from_proto(ProtoMessage.FromString(recv_frame(conn)))
                    except Exception as exc:  # noqa: BLE001  (a broken frame: the agent is ours, but say why)
                        log(WARNING, "[fedshield] %s: unreadable request on the site socket: %s", self.name, exc)
                        continue
                    try:
                        reply = self.answer(msg, context)
                    except Exception as exc:  # noqa: BLE001  (the round's failure is the coordinator's data)
                        log(WARNING, "[fedshield] %s: no reply for round: %s", self.name, exc)
                        reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=str(exc)[:500]),
                                        reply_to=msg)
                    try:
                        send_frame(conn, message_to_proto(reply).SerializeToString())
                    except OSError as exc:
                        log(WARNING, "[fedshield] %s: the upward agent left before its reply: %s", self.name, exc)
        finally:
            server.close()
            path.unlink(missing_ok=True)


def forward(path: str | os.PathLike, message: Message) -> Message:
    """The upward agent's side: hand ``message`` to the site ServerApp serving ``path``; its reply (content or
    error), rebuilt as a reply to ``message``."""
    from flwr.common.serde import message_from_proto, message_to_proto
    from flwr.proto.message_pb2 import Message as ProtoMessage

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError as exc:
            raise ClientError(f"the site's ServerApp must serve {path} (is the aggregator's site run up?). "
                              f"Found: {exc.strerror or exc}") from None
        send_frame(sock, message_to_proto(message).SerializeToString())
        reply = message_from_proto(ProtoMessage.FromString(recv_frame(sock)))
    if reply.has_error():
        raise ClientError(reply.error.reason)
    return Message(reply.content, reply_to=message)


def make_site_app():
    """The site's ServerApp: its RunConfig from the run config, serving the upward agent on ``site-socket``."""
    from flwr.serverapp import Grid, ServerApp

    from clients.flower_pins import patch_grid

    from .config import RunConfig
    from .rundir import RunDirectory
    from .server_app import default_run_dir

    site_app = ServerApp()

    @site_app.main()
    def main(grid: Grid, context: Context) -> None:
        patch_grid()
        mapping = dict(context.run_config)
        path = str(mapping.pop(SOCKET_KEY, ""))
        if not path:
            raise ClientError(f"the site's run config must name {SOCKET_KEY} (started by `fedshield aggregator start`)")
        cfg = RunConfig.from_mapping(mapping)
        run_dir = RunDirectory(cfg.server.run_dir or default_run_dir(context.run_id))
        SiteWorkflow(cfg, grid, run_dir, name="site").serve(path)

    return site_app


app = make_site_app()

__all__ = ["SITE_WEIGHT", "SOCKET_KEY", "SiteWorkflow", "app", "check_site_config", "forward", "from_above", "recv_frame",
           "send_frame"]
