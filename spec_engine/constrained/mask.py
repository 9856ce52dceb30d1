"""Grammar masks on the target's logits: tokens a request's grammar does not allow next get
-inf before anything is drawn or reported (SGLang's vocab mask), so sampling, greedy decoding
and the reported log-probs are those of the constrained distribution.

Plain decoding masks each row with its request's grammar state. Speculative verify masks each
draft-tree node's row with the state after that node's path (SGLang's traverse_tree): walking
the tree depth first, the matcher accepts a node's token, fills the node's row, visits its
children and rolls the token back. A draft token the grammar does not allow gets probability 0
at its parent, so verify rejects it and the emitted tokens follow the constrained target, as
plain decoding would. Rows no walk can reach (under a rejected token, or after the grammar
terminated, where the request finishes) stay unmasked.

The masks are built on the host and copied to the device; with no grammar in the batch nothing
runs at all (no copy, no host read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from spec_engine.constrained.grammar import Grammar


def mask_rows(logits: torch.Tensor, grammars: Sequence[Optional[Grammar]]) -> torch.Tensor:
    """Plain decoding: row r masked by grammars[r]'s current state (None: left as is)."""
    rows = [r for r, g in enumerate(grammars) if g is not None]
    if not rows:
        return logits
    bitmask = _bitmask(len(rows), logits.shape[-1])
    for j, r in enumerate(rows):
        grammars[r].fill(bitmask, j)
    return _apply(logits, rows, bitmask)


def mask_trees(
    logits: torch.Tensor,
    grammars: Sequence[Optional[Grammar]],
    parents: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Speculative verify: the rows of request i are its tree's nodes (parents[i], tokens[i],
    root first, node 0 being its last emitted token); each is masked by the grammar state after
    the node's path."""
    offsets, start = [], 0
    for p in parents:
        offsets.append(start)
        start += len(p)
    asking = [i for i, g in enumerate(grammars) if g is not None]
    if not asking:
        return logits
    rows = [offsets[i] + node for i in asking for node in range(len(parents[i]))]
    bitmask = _bitmask(len(rows), logits.shape[-1])
    base = 0
    for i in asking:
        _walk(grammars[i], parents[i], tokens[i], bitmask, base)
        base += len(parents[i])
    return _apply(logits, rows, bitmask)


def _walk(
    grammar: Grammar,
    parents: Sequence[int],
    tokens: Sequence[int],
    bitmask: torch.Tensor,
    base: int,
) -> None:
    """Fill bitmask[base + node] for every node a walk can reach (depth first from the root)."""
    kids: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(node)
    grammar.fill(bitmask, base)
    # (node, whether its token is to be rolled back when leaving it); -1 marks a rollback.
    stack: list[int] = list(reversed(kids[0]))
    while stack:
        node = stack.pop()
        if node < 0:
            grammar.rollback(1)
            continue
        if not _allowed(bitmask, base + parents[node], tokens[node]):
            continue
        grammar.accept_token(tokens[node])
        stack.append(-1)
        if not grammar.is_terminated():
            grammar.fill(bitmask, base + node)
            stack.extend(reversed(kids[node]))


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token >> 5]) >> (token & 31)) & 1)


def _bitmask(rows: int, vocab: int) -> torch.Tensor:
    """Host int32 words, every token allowed (a row no grammar state fills stays so)."""
    return torch.full((rows, -(-vocab // 32)), -1, dtype=torch.int32, device="cpu")


def _apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` whose `rows` hold -inf where bitmask's bit is clear."""
    device = logits.device
    words = bitmask.to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return out
