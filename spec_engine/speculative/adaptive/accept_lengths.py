"""AcceptLengths: the tokens a verify at each depth is expected to emit per request.

Accept lengths are a property of the text and the draft more than of the batch, so they are kept
across batch sizes as moving averages of the survival P(a >= k) of the drafts a request accepts
(a), per k. A chain's first d draft tokens do not depend on how deep it drafts
(args.spec_shapes.nested_shapes), so accept(d) = 1 + sum_{k<=d} P(a >= k) with P(a >= k) from
every step run at a depth >= k: running deep measures every shallower depth too. An NGRAM tree
of d + 1 nodes is the first d + 1 nodes of a larger tree's trie walk
(args.spec_shapes.contained_shapes): a step's accepted path (node indices, which grow along it)
says exactly what each smaller tree would have accepted, its leading nodes numbered <= d, so
every step feeds the averages of its own depth and of every shallower one. A draft model's tree
of fewer tokens keeps other branches: its survival is kept from its own steps.

Each request a step verified counts as one sample, up to STEP_SAMPLES per step (its requests sit
at the same point of their generations: 64 requests of one step are not 64 independent samples):
the averages are plain means of the first 1 / ALPHA_PER_REQUEST samples, then move by
ALPHA_PER_REQUEST per sample, so a step of one request (batch 1, where each step either accepts
everything or not) moves them as little as its one sample warrants, and a depth's estimate does
not rest on its first lucky or unlucky step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from spec_engine.speculative.adaptive.costs import PLAIN

STEP_SAMPLES = 8  # the most samples one step's requests count for in the survival averages
ALPHA_PER_REQUEST = 1 / 32  # weight of one request's accepted drafts in the survival averages


def _leading(path: Sequence[int], depth: int) -> int:
    """Drafts of the accepted `path` (node indices, root 0 first) that the tree of its first
    depth + 1 nodes holds: node indices grow along a path, so its leading nodes numbered
    <= depth."""
    return next((i for i, node in enumerate(path[1:]) if node > depth), len(path) - 1)


class AcceptLengths:
    def __init__(self, depths: Sequence[int], nested: bool, contained: bool) -> None:
        """`depths`: the candidate depths (ascending); `nested`: a chain, `contained`: NGRAM's
        trees (see the module docstring)."""
        self.depths = list(depths)
        self.nested = nested
        self.contained = contained
        # (pool, k) -> EMA of the share of requests that accepted >= k drafts; the pool is 0
        # for nested shapes, else the depth whose draft accepted them.
        self.survival: dict[tuple[int, int], float] = {}
        self.samples: dict[tuple[int, int], int] = {}  # samples each survival average has seen
        # length() by depth, read several times a decode step, until the averages move
        self.lengths: dict[int, Optional[float]] = {}

    def observe(
        self, mode: int, tokens: Sequence[Sequence[int]], paths: Optional[Sequence[Sequence[int]]]
    ) -> None:
        """A verify step at depth `mode` emitted `tokens` per request (the accepted drafts and
        the bonus token), along the accepted tree `paths` (root first)."""
        for pool, depth, accepted in self._accepted(mode, tokens, paths):
            self._add(pool, depth, accepted)

    def _accepted(
        self,
        mode: int,
        tokens: Sequence[Sequence[int]],
        paths: Optional[Sequence[Sequence[int]]],
    ) -> list[tuple[int, int, list[int]]]:
        """(pool, depth, drafts each request accepted) for every depth a step of `mode` measures:
        a chain's shared pool up to `mode`; with accepted paths of contained trees, each depth
        up to `mode`, what its smaller tree would have accepted; else `mode` alone."""
        accepted = [len(t) - 1 for t in tokens]
        if self.nested:
            return [(PLAIN, mode, accepted)]
        if not (self.contained and paths):
            return [(mode, mode, accepted)]
        return [(d, d, [_leading(p, d) for p in paths]) for d in self.depths if d <= mode]

    def _add(self, pool: int, depth: int, accepted: Sequence[int]) -> None:
        self.lengths.clear()
        n = min(len(accepted), STEP_SAMPLES)
        for k in range(1, depth + 1):
            share = sum(a >= k for a in accepted) / len(accepted)
            seen = self.samples.get((pool, k), 0)
            mean = n / (seen + n) if seen * ALPHA_PER_REQUEST < 1 else 0.0
            weight = max(1 - (1 - ALPHA_PER_REQUEST) ** n, mean)
            old = self.survival.get((pool, k), share)
            self.survival[(pool, k)] = old + weight * (share - old)
            self.samples[(pool, k)] = seen + n

    def length(self, depth: int) -> Optional[float]:
        """Expected tokens a verify at `depth` emits per request (None until measured)."""
        if depth not in self.lengths:
            pool = PLAIN if self.nested else depth
            survival = [self.survival.get((pool, k)) for k in range(1, depth + 1)]
            self.lengths[depth] = None if None in survival else 1.0 + sum(survival)
        return self.lengths[depth]

    def set(self, survival: Sequence[float]) -> None:
        """P(a >= k) for k = 1, 2, ... (0 past the list) at every depth."""
        if any(not 0.0 <= p <= 1.0 for p in survival):
            raise ValueError(f"survival probabilities must lie in [0, 1], got {list(survival)}")
        if any(b > a for a, b in zip(survival, survival[1:])):
            raise ValueError(f"survival probabilities must not grow with k, got {list(survival)}")
        self.lengths.clear()
        for pool in [PLAIN] if self.nested else self.depths:
            for k in range(1, self.depths[-1] + 1):
                self.survival[(pool, k)] = survival[k - 1] if k <= len(survival) else 0.0
