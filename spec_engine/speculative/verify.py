"""Verification: which draft tokens the target accepts, and the bonus token after them.

Greedy requests accept the longest root-to-node path whose tokens equal the target's argmax at
each parent, then emit the argmax at the last accepted node.

Sampled requests use exact tree rejection sampling with drafts treated as deterministic
proposals (SGLang's target-only rule): at each level one uniform u is compared with the running
sum of the target probabilities of the children tried so far, in order; the first child with
u <= sum / threshold_acc (or with probability >= threshold_single) is accepted and the walk goes
down to it. If none is, the emitted token is drawn from the target distribution with the tried
children removed. With both thresholds at 1.0 this is an inverse-CDF draw from the target at
every level, so every emitted token follows the target distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from spec_engine.core.readback import read_back
from spec_engine.core.request import Req
from spec_engine.layers.sampler import filtered_probs, inverse_cdf, request_uniform
from spec_engine.mem.upload import upload
from spec_engine.speculative.tree import TreeTensors

# Uniform streams of a request (stream 0 is plain sampling).
ACCEPT_STREAM = 1
RESIDUAL_STREAM = 2


@dataclass
class Acceptance:
    path: list[int]  # accepted nodes, root first
    tokens: list[int]  # emitted tokens: the accepted drafts, then the bonus token
    rows: list[int]  # verify row whose distribution produced each emitted token


LogProbs = Optional[list[list[float]]]
TopLogProbs = Optional[list[list[list[tuple[float, int]]]]]


class Verified(NamedTuple):
    """A verify step's results on the host: each request's acceptance, the step's flags' values
    (None without flags) and the asked log-probs of the emitted tokens (None: none asked)."""

    accepts: list[Acceptance]
    flags: Optional[list[int]]
    logprobs: LogProbs = None
    top_logprobs: TopLogProbs = None
    token_ids_logprobs: Optional[list[list[list[float]]]] = None


@dataclass
class LogprobAsk:
    """Per request: whether it returns its tokens' log-probs, how many top log-probs, and the
    ids whose log-probs it reports (token_ids_logprob)."""

    want: Sequence[bool]
    top_nums: Sequence[int]
    chosen: Sequence[tuple[int, ...]] = ()

    @property
    def anything(self) -> bool:
        return any(self.want) or any(self.top_nums) or any(self.chosen)

    @property
    def chosen_width(self) -> int:
        return max((len(c) for c in self.chosen), default=0)


def target_probs(logits: torch.Tensor, reqs: Sequence[Req], row_req: list[int]) -> torch.Tensor:
    """Dense target distributions per row (temperature, top-k, top-p, min-p applied,
    renormalised)."""
    vocab = logits.shape[-1]
    temps, ks, ps, mins, filtered = [], [], [], [], []
    for row, i in enumerate(row_req):
        sp = reqs[i].input.sampling_params
        temps.append(sp.logit_scale)
        k = vocab if sp.top_k < 0 else min(sp.top_k, vocab)
        ks.append(k)
        ps.append(sp.top_p)
        mins.append(sp.min_p)
        if k < vocab or sp.top_p < 1.0 or sp.min_p > 0.0:
            filtered.append(row)
    f32, int64 = torch.float32, torch.int64
    temps_t, rows, ks_t, ps_t, mins_t = upload(
        logits.device, (temps, f32), (filtered, int64), (ks, int64), (ps, f32), (mins, f32)
    )
    probs = torch.softmax(logits / temps_t[:, None], -1)
    if filtered:
        kept, ids = filtered_probs(
            probs[rows], ks_t[rows], ps_t[rows], mins_t[rows], max(ks[row] for row in filtered)
        )
        dense = torch.zeros_like(probs[rows]).scatter_(1, ids, kept)
        probs[rows] = dense / dense.sum(-1, keepdim=True)
    return probs


class WalkTensors(NamedTuple):
    """Every request's walk on the device, fixed width (W = the deepest depth + 1): the accepted
    path's nodes, root first [B, W]; the emitted tokens (the accepted drafts, then the bonus
    token) [B, W]; the verify row whose distribution produced each [B, W]; the accepted drafts
    [B]. Entries past a request's walk are padding (path: node 0)."""

    path: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    accepted: torch.Tensor


