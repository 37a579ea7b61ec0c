"""A client's device profile: what hardware it has and how fast it trains.

The profile travels in each train reply's metrics (numbers only) so the
coordinator can prefer fast clients. It is advisory: the coordinator treats it
as untrusted input and validates every value.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from .tasks import Dataset, Task
from .tasks.inputs import forward, repeat, to_tensors
from .tasks.sgd import SGD

PROFILE_CPUS = "profile-cpus"
PROFILE_MEM_GB = "profile-mem-gb"
PROFILE_CUDA = "profile-cuda"
PROFILE_STEP_MS = "profile-step-ms"
PROFILE_LINK_MBPS = "profile-link-mbps"
PROFILE_KEYS = (PROFILE_CPUS, PROFILE_CUDA, PROFILE_LINK_MBPS, PROFILE_MEM_GB, PROFILE_STEP_MS)

_STEPS = 5  # timed steps (after one warm-up); the median is reported
_cache: dict[tuple[str, str, int], dict[str, int | float]] = {}


def _memory_gb() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / 2**30
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return 0.0


def _step_ms(task: Task, device: torch.device, batch_size: int, data: Dataset | None) -> float:
    """Median milliseconds of one forward+backward+SGD step of the task's model and loss on a batch of
    ``data`` (the training set's first examples when None), repeated up to ``batch_size`` rows."""
    sample = task.sample_batch(data if data is not None else task.train_set, batch_size)
    reps = -(-batch_size // max(len(sample), 1))
    with torch.random.fork_rng(devices=[]):  # leave the caller's random state alone
        torch.manual_seed(0)
        model = task.build().to(device)
    x = to_tensors(repeat(sample.x, reps, batch_size), device)
    y = to_tensors(repeat(sample.y, reps, batch_size), device)
    opt = SGD(model.parameters(), lr=0.0)
    loss_fn = task.loss
    model.train()
    times = []
    for i in range(_STEPS + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(forward(model, x), y).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first step warms up allocators and kernels
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def measure_profile(task: Task, device: torch.device, *, batch_size: int = 16,
                    node_config: Mapping[str, Any] | None = None, data: Dataset | None = None) -> dict[str, int | float]:
    """This process's device profile, measured once per (task, device, batch size).

    Returns ``profile-cpus``, ``profile-mem-gb`` (physical memory, GiB),
    ``profile-cuda`` (1 when ``device`` is CUDA), ``profile-step-ms`` (median time
    of one training step of the task's model on a synthetic batch of
    ``batch_size``) and, when the node config declares ``link-mbps``,
    ``profile-link-mbps``.
    """
    device = torch.device(device)
    key = (task.spec, str(device), int(batch_size))  # the spec: hidden-units changes the model, not the name
    if key not in _cache:
        _cache[key] = {
            PROFILE_CPUS: int(os.cpu_count() or 1),
            PROFILE_MEM_GB: round(_memory_gb(), 3),
            PROFILE_CUDA: int(device.type == "cuda"),
            PROFILE_STEP_MS: _step_ms(task, device, max(1, int(batch_size)), data),
        }
    profile = dict(_cache[key])
    link = (node_config or {}).get("link-mbps")
    if isinstance(link, int | float) and not isinstance(link, bool) and math.isfinite(link) and link > 0:
        profile[PROFILE_LINK_MBPS] = float(link)
    return profile
