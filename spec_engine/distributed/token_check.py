"""--debug-tp-check-tokens: after every step, the ranks compare the tokens they sampled.

Every rank samples from the same gathered logits with the same per-request seeds, so the
tokens agree as long as the collectives and kernels are deterministic (SGLang relies on the
same; its SYNC_TOKEN_IDS_ACROSS_TP makes them agree by an all-reduce instead, which hides a
divergence rather than reporting it). A rank that disagrees would take its scheduler elsewhere
and the ranks would wait on each other in mismatched collectives; with this check every rank
raises the same error in the same step, and the requests in flight fail with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spec_engine.distributed.parallel_state import TPGroup


class TokenMismatch(RuntimeError):
    pass


class TokenCheck:
    """A worker whose prefill and decode results (overlapped or not) are compared across the
    ranks; everything else is the wrapped worker's."""

    def __init__(self, worker: Any, group: TPGroup) -> None:
        self.worker = worker
        self.group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    def prefill(self, reqs: Sequence[Any]) -> Any:
        return self._checked("prefill", reqs, self.worker.prefill(reqs))

    def decode(self, reqs: Sequence[Any], *depth: Any) -> Any:
        return self._checked("decode", reqs, self.worker.decode(reqs, *depth))

    def launch_decode(self, reqs: Sequence[Any], previous: Any = None) -> Any:
        """An overlapped decode step (core/overlap.py): checked when it is read back."""
        pending = self.worker.launch_decode(reqs, previous)
        finish = pending.finish
        pending.finish = lambda: self._checked("decode", pending.reqs, finish())
        return pending

    def _checked(self, step: str, reqs: Sequence[Any], result: Any) -> Any:
        every = self.group.gather_objects(result.tokens)
        for rank, tokens in enumerate(every[1:], start=1):
            if tokens != every[0]:
                i = next(i for i, (a, b) in enumerate(zip(every[0], tokens)) if a != b)
                raise TokenMismatch(
                    f"--debug-tp-check-tokens: tensor-parallel ranks sampled different tokens in "
                    f"a {step} step: request {reqs[i].input.rid!r} got {every[0][i]} on rank 0 "
                    f"and {tokens[i]} on rank {rank}; the ranks' numerics or seeds diverged"
                )
        return result
