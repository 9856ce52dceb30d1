"""Today's draft trees and tree walk on the host (the engine's before they moved to the device,
kept verbatim as the oracles the device versions must equal): `select_trees` and `tree_mask`
(speculative/tree.py's), and `verify_trees` (speculative/verify.py's), node for node and token
for token: per request, greedy by the target's argmax, sampled by SGLang's target-only rule
with the running float sum of the children's probabilities accumulated in Python floats."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from spec_engine.core.readback import read_back
from spec_engine.core.request import Req
from spec_engine.layers.sampler import inverse_cdf, request_uniform
from spec_engine.speculative.tree import DraftTree
from spec_engine.speculative.verify import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    Acceptance,
    LogprobAsk,
    LogProbs,
    TopLogProbs,
    Verified,
    target_probs,
)


def verify_trees(
    logits: torch.Tensor,
    trees: Sequence[DraftTree],
    reqs: Sequence[Req],
    banned: Sequence[Sequence[list[int]]],
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    flags: Optional[torch.Tensor] = None,
    asked: Optional[LogprobAsk] = None,
) -> Verified:
    """Walk each request's tree against the target logits ([sum of tree sizes, vocab], float32).

    banned[i][d]: tokens request i may not emit at depth d (EOS/stop ids before min_new_tokens).
    One read brings back the target's argmax, `flags` (a [rows] tensor, the verify's NaN rows),
    every sampled walk's inputs and, where `asked`, the log-probs of every token the step may
    emit (the target's log-softmax at the request's temperature, and its top log-probs).
    """
    offsets, row_req = [], []
    for i, tree in enumerate(trees):
        offsets.append(len(row_req))
        row_req.extend([i] * tree.size)
    masked = logits
    ban_rows, ban_ids = [], []
    for i, tree in enumerate(trees):
        for node, depth in enumerate(tree.depths):
            if depth < len(banned[i]):
                ban_rows.extend([offsets[i] + node] * len(banned[i][depth]))
                ban_ids.extend(banned[i][depth])
    if ban_rows:
        masked = logits.index_put(
            (
                torch.tensor(ban_rows, device=logits.device),
                torch.tensor(ban_ids, device=logits.device),
            ),
            torch.tensor(float("-inf"), device=logits.device),
        )
    greedy = [r.input.sampling_params.is_greedy for r in reqs]
    sampled = [i for i, g in enumerate(greedy) if not g]
    walks = [_SampledWalk(trees[i], offsets[i], reqs[i]) for i in sampled]
    # Sampled walks' inputs are computed for every node up front, so that the step reads the
    # argmax, the flags and the walks' inputs in one copy.
    inputs = _walk_inputs(walks, target_probs(masked, reqs, row_req)) if walks else ()
    argmax_t = masked.argmax(-1)
    scored = asked is not None and asked.anything
    lp_inputs = (
        logprob_inputs(logits, reqs, row_req, argmax_t, walks, inputs, asked) if scored else ()
    )
    argmax, flag_values, *values = read_back(argmax_t, flags, *inputs, *lp_inputs)
    walk_values, lp_values = values[: len(inputs)], values[len(inputs) :]
    out: list[Optional[Acceptance]] = [
        _walk_greedy(tree, argmax, offsets[i]) if greedy[i] else None
        for i, tree in enumerate(trees)
    ]
    if walks:
        _walk_host(walks, *walk_values, threshold_single, threshold_acc)
        for i, walk in zip(sampled, walks):
            out[i] = Acceptance(walk.path, walk.tokens, walk.rows)
    if not scored:
        return Verified(out, flag_values)
    return Verified(
        out, flag_values, *emitted_logprobs(out, asked, argmax, walks, walk_values, lp_values)
    )


def _walk_greedy(tree: DraftTree, argmax: list[int], offset: int) -> Acceptance:
    kids = tree.children()
    node, path, tokens, rows = 0, [0], [], []
    while True:
        best = argmax[offset + node]
        tokens.append(best)
        rows.append(offset + node)
        match = next((k for k in kids[node] if tree.tokens[k] == best), None)
        if match is None:
            return Acceptance(path, tokens, rows)
        path.append(match)
        node = match


class _SampledWalk:
    """One sampled request's walk down its tree: where it stands and what it emitted."""

    def __init__(self, tree: DraftTree, offset: int, req: Req) -> None:
        self.tree, self.offset, self.req = tree, offset, req
        self.kids = tree.children()
        self.node, self.path, self.tokens, self.rows = 0, [0], [], []
        self.level = len(req.output_ids)
        self.child_p: list[float] = []  # target probability of each node's token at its parent

    def pairs(self) -> list[tuple[int, int]]:
        """(verify row of its parent, token) of every node but the root, in node order."""
        tree = self.tree
        return [(self.offset + tree.parents[k], tree.tokens[k]) for k in range(1, tree.size)]

    def accept(self, node: int) -> None:
        self.tokens.append(self.tree.tokens[node])
        self.path.append(node)
        self.node = node
        self.level += 1

    def descend(self, threshold_single: float, threshold_acc: float) -> None:
        """Accept children level by level until none is: the walk then stands at the node whose
        residual distribution draws the emitted token (its row recorded)."""
        while True:
            self.rows.append(self.offset + self.node)
            u = request_uniform(self.req.input.seed, self.level, ACCEPT_STREAM)
            acc = 0.0
            for k in self.kids[self.node]:
                p = self.child_p[k]
                acc += p
                if u <= acc / threshold_acc or p >= threshold_single:
                    self.accept(k)
                    break
            else:
                return