def verify_trees(
    logits: torch.Tensor,
    trees: TreeTensors,
    reqs: Sequence[Req],
    banned: Sequence[Sequence[list[int]]],
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    flags: Optional[torch.Tensor] = None,
    asked: Optional[LogprobAsk] = None,
) -> tuple[Verified, WalkTensors]:
    """Walk each request's tree against the target logits ([sum of tree sizes, vocab], float32),
    every request at once on the device (`walk_trees`), and read the walks back.

    banned[i][d]: tokens request i may not emit at depth d (EOS/stop ids before min_new_tokens).
    One read brings back the walks, `flags` (a [rows] tensor, the verify's NaN rows) and, where
    `asked`, the emitted tokens' log-probs (the target's log-softmax at the request's
    temperature, and its top log-probs).
    """
    row_req = [i for i, n in enumerate(trees.sizes) for _ in range(n)]
    masked = _ban(logits, trees, banned)
    sampled = [i for i, r in enumerate(reqs) if not r.input.sampling_params.is_greedy]
    probs = target_probs(masked, reqs, row_req) if sampled else None
    walk = walk_trees(
        trees, masked.argmax(-1), probs, reqs, sampled, threshold_single, threshold_acc
    )
    scored = asked is not None and asked.anything
    lp_inputs = (
        path_logprobs(logits, reqs, row_req, walk.rows, walk.tokens, asked) if scored else ()
    )
    path, tokens, accepted, flag_values, *lp_values = read_back(
        walk.path, walk.tokens, walk.accepted, flags, *lp_inputs
    )
    width, offset, accepts = trees.depth + 1, 0, []
    for i, (a, size) in enumerate(zip(accepted, trees.sizes)):
        nodes = path[i * width : i * width + a + 1]
        accepts.append(
            Acceptance(nodes, tokens[i * width : i * width + a + 1], [offset + n for n in nodes])
        )
        offset += size
    if not scored:
        return Verified(accepts, flag_values), walk
    return Verified(accepts, flag_values, *host_logprobs(accepts, asked, width, lp_values)), walk


def _ban(
    logits: torch.Tensor, trees: TreeTensors, banned: Sequence[Sequence[list[int]]]
) -> torch.Tensor:
    """`logits` with -inf at each node's banned tokens (its request's at the node's depth)."""
    most = max((len(ids) for per_depth in banned for ids in per_depth), default=0)
    if not most:
        return logits
    b, width = len(banned), trees.depth + 1
    vocab = logits.shape[-1]
    table = [[vocab] * (width * most) for _ in range(b)]  # id `vocab`: nothing banned
    for i, per_depth in enumerate(banned):
        for d, ids in enumerate(per_depth[:width]):
            table[i][d * most : d * most + len(ids)] = ids
    device = logits.device
    ids = torch.tensor(table, dtype=torch.int64, device=device).view(b, width, most)
    at_nodes = ids.gather(1, trees.depths[:, :, None].expand(-1, -1, most))  # [B, N, most]
    # Padding nodes name their root's row at depth 0: they ban what the root bans.
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=device)
    rows = trees.rows[:, :, None].expand_as(at_nodes)
    mask[rows.reshape(-1), at_nodes.reshape(-1)] = True
    return logits.masked_fill(mask[:, :vocab], float("-inf"))


