"""Draft trees: which draft tokens a verify step checks, and how they hang together.

Node 0 of every tree is the root: the request's last token, whose KV is not computed yet.
Nodes are numbered so that parents precede children; a node at depth d sits at sequence
position kv_len + d and attends to the cached prefix plus its own ancestors (tree mask).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from spec_engine.core.readback import read_back
from spec_engine.mem.upload import upload


@dataclass
class DraftTree:
    tokens: list[int]  # node tokens, root first
    parents: list[int]  # parent node of each node (-1 for the root)
    depths: list[int]

    @property
    def size(self) -> int:
        return len(self.tokens)

    def children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids


@dataclass
class TreeTensors:
    """A verify step's draft trees on the device, padded to the widest tree's N nodes: per
    request [B, N] its node tokens, parents (-1: the root, and padding nodes, which are nobody's
    child, so no walk reaches them), depths and verify rows (the trees' nodes sit in the verify
    batch tree after tree; a padding node names its tree's root row). On the host: the tree
    sizes, the deepest node's depth and a bound of a node's children."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    rows: torch.Tensor
    sizes: list[int]
    depth: int
    fanout: int


def tree_tensors(trees: list[DraftTree], device: torch.device) -> TreeTensors:
    """`trees` as TreeTensors, copied to the device in one transfer."""
    n = max(t.size for t in trees)
    table, offset = [], 0
    for t in trees:
        pad = n - t.size
        rows = list(range(offset, offset + t.size)) + [offset] * pad
        table.append([t.tokens + [0] * pad, t.parents + [-1] * pad, t.depths + [0] * pad, rows])
        offset += t.size
    tokens, parents, depths, rows = torch.tensor(table, dtype=torch.int64, device=device).unbind(1)
    fanout = max(len(kids) for t in trees for kids in t.children())
    return TreeTensors(
        tokens,
        parents,
        depths,
        rows,
        [t.size for t in trees],
        max(max(t.depths) for t in trees),
        fanout,
    )


def chain(root: int) -> DraftTree:
    """A tree of the root alone (a plain decode step)."""
    return DraftTree([root], [-1], [0])


def host_trees(trees: TreeTensors) -> list[DraftTree]:
    """`trees` on the host, in one read (what grammars, penalties and custom logit processors
    walk before the verify)."""
    tokens, parents, depths = read_back(trees.tokens, trees.parents, trees.depths)
    n, out = trees.tokens.shape[1], []
    for i, size in enumerate(trees.sizes):
        cut = slice(i * n, i * n + size)
        out.append(DraftTree(tokens[cut], parents[cut], depths[cut]))
    return out


def tree_masks(trees: TreeTensors, kv_lens: list[int], device: torch.device) -> list[torch.Tensor]:
    """Each tree's [size, kv_len + size] attention mask: the prefix, then node i sees node j iff j
    is i or an ancestor of i. Views of one tensor built on the device by a fixed number of
    kernels (ancestors by following parents a level per iteration, the trees' depth at most)."""
    b, n = trees.parents.shape
    sizes = trees.sizes
    cols = [k + size for k, size in zip(kv_lens, sizes)]
    starts = list(accumulate((size * c for size, c in zip(sizes, cols)), initial=0))
    total = starts[-1]
    nodes = torch.arange(n, device=device)
    up = nodes.expand(b, n)  # each node's ancestor at the current distance (-1: none)
    seen = up[:, :, None] == nodes
    for _ in range(trees.depth):
        up = torch.where(up >= 0, trees.parents.gather(1, up.clamp(min=0)), -1)
        seen |= up[:, :, None] == nodes
    meta = upload(device, ([starts[:-1], cols, list(kv_lens), list(sizes)], torch.int64))[0]
    meta = meta.view(4, b)
    start, col, kv, size = meta[:, :, None, None]
    at = start + nodes[:, None] * col + kv + nodes  # [B, N, N]: where (i, j) of the tree sits
    inside = (nodes[:, None] < size) & (nodes < size)
    flat = torch.ones(total + 1, dtype=torch.bool, device=device)  # the last: padding's scratch
    flat[torch.where(inside, at, total).reshape(-1)] = seen.reshape(-1)
    blocks = flat[:total].split([size * c for size, c in zip(sizes, cols)])
    return [v.view(size, c) for v, size, c in zip(blocks, sizes, cols)]


def select_trees(
    roots: torch.Tensor,
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    num_nodes: int,
    depth: int,
    fanout: int,
) -> TreeTensors:
    """Keep each request's best `num_nodes - 1` draft candidates, by cumulative draft probability,
    as trees on the device (no read).

    roots: [B] the requests' last tokens; tokens/scores/parents: [B, C] candidates in generation
    order (a parent before its children; parents hold candidate indices, -1 for the root);
    depths: [C]; depth: the deepest candidate's; fanout: a bound of a candidate's children.
    Ties go to the shallower candidate, and since a child's score never exceeds its parent's,
    every kept candidate's parent is kept too.
    """
    keep = num_nodes - 1
    b, c = tokens.shape
    device = tokens.device
    # Stable sort on descending score: among equal scores, earlier (shallower) candidates win.
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :keep]
    chosen = torch.sort(order, dim=1).values  # kept candidates in generation order: nodes 1..
    node_of = torch.zeros(b, c, dtype=torch.int64, device=device)
    node_of.scatter_(1, chosen, torch.arange(1, num_nodes, device=device).expand(b, keep))
    parent = parents.gather(1, chosen)
    first = torch.zeros(b, 1, dtype=torch.int64, device=device)
    return TreeTensors(
        tokens=torch.cat((roots[:, None], tokens.gather(1, chosen)), dim=1),
        parents=torch.cat(
            (first - 1, torch.where(parent >= 0, node_of.gather(1, parent.clamp(min=0)), 0)), dim=1
        ),
        depths=torch.cat((first, depths[chosen]), dim=1),
        rows=torch.arange(b * num_nodes, device=device).view(b, num_nodes),
        sizes=[num_nodes] * b,
        depth=depth,
        fanout=fanout,
    )
