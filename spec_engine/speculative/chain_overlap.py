"""Overlapped speculative steps for chain drafts (--speculative-eagle-topk 1), as SGLang's Spec V2
(eagle_worker_v2.py): step N+1 is drafted, verified and extended on the device before step N's
accept lengths are read back.

A chain step's inputs depend on the previous step's acceptance: the root token (its bonus
token), where the verify starts (the request's committed KV length), and the draft's next-round
state. None of it goes through the host here:

* **On the device** (`PendingSpec`): per request of a launched step, its committed KV length
  after the step (`kv`) and its bonus token (`tokens`), the next step's KV start and root. A
  request of the step in flight reads both with a device gather (core/worker.py's
  `resolve_placeholders`, SGLang's FutureMap); the others give their host values. The draft's
  next-round state (`Req.spec_state`) is set at launch to rows of the step's device tensors, so
  any later step, overlapped or synchronous, drafts from it.
* **Acceptance** on the device (`_walk`, speculative/verify.py's walk at top-k 1): a greedy
  chain accepts the drafts equal to the target's argmax at their parent and emits the argmax
  after them; a sampled one compares each draft's target probability with its uniform and
  draws from the residual where it stops. A uniform's index counts the request's output
  tokens, which the host knows only up to the step in flight's: the host tabulates the
  uniforms for every count that step may emit, the device picks by what it did emit. An
  accepted chain needs no KV moves (node j already sits at position kv + j). The draft extends
  over all `n` verify rows (SGLang's fixed-width draft extend) and keeps its output at the last
  accepted row: rows past it write draft KV beyond the committed length, never read before the
  next step rewrites it. Attention takes device lengths through `ForwardBatch.kv_indices` /
  `kv_mask` over a host-known width (the torch_native backend; FlashInfer steps stay
  synchronous).
* **KV.** The host keeps each request's `kv_len` at an upper bound of its committed length
  (every slot up to it allocated): a launch allocates positions kv_len .. kv_len + n - 1 (the
  verify's worst case, what `decode_kv_demand` reports) and moves the bound by `n`. When a step
  is read (`finish`, the step's one host read: emitted tokens, accept lengths, NaN flags, asked
  log-probs) the bound is trimmed to what it may still need: committed + n for a request in
  the step launched after it, the committed length otherwise (then the synchronous path finds
  the exact state). A request that finished while a step was in flight keeps its KV until that
  step is read; then it is trimmed back to its committed length before that step and released
  (core/overlap.py's `release_after`), as the synchronous path would have.
* **Who owns the step in flight:** the scheduler (core/overlap.py's `InFlight`), as for plain
  decoding; each `PendingSpec` knows the step launched after it (`successor`), whose rows its
  read tightens.

Overlapped: greedy and sampled requests of EAGLE, EAGLE-3, single-layer MTP and STANDALONE
chains (a STANDALONE draft first runs the root token at its slot, on the device too) at page
size 1 with the torch_native backend and --enable-deterministic-inference (the overlapped
attention pads to a bound of the lengths, the synchronous one to the lengths: only
batch-invariant kernels give the same values at both widths), one rank, the accept alarm not
set to disable. Everything else (top-k > 1 trees, NGRAM, a self-draft, multi-layer MTP,
--speculative-adaptive; requests with penalties, grammars, min_new_tokens still to reach or
top-p replay) runs the synchronous step: the scheduler drains the step in flight first.
Outputs are those of the synchronous path (tests/engine/test_spec_overlap.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from spec_engine.constrained.mask import mask_trees
from spec_engine.core.custom_logit_processor import apply_processors_to_trees
from spec_engine.core.logits_processor import (
    NONFINITE_LOGITS,
    nonfinite_flags,
    replace_nan,
    wants_top_p_replay,
    warn_nan,
)
from spec_engine.core.readback import read_back
from spec_engine.core.request import Req
from spec_engine.core.worker import PendingDecode, StepResult, resolve_placeholders
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.layers.sampler import inverse_cdf, request_uniform
from spec_engine.speculative.base import SpecWorker
from spec_engine.speculative.verify import (
    ACCEPT_STREAM,
    RESIDUAL_STREAM,
    Acceptance,
    LogprobAsk,
    host_logprobs,
    path_logprobs,
    target_probs,
)

# The worker these functions serve: an EagleWorker (speculative/eagle_worker.py), which imports
# this module.
EagleWorker = SpecWorker


@dataclass
class PendingSpec(PendingDecode):
    """A chain step launched and not yet read: `tokens` its bonus tokens, `kv` the committed KV
    lengths after it, `emitted` how many tokens each request emits (all [B], on the device);
    `before`: each request's committed length before it, where the host knows it (else filled
    when the previous step is read)."""

    release_unread = False
    kv: Optional[torch.Tensor] = None
    emitted: Optional[torch.Tensor] = None  # [B]: tokens each request emits
    before: list[Optional[int]] = field(default_factory=list)
    successor: Optional[PendingSpec] = None


def chain_request_ok(worker: EagleWorker, req: Req) -> bool:
    """Whether `req`'s next verify needs nothing of its newest tokens on the host: no bans left
    (min_new_tokens reached), no top-p replay."""
    sp = req.input.sampling_params
    return not req.banned_tokens(worker.eos_token_ids) and not wants_top_p_replay(sp)


def launch_chain(
    worker: EagleWorker, reqs: Sequence[Req], previous: Optional[PendingSpec]
) -> PendingSpec:
    """Draft, verify, accept and extend one chain step of `reqs` without reading anything back."""
    shape = worker.shape(None)
    n, b, device = shape.draft_tokens, len(reqs), worker.device
    rows = {id(r): j for j, r in enumerate(previous.reqs)} if previous is not None else {}
    kv = worker._tensor([-1 - rows[id(r)] if id(r) in rows else r.kv_len for r in reqs])
    roots = worker._tensor([-1 - rows[id(r)] if id(r) in rows else r.output_ids[-1] for r in reqs])
    if rows:
        kv = resolve_placeholders(kv, previous.kv)
        roots = resolve_placeholders(roots, previous.tokens)
    bounds = [r.kv_len for r in reqs]  # committed length <= bound, slots allocated up to it
    width = max(bounds) + n
    worker.alloc_verify_slots(reqs, [n] * b)  # positions bound .. bound + n - 1
    for r in reqs:
        r.kv_len += n
    pool_idx = worker._tensor([r.req_pool_idx for r in reqs])
    steps = torch.arange(n, device=device)
    table = worker.runner.req_to_token_pool.req_to_token
    positions = kv[:, None] + steps[None, :]  # [B, n]
    slots = table[pool_idx[:, None], positions].to(torch.int64).reshape(-1)
    keys = table[pool_idx, :width].to(torch.int64)
    seen = torch.arange(width, device=device)[None, None, :] < (positions + 1)[:, :, None]
    if worker.features:
        first = torch.stack([r.spec_state.ids for r in reqs])
        hidden = torch.stack([r.spec_state.hidden for r in reqs])
        drafts = _draft_chain(worker, reqs, (first, hidden), kv, kv - 1, max(bounds), shape.steps)
    else:  # a STANDALONE draft runs the root first, writing its KV at the root's slot
        at_root = slots.view(b, n)[:, 0]
        root = _batch(ForwardMode.DECODE, roots, kv[:, None], at_root, pool_idx, kv, bounds)
        root.seq_lens, root.seq_lens_cpu = kv + 1, [k + 1 for k in bounds]
        root.extend_seq_lens_cpu = root.extend_prefix_lens_cpu = None
        top = torch.softmax(worker.draft.forward(root, None)[0], -1).topk(1, dim=-1).indices
        first = worker.draft.to_target_ids(top)
        drafts = _draft_chain(worker, reqs, (first, None), kv + 1, kv, max(bounds) + 1, shape.steps)
    ids = torch.cat((roots[:, None], drafts), dim=1).reshape(-1)
    worker.verify_steps += 1
    out = worker.runner.forward(
        _batch(ForwardMode.TARGET_VERIFY, ids, positions, slots, pool_idx, kv, bounds, keys, seen)
    )
    detect = worker.runner.args.enable_nan_detection
    logits, flags = replace_nan(out.logits) if detect else (out.logits, nonfinite_flags(out.logits))
    # No-ops for the requests this path takes (chain_request_ok): kept so the logits are the
    # synchronous verify's to the bit.
    chains = [list(range(-1, n - 1)) for _ in reqs]
    logits = mask_trees(logits, [r.grammar for r in reqs], chains, [[0] * n for _ in reqs])
    logits = apply_processors_to_trees(logits, reqs, chains, [[0] * n for _ in reqs])
    ahead = None
    if rows:  # the tokens the step in flight emits, per request (0: not in it)
        ahead = worker._tensor([-1 - rows[id(r)] if id(r) in rows else 0 for r in reqs])
        ahead = resolve_placeholders(ahead, previous.emitted)
    accepted, emitted = _walk(worker, reqs, logits, drafts, ahead)
    bonus = emitted.gather(1, accepted[:, None]).squeeze(1)
    committed = kv + accepted + 1
    emitted = emitted.reshape(-1)  # per verify row, the token emitted there if any
    asked = LogprobAsk(
        [r.input.return_logprob for r in reqs],
        [r.input.top_logprobs_num for r in reqs],
        [r.input.token_ids_logprob for r in reqs],
    )
    row_req = [i for i in range(b) for _ in range(n)]
    lp_inputs = ()
    if asked.anything:
        at_rows = torch.arange(b * n, device=device).view(b, n)
        lp_inputs = path_logprobs(logits, reqs, row_req, at_rows, emitted.view(b, n), asked)
    if not worker.draft.shares_target:
        # A feature draft pairs each emitted token with the feature before it, a STANDALONE
        # draft reads the accepted path's tokens (the verify's inputs).
        tokens = emitted if worker.features else ids
        batch = _batch(ForwardMode.DRAFT_EXTEND, tokens, positions, slots, pool_idx, kv, bounds)
        batch.kv_indices, batch.kv_mask = keys, seen
        batch.logits_indices = torch.arange(b, device=device) * n + accepted
        feats = worker._features(out) if worker.features else None
        draft_logits, nxt = worker.draft.forward(batch, feats)
        if worker.features:
            probs, top = torch.softmax(draft_logits, -1).topk(1, dim=-1)
            worker.keep_states(reqs, probs, worker.draft.to_target_ids(top), nxt)

    def finish() -> StepResult:
        values = read_back(emitted, accepted, flags, *lp_inputs)  # the step's one read
        return _result(worker, pending, values, n, asked, detect)

    pending = PendingSpec(
        list(reqs),
        [0] * b,
        bonus,
        finish,
        kv=committed,
        emitted=accepted + 1,
        before=[None if id(r) in rows else r.kv_len - n for r in reqs],
    )
    if previous is not None:
        previous.successor = pending
    return pending


def _walk(
    worker: EagleWorker,
    reqs: Sequence[Req],
    logits: torch.Tensor,
    drafts: torch.Tensor,
    ahead: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chain's walk on the device, as speculative/verify.py walks it on the host: the drafts
    accepted [B], and per node [B, n] the token emitted there if the walk stops there. Greedy:
    a draft equal to its parent's argmax is accepted, the argmax emitted. Sampled: a draft whose
    target probability p passes u <= p / threshold_acc or p >= threshold_single (or whose
    parent's residual is empty) is accepted, else the residual's draw emitted; `ahead` (tokens
    the step in flight emits, per request) picks each node's uniforms from a host table over
    every count it may emit (their index counts the request's output tokens)."""
    b, steps = drafts.shape
    n, device = steps + 1, worker.device
    grid = logits.argmax(-1).view(b, n)
    accept = drafts == grid[:, :-1]
    sampled = [i for i, r in enumerate(reqs) if not r.input.sampling_params.is_greedy]
    emitted = grid
    if sampled:
        row_req = [i for i in range(b) for _ in range(n)]
        probs = target_probs(logits, reqs, row_req).view(b, n, -1)
        p = probs[:, :-1].gather(2, drafts[:, :, None]).squeeze(2).double()
        residual = probs.clone()
        residual[:, :-1].scatter_(2, drafts[:, :, None], 0.0)
        empty = residual.sum(-1) <= 0
        u_acc, u_res = _uniforms(reqs, sampled, n, device)
        pick = torch.zeros(b, dtype=torch.int64, device=device) if ahead is None else ahead
        u_acc, u_res = (u[torch.arange(b, device=device), pick] for u in (u_acc, u_res))
        drawn = inverse_cdf(residual.view(b * n, -1), u_res.reshape(-1)).view(b, n)
        passes = (u_acc[:, :-1] <= p / worker.threshold_acc) | (p >= worker.threshold_single)
        is_sampled = torch.zeros(b, 1, dtype=torch.bool, device=device)
        is_sampled[sampled] = True
        accept = torch.where(is_sampled, passes | empty[:, :-1], accept)
        emitted = torch.where(is_sampled, drawn, grid)
    accepted = accept.to(torch.int64).cumprod(1).sum(1)
    padded = torch.cat((drafts, grid[:, :1]), dim=1)  # the drafts, node by node (last: unused)
    node = torch.arange(n, device=device)[None, :]
    return accepted, torch.where(node < accepted[:, None], padded, emitted)