def walk_trees(
    trees: TreeTensors,
    argmax: torch.Tensor,
    probs: Optional[torch.Tensor],
    reqs: Sequence[Req],
    sampled: list[int],
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> WalkTensors:
    """Every request's walk down its tree at once, a level per iteration (at most the trees'
    depth), no read: `argmax` [rows] the target's (banned tokens masked), `probs` [rows, vocab]
    its distributions (None: no sampled request).

    Greedy: the lowest-numbered child whose token is the argmax at its parent is accepted, the
    argmax emitted where none is. Sampled (requests `sampled`), SGLang's target-only rule: at
    the walk's level one uniform u (ACCEPT_STREAM, indexed by the request's output tokens so far
    plus the level) is compared with the running sum of the target probabilities of the
    children in node order, summed in float64 (Python floats, as the host walk summed them);
    the first child with u <= sum / threshold_acc or p >= threshold_single is accepted. If none
    is and the node's residual (the target without its children's tokens) is empty (the
    children hold all the mass and u passed their float sum by rounding), the last child is
    accepted; else the residual's inverse-CDF draw at the node's level (RESIDUAL_STREAM) is
    emitted."""
    tokens, parents, rows = trees.tokens, trees.parents, trees.rows
    b, n = tokens.shape
    device = tokens.device
    nodes = torch.arange(n, device=device)
    at_argmax = argmax[rows]  # [B, N]
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    path = torch.zeros(b, trees.depth + 1, dtype=torch.int64, device=device)
    accepted = torch.zeros(b, dtype=torch.int64, device=device)
    active = torch.ones(b, dtype=torch.bool, device=device)
    if sampled:
        child_p, cum_p, empty, drawn, u_acc = _sampled_inputs(trees, probs, reqs, sampled)
        is_sampled = torch.zeros(b, dtype=torch.bool, device=device)
        is_sampled[sampled] = True
    for level in range(trees.depth):
        kids = (parents == cur[:, None]) & active[:, None]
        hit = kids & (tokens == at_argmax.gather(1, cur[:, None]))
        if sampled:
            u = u_acc[:, level : level + 1]
            passes = (u <= cum_p / threshold_acc) | (child_p >= threshold_single)
            hit = torch.where(is_sampled[:, None], kids & passes, hit)
        first = torch.where(hit, nodes, n).min(1).values  # the lowest-numbered hit
        found = first < n
        if sampled:
            last = torch.where(kids, nodes, -1).max(1).values
            at_empty = empty.gather(1, cur[:, None]).squeeze(1)
            fallback = is_sampled & ~found & at_empty & (last >= 0)
            first = torch.where(found, first, last)
            found = found | fallback
        cur = torch.where(found, first, cur)
        path[:, level + 1] = torch.where(found, first, 0)
        accepted += found
        active = found
    bonus = at_argmax.gather(1, cur[:, None]).squeeze(1)
    if sampled:
        bonus = torch.where(is_sampled, drawn.gather(1, cur[:, None]).squeeze(1), bonus)
    steps = torch.arange(trees.depth + 1, device=device)[None, :]
    drafts = torch.cat((tokens.gather(1, path[:, 1:]), bonus[:, None]), dim=1)
    emitted = torch.where(steps < accepted[:, None], drafts, bonus[:, None])
    return WalkTensors(path, emitted, rows.gather(1, path), accepted)


def _sampled_inputs(
    trees: TreeTensors, probs: torch.Tensor, reqs: Sequence[Req], sampled: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What sampled walks read, per node [B, N]: its token's target probability at its parent
    (float64 of the float32), the running float64 sum of it and its older siblings' (added in
    node order, a sibling rank per iteration), whether its residual is empty, its residual's
    draw; and per request its ACCEPT uniform at each level [B, depth + 1]."""
    tokens, parents, rows = trees.tokens, trees.parents, trees.rows
    b, n = tokens.shape
    device = tokens.device
    has_parent = parents >= 0
    parent = parents.clamp(min=0)
    child_p = probs[rows.gather(1, parent), tokens].double()
    older = (parents[:, None, :] == parents[:, :, None]) & (
        torch.arange(n, device=device)[None, :] < torch.arange(n, device=device)[:, None]
    )  # [B, k, j]: j an older sibling of k
    rank = older.sum(-1)
    previous = (older * torch.arange(1, n + 1, device=device)).max(-1).values - 1
    cum_p = child_p.clone()
    for r in range(1, trees.fanout):
        before = cum_p.gather(1, previous.clamp(min=0))
        cum_p = torch.where(has_parent & (rank == r), before + child_p, cum_p)
    # Each node's residual: its row's distribution, its children's tokens removed (a padding
    # node's or the root's "parent" entry goes to a scratch row).
    residual = torch.cat((probs[rows.reshape(-1)], probs.new_zeros(1, probs.shape[-1])))
    flat = torch.arange(b, device=device)[:, None] * n + parent
    residual[torch.where(has_parent, flat, b * n).reshape(-1), tokens.reshape(-1)] = 0.0
    residual = residual[:-1]
    empty = (residual.sum(-1) <= 0).view(b, n)
    width = trees.depth + 1
    uniforms = [[[0.0] * width for _ in reqs] for _ in range(2)]
    for i in sampled:
        seed, base = reqs[i].input.seed, len(reqs[i].output_ids)
        for stream, table in zip((ACCEPT_STREAM, RESIDUAL_STREAM), uniforms):
            table[i] = [request_uniform(seed, base + d, stream) for d in range(width)]
    u_acc, u_res = upload(device, (uniforms, torch.float64))[0].view(2, b, width).unbind(0)
    drawn = inverse_cdf(residual, u_res.gather(1, trees.depths).reshape(-1)).view(b, n)
    return child_p, cum_p, empty, drawn, u_acc


def path_logprobs(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    row_req: list[int],
    rows: torch.Tensor,
    tokens: torch.Tensor,
    asked: LogprobAsk,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """On the device, at each emitted token's verify row ([B, W] `rows`, `tokens`): the target's
    log-softmax at the request's temperature of the token [B, W]; with top log-probs asked, the
    row's top (values, ids) [B, W, k]; with token_ids_logprob, the row's log-probs of its
    request's ids [B, W, width] (padded with id 0). Every row's log-softmax and top-k are taken
    over the whole verify batch, then gathered."""
    width = asked.chosen_width
    padded = (
        [list(asked.chosen[i]) + [0] * (width - len(asked.chosen[i])) for i in row_req]
        if width
        else []
    )
    temps, chosen = upload(
        logits.device,
        ([reqs[i].input.sampling_params.logit_scale for i in row_req], torch.float32),
        (padded, torch.int64),
    )
    logp = torch.log_softmax(logits / temps[:, None], -1)
    at_tokens = logp[rows, tokens]
    top = max(asked.top_nums)
    vals = ids = None
    if top:
        vals, ids = logp.topk(top, dim=-1)
        vals, ids = vals[rows], ids[rows]
    at_chosen = None
    if width:
        at_chosen = logp.gather(1, chosen.view(len(row_req), width))[rows]
    return at_tokens, vals, ids, at_chosen


def host_logprobs(
    accepts: Sequence[Acceptance], asked: LogprobAsk, width: int, lp_values: list
) -> tuple[LogProbs, TopLogProbs, Optional[list[list[list[float]]]]]:
    """`path_logprobs`' values read back ([B, W] flattened, W = `width`), cut to each request's
    emitted tokens and its asked numbers."""
    at_tokens, vals, ids, at_chosen = lp_values
    k, chosen_width = max(asked.top_nums), asked.chosen_width
    lps, tops, chosen = [], [], []
    for i, (acc, want, top_n) in enumerate(zip(accepts, asked.want, asked.top_nums)):
        cells = range(i * width, i * width + len(acc.tokens))
        lps.append([at_tokens[c] for c in cells] if want else [])
        tops.append(
            [list(zip(vals[c * k : c * k + top_n], ids[c * k : c * k + top_n])) for c in cells]
            if top_n
            else []
        )
        if chosen_width:
            n = len(asked.chosen[i])
            chosen.append([at_chosen[c * chosen_width : c * chosen_width + n] for c in cells])
    return (
        lps if any(asked.want) else None,
        tops if any(asked.top_nums) else None,
        chosen if chosen_width else None,
    )
