"""Local DP overhead: one client's DP-SGD step against the non-private step, in the same run.

    python benchmarks/dp_overhead.py [--steps 40] [--warmup 5] [--threads N] [--json FILE]

One step = forward + backward + optimizer step on a fixed batch of 64 (SGD, lr 0.1,
momentum 0.9), for (a) the digits MLP 64-128-10 and (b) a ~0.5M-parameter CNN on
synthetic 1x28x28 images. DP-SGD runs through the client's own code path
(clients.dp_training.make_private_trainer: flat clipping, Gaussian noise) in the
client's default ``fast`` mode (fedshield's one-backward per-example clipping) and,
as a reference line, in Opacus's ghost-clipping mode. The variants are timed
interleaved, step by step, and each figure is the median after warmup. Target from
the issue: the client's DP-SGD step (fast) <= 2x the non-private step.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

# benchmarks/ must not be on the path: benchmarks/aggregation.py would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulations import bench as _report  # noqa: E402
Report = _report.Report

from clients import TaskSpec, TrainSettings  # noqa: E402
from clients.dp_training import LocalDpSettings, make_private_trainer  # noqa: E402
from clients.tasks import get_task  # noqa: E402

BATCH = 64
TARGET = 2.0
MODES = ("fast", "ghost")  # the client's default path (the target), Opacus ghost clipping (reference)
SETTINGS = TrainSettings(local_epochs=1, batch_size=BATCH, lr=0.1, momentum=0.9)


def small_cnn() -> nn.Module:
    """conv(1,32,3)-conv(32,64,3)-maxpool(2)-fc(9216,52)-fc(52,10): 498,630 parameters."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 12 * 12, 52), nn.ReLU(), nn.Linear(52, 10),
    )


def plain_step(model: nn.Module):
    opt = torch.optim.SGD(model.parameters(), lr=SETTINGS.lr, momentum=SETTINGS.momentum)
    loss_fn = nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def dp_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str):
    """A DP-SGD step built exactly as the client builds it; returns (step, mode that ran)."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    dp = LocalDpSettings(noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode)
    trainer = make_private_trainer(model, loader, SETTINGS, dp,
                                   noise_generator=torch.Generator().manual_seed(0))
    return trainer.step, trainer.grad_sample_mode


def time_interleaved(steps: dict, x, y, n: int, warmup: int) -> dict[str, float]:
    """Median seconds per step for each variant, timed round-robin so drift hits all alike."""
    for _ in range(warmup):
        for step in steps.values():
            step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(x, y)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench(rep: Report, label: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, warmup: int) -> None:
    params = sum(p.numel() for p in model.parameters())
    steps = {"non-private": plain_step(copy.deepcopy(model))}
    ran = {}
    for mode in MODES:
        steps[f"DP-SGD {mode}"], ran[mode] = dp_step(copy.deepcopy(model), x, y, mode)
    print(f"# {label}: {params:,} parameters, input {tuple(x.shape)}, modes run: {ran}, "
          f"{n} timed steps each after {warmup} warmup", flush=True)
    med = time_interleaved(steps, x, y, n, warmup)
    base = med["non-private"] * 1e3
    rep.add(f"{label}: non-private step", base, "ms")
    for mode in MODES:
        value = med[f"DP-SGD {mode}"] * 1e3
        ratio = value / base
        target = f"<= {TARGET:g}x" if mode == "fast" else ""
        what = "(ratio = DP / plain)" if mode == "fast" else "(Opacus reference)"
        rep.add(f"{label}: DP-SGD {mode} step {what}", value, "ms", "non-private step ms", base,
                target, (ratio <= TARGET) if mode == "fast" else None, ratio=ratio)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant for the CNN (MLP: 5x)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: all CPUs this process may use)")
    p.add_argument("--json")
    a = p.parse_args()
    for message in ("Secure RNG turned off", "Full backward hook is firing"):
        warnings.filterwarnings("ignore", message=message)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(a.threads or cpus)
    import opacus

    print(f"# torch {torch.__version__}, opacus {opacus.__version__}, CPU, torch threads: "
          f"{torch.get_num_threads()} (of {cpus} CPUs); batch {BATCH}; noise 1.0, clip 1.0", flush=True)
    rep = Report("dp_overhead")
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (BATCH,), generator=g)
    torch.manual_seed(0)
    bench(rep, "digits MLP 64-128-10", get_task(TaskSpec()).build_model(),
          torch.rand(BATCH, 64, generator=g), y, 5 * a.steps, a.warmup)
    bench(rep, "CNN 1x28x28", small_cnn(), torch.randn(BATCH, 1, 28, 28, generator=g), y, a.steps, a.warmup)
    rep.write_json(a.json)


if __name__ == "__main__":
    main()