def _walk_inputs(
    walks: list[_SampledWalk], probs: torch.Tensor
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """What the walks read, on the device, for every node at once (a read per request and level
    made a GPU verify step wait on the host as often): each child's target probability at its
    parent (node order, roots left out), and per node (walk after walk) whether its residual
    (the target with its children removed) is empty and the token it draws: a walk stops at a
    node whose children were all tried, and its uniform there is the node's depth's."""
    device = probs.device
    pairs = [pair for w in walks for pair in w.pairs()]
    child_p = None
    if pairs:
        rows, toks = zip(*pairs)
        child_p = probs[torch.tensor(rows, device=device), torch.tensor(toks, device=device)]
    node_rows, uniforms, zero_rows, zero_toks = [], [], [], []
    for w in walks:
        for k, kids in enumerate(w.kids):
            zero_rows.extend([len(node_rows)] * len(kids))
            zero_toks.extend(w.tree.tokens[c] for c in kids)
            node_rows.append(w.offset + k)
            level = w.level + w.tree.depths[k]  # the walk's level once it stands at node k
            uniforms.append(request_uniform(w.req.input.seed, level, RESIDUAL_STREAM))
    residual = probs[torch.tensor(node_rows, device=device)]  # a copy
    if zero_rows:
        rows_t = torch.tensor(zero_rows, device=device)
        residual[rows_t, torch.tensor(zero_toks, device=device)] = 0.0
    empty = residual.sum(-1) <= 0
    drawn = inverse_cdf(residual, torch.tensor(uniforms, dtype=torch.float64, device=device))
    return child_p, empty, drawn


def _walk_host(
    walks: list[_SampledWalk],
    child_p: Optional[list[float]],
    empty: list[int],
    drawn: list[int],
    threshold_single: float,
    threshold_acc: float,
) -> None:
    """The walks on the host from `_walk_inputs`' values: down while a child is accepted; at a
    node with an empty residual (the children hold all the mass and u only passed their float
    sum by rounding) the last child is accepted and the walk goes on; else the node's draw is
    the emitted token."""
    child_start = node_start = 0
    for w in walks:
        n = w.tree.size
        w.child_p = [0.0] + (child_p or [])[child_start : child_start + n - 1]  # the root: none
        child_start += n - 1
        while True:
            w.descend(threshold_single, threshold_acc)
            if not empty[node_start + w.node]:
                w.tokens.append(drawn[node_start + w.node])
                break
            w.accept(w.kids[w.node][-1])
        node_start += n


def logprob_inputs(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    row_req: list[int],
    argmax: torch.Tensor,
    walks: list[_SampledWalk],
    walk_inputs: tuple,
    asked: LogprobAsk,
) -> tuple[
    torch.Tensor,
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
    Optional[torch.Tensor],
]:
    """On the device, the log-probs of every token a step may emit, before the walks pick: each
    row's argmax (greedy walks), each child's token at its parent's row and each node's residual
    draw (sampled walks); with top log-probs asked, every row's (values, ids); with
    token_ids_logprob, every row's log-probs of its request's ids (padded with id 0)."""
    device = logits.device
    temps = torch.tensor(
        [reqs[i].input.sampling_params.logit_scale for i in row_req], device=device
    )
    logp = torch.log_softmax(logits / temps[:, None], -1)
    at_argmax = logp.gather(1, argmax[:, None]).squeeze(1)
    at_children = at_draws = None
    pairs = [pair for w in walks for pair in w.pairs()]
    if pairs:
        rows, toks = zip(*pairs)
        at_children = logp[torch.tensor(rows, device=device), torch.tensor(toks, device=device)]
    if walks:
        nodes = torch.tensor(
            [w.offset + k for w in walks for k in range(w.tree.size)], device=device
        )
        at_draws = logp[nodes].gather(1, walk_inputs[2][:, None]).squeeze(1)
    top = max(asked.top_nums)
    vals, ids = logp.topk(top, dim=-1) if top else (None, None)
    at_chosen = None
    width = asked.chosen_width
    if width:
        padded = [list(asked.chosen[i]) + [0] * (width - len(asked.chosen[i])) for i in row_req]
        at_chosen = logp.gather(1, torch.tensor(padded, dtype=torch.int64, device=device))
    return at_argmax, at_children, at_draws, vals, ids, at_chosen


def emitted_logprobs(
    accepts: Sequence[Acceptance],
    asked: LogprobAsk,
    argmax: list[int],
    walks: list[_SampledWalk],
    walk_values: list,
    lp_values: list,
) -> tuple[LogProbs, TopLogProbs, Optional[list[list[list[float]]]]]:
    """Target log-softmax at the request's temperature of every emitted token (and top-k), from
    `logprob_inputs`' values: an emitted token is a row's argmax, a child's token at its parent's
    row or a node's draw; and per emitted token, its row's log-probs of the asked ids."""
    at_argmax, at_children, at_draws, vals, ids, at_chosen = lp_values
    value = {(row, token): v for row, (token, v) in enumerate(zip(argmax, at_argmax))}
    if walks:
        pairs = [pair for w in walks for pair in w.pairs()]
        value.update(zip(pairs, at_children or []))
        nodes = [w.offset + k for w in walks for k in range(w.tree.size)]
        value.update(((row, token), v) for row, token, v in zip(nodes, walk_values[2], at_draws))
    k = max(asked.top_nums)
    lps, tops = [], []
    for acc, w, n in zip(accepts, asked.want, asked.top_nums):
        lps.append([value[(row, token)] for row, token in zip(acc.rows, acc.tokens)] if w else [])
        tops.append(
            [list(zip(vals[r * k : r * k + n], ids[r * k : r * k + n])) for r in acc.rows]
            if n
            else []
        )
    chosen = None
    width = asked.chosen_width
    if width:
        chosen = [
            [at_chosen[r * width : r * width + len(c)] for r in acc.rows]
            for acc, c in zip(accepts, asked.chosen)
        ]
    return (lps if any(asked.want) else None), (tops if any(asked.top_nums) else None), chosen


def tree_mask(tree: DraftTree) -> list[list[bool]]:
    """[n, n]: node i attends to node j iff j is i or an ancestor of i."""
    n = tree.size
    rows = []
    for node in range(n):
        row = [False] * n
        while node >= 0:
            row[node] = True
            node = tree.parents[node]
        rows.append(row)
    return rows


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
