"""Draft trees: which draft tokens a verify step checks, and how they hang together.

Node 0 of every tree is the root: the request's last token, whose KV is not computed yet.
Nodes are numbered so that parents precede children; a node at depth d sits at sequence
position kv_len + d and attends to the cached prefix plus its own ancestors (tree mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
    chosen = torch.sort(order, dim=1).values.tolist()
    tokens_l, parents_l, depths_l = tokens.tolist(), parents.tolist(), depths.tolist()
    trees = []
    for b, cands in enumerate(chosen):
        node_of = {c: i + 1 for i, c in enumerate(cands)}
        tree_parents = [-1] + [
            node_of.get(parents_l[b][c], 0) if parents_l[b][c] >= 0 else 0 for c in cands
        ]
        missing = [c for c in cands if parents_l[b][c] >= 0 and parents_l[b][c] not in node_of]
        assert not missing, "draft tree lost a parent; candidate scores must not grow with depth"
        trees.append(
            DraftTree(
                [roots[b]] + [tokens_l[b][c] for c in cands],
                tree_parents,
                [0] + [depths_l[c] for c in cands],
            )
        )
    return trees
