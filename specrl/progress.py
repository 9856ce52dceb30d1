"""A transient progress bar of the groups kept so far in the current rollout, on a terminal only
(elsewhere rich would leave an empty line per rollout); it is gone once the rollout ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)


class RolloutProgress:
    def __init__(self) -> None:
        console = Console()
        self._progress = Progress(
            TextColumn("rollout {task.fields[rollout]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("groups"),
            TimeElapsedColumn(),
            transient=True,
            console=console,
            disable=not console.is_interactive,
        )
        self._task: TaskID | None = None

    def update(self, done: int, total: int) -> None:
        """Groups kept so far of those wanted (the RolloutManager's on_group_kept hook)."""
        if self._task is not None:
            self._progress.update(self._task, completed=done, total=total)

    @contextlib.contextmanager
    def rollout(self, rollout_id: int, total: int) -> Iterator[None]:
        """The bar while one rollout is generated; log lines printed outside it stay intact."""
        self._task = self._progress.add_task("", total=total, rollout=rollout_id)
        self._progress.start()
        try:
            yield
        finally:
            self._progress.stop()
            self._progress.remove_task(self._task)
            self._task = None
