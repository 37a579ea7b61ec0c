"""Benchmark reporting: each figure printed beside its baseline and ratio, and written as JSON (--json)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    baseline: str
    baseline_value: float | None
    ratio: float | None
    target: str
    met: bool | None


def medians_interleaved(fns: dict[str, Callable[[], object]], repeat: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median timing (seconds) of each function, timed in turns (a, b, c, a, b, c, ...) so that
    ours and its baselines see the same background load on a shared machine: their ratio is
    steadier than from timings taken one after the other."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def best_of(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median of ``repeat`` timings in seconds after ``warmup`` untimed calls."""
    return medians_interleaved({"fn": fn}, repeat, warmup)["fn"]


class Report:
    def __init__(self, title: str) -> None:
        self.title = title
        self.figures: list[Figure] = []

    def add(self, name: str, value: float, unit: str, baseline: str = "", baseline_value: float | None = None,
            target: str = "", met: bool | None = None, ratio: float | None = None) -> Figure:
        if ratio is None and baseline_value:
            ratio = baseline_value / value if value else None
        fig = Figure(name, value, unit, baseline, baseline_value, ratio, target, met)
        self.figures.append(fig)
        ratio_s = f"{fig.ratio:8.2f}x" if fig.ratio is not None else "        -"
        base_s = f"{baseline_value:10.3f}" if baseline_value is not None else "          "
        mark = {True: "MET", False: "NOT MET", None: ""}[met]
        print(f"{name:<58} {value:10.3f} {unit:<5} | {baseline:<34} {base_s} | {ratio_s} | {target} {mark}", flush=True)
        return fig

    def write_json(self, path: str | None) -> None:
        if path:
            Path(path).write_text(json.dumps({"title": self.title, "figures": [asdict(f) for f in self.figures]}, indent=2))
