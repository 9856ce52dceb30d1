"""EagleWorker: tree drafting with a draft model — EAGLE-2, EAGLE-3, MTP and STANDALONE.

Feature drafts (EAGLE, EAGLE-3, MTP) pair token t[p+1] with the target's feature at p and
keep draft KV at position p, so after every target forward the draft "extends" over the same
positions (the features are fresh then) and keeps the top-k of its last output for the next
round. A STANDALONE draft is a plain LM: its KV at p comes from t[p], so each round starts by
running the root token.

A decode round (SGLang's flow): draft `num_steps` levels, each expanding the best `topk` nodes
by cumulative draft probability into topk x topk children (branch rows attend to the prefix
plus their own ancestors' draft KV in scratch slots); keep the best `num_draft_tokens - 1`
candidates as a tree; verify it with the target (SpecWorker.verify); extend the draft over the
accepted tokens.

Under --speculative-adaptive the speculation policy also picks the round's depth: a shallower
shape (args.spec_shapes) drafts fewer steps and keeps fewer candidates from the same next-round
state, and the extend after its verify leaves the state any depth starts from, so depths may
change from one round to the next.

Plain steps under --speculative-adaptive (the policy decodes plainly when its cost model
expects that to emit more tokens/s) run no draft work: they record the draft's inputs at the
decoded positions (speculative/draft_lag.py), and the next speculative step first extends the
draft over every lagging request's recorded positions in one batch — the extend each plain
step would otherwise have run, so the draft's KV and next-round state (spec_state) are then
exactly as if the plain stretch had been verify rounds that accepted no draft token. A
self-draft (the target drafting for itself) needs nothing: the plain step writes its KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.resolve import DraftKind
from spec_engine.args.spec_shapes import SpecShape
from spec_engine.attention.torch_native import TorchNativeBackend
from spec_engine.core.request import Req
from spec_engine.core.worker import AllocFn, StepResult
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.runner.model_runner import ForwardOutput, ModelRunner
from spec_engine.speculative import draft_lag
from spec_engine.speculative.base import SpecWorker
from spec_engine.speculative.chain_overlap import PendingSpec, chain_request_ok, launch_chain
from spec_engine.speculative.draft_runner import DraftRunner
from spec_engine.speculative.tree import TreeTensors, select_trees


@dataclass
class DraftState:
    """A feature draft's output at a request's last position: the first level of its tree."""

    probs: torch.Tensor  # [topk] draft probabilities
    ids: torch.Tensor  # [topk] target token ids
    hidden: torch.Tensor  # [H] feature for the next draft step
    # Multi-layer MTP: the later levels' (probs, ids), level k from MTP layer k.
    later: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None


@dataclass
class DraftExtend:
    """One request's part of a draft forward over consecutive positions: `tokens` at positions
    start .. start + len(tokens) - 1, writing draft KV at the target's slots for them."""

    req: Req
    start: int
    tokens: list[int]
    keep_state: bool  # keep the draft's output at the last position as the next round's first level


