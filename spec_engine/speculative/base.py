"""SpecWorker: what every speculative worker shares — verifying draft trees with the target and
keeping exactly the KV of accepted tokens.

KV of a verify step: each request gets slots for positions kv_len .. kv_len + n - 1 (n = tree
size), continuing its pages, and tree node i writes the slot of position kv_len + i. After
acceptance the accepted path's K/V is copied down to positions kv_len .. kv_len + a (node i of
the path to position kv_len + i; every source is read before any destination is written), by
one gather over the walks' fixed-width device paths, and whole pages past the kept positions are
freed (by the walks' host values, read with the verify's tokens). The same slot layout
works for any page size and leaves the request-to-token row contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Optional

import torch

from spec_engine.args.engine_args import EngineArgs
from spec_engine.args.spec_shapes import SpecShape, spec_shapes
from spec_engine.constrained.mask import mask_trees
from spec_engine.core.custom_logit_processor import apply_processors_to_trees
from spec_engine.core.logits_processor import (
    NONFINITE_LOGITS,
    nonfinite_flags,
    process_logits,
    replace_nan,
    top_p_replay,
    wants_top_p_replay,
    warn_nan,
)
from spec_engine.core.request import Req
from spec_engine.core.worker import AllocFn, ModelWorker, StepResult
from spec_engine.forward_batch import ForwardBatch, ForwardMode
from spec_engine.runner.model_runner import ForwardOutput, ModelRunner
from spec_engine.speculative.stage_times import StageTimes
from spec_engine.speculative.tree import DraftTree, TreeTensors, host_trees, tree_masks
from spec_engine.speculative.verify import Acceptance, LogprobAsk, WalkTensors, verify_trees


class SpecWorker(ModelWorker):
    # Speculative steps overlap only where a worker says so (speculative/chain_overlap.py).
    can_overlap = False

    def __init__(
        self,
        runner: ModelRunner,
        alloc_kv: AllocFn,
        eos_token_ids: frozenset[int],
        args: EngineArgs,
    ) -> None:
        super().__init__(runner, alloc_kv, eos_token_ids)
        # The configured (deepest) shape, and with --speculative-adaptive the shallower ones the
        # speculation policy may ask `decode` for (args.spec_shapes).
        self.shapes = {s.depth: s for s in spec_shapes(args, args.speculative_adaptive)}
        self.max_depth = max(self.shapes)
        self.num_draft_tokens = args.speculative_num_draft_tokens
        self.threshold_single = args.speculative_accept_threshold_single
        self.threshold_acc = args.speculative_accept_threshold_acc
        self.timings = StageTimes(self.device)
        self.verify_steps = 0

    def decode_headroom(self) -> int:
        # Verify slots past the last token (the deepest shape's), plus a page of rounding.
        return self.num_draft_tokens + self.page_size

    def decode_kv_demand(self, reqs: Sequence[Req], depth: Optional[int] = None) -> int:
        if depth == 0:
            return super().decode_kv_demand(reqs)
        return self._speculate_kv_demand(reqs, self.shape(depth))

    def decode(self, reqs: Sequence[Req], depth: Optional[int] = None) -> StepResult:
        """A verify round at `depth` (None: the deepest), or with depth 0 `decode_plain`."""
        if depth == 0:
            return self.decode_plain(reqs)
        return self._speculate(reqs, self.shape(depth))

    def _speculate_kv_demand(self, reqs: Sequence[Req], shape: SpecShape) -> int:
        """KV tokens a verify round of `shape` allocates for `reqs`."""
        raise NotImplementedError

    def _speculate(self, reqs: Sequence[Req], shape: SpecShape) -> StepResult:
        """Draft trees of `shape` for `reqs`, verified (SpecWorker.verify)."""
        raise NotImplementedError

    def decode_plain(self, reqs: Sequence[Req]) -> StepResult:
        """One token per request without speculation: the target's KV and sampling as plain
        decoding (a draft's state is left behind unless the worker records what it misses)."""
        return ModelWorker.decode(self, reqs)

    # What the speculation policy (speculative/policy.py) asks of a worker beyond decoding.

    @property
    def plain_steps_keep_draft(self) -> bool:
        """Whether the worker may speculate again after `decode_plain` steps (no draft state a
        plain step leaves behind)."""
        return True

    def catch_up(self, reqs: Sequence[Req], full_only: bool = False) -> None:
        """Before a speculative `decode`: bring a draft that lags behind plain steps up to date
        (speculative/draft_lag.py; `decode` would otherwise do it first), synchronized. Before a
        plain step (`full_only`): only the drafts that lag by draft_lag.lag_limit positions."""

    def catch_up_seconds(self, reqs: Sequence[Req]) -> Optional[float]:
        """What `catch_up(reqs)` would take now (0 without a lagging draft; None: not known
        yet)."""
        return 0.0

    def shape(self, depth: Optional[int]) -> SpecShape:
        """The shape of a decode step at `depth` (None: the deepest)."""
        shape = self.shapes.get(self.max_depth if depth is None else depth)
        if shape is None:
            raise ValueError(
                f"speculative depth {depth} is not one of this worker's ({sorted(self.shapes)})"
            )
        return shape

    def verify_kv_demand(self, reqs: Sequence[Req], sizes: Sequence[int]) -> int:
        starts = [r.kv_len for r in reqs]
        return self.page_size * self.runner.allocator.pages_needed(
            starts, [s + n for s, n in zip(starts, sizes)]
        )

    def alloc_verify_slots(self, reqs: Sequence[Req], sizes: Sequence[int]) -> None:
        """Slots for positions kv_len .. kv_len + size - 1 of each request, written to its row."""
        starts = [r.kv_len for r in reqs]
        self._alloc(reqs, starts, [s + n for s, n in zip(starts, sizes)])

    def verify(
        self,
        reqs: Sequence[Req],
        trees: TreeTensors,
        on_host: Optional[Sequence[DraftTree]] = None,
    ) -> tuple[StepResult, list[Acceptance], ForwardOutput]:
        """Run the target over every tree (slots already allocated), accept, keep accepted KV.
        `on_host`: the trees on the host where the worker has them (else read when a request
        needs them: `_accept`)."""
        start = self.timings.now()
        self.verify_steps += 1
        batch = self._verify_batch(reqs, trees)
        slots = batch.out_cache_loc
        out = self.runner.forward(batch)
        result, accepts, walk = self._accept(out.logits, reqs, trees, on_host)
        start = self.timings.add("verify_s", start)
        self._keep_accepted(reqs, trees.sizes, accepts, walk, slots)
        self.timings.add("bookkeeping_s", start)
        return result, accepts, out

    def _verify_batch(self, reqs: Sequence[Req], trees: TreeTensors) -> ForwardBatch:
        """The TARGET_VERIFY forward of each tree after its request's KV, node i at position
        kv_len + its depth writing the slot of kv_len + i, attending by the tree's mask."""
        sizes = trees.sizes
        kv_lens = [r.kv_len for r in reqs]
        ends = [k + n for k, n in zip(kv_lens, sizes)]
        positions = self._tensor(kv_lens)[:, None] + trees.depths
        ids, positions = trees.tokens.reshape(-1), positions.reshape(-1)
        width = trees.tokens.shape[1]
        if any(n < width for n in sizes):  # padded trees (NGRAM's): their real nodes
            real = self._tensor([i * width + k for i, n in enumerate(sizes) for k in range(n)])
            ids, positions = ids[real], positions[real]
        return ForwardBatch(
            mode=ForwardMode.TARGET_VERIFY,
            input_ids=ids,
            positions=positions,
            out_cache_loc=self.runner.req_to_token_pool.read_ranges(
                [r.req_pool_idx for r in reqs], kv_lens, ends
            ),
            req_pool_indices=self._tensor([r.req_pool_idx for r in reqs]),
            seq_lens=self._tensor(ends),
            seq_lens_cpu=ends,
            extend_seq_lens_cpu=list(sizes),
            extend_prefix_lens_cpu=kv_lens,
            custom_masks=tree_masks(trees, kv_lens, self.device),
            capture_hidden=True,
        )

    def _accept(
        self,
        logits: torch.Tensor,
        reqs: Sequence[Req],
        trees: TreeTensors,
        on_host: Optional[Sequence[DraftTree]],
    ) -> tuple[StepResult, list[Acceptance], WalkTensors]:
        """Accept each tree's longest path the target agrees with (tree rejection sampling at the
        requests' sampling parameters), with the emitted tokens' log-probs: on the host, and the
        walks on the device."""
        detect = self.runner.args.enable_nan_detection
        logits, flags = replace_nan(logits) if detect else (logits, nonfinite_flags(logits))
        if any(_walks_paths(r) for r in reqs):  # the trees' paths on the host: a read
            on_host = on_host if on_host is not None else host_trees(trees)
            logits = _process_tree_logits(logits, reqs, on_host)
            parents, tokens = [t.parents for t in on_host], [t.tokens for t in on_host]
            logits = mask_trees(logits, [r.grammar for r in reqs], parents, tokens)
            logits = apply_processors_to_trees(logits, reqs, parents, tokens)
        banned = [
            [r.banned_tokens(self.eos_token_ids, d) for d in range(trees.depth + 1)] for r in reqs
        ]
        asked = LogprobAsk(
            [r.input.return_logprob for r in reqs],
            [r.input.top_logprobs_num for r in reqs],
            [r.input.token_ids_logprob for r in reqs],
        )
        # The verify's read: the walks, the NaN flags and the asked log-probs in one copy.
        (accepts, flag_values, logprobs, top, chosen), walk = verify_trees(
            logits,
            trees,
            reqs,
            banned,
            self.threshold_single,
            self.threshold_acc,
            flags,
            asked,
        )
        bad_rows: set[int] = set()
        if detect:
            warn_nan(flag_values)
        else:
            bad_rows = {row for row, bad in enumerate(flag_values) if bad}
        top_p_ids = _top_p_replay(logits, reqs, accepts, logprobs)  # renormalises logprobs
        result = StepResult(
            tokens=[a.tokens for a in accepts],
            logprobs=logprobs,
            top_logprobs=top,
            token_ids_logprobs=chosen,
            drafted=[n - 1 for n in trees.sizes],
            accept_paths=[a.path for a in accepts],
            top_p_ids=top_p_ids,
            # Only rows that produced an emitted token count: a rejected draft branch (say, a
            # token whose embedding is broken) does not fail its request.
            failed={
                i: NONFINITE_LOGITS for i, a in enumerate(accepts) if bad_rows.intersection(a.rows)
            },
        )
        return result, accepts, walk

    def _keep_accepted(
        self,
        reqs: Sequence[Req],
        sizes: Sequence[int],
        accepts: Sequence[Acceptance],
        walk: WalkTensors,
        slots: torch.Tensor,
    ) -> None:
        """`slots`: the verify's slots, request after request (positions kv_len .. + size - 1).
        The accepted path's KV moves down by the device paths (`walk`), the rest is freed by the
        host's (`accepts`, the same walks read back)."""
        # The same slots on the host (the table's mirror): which to free costs no read.
        host = self.runner.req_to_token_pool.read_ranges_host(
            [r.req_pool_idx for r in reqs],
            [r.kv_len for r in reqs],
            [r.kv_len + n for r, n in zip(reqs, sizes)],
        )
        free = []
        page = self.page_size
        offset = 0
        for r, n, acc in zip(reqs, sizes, accepts):
            k = r.kv_len
            kept = len(acc.path)
            first_free = -(-(k + kept) // page) * page  # pages holding a kept position stay
            free.extend(range(offset + first_free - k, offset + n))
            r.kv_len = k + kept
            offset += n
        if any(node != j for acc in accepts for j, node in enumerate(acc.path)):
            self._move_accepted(sizes, walk, slots)
        if free:
            self.runner.allocator.free(host[free])

    def _move_accepted(self, sizes: Sequence[int], walk: WalkTensors, slots: torch.Tensor) -> None:
        """Copy each accepted path's KV (and routing) down, node path[j] to position kv_len + j,
        in one gather over the fixed-width paths: entries past a walk move its root onto itself
        (harmless; the root is no other move's destination)."""
        b, width = walk.path.shape
        starts = self._tensor(list(accumulate(sizes, initial=0))[:-1])[:, None]
        steps = torch.arange(width, device=self.device)[None, :]
        on_path = steps <= walk.accepted[:, None]
        src = starts + torch.where(on_path, walk.path, 0)
        dst = starts + torch.where(on_path, steps, 0)
        picked = slots[torch.cat((src.reshape(-1), dst.reshape(-1)))]
        src_t, dst_t = picked[: b * width], picked[b * width :]
        for buf in self.runner.kv_pool.buffers():
            buf.index_copy_(0, dst_t, buf.index_select(0, src_t))
        if self.runner.routing is not None:  # accepted tokens' routing moves with their KV
            self.runner.routing.move(src_t, dst_t)


def _walks_paths(req: Req) -> bool:
    """Whether `req`'s verify rows depend on their draft paths: penalties or logit bias, a
    grammar, a custom logit processor."""
    return (
        req.input.sampling_params.changes_logits
        or req.grammar is not None
        or req.input.custom_logit_processor is not None
    )


def _process_tree_logits(
    logits: torch.Tensor, reqs: Sequence[Req], trees: Sequence[DraftTree]
) -> torch.Tensor:
    """Penalties and logit bias per verify row, each row with the tokens its request would have
    emitted up to that node: the output so far (the root included) and the draft path."""
    if not any(r.input.sampling_params.changes_logits for r in reqs):
        return logits
    params, contexts = [], []
    for r, tree in zip(reqs, trees):
        sp = r.input.sampling_params
        params.extend([sp] * tree.size)
        if not sp.changes_logits:
            contexts.extend([()] * tree.size)
            continue
        paths: list[list[int]] = []
        for node, parent in enumerate(tree.parents):
            paths.append([] if parent < 0 else [*paths[parent], tree.tokens[node]])
        contexts.extend(r.output_ids + path for path in paths)
    return process_logits(logits, params, contexts)


def _top_p_replay(
    logits: torch.Tensor,
    reqs: Sequence[Req],
    accepts: Sequence[Acceptance],
    logprobs: Optional[list[list[float]]],
) -> Optional[list[list[list[int]]]]:
    """slime's top-p replay for the requests that ask: each emitted token's nucleus from the
    verify row that produced it; their log-probs renormalised over it (in place)."""
    asking = [i for i, r in enumerate(reqs) if wants_top_p_replay(r.input.sampling_params)]
    if not asking:
        return None
    out: list[list[list[int]]] = [[] for _ in reqs]
    for i in asking:
        acc, sp = accepts[i], reqs[i].input.sampling_params
        rows = torch.tensor(acc.rows, dtype=torch.int64, device=logits.device)
        out[i], renormed = top_p_replay(logits[rows], [sp] * len(acc.rows), acc.tokens)
        if logprobs is not None and reqs[i].input.return_logprob:
            logprobs[i] = renormed
    return out
