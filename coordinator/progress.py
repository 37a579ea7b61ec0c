"""Live progress of a run in the terminal (rich): one bar and one line per round."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def format_row(row: dict[str, Any], total: int) -> str:
    privacy = ""
    if row.get("epsilon") is not None:
        privacy = f"  eps {row['epsilon']:.3g}"
    elif row.get("local_epsilon_max") is not None:
        privacy = f"  client eps <= {row['local_epsilon_max']:.3g}"
    # A FedBuff release takes replies to messages sent in earlier windows: "accepted 2/0" read as more than was asked
    counts = (f"accepted {row['accepted']} of {row['replies']} replies (sent {row['selected']})"
              if row.get("workflow") == "fedbuff" else f"accepted {row['accepted']}/{row['selected']}")
    return (
        f"round {row['round']:>3}/{total}  acc {row['test_accuracy']:.4f}  loss {row['test_loss']:.4f}  "
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
        info = f"acc {row['test_accuracy']:.3f}"
        self._progress.update(self._task, completed=row["round"], info=info)


def accuracy_text(value: object) -> str:
    """A summary's accuracy for a line of output: "n/a" where no round was evaluated (None, nan)."""
    return f"{value:.4f}" if isinstance(value, int | float) and value == value else "n/a"
