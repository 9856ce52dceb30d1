"""Draft trees: which draft tokens a verify step checks, and how they hang together.

Node 0 of every tree is the root: the request's last token, whose KV is not computed yet.
Nodes are numbered so that parents precede children; a node at depth d sits at sequence
position kv_len + d and attends to the cached prefix plus its own ancestors (tree mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spec_engine.core.readback import read_back


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

    def mask(self, device: torch.device) -> torch.Tensor:
        """[n, n] bool: node i attends to node j iff j is i or an ancestor of i."""
        n = self.size
        rows = []
        for node in range(n):
            row = [False] * n
            while node >= 0:
                row[node] = True
                node = self.parents[node]
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=device)


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


def select_trees(
    roots: list[int],
    tokens: torch.Tensor,
    scores: torch.Tensor,
    parents: torch.Tensor,
    depths: torch.Tensor,
    num_nodes: int,
) -> list[DraftTree]:
    """Keep each request's best `num_nodes - 1` draft candidates, by cumulative draft probability.

    tokens/scores/parents: [B, C] candidates in generation order (a parent before its children;
    parents hold candidate indices, -1 for the root); depths: [C]. Ties go to the shallower
    candidate, and since a child's score never exceeds its parent's, every kept candidate's
    parent is kept too.
    """
    keep = num_nodes - 1
    # Stable sort on descending score: among equal scores, earlier (shallower) candidates win.
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :keep]
    b, c = tokens.shape
    # The step's draft read: the chosen candidates, their tokens, parents and depths at once.
    chosen_f, tokens_f, parents_f, depths_l = read_back(
        torch.sort(order, dim=1).values, tokens, parents, depths
    )
    trees = []
    for row in range(b):
        cands = chosen_f[row * keep : (row + 1) * keep]
        tokens_l, parents_l = tokens_f[row * c : (row + 1) * c], parents_f[row * c : (row + 1) * c]
        node_of = {cand: i + 1 for i, cand in enumerate(cands)}
        tree_parents = [-1] + [
            node_of.get(parents_l[cand], 0) if parents_l[cand] >= 0 else 0 for cand in cands
        ]
        missing = [
            cand for cand in cands if parents_l[cand] >= 0 and parents_l[cand] not in node_of
        ]
        assert not missing, "draft tree lost a parent; candidate scores must not grow with depth"
        trees.append(
            DraftTree(
                [roots[row]] + [tokens_l[cand] for cand in cands],
                tree_parents,
                [0] + [depths_l[cand] for cand in cands],
            )
        )
    return trees