class EagleWorker(SpecWorker):
    def __init__(
        self,
        runner: ModelRunner,
        alloc_kv: AllocFn,
        eos_token_ids: frozenset[int],
        args: EngineArgs,
        draft: DraftRunner,
    ) -> None:
        super().__init__(runner, alloc_kv, eos_token_ids, args)
        self.draft = draft
        self.steps = args.speculative_num_steps
        self.topk = args.speculative_eagle_topk
        self.features = draft.kind.uses_target_features
        # EAGLE-3 reads the target layers the target model captures (EngineConfig.capture_layers).
        self.aux_features = draft.kind is DraftKind.EAGLE3
        # --enable-multi-layer-eagle: every level of the chain comes from the draft extend, level
        # k from MTP layer k (SGLang's MultiLayerEagleWorker); no draft decode steps run.
        self.multi_layer = draft.mtp_layers > 1
        self.adaptive = args.speculative_adaptive
        self.max_running = args.max_running_requests
        self.max_lag: Optional[int] = None  # from the feature rows' size: the first plain step
        # The most positions any request's draft may lag now (plain steps since the catch-up of
        # every lagging request, or the longest record a full-only catch-up left): below
        # max_lag, a plain step's catch-up check reads no request.
        self.lag_bound = 0
        self.extend_cost = draft_lag.ExtendCost()  # --speculative-adaptive's catch-up estimate
        # Overlapped steps (speculative/chain_overlap.py): chains of one shape with a draft model,
        # page size 1, device lengths through torch_native attention, no alarm that would stop
        # speculating between a step's launch and its read, batch-invariant kernels (the
        # overlapped attention pads to a bound of the lengths: only invariant kernels give the
        # synchronous step's values at another width), one rank (not tried at --tp-size > 1).
        # Else synchronous steps.
        self.can_overlap = (
            self.topk == 1
            and not self.multi_layer
            and not self.adaptive
            and not draft.shares_target
            and self.page_size == 1
            and self.shape(None).draft_tokens == self.steps + 1
            and isinstance(runner.attn_backend, TorchNativeBackend)
            and isinstance(draft.attn_backend, TorchNativeBackend)
            and args.speculative_on_collapse != "disable"
            and args.enable_deterministic_inference
            and runner.tp.size == 1
        )

    # ---------------------------------------------------------------- memory

    def _scratch_size(self, batch: int, steps: int) -> int:
        """Draft KV slots of the tree steps after the first (topk rows per request each)."""
        return (steps - 1) * batch * self.topk

    def decode_headroom(self) -> int:
        # Verify slots and this request's share of the draft scratch (each rounded to a page),
        # at the deepest shape.
        return super().decode_headroom() + self._scratch_size(1, self.steps) + self.page_size

    @property
    def plain_steps_keep_draft(self) -> bool:
        # Without --speculative-adaptive a plain step (an acceptance alarm's) skips the draft,
        # which is then behind for good: the draft work is saved for the rest of the request.
        return self.adaptive

    def _speculate_kv_demand(self, reqs: Sequence[Req], shape: SpecShape) -> int:
        scratch = -(-self._scratch_size(len(reqs), shape.steps) // self.page_size) * self.page_size
        return self.verify_kv_demand(reqs, [shape.draft_tokens] * len(reqs)) + scratch

    # ---------------------------------------------------------------- overlap

    def overlappable(self, req: Req) -> bool:
        return chain_request_ok(self, req)

    def launch_decode(
        self, reqs: Sequence[Req], previous: Optional[PendingSpec] = None
    ) -> PendingSpec:
        """A chain step launched without reading anything back (speculative/chain_overlap.py)."""
        return launch_chain(self, reqs, previous)

    def keep_states(
        self, reqs: Sequence[Req], probs: torch.Tensor, ids: torch.Tensor, hidden: torch.Tensor
    ) -> None:
        """Each request's next-round draft state: row i of the draft's outputs."""
        for i, r in enumerate(reqs):
            r.spec_state = DraftState(probs[i], ids[i], hidden[i])

    # ---------------------------------------------------------------- prefill

    def prefill(self, reqs: Sequence[Req]) -> StepResult:
        result, out, starts, ends = self._prefill(reqs, capture_hidden=self.features)
        if self.draft.shares_target:  # a self-draft's KV is the target's, written just now
            return result
        start = self.timings.now()
        entries = []
        for i, (r, s, e) in enumerate(zip(reqs, starts, ends)):
            done = e == r.seq_len  # the prompt is complete: its last draft output starts round one
            if self.features:
                nxt = result.tokens[i][0] if done else r.fill_ids[e]
                entries.append(DraftExtend(r, s, r.fill_ids[s + 1 : e] + [nxt], done))
            else:
                entries.append(DraftExtend(r, s, r.fill_ids[s:e], done))
        feats = self._features(out) if self.features else None
        self._extend_draft(entries, feats)
        end = self.timings.add("draft_s", start)
        if self.adaptive:  # the catch-up estimate's sample (on CUDA it waits for the extend)
            positions = sum(len(e.tokens) for e in entries)
            self.extend_cost.add(positions, self.timings.elapsed(start, end))
        return result

    # ---------------------------------------------------------------- decode

    def _speculate(self, reqs: Sequence[Req], shape: SpecShape) -> StepResult:
        """A round of `shape`: its depth in draft steps and its draft tokens (any depth drafts
        from the same state, and the extend after the verify leaves the state every depth
        starts from)."""
        self.catch_up(reqs)
        start = self.timings.now()
        self.alloc_verify_slots(reqs, [shape.draft_tokens] * len(reqs))
        size = self._scratch_size(len(reqs), shape.steps)
        scratch = self.alloc_kv([0], [size], [0]) if size else None
        trees = self._draft_trees(reqs, None if scratch is None else scratch.device, shape)
        if scratch is not None:
            self.runner.allocator.free(scratch.host)
        self.timings.add("draft_s", start)
        result, accepts, out = self.verify(reqs, trees)
        if self.draft.shares_target:  # the verify wrote the accepted tokens' KV for both
            return result
        start = self.timings.now()
        feats = self._features(out) if self.features else None
        entries, rows = [], []
        for r, acc in zip(reqs, accepts):
            kept = len(acc.path)
            first = r.kv_len - kept
            # A STANDALONE draft reads the accepted path's tokens: the root (the last output),
            # then the accepted drafts.
            tokens = acc.tokens if self.features else [r.output_ids[-1], *acc.tokens[:-1]]
            entries.append(DraftExtend(r, first, tokens, keep_state=True))
            rows.extend(acc.rows)  # the path's verify rows
        hidden = feats[self._tensor(rows)] if feats is not None else None
        self._extend_draft(entries, hidden, mode=ForwardMode.DRAFT_EXTEND)
        self.timings.add("draft_s", start)
        return result

    def decode_plain(self, reqs: Sequence[Req]) -> StepResult:
        """One target token per request; with --speculative-adaptive the draft's inputs at the
        decoded positions are recorded for the next speculative step (see the module docstring)."""
        if not self.adaptive or self.draft.shares_target:
            return super().decode_plain(reqs)
        result, out = self._decode(reqs, capture_hidden=self.features)
        # A feature draft pairs the decoded position's feature with the token sampled there, a
        # STANDALONE draft reads the token that was decoded there (the last output so far).
        feats = self._features(out) if self.features else None
        tokens = (
            [t[0] for t in result.tokens] if self.features else [r.output_ids[-1] for r in reqs]
        )
        draft_lag.record(reqs, tokens, feats)
        if self.max_lag is None:
            self.max_lag = draft_lag.lag_limit(feats, self.max_running)
        self.lag_bound += 1
        return result

    def catch_up(self, reqs: Sequence[Req], full_only: bool = False) -> None:
        """One draft extend over every recorded position of the lagging requests in `reqs`
        (`full_only`: of those whose record reached draft_lag.lag_limit), which leaves each
        one's draft KV and next-round state at its last position. Under --speculative-adaptive
        `reqs` is every running request (one group a step), so a catch-up of them bounds every
        lag (lag_bound)."""
        if full_only and (self.max_lag is None or self.lag_bound < self.max_lag):
            return  # no request has lagged max_lag plain steps yet
        limit = self.max_lag if full_only else None
        lagging = [r for r in reqs if draft_lag.lagging(r, limit)]
        # What lags after this catch-up: the records short of the limit (none without one).
        lengths = [len(r.draft_lag.tokens) for r in reqs if r.draft_lag is not None]
        self.lag_bound = max((n for n in lengths if n < limit), default=0) if limit else 0
        if not lagging:
            return
        start = self.timings.now()
        lags, feats = draft_lag.take(lagging)
        entries = [DraftExtend(r, lag.start, lag.tokens, True) for r, lag in zip(lagging, lags)]
        self._extend_draft(entries, feats, mode=ForwardMode.DRAFT_EXTEND)
        end = self.timings.add("draft_s", start)
        self.extend_cost.add(sum(len(lag.tokens) for lag in lags), self.timings.elapsed(start, end))

    def catch_up_seconds(self, reqs: Sequence[Req]) -> Optional[float]:
        return self.extend_cost.predict(draft_lag.positions(reqs))

    def release(self, req: Req) -> int:
        # No draft KV from the first lagging position on: a request sharing it would draft badly.
        lag, req.draft_lag = req.draft_lag, None
        return req.kv_len if lag is None else lag.start

    def _features(self, out: ForwardOutput) -> torch.Tensor:
        return out.aux_hidden if self.aux_features else out.hidden

    def _extend_draft(
        self,
        entries: list[DraftExtend],
        hidden: torch.Tensor | None,
        mode: ForwardMode = ForwardMode.EXTEND,
    ) -> None:
        """One draft forward over every entry; keeps the next round's first level where asked.
        `mode`: DRAFT_EXTEND for a decode round's accepted tokens and for catch-ups (graph-run
        while no entry is wider than the captured extend), EXTEND after a prefill."""
        ids, positions, ends, lens, last = [], [], [], [], []
        for e in entries:
            n = len(e.tokens)
            ids.extend(e.tokens)
            positions.extend(range(e.start, e.start + n))
            ends.append(e.start + n)
            lens.append(n)
            last.append(len(ids) - 1)
        rows = self._tensor(last)
        batch = ForwardBatch(
            mode=mode,
            input_ids=self._tensor(ids),
            positions=self._tensor(positions),
            out_cache_loc=self.runner.req_to_token_pool.read_ranges(
                [e.req.req_pool_idx for e in entries], [e.start for e in entries], ends
            ),
            req_pool_indices=self._tensor([e.req.req_pool_idx for e in entries]),
            seq_lens=self._tensor(ends),
            seq_lens_cpu=ends,
            extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[e.start for e in entries],
            # Multi-layer MTP feeds every row's output to the next layer (its logits: last rows).
            logits_indices=None if self.multi_layer else rows,
        )
        logits, nxt = self.draft.forward(
            batch, hidden, head_rows=rows if self.multi_layer else None
        )
        if not self.features:
            return
        feats = nxt
        if self.multi_layer:
            nxt = nxt[rows]
        probs, top_ids = torch.softmax(logits, -1).topk(self.topk, dim=-1)
        top_ids = self.draft.to_target_ids(top_ids)
        later = self._later_levels(batch, rows, top_ids[:, 0], feats) if self.multi_layer else []
        for i, e in enumerate(entries):
            if e.keep_state:
                levels = [(p[i], c[i]) for p, c in later] if self.multi_layer else None
                e.req.spec_state = DraftState(probs[i], top_ids[i], nxt[i], levels)

    def _later_levels(
        self, batch: ForwardBatch, last: torch.Tensor, top1: torch.Tensor, feats: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Multi-layer MTP's draft extend after layer 0 (`top1`: its choice at each request's
        last row, `feats`: its output at every row): layer k runs over the same positions with
        each token k further on (the sequence shifted left, the last token the previous layer's
        top-1) and the previous layer's features, as SGLang's forward_draft_extend does.
        Returns each later layer's (probs, ids) [B, topk] at the last rows."""
        levels = []
        ids = batch.input_ids
        for layer in range(1, self.draft.mtp_layers):
            # Rolling the flat batch left shifts every request's tokens; the token that crossed
            # from the next request lands on a last position, which top1 overwrites.
            ids = torch.roll(ids, -1).index_copy(0, last, top1)
            step = dataclasses.replace(batch, input_ids=ids, attn_meta=None)
            logits, feats = self.draft.forward(step, feats, layer=layer, head_rows=last)
            probs, top_ids = torch.softmax(logits, -1).topk(self.topk, dim=-1)
            top_ids = self.draft.to_target_ids(top_ids)
            levels.append((probs, top_ids))
            top1 = top_ids[:, 0]
        return levels

    def _draft_trees(
        self, reqs: Sequence[Req], scratch: torch.Tensor | None, shape: SpecShape
    ) -> TreeTensors:
        b, k = len(reqs), self.topk
        roots = [r.output_ids[-1] for r in reqs]
        kv_lens = self._tensor([r.kv_len for r in reqs])
        if self.features:
            probs = torch.stack([r.spec_state.probs for r in reqs])
            ids = torch.stack([r.spec_state.ids for r in reqs])
            hidden = torch.stack([r.spec_state.hidden for r in reqs])
            prefix_lens = kv_lens
            pos_base = kv_lens - 1  # a node at depth d feeds the draft at position kv_len + d - 1
        else:
            probs, ids = self._root_step(reqs, roots)
            hidden = None
            prefix_lens = kv_lens + 1  # the root's draft KV (position kv_len) is part of the prefix
            pos_base = kv_lens
        scores_l, tokens_l, parents_l = (
            [probs],
            [ids],
            [torch.full((b, k), -1, dtype=torch.int64, device=self.device)],
        )
        depth_l = [torch.ones(k, dtype=torch.int64, device=self.device)]
        frontier, f_scores, f_tokens = torch.arange(k, device=self.device).expand(b, k), probs, ids
        f_hidden = hidden.repeat_interleave(k, dim=0) if hidden is not None else None
        f_path = torch.empty(b * k, 0, dtype=torch.int64, device=self.device)
        widest = max(r.kv_len for r in reqs) + (0 if self.features else 1)
        prefix_idx, prefix_ok = self._prefix_indices(reqs, prefix_lens, widest)
        offset = k
        for step in range(1, shape.steps):
            own = scratch[(step - 1) * b * k : step * b * k]
            if self.multi_layer:
                p = torch.stack([r.spec_state.later[step - 1][0] for r in reqs])
                c = torch.stack([r.spec_state.later[step - 1][1] for r in reqs])
                nxt = None
            else:
                p, c, nxt = self._draft_step(
                    reqs, step, own, (f_tokens, f_hidden, f_path), (prefix_idx, prefix_ok), pos_base
                )
            child_scores = (f_scores[:, :, None] * p.view(b, k, k)).reshape(b, k * k)
            child_tokens = c.view(b, k * k)
            scores_l.append(child_scores)
            tokens_l.append(child_tokens)
            parents_l.append(frontier[:, :, None].expand(b, k, k).reshape(b, k * k))
            depth_l.append(torch.full((k * k,), step + 1, dtype=torch.int64, device=self.device))
            sel = child_scores.topk(k, dim=-1).indices
            frontier = offset + sel
            offset += k * k
            f_scores, f_tokens = child_scores.gather(1, sel), child_tokens.gather(1, sel)
            parent_rows = (sel // k + torch.arange(b, device=self.device)[:, None] * k).reshape(-1)
            f_hidden = nxt[parent_rows] if nxt is not None and self.features else None
            f_path = torch.cat((f_path[parent_rows], own[parent_rows][:, None]), dim=1)
        return select_trees(
            self._tensor(roots),
            torch.cat(tokens_l, 1),
            torch.cat(scores_l, 1),
            torch.cat(parents_l, 1),
            torch.cat(depth_l),
            shape.draft_tokens,
            depth=shape.steps,
            fanout=k,
        )

    def _draft_step(
        self,
        reqs: Sequence[Req],
        step: int,
        own: torch.Tensor,
        frontier: tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor],
        prefix: tuple[torch.Tensor, torch.Tensor],
        pos_base: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """One tree level: the frontier's (tokens, features, draft-KV path) rows run the draft at
        depth `step`, writing their KV at `own`. Returns the children's probs and target ids
        [B * topk, topk] and the rows' next features."""
        b, k = len(reqs), self.topk
        f_tokens, f_hidden, f_path = frontier
        prefix_idx, prefix_ok = prefix
        row_lens = prefix_ok.sum(1)
        # A row's draft keys follow its own prefix, not the batch's longest: where a key sits
        # on the key axis must not depend on the batch (batch-invariant attention sums the
        # keys in axis order).
        cols = row_lens[:, None] + torch.arange(step, device=self.device)[None, :]
        padding = torch.zeros(b * k, step, dtype=torch.int64, device=self.device)
        kv_idx = torch.cat((prefix_idx, padding), dim=1).scatter(
            1, cols, torch.cat((f_path, own[:, None]), dim=1)
        )
        kv_ok = torch.cat((prefix_ok, padding.bool()), dim=1).scatter(
            1, cols, torch.ones_like(cols, dtype=torch.bool)
        )
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=f_tokens.reshape(-1),
            positions=(pos_base + step).repeat_interleave(k),
            out_cache_loc=own,
            req_pool_indices=self._tensor([r.req_pool_idx for r in reqs]).repeat_interleave(k),
            seq_lens=kv_ok.sum(1),
            seq_lens_cpu=[0] * (b * k),
            kv_indices=kv_idx,
            kv_mask=kv_ok,
        )
        logits, nxt = self.draft.forward(batch, f_hidden)
        p, c = torch.softmax(logits, -1).topk(k, dim=-1)
        c = self.draft.to_target_ids(c)
        return p, c, nxt

    def _root_step(
        self, reqs: Sequence[Req], roots: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """STANDALONE: run the root tokens (slot of position kv_len, allocated for verify)."""
        kv_lens = [r.kv_len for r in reqs]
        batch = ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self._tensor(roots),
            positions=self._tensor(kv_lens),
            out_cache_loc=self.runner.req_to_token_pool.read_ranges(
                [r.req_pool_idx for r in reqs], kv_lens, [n + 1 for n in kv_lens]
            ),
            req_pool_indices=self._tensor([r.req_pool_idx for r in reqs]),
            seq_lens=self._tensor([n + 1 for n in kv_lens]),
            seq_lens_cpu=[n + 1 for n in kv_lens],
        )
        logits, _ = self.draft.forward(batch, None)
        probs, ids = torch.softmax(logits, -1).topk(self.topk, dim=-1)
        return probs, self.draft.to_target_ids(ids)

    def _prefix_indices(
        self, reqs: Sequence[Req], lens: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per branch row (topk per request): the request's prefix slots, padded to `width` (the
        longest of `lens`, known on the host), and validity."""
        table = self.runner.req_to_token_pool.req_to_token
        idx = table[self._tensor([r.req_pool_idx for r in reqs]), :width].to(torch.int64)
        ok = torch.arange(width, device=self.device)[None, :] < lens[:, None]
        return idx.repeat_interleave(self.topk, 0), ok.repeat_interleave(self.topk, 0)
