"""The speculative shapes --speculative-adaptive chooses from: the configured one and shallower.

A verify step of depth d checks a draft at most d tokens deep. Deeper drafts accept more tokens
per verify when the draft predicts well, but every drafted token costs a draft step (EAGLE
family) and a verify row per request; which depth emits the most tokens per second depends on
the batch size and on how far drafts are accepted, so the cost model (speculative.adaptive)
measures a few depths per batch-size bucket and picks one per step. The configured flags
(--speculative-num-steps, -eagle-topk, -num-draft-tokens) are the deepest shape.

The candidate depths are the powers of two below the configured depth and that depth itself
(3 steps: 1, 2, 3; 5 steps: 1, 2, 4, 5): each depth is measured on its own in every bucket, so
the set stays small (its warm-up and exploration steps cost most at small step counts), and a
factor of at most two separates neighbouring depths.

Depth d's shape: the EAGLE family drafts d steps with the configured top-k, and verifies
d + 1 tokens for a chain, or for a tree the configured draft tokens scaled by d / steps (at
least a chain of d, at most what d steps of top-k propose); NGRAM verifies trees of d + 1 nodes
(d draft tokens; its trees are as deep as they are long at most).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spec_engine.args.resolve import max_draft_tokens


@dataclass(frozen=True)
class SpecShape:
    """One speculative shape: its depth (the most draft tokens one verify may accept), the draft
    steps it runs (NGRAM: 0, it has no draft model) and the tokens each request verifies (the
    root included)."""

    depth: int
    steps: int
    draft_tokens: int


def candidate_depths(deepest: int) -> list[int]:
    """1, 2, 4, ... below `deepest`, then `deepest` (ascending)."""
    if deepest < 1:
        raise ValueError(f"a speculative depth must be at least 1, got {deepest}")
    depths, d = [], 1
    while d < deepest:
        depths.append(d)
        d *= 2
    return depths + [deepest]


def spec_shapes(args: Any, adaptive: bool) -> list[SpecShape]:
    """The shapes a speculative step may use under resolved `args`, shallowest first: all the
    candidates with `adaptive` (--speculative-adaptive), else the configured shape alone."""
    tokens = args.speculative_num_draft_tokens
    if args.speculative_algorithm == "NGRAM":
        deepest = tokens - 1
        depths = candidate_depths(deepest) if adaptive else [deepest]
        return [SpecShape(d, 0, d + 1) for d in depths]
    steps, topk = args.speculative_num_steps, args.speculative_eagle_topk
    depths = candidate_depths(steps) if adaptive else [steps]
    shapes = []
    for d in depths:
        scaled = 1 + -(-(tokens - 1) * d // steps)  # ceil: the configured tokens at d = steps
        shapes.append(SpecShape(d, d, min(max_draft_tokens(d, topk), max(d + 1, scaled))))
    return shapes


def nested_shapes(args: Any) -> bool:
    """Whether a shallower shape's draft is the first tokens of a deeper one's (a chain: top-k 1
    with a draft model), so the accept length of depth d is 1 + E[min(a, d)] over the drafts
    accepted (a) at any depth >= d. A tree of fewer tokens keeps other branches, so its accept
    length is measured per depth (NGRAM's: from the accepted paths, contained_shapes)."""
    return args.speculative_algorithm != "NGRAM" and args.speculative_eagle_topk == 1


def contained_shapes(args: Any) -> bool:
    """Whether a tree of d + 1 nodes is the first d + 1 nodes of a deeper shape's tree: NGRAM's
    (the same breadth-first trie walk, stopped at its budget: speculative/ngram.py), so a step's
    accepted path tells what every smaller tree would have accepted."""
    return args.speculative_algorithm == "NGRAM"
