"""Watching an engine's plain decode steps, overlapped or not: the worker runs a step-by-step
decode with `decode` and an overlapped one (core/overlap.py, the default) with `launch_decode`;
a test that watches decode batches must wrap both."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def before_each_decode(engine: Any, watch: Callable[[list], None]) -> None:
    """Call `watch(reqs)` on the scheduler thread right before each decode step of the engine's
    worker is run or launched."""
    worker = engine.scheduler.worker
    decode, launch = worker.decode, worker.launch_decode

    def decoded(reqs: list, *args: Any) -> Any:
        watch(reqs)
        return decode(reqs, *args)

    def launched(reqs: list, *args: Any) -> Any:
        watch(reqs)
        return launch(reqs, *args)

    worker.decode, worker.launch_decode = decoded, launched
