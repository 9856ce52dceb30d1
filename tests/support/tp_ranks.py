"""Rank targets for tests/engine/test_tensor_parallel.py, in a module of their own so the spawned
ranks import nothing else."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from spec_engine.distributed.token_check import TokenCheck, TokenMismatch


def fail_on_rank_1(payload: Any, group: Any, ready: Callable[[], None]) -> None:
    """Rank 1 fails while building its engine (as a bad shard or a missing device would)."""
    if group.rank == 1:
        raise ValueError(f"rank 1 cannot build its engine from {payload!r}")
    ready()


class Sampled:
    """A worker stand-in whose decode step samples `tokens`."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def decode(self, reqs: Any) -> Any:
        return SimpleNamespace(tokens=self.tokens)

    def launch_decode(self, reqs: Any, previous: Any = None) -> Any:
        """An overlapped step: its tokens come with its read (`finish`)."""
        return SimpleNamespace(reqs=reqs, finish=lambda: self.decode(reqs))


def sample_9_for_request_b(reqs: Any, group: Any, ready: Callable[[], None]) -> None:
    """Rank 1 samples [7, 9] under --debug-tp-check-tokens (rank 0: [7, 8]) in a decode step,
    then in an overlapped one; it exits with 0 only if its check raised both times too."""
    ready()
    check = TokenCheck(Sampled([7, 8 + group.rank]), group)
    for step in (lambda: check.decode(reqs), lambda: check.launch_decode(reqs).finish()):
        try:
            step()
        except TokenMismatch:
            continue
        raise AssertionError("rank 1's token check passed")
