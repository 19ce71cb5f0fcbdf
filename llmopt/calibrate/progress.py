"""A rich progress bar over decoder layers (on stderr, so stdout stays clean for --json users)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn


@contextmanager
def layer_progress(console: Console, description: str, total: int) -> Iterator[Callable[..., None]]:
    """Yield `advance(*_)`: one call per finished layer."""
    progress = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=True)
    task = progress.add_task(description, total=total)
    with progress:
        yield lambda *_: progress.advance(task)
