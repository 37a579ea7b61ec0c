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
"""

from __future__ import annotations

import dataclasses
import math
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.common.logger import log

from aggregation import AggregationError, array_to_tensor
from clients import ClientError
from clients.client_app import encode_with_feedback
from clients.protocol import (
    CLIENT_TIME,
    CODEC,
    WEIGHTS,
    codec_from_record,
    parse_train_message,
    record_of,
    train_reply_content,
)

from .progress import format_row
from .workflow import SyncWorkflow, no_updates_reason

SITE_WEIGHT = "weight_total"  # a row's total weight of its aggregate: what the site reports upward as num-examples


class SiteWorkflow(SyncWorkflow):
    """A :class:`SyncWorkflow` whose rounds the coordinator above drives: :meth:`answer` runs one round on the
    site's clients from the coordinator's weights and returns the reply a client would send.

    The site's own evaluation is skipped (the coordinator evaluates the global model). Its run directory keeps
    its rows (``metrics.csv``), a checkpoint per round (central DP's ledger, its clients' state) and its plots.
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

    def evaluate(self) -> tuple[float, float]:
        return float("nan"), float("nan")

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
        instr, weights = self._instruction(msg)
        codec = codec_from_record(record_of(msg.content, CODEC, ConfigRecord))
        self.weights, self.version = weights.to(self.device), instr.version
        # the clients train as the coordinator says; the seed too, so a client's batches are the flat run's
        self.cfg = dataclasses.replace(self.cfg, train=instr.train,
                                       server=dataclasses.replace(self.cfg.server, seed=instr.seed))
        self._delta = None
        row = self.run_round(instr.round)
        self.rejections.update(row["rejected_by_rule"])
        self.history.append(row)
        self.round = instr.round
        self._checkpoint()
        self.run_dir.write_metrics(self.history)
        log(INFO, "[fedshield] %s: %s", self.name, format_row(row, 0))
        weight = row.get(SITE_WEIGHT, 0)
        if self._delta is None or not weight:
            reason = no_updates_reason(row["rejected_by_rule"]) if row["rejected_by_rule"] else (
                f"{row['accepted']} of {row['selected']} clients' updates aggregated")
            log(WARNING, "[fedshield] %s: round %d aggregated nothing; its clients' work this round is lost (%s)",
                self.name, instr.round, reason)
            raise ClientError(f"{self.name} aggregated no update in round {instr.round}: {reason}")
        gen = torch.Generator().manual_seed(hash((instr.seed, instr.round, self.name)) & 0x7FFFFFFF)
        encoded = encode_with_feedback(codec, self._delta.detach().to("cpu", torch.float32), context, gen)
        loss = row.get("train_loss", float("nan"))
        metrics: dict[str, int | float] = {
            "num-examples": max(1, int(round(weight))), "base-version": instr.version,
            "train-time-s": float(row["round_time_s"]), CLIENT_TIME: float(row["round_time_s"]),
            "site-clients": int(row["accepted"]), "site-rejected": int(row["rejected"])}
        if math.isfinite(loss):
            metrics["train-loss"] = float(loss)
        return Message(train_reply_content(encoded, metrics), reply_to=msg)


__all__ = ["SITE_WEIGHT", "SiteWorkflow"]
