"""The batched in-process engine with its training sharded over Ray actors (``simulation.batched-shards``).

The round logic, message checks, replies and aggregation stay in this process, on ``BatchedGrid``'s code; only
``train_batched`` runs elsewhere: a round's batchable jobs are split into ``shards`` contiguous pieces, each
trained by one actor (one CPU, one torch thread) on a Ray instance this process starts or a cluster it joins
(``ray-address``). An actor gets the task's spec, the global weights, the nodes' configs and their generators'
seeds, rebuilds the nodes' data itself (``client_data``: the same function and config as here, so the same
examples) and sends back the deltas, the losses and each generator's state after training, which the replies'
stochastic codecs go on drawing from. The result equals the in-process batched engine's (tested on 127.0.0.1).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .batched import DEFAULT_CHUNK
from .batched_grid import BatchedGrid


class _ShardWorker:
    """One actor: trains a piece of a round's batch (its task and data cached between rounds)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def train(self, spec: Any, weights: np.ndarray, node_configs: list[dict[str, Any]], settings: Any,
              seeds: list[int], chunk: int, kept: list[dict[str, torch.Tensor]] | None, run_seed: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict[str, torch.Tensor]] | None]:
        from clients.data import client_data
        from clients.tasks import load_task

        from .batched import train_batched

        task = load_task(spec)
        data = [client_data(task, config) for config in node_configs]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        deltas, losses = train_batched(task, torch.from_numpy(weights), data, settings, gens, chunk=chunk, kept=kept,
                                       seed=run_seed)
        return deltas.numpy(), losses.numpy(), torch.stack([g.get_state() for g in gens]).numpy(), kept


class ShardedBatchedGrid(BatchedGrid):
    """``BatchedGrid`` whose batched training runs on ``shards`` Ray actors (Ray must be initialised). Its
    checkpoints are the in-process engine's: a run may resume with or without shards."""

    def __init__(self, client: Any, num_nodes: int, node_config: Any = None, run_id: int = 1,
                 chunk: int = DEFAULT_CHUNK, shards: int = 2) -> None:
        import ray

        super().__init__(client, num_nodes, node_config, run_id, chunk)
        if shards < 1:
            raise ValueError(f"shards must be >= 1. Found {shards}.")
        worker = ray.remote(num_cpus=1)(_ShardWorker)
        self._workers = [worker.remote() for _ in range(shards)]

    def close(self) -> None:
        """End the actors (their CPUs, for what runs next on the Ray instance); a later round would fail."""
        import ray

        for worker in self._workers:
            ray.kill(worker)
        self._workers = []

    def _compute(self, group: list, kept: list[dict] | None) -> tuple[torch.Tensor, torch.Tensor]:
        import ray

        jobs = [job for *_, job in group]
        node_configs = [self.contexts[msg.metadata.dst_node_id].node_config for _, msg, *_ in group]
        weights = jobs[0].weights.detach().to("cpu", torch.float32).contiguous().numpy()
        spec, settings = jobs[0].task.spec, jobs[0].instr.train
        pieces = [p for p in np.array_split(np.arange(len(jobs)), len(self._workers)) if len(p)]
        refs = [w.train.remote(spec, weights, [dict(node_configs[i]) for i in piece], settings,
                               [jobs[i].generator.initial_seed() for i in piece], self.chunk,
                               None if kept is None else [kept[i] for i in piece], jobs[0].instr.seed)
                for w, piece in zip(self._workers, pieces, strict=False)]
        deltas, losses = [], []
        for piece, (d, loss, states, left) in zip(pieces, ray.get(refs), strict=True):
            deltas.append(torch.from_numpy(d))
            losses.append(torch.from_numpy(loss))
            for j, (i, state) in enumerate(zip(piece, states, strict=True)):  # each node's generator and kept
                jobs[i].generator.set_state(torch.from_numpy(state.copy()))  # entries as its training left them
                if kept is not None:
                    kept[i].clear()
                    kept[i].update(left[j])
        return torch.cat(deltas), torch.cat(losses)


__all__ = ["ShardedBatchedGrid"]
