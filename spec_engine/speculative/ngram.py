"""NGRAM speculation: draft trees from an n-gram cache of prompts and outputs, no draft model.

The cache is a trie of every token run up to `branch_length` long, fed incrementally from all
requests' prompts and generated tokens. To draft for a request, its last w tokens (w from the
max match window down to the min) are looked up; each match anchors a breadth-first walk over
the continuations seen after that context, most recent first, with a breadth that shrinks with
depth and is smaller for longer (more specific) matches — SGLang's NGRAM parameters.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.spec_shapes import SpecShape
from spec_engine.core.request import Req
from spec_engine.core.worker import AllocFn, StepResult
from spec_engine.runner.model_runner import ModelRunner
from spec_engine.speculative.base import SpecWorker
from spec_engine.speculative.tree import DraftTree, tree_tensors

logger = logging.getLogger(__name__)


class _Node:
    __slots__ = ("children", "stamp")

    def __init__(self, stamp: int) -> None:
        self.children: dict[int, _Node] = {}
        self.stamp = stamp


@dataclass
class NgramCursor:
    """A request's insertion point: how much of it is in the cache, and the open runs."""

    generation: int
    inserted: int = 0
    runs: list[tuple[_Node, int]] = field(default_factory=list)  # (trie node, run length)


class NgramCache:
    def __init__(
        self,
        min_window: int,
        max_window: int,
        min_breadth: int,
        max_breadth: int,
        branch_length: int,
        capacity: int,
    ) -> None:
        self.min_window, self.max_window = min_window, max_window
        self.min_breadth, self.max_breadth = min_breadth, max_breadth
        self.branch_length = branch_length
        self.capacity = capacity
        self._clock = itertools.count(1)
        self.generation = 0
        self._reset()

    def _reset(self) -> None:
        self.root = _Node(0)
        self.size = 0
        self.generation += 1

    def insert(self, cursor: Optional[NgramCursor], tokens: Sequence[int]) -> NgramCursor:
        """Add `tokens[cursor.inserted:]` (the whole list for a new cursor) to the cache."""
        if cursor is None or cursor.generation != self.generation:
            cursor = NgramCursor(self.generation)  # a new request, or the cache was cleared
        for token in tokens[cursor.inserted :]:
            stamp = next(self._clock)
            runs = []
            for node, length in cursor.runs + [(self.root, 0)]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node(stamp)
                    self.size += 1
                child.stamp = stamp
                if length + 1 < self.branch_length:
                    runs.append((child, length + 1))
            cursor.runs = runs
        cursor.inserted = len(tokens)
        if self.size > self.capacity:
            logger.info(
                "n-gram cache reached %d nodes (--speculative-ngram-capacity); clearing it",
                self.size,
            )
            self._reset()
        return cursor

    def draft(self, context: Sequence[int], max_nodes: int) -> DraftTree:
        """A tree rooted at context[-1] with at most max_nodes nodes (the root included)."""
        tree = DraftTree([context[-1]], [-1], [0])
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        scale = (self.max_breadth - self.min_breadth) / (self.max_window - self.min_window + 1)
        for window in range(min(len(context), self.max_window), self.min_window - 1, -1):
            anchor = self._match(context[-window:])
            if anchor is None:
                continue
            queue = [(0, anchor, (self.max_window - window) * scale + self.min_breadth)]
            while queue and tree.size < max_nodes:
                parent, trie_node, breadth = queue.pop(0)
                kids = sorted(trie_node.children.items(), key=lambda kv: -kv[1].stamp)
                for token, child in kids[: max(1, int(breadth))]:
                    if tree.size >= max_nodes:
                        break
                    node = index.get((parent, token))
                    if node is None:
                        node = index[(parent, token)] = tree.size
                        tree.tokens.append(token)
                        tree.parents.append(parent)
                        tree.depths.append(tree.depths[parent] + 1)
                    queue.append((node, child, breadth - scale))
            if tree.size >= max_nodes:
                break
        return tree

    def _match(self, tokens: Sequence[int]) -> Optional[_Node]:
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                return None
        return node if node.children else None


class NgramWorker(SpecWorker):
    def __init__(
        self,
        runner: ModelRunner,
        alloc_kv: AllocFn,
        eos_token_ids: frozenset[int],
        args: EngineArgs,
    ) -> None:
        super().__init__(runner, alloc_kv, eos_token_ids, args)
        self.cache = NgramCache(
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
            args.speculative_ngram_min_bfs_breadth,
            args.speculative_ngram_max_bfs_breadth,
            args.speculative_ngram_branch_length,
            args.speculative_ngram_capacity,
        )

    def _speculate_kv_demand(self, reqs: Sequence[Req], shape: SpecShape) -> int:
        return self.verify_kv_demand(reqs, [shape.draft_tokens] * len(reqs))

    def _speculate(self, reqs: Sequence[Req], shape: SpecShape) -> StepResult:
        """Draft trees of at most the shape's tokens (a shallower depth: a smaller tree, as
        deep as it is long at most), verified."""
        nodes = shape.draft_tokens
        start = self.timings.now()
        trees = []
        for r in reqs:
            ids = r.fill_ids
            r.spec_state = self.cache.insert(r.spec_state, ids)
            trees.append(self.cache.draft(ids, nodes))
        self.alloc_verify_slots(reqs, [t.size for t in trees])
        self.timings.add("draft_s", start)
        return self.verify(reqs, tree_tensors(trees, self.device), trees)[0]
