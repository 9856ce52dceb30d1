"""Rank targets for tests/engine/test_tensor_parallel.py, in a module of their own so the spawned
ranks import nothing else."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def fail_on_rank_1(payload: Any, group: Any, ready: Callable[[], None]) -> None:
    """Rank 1 fails while building its engine (as a bad shard or a missing device would)."""
    if group.rank == 1:
        raise ValueError(f"rank 1 cannot build its engine from {payload!r}")
    ready()
