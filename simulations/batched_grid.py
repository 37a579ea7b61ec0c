"""The in-process Grid, with the round's plain train messages of one model trained together (``train_batched``).

Each node's message is checked, its data and generator found, and its reply encoded by the ClientApp's own
functions (``start_update``, ``update_metrics``, ``train_reply``): only the training loop differs, and it
gives the one-by-one loop's result within float tolerance. Messages it cannot batch (SecAgg+ stages, local
DP, evaluation, a task ``batched_supported`` refuses) go to the ClientApp one by one, as on ``InProcessGrid``.
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
import warnings
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import torch
from flwr.app import ConfigRecord, Context, Message
from flwr.common.logger import log

from aggregation import get_device
from aggregation._errors import shown
from clients import ClientError
from clients.client_app import app, keep_entries, kept_entries, refusal, start_update, train_reply, update_metrics
from clients.protocol import CODEC, LOCAL_DP, MESSAGE_TYPE_TRAIN, codec_from_record, record_of
from clients.tasks.base import normalises_by_batch

from .batched import DEFAULT_CHUNK, batched_supported, train_batched
from .inprocess import InProcessGrid, call_client


_NO_RULE = re.compile(r"batching rule for (\S+?)\.? ")  # torch's BatchedFallback warnings (the nested one too)


class BatchedGrid(InProcessGrid):
    """``InProcessGrid`` whose fedshield train messages sharing a model and settings are trained as one batch."""

    def __init__(self, client: Any, num_nodes: int, node_config: Any = None, run_id: int = 1,
                 chunk: int = DEFAULT_CHUNK) -> None:
        super().__init__(client, num_nodes, node_config, run_id)
        self._ours = client is app  # another ClientApp (a test's, a user's) is always called as it is
        self.chunk = chunk
        # clients trained and answered per step: at 10,000 clients a round, the deltas of all (~385 MB for the
        # digits MLP) had been held beside their encoded replies
        self.piece = max(chunk, 1024)
        self._support: dict[Any, str | None] = {}
        self._batch_norm: dict[Any, bool] = {}  # per task: whether its model normalises by batch statistics
        self.batched_messages = 0  # how many train messages were trained batched (tests, reports)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        ids, groups, messages = [], {}, list(messages)
        memo: dict = {}  # the messages share their config and weights records: each parsed and checked once
        codecs: dict = {}
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                continue
            msg.metadata.__dict__["_message_id"] = mid = uuid.uuid4().hex
            ids.append(mid)
            job = self._job(msg, self.contexts[node], memo, codecs)
            if job is None:
                self._replies[mid] = call_client(self._client, msg, self.contexts[node])
            elif isinstance(job, Message):  # refused before training, as the ClientApp would
                self._replies[mid] = job
            else:
                groups.setdefault((job[1].task.spec, job[1].instr), []).append((mid, msg, *job))
        for group in groups.values():  # a piece at a time: a round's deltas are never all held at once
            for start in range(0, len(group), self.piece):
                self._train(group[start:start + self.piece])
        self.contexts.release_empty(m.metadata.dst_node_id for m in messages)
        return ids

    def _job(self, msg: Message, ctx: Context, memo: dict, codecs: dict):
        """(codec, UpdateJob) for a batchable message, a refusal Message, or None (not batchable: one by one)."""
        if not self._ours or msg.metadata.message_type != MESSAGE_TYPE_TRAIN or LOCAL_DP in msg.content:
            return None
        try:
            record = record_of(msg.content, CODEC, ConfigRecord)
            if id(record) not in codecs:  # codecs keep no state of their own: one per distinct record
                codecs[id(record)] = codec_from_record(record)
            codec = codecs[id(record)]
            job = start_update(msg, ctx, memo)
        except ClientError as exc:
            return refusal(msg, exc)
        if not self._supported(job):
            return None
        if self._batch_norm[job.task.spec] and min(len(job.data), job.instr.train.batch_size) == 1:
            return None  # a batch of one example (BatchNorm1d refuses it in training; any BatchNorm to be safe): alone,
            # so the rest stay batched. (A last batch of one joins the one before it, batched or not.)
        return codec, job

    def _supported(self, job: Any) -> bool:
        task = job.task
        if task.spec not in self._support:
            model = task.build()
            self._batch_norm[task.spec] = normalises_by_batch(model)
            why = batched_supported(task, model)
            if why is None and get_device().type == "cpu" and any(
                    isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules()):
                # vmap turns per-client convolutions into grouped ones, slower on CPU than one client at a time
                # (a 10k-parameter CNN, 10 clients of 200 images: 1.2-1.5 s a round batched, 0.72-0.75 s one by one)
                why = "convolutions batched over clients are slower on CPU than one client at a time"
            self._support[task.spec] = why or self._probe(job)
            if self._support[task.spec]:
                log(INFO, "[fedshield] in-process engine: clients train one at a time: %s", self._support[task.spec])
        return self._support[task.spec] is None

    def _probe(self, job: Any) -> str | None:
        """One batched step of two clients on two of ``job``'s examples, before the task's first batch: the reason
        to train one at a time when vmap runs one of the model's operators client by client (torch's "no batching
        rule" warning: an LSTM on CPU took 2.1 s a round batched, 0.74 s one by one). A probe that fails says
        nothing: the round's own batch fails the same way and says why."""
        if len(job.data) == 0:
            return None
        pick = [0, min(1, len(job.data) - 1)]  # (a client of one example: it twice)
        tiny = job.data.take(pick)
        settings = dataclasses.replace(job.instr.train, local_epochs=1, batch_size=2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                train_batched(job.task, job.weights.to(get_device()), [tiny, tiny], settings,
                              [torch.Generator(), torch.Generator()], seed=job.instr.seed)
            except Exception:  # noqa: BLE001 - (see above)
                return None
        slow = sorted({m.group(1) for w in caught if (m := _NO_RULE.search(str(w.message)))})
        if slow:
            return (f"torch has no batching rule for {', '.join(slow)}: a step batched over clients runs it one "
                    "client at a time, slower than training them one by one")
        return None

    def _compute(self, group: list, kept: list[dict] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(deltas, losses) of a group's jobs (``(message id, message, codec, job)`` each) trained together from
        their global weights, each job's generator advanced as its training drew and its ``kept`` entries
        replaced by what its training left (None: the task keeps none)."""
        jobs = [job for *_, job in group]
        weights = jobs[0].weights.to(get_device())
        return train_batched(jobs[0].task, weights, [j.data for j in jobs], jobs[0].instr.train,
                             [j.generator for j in jobs], chunk=self.chunk, kept=kept, seed=jobs[0].instr.seed)

    def _train(self, group: list) -> None:
        """Train one group's jobs together and store each node's reply (one by one if the batch fails)."""
        jobs = [job for *_, job in group]
        contexts = [self.contexts[msg.metadata.dst_node_id] for _, msg, *_ in group]
        kept = [kept_entries(ctx) for ctx in contexts] if jobs[0].task.layout().kept else None
        start = time.perf_counter()
        try:
            deltas, losses = self._compute(group, kept)
        except Exception as exc:  # noqa: BLE001 - a loss that vmap cannot run: the ClientApp, one by one
            reason = shown(f"{type(exc).__name__}: {exc}".split("\n", 1)[0], 300)  # (torch's can run to pages)
            log(WARNING, "[fedshield] in-process engine: batched training failed (%s); clients train one at a time",
                reason)
            self._support[jobs[0].task.spec] = reason
            for mid, msg, *_ in group:
                self._replies[mid] = call_client(self._client, msg, self.contexts[msg.metadata.dst_node_id])
            return
        share = (time.perf_counter() - start) / len(jobs)
        deltas = deltas.cpu()
        for k, ((mid, msg, codec, job), ctx) in enumerate(zip(group, contexts, strict=True)):
            if kept is not None:  # as the ClientApp keeps them: before the reply, whatever it says
                keep_entries(ctx, kept[k])
            job.start = time.perf_counter() - share  # a node's own time: its share of the batch
            try:
                metrics = update_metrics(job, deltas[k], {"train-loss": float(losses[k]), "train-time-s": share}, ctx)
                self._replies[mid] = train_reply(msg, ctx, codec, deltas[k].clone(), metrics, job.generator, job.start)
            except ClientError as exc:
                self._replies[mid] = refusal(msg, exc)
            self.batched_messages += 1


__all__ = ["BatchedGrid"]
