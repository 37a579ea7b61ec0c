"""Live progress of a run in the terminal (rich): one bar and one line per round."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .rundir import finite, shown_metric


def format_row(row: dict[str, Any], total: int) -> str:
    privacy = ""
    if row.get("epsilon") is not None:
        privacy = f"  eps {row['epsilon']:.3g}"
    elif row.get("local_epsilon_max") is not None:
        privacy = f"  client eps <= {row['local_epsilon_max']:.3g}"
    # A FedBuff release takes replies to messages sent in earlier windows: "accepted 2/0" read as more than was asked
    counts = (f"accepted {row['accepted']} of {row['replies']} replies (sent {row['selected']})"
              if row.get("workflow") == "fedbuff" else f"accepted {row['accepted']}/{row['selected']}")
    named = shown_metric(row["test_accuracy"], row.get("test_metrics"), row["test_loss"])
    head = "" if named and named[0] == "loss" else f"{headline(row['test_accuracy'], row.get('test_metrics'))}  "
    return (
        f"round {row['round']:>3}/{total}  {head}loss {row['test_loss']:.4f}  "
        f"{counts}  rejected {row['rejected']}  "
        f"down {row['bytes_down'] / 1e6:.2f} MB  up {row['bytes_up'] / 1e6:.2f} MB  {row['round_time_s']:.2f} s{privacy}"
    )


class RoundProgress:
    """``with RoundProgress(total, start) as p: p.update(row)``."""

    def __init__(self, total: int, title: str, start: int = 0, console: Console | None = None) -> None:
        self.total = total
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=self.console, transient=False,
        )
        self._task = self._progress.add_task(title, total=total, completed=start, info="starting")

    def __enter__(self) -> "RoundProgress":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, row: dict[str, Any]) -> None:
        # In a terminal rich wraps at its width; into a file or pipe each round stays one line (no wrap at 80).
        self._progress.console.print(format_row(row, self.total), markup=False,
                                     soft_wrap=not self.console.is_terminal)
        info = headline(row["test_accuracy"], row.get("test_metrics"), digits=3, loss=row.get("test_loss"))
        self._progress.update(self._task, completed=row["round"], info=info)


def headline(accuracy: object, metrics: object = None, digits: int = 4, loss: object = None) -> str:
    """A round's result in a few characters: ``acc 0.9556``; for a task without accuracy (a regression, a
    language model) its ``first_metric`` (``rmse 0.912``, ``perplexity 12.3``), else its loss."""
    named = shown_metric(accuracy, metrics, loss)
    return f"{named[0]} {named[1]:.{digits}g}" if named else f"acc {accuracy:.{digits}f}"


def result_text(summary: dict[str, Any]) -> str:
    """A run's final result for a line of output: ``test accuracy 0.9556``, else the task's ``first_metric``
    (``test rmse 0.9123``), else its loss, else ``test accuracy n/a`` (no round evaluated)."""
    accuracy = summary.get("final_test_accuracy")
    named = shown_metric(accuracy, summary.get("final_test_metrics"), summary.get("final_test_loss"))
    if named:
        return f"test {named[0]} {named[1]:.4g}"
    return f"test accuracy {accuracy:.4f}" if finite(accuracy) else "test accuracy n/a"