def _uniforms(
    reqs: Sequence[Req], sampled: list[int], n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, n + 1, n] uniforms of each sampled request's walk (ACCEPT and RESIDUAL streams): at
    [i, e, j] the one of node j when the step in flight emits e tokens."""
    acc = [[[0.0] * n for _ in range(n + 1)] for _ in reqs]
    res = [[[0.0] * n for _ in range(n + 1)] for _ in reqs]
    for i in sampled:
        seed, base = reqs[i].input.seed, len(reqs[i].output_ids)
        for e in range(n + 1):
            for j in range(n):
                acc[i][e][j] = request_uniform(seed, base + e + j, ACCEPT_STREAM)
                res[i][e][j] = request_uniform(seed, base + e + j, RESIDUAL_STREAM)
    return (torch.tensor(t, dtype=torch.float64, device=device) for t in (acc, res))


def _draft_chain(
    worker: EagleWorker,
    reqs: Sequence[Req],
    first: tuple[torch.Tensor, Optional[torch.Tensor]],
    prefix_lens: torch.Tensor,
    pos_base: torch.Tensor,
    widest: int,
    steps: int,
) -> torch.Tensor:
    """The chain's draft tokens [B, steps]: `first` the first level's ids [B, 1] and features
    (None: a STANDALONE draft), the others from draft steps over the device lengths
    (EagleWorker._draft_trees at top-k 1; `widest`: a bound of `prefix_lens`)."""
    b = len(reqs)
    f_tokens, f_hidden = first
    tokens = [f_tokens]
    if steps > 1:
        scratch = worker.alloc_kv([0], [(steps - 1) * b], [0])
        prefix = worker._prefix_indices(reqs, prefix_lens, widest)
        path = torch.empty(b, 0, dtype=torch.int64, device=worker.device)
        for step in range(1, steps):
            own = scratch.device[(step - 1) * b : step * b]
            _, c, nxt = worker._draft_step(
                reqs, step, own, (f_tokens, f_hidden, path), prefix, pos_base
            )
            f_tokens, f_hidden = c.view(b, 1), nxt if worker.features else None
            path = torch.cat((path, own[:, None]), dim=1)
            tokens.append(f_tokens)
        worker.runner.allocator.free(scratch.host)
    return torch.cat(tokens, dim=1)


def _batch(
    mode: ForwardMode,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    pool_idx: torch.Tensor,
    kv: torch.Tensor,
    bounds: list[int],
    keys: Optional[torch.Tensor] = None,
    seen: Optional[torch.Tensor] = None,
) -> ForwardBatch:
    """A forward of `n` rows per request at device positions; the host lengths are the bounds
    (the key width the attention pads to)."""
    b, n = positions.shape
    return ForwardBatch(
        mode=mode,
        input_ids=ids,
        positions=positions.reshape(-1),
        out_cache_loc=slots,
        req_pool_indices=pool_idx,
        seq_lens=kv + n,
        seq_lens_cpu=[k + n for k in bounds],
        extend_seq_lens_cpu=[n] * b,
        extend_prefix_lens_cpu=list(bounds),
        kv_indices=keys,
        kv_mask=seen,
        capture_hidden=mode is ForwardMode.TARGET_VERIFY,
    )


def _result(
    worker: EagleWorker,
    pending: PendingSpec,
    values: list,
    n: int,
    asked: LogprobAsk,
    detect: bool,
) -> StepResult:
    """The read step's StepResult, and its KV bounds tightened (module docstring)."""
    argmax, accepted, flag_values, *lp_values = values
    reqs = pending.reqs
    accepts = []
    for i, a in enumerate(accepted):
        rows = [i * n + j for j in range(a + 1)]
        accepts.append(Acceptance(list(range(a + 1)), [argmax[r] for r in rows], rows))
    bad_rows: set[int] = set()
    if detect:
        warn_nan(flag_values)
    else:
        bad_rows = {row for row, bad in enumerate(flag_values) if bad}
    logprobs = top = chosen = None
    if asked.anything:
        logprobs, top, chosen = host_logprobs(accepts, asked, n, lp_values)
    failed = {i: NONFINITE_LOGITS for i, a in enumerate(accepts) if bad_rows.intersection(a.rows)}
    result = StepResult(
        tokens=[a.tokens for a in accepts],
        logprobs=logprobs,
        top_logprobs=top,
        token_ids_logprobs=chosen,
        drafted=[n - 1] * len(reqs),
        accept_paths=[a.path for a in accepts],
        failed=failed,
    )
    later = pending.successor
    next_rows = {id(r): j for j, r in enumerate(later.reqs)} if later is not None else {}
    for i, r in enumerate(reqs):
        committed = pending.before[i] + accepted[i] + 1 if pending.before[i] is not None else None
        if r.finished:  # finished while this step was in flight: trimmed back, then released
            pending.starts[i] = pending.before[i]
            continue
        j = next_rows.get(id(r))
        if j is not None:
            later.before[j] = committed
        _trim(worker, r, committed + n if j is not None else committed)
    return result


def _trim(worker: EagleWorker, req: Req, end: int) -> None:
    """Free `req`'s slots from position `end` on (page size 1: no partial pages)."""
    if req.kv_len > end:
        pool = worker.runner.req_to_token_pool
        worker.runner.allocator.free(pool.read_host(req.req_pool_idx, req.kv_len, start=end))
        req.kv_len = end
