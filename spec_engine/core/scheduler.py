"""Scheduler: continuous batching over one worker.

Each step either prefills (new requests, or the next chunk of a long prompt) or decodes every
running request. Admission is first-come-first-served and bounded by free KV (counting what
the prefix cache could evict and a reserve for running requests' future tokens, SGLang's
new-token ratio), by --max-running-requests and by the prefill token budget. When a decode
step cannot get KV, requests are retracted (their KV released, put back at the head of the
queue) and later resumed from where they stopped. Requests with the same prompt are not
prefilled side by side: the later ones wait one step and reuse the first one's cached KV.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Optional

from spec_engine.args.engine_args import EngineArgs
from spec_engine.core.accept_alarm import AcceptAlarm
from spec_engine.core.adaptive import SpecCostModel
from spec_engine.core.request import Req
from spec_engine.core.worker import ModelWorker, StepResult
from spec_engine.mem.radix_cache import RadixCache

logger = logging.getLogger(__name__)

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's future tokens counted in the reserve
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # steps to decay from the initial to the minimum ratio


class Scheduler:
    """Admission, batching, retraction and outputs over one worker. Whether generation may run
    at all (pause, released memory) is core.memory.MemoryController's to say, not the
    scheduler's."""

    def __init__(
        self,
        args: EngineArgs,
        worker: ModelWorker,
        tree_cache: RadixCache,
        eos_token_ids: frozenset[int],
        decode_tail: Optional[Callable[[list[int]], str]] = None,
    ) -> None:
        self.args = args
        self.worker = worker
        self.tree_cache = tree_cache
        self.allocator = tree_cache.allocator
        self.req_to_token = tree_cache.req_to_token
        self.page_size = args.page_size
        self.eos_token_ids = eos_token_ids
        self.decode_tail = decode_tail
        self.max_running = args.max_running_requests
        chunk = args.chunked_prefill_size
        self.chunking = chunk != -1
        self.prefill_budget = (
            min(args.max_prefill_tokens, chunk) if self.chunking else args.max_prefill_tokens
        )
        self.init_ratio = min(1.0, INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.min_ratio = min(self.init_ratio, MIN_NEW_TOKEN_RATIO * args.schedule_conservativeness)
        self.new_token_ratio = self.init_ratio
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Optional[Req] = None
        # The prefill batch being run: admitted, but not yet running (needed if the step fails).
        self.prefilling: list[Req] = []
        self.num_retractions = 0
        self.last_gen_throughput = 0.0
        self.spec_verify_ct = 0  # verify passes, engine-wide
        self.spec_emitted = 0  # tokens those passes emitted
        self.spec_depth_sum = 0  # the most drafts they could accept: each pass's depth
        # Bumped when weights change and cached KV is dropped; KV from an older epoch is never
        # shared.
        self.weight_epoch = 0
        # Accept length per weight update, with speculation only (core.accept_alarm).
        self.alarm: Optional[AcceptAlarm] = (
            AcceptAlarm(
                args.speculative_collapse_threshold,
                args.speculative_collapse_min_verify_steps,
                args.speculative_on_collapse,
                args.weight_version,
            )
            if args.speculative_algorithm is not None
            else None
        )
        self.adaptive = SpecCostModel.from_args(args) if args.speculative_adaptive else None

    # ------------------------------------------------------------ public

    def add_request(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self.waiting or self.running or self.chunked)

    def holds_kv(self) -> bool:
        """Whether a running (or half-prefilled) request holds KV slots."""
        return bool(self.running or self.chunked)

    def retract_all(self) -> None:
        """Put every running request back at the head of the queue, its KV released (it is
        recomputed when the request runs again)."""
        active = self._active_reqs()
        for req in active:
            self._release_kv(req)
            req.retractions += 1
        self.running, self.chunked = [], None
        self.waiting.extendleft(reversed(active))

    def weights_changed(self, flush: bool) -> None:
        """New weights are in: with `flush`, cached prefixes stop being served (KV that running
        requests hold stays theirs, but is never shared again)."""
        if flush:
            self.weight_epoch += 1
            self.tree_cache.invalidate()

    def _release_kv(self, req: Req) -> None:
        shared = self.worker.release(req)
        self.tree_cache.cache_finished_req(req, req.kv_epoch == self.weight_epoch, upto=shared)

    def step(self) -> None:
        batch = self._schedule_prefill()
        if batch:
            self.prefilling = batch
            result = self.worker.prefill(batch)
            self._after_prefill(batch, result)
            self.prefilling = []
        elif self.running:
            groups = self._ensure_decode_room()
            start = time.perf_counter()
            n = 0
            for reqs, depth in groups:
                caught = time.perf_counter()  # a lagging draft's catch-up: timed apart
                self.worker.catch_up(reqs, full_only=depth == 0)
                began = time.perf_counter()
                if depth != 0:  # None: the configured shape (a plain worker: its decode step)
                    out = self.worker.decode(reqs, *(() if depth is None else (depth,)))
                else:  # (never stale with NGRAM or --speculative-adaptive: draft_lag.py)
                    for req in reqs:
                        req.draft_stale = not self.worker.plain_steps_keep_draft
                    out = self.worker.decode_plain(reqs)
                seconds = time.perf_counter() - began  # the tokens are on the host: synchronized
                verify_ct, emitted = self.spec_verify_ct, self.spec_emitted
                n += self._process_outputs(reqs, out)
                passes = self.spec_verify_ct - verify_ct
                self.spec_depth_sum += passes * (depth or self.worker.max_depth)
                # The alarm compares accept lengths of one shape: the configured (deepest) one.
                if self.alarm is not None and depth in (None, self.worker.max_depth):
                    self.alarm.record(passes, self.spec_emitted - emitted)
                if self.adaptive is not None:
                    observed = (out.tokens, out.accept_paths, began - caught)
                    self.adaptive.observe(depth, len(reqs), seconds, *observed)
            self.last_gen_throughput = n / max(time.perf_counter() - start, 1e-9)
            self.new_token_ratio = max(
                self.min_ratio,
                self.new_token_ratio
                - (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS,
            )

    def _decode_groups(self) -> list[tuple[list[Req], Optional[int]]]:
        """The running requests split into groups of one forward each, with a depth (0: plain,
        None: the worker's configured decode; else --speculative-adaptive's choice). Plain: all
        while a `disable` acceptance alarm is up, and afterwards those that decoded plainly
        before (`draft_stale`): a plain step writes no draft KV and leaves a feature draft's
        next-round state (spec_state) at an older position, so they decode plainly until they
        finish rather than resync the draft (whose extend over the plain tokens would need the
        target's features there, which a plain step does not keep). Requests admitted after the
        update speculate at once. With --speculative-adaptive the cost model picks the whole
        batch's mode and depth (plain steps keep the draft recoverable: draft_lag.py)."""
        if self.alarm is None:  # no speculation
            return [(self.running, None)]
        if not self.alarm.speculating:
            return [(self.running, 0)]
        if self.adaptive is not None:  # no request is behind: any may switch at any step
            catch_up = self.worker.catch_up_seconds(self.running)  # what a try would pay first
            return [(self.running, self.adaptive.choose(len(self.running), catch_up))]
        plain = [r for r in self.running if r.draft_stale]
        spec = [r for r in self.running if not r.draft_stale]
        return [(g, depth) for g, depth in ((spec, None), (plain, 0)) if g]

    def weights_updated(self, weight_version: str) -> None:
        """A weight update (target or draft) is in under `weight_version`: acceptance is
        measured afresh and speculation, if an alarm stopped it, resumes for new requests."""
        if self.alarm is not None:
            self.alarm.weights_updated(weight_version)
        if self.adaptive is not None:
            self.adaptive.weights_updated()

    def abort(self, rid: str, message: str = "aborted by request") -> int:
        """Abort every request with this rid (or whose n-sample parent has it); returns how many."""
        victims = [r for r in self._all_reqs() if r.input.rid == rid or r.input.parent_rid == rid]
        for req in victims:
            self._finish_abort(req, message)
        return len(victims)

    def abort_all(self, message: str) -> None:
        for req in list(self._all_reqs()):
            self._finish_abort(req, message)

    def fail_all(self, message: str) -> None:
        """After a failed step: end every request with an error and start KV memory afresh
        (the step may have left slots half-assigned)."""
        reqs = list({id(r): r for r in self._all_reqs() + self.prefilling}.values())
        self.waiting.clear()
        self.running = []
        self.chunked = None
        self.prefilling = []
        self.allocator.reset()
        self.req_to_token.reset()
        self.tree_cache.reset()
        for req in reqs:
            self.worker.release(req)
            req.finished_reason = {"type": "abort", "message": message, "status_code": 500}
            req.req_pool_idx, req.last_node = None, None
            self._notify(req, True)

    def drop_prefix_cache(self) -> None:
        """Free every cached prefix and start an empty tree (no request may hold one)."""
        self.tree_cache.evict(self.tree_cache.total_size())
        self.tree_cache.reset()

    def flush_cache(self, paused: bool) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running, unless
        generation is `paused` (then cached prefixes just stop being served)."""
        if not self.has_work():
            self.drop_prefix_cache()
            return True
        if paused:
            self.weights_changed(flush=True)
            return True
        return False

    def available_tokens(self) -> int:
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def memory_report(self) -> dict[str, int]:
        """Where every KV slot is: free, cached (tree), owned by requests (whole pages); the
        three sum to the total."""
        page = self.page_size
        owned = sum(-(-r.kv_len // page) * page - r.prefix_len for r in self._active_reqs())
        return {
            "total": self.allocator.total_tokens,
            "free": self.allocator.available_size(),
            "cached": self.tree_cache.total_size(),
            "owned_by_requests": owned,
        }

    # ------------------------------------------------------------ admission

    def _schedule_prefill(self) -> list[Req]:
        if not self.waiting and self.chunked is None:
            return []
        budget = self.prefill_budget
        batch: list[Req] = []
        rem_tokens = self.available_tokens() - self._reserved_tokens()
        if self.chunked is not None:
            req = self.chunked
            remaining = req.seq_len - req.kv_len
            req.extend_len = min(remaining, budget) if self.chunking else remaining
            budget -= req.extend_len
            batch.append(req)
            if req.extend_len < remaining:
                return batch
            self.chunked = None  # its last chunk; its KV was reserved (see _reserved_tokens)
        cache_on = not self.tree_cache.disable
        prompts_in_batch = {tuple(r.input.origin_input_ids) for r in batch} if cache_on else set()
        admitted: list[Req] = []
        for req in self.waiting:
            if budget <= 0 or len(self.running) + len(batch) >= self.max_running:
                break
            if self.req_to_token.available_size() == 0:
                break
            # Prompt log-probs need the logits of the positions they score: as in SGLang, the
            # cached prefix stops at the first of them (logprob_start_len).
            scored = req.positions_to_score()
            reusable = scored.start if scored else req.seq_len - 1
            prefix, node = self.tree_cache.match_prefix(req.fill_ids[:reusable])
            prefix_len = len(prefix)
            cacheable = (reusable - self.tree_cache.key_shift) // self.page_size * self.page_size
            if prefix_len < cacheable and tuple(req.input.origin_input_ids) in prompts_in_batch:
                continue  # an identical prompt is being prefilled: reuse its KV next step
            extend = req.seq_len - prefix_len
            future = min(req.max_new_tokens() - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
            # Locking the matched prefix takes it out of the evictable room as well.
            need = (
                self.allocator.pages_needed([prefix_len], [req.seq_len]) * self.page_size
                + future * self.new_token_ratio
                + self.tree_cache.unlocked_len(node)
                + self.worker.decode_headroom()
            )
            if need > rem_tokens and (batch or self.running):
                break
            n = min(extend, budget) if self.chunking else extend
            if not self.chunking and extend > budget and batch:
                break
            self.tree_cache.inc_lock_ref(node)
            req.kv_epoch = self.weight_epoch
            req.draft_stale = False  # the worker's prefill rebuilds the draft's KV and state
            req.req_pool_idx = self.req_to_token.alloc()
            self.req_to_token.write(req.req_pool_idx, 0, prefix)
            req.prefix_len = req.kv_len = prefix_len
            req.last_node = node
            if req.retractions == 0:
                req.cached_tokens = prefix_len
            req.extend_len = n
            rem_tokens -= need
            budget -= n
            batch.append(req)
            admitted.append(req)
            if not self.tree_cache.disable:
                prompts_in_batch.add(tuple(req.input.origin_input_ids))
            if n < extend:
                self.chunked = req
                break
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        return batch

    def _reserved_tokens(self) -> float:
        """KV kept back for requests already admitted: their future tokens, and the rest of the
        prompt of the request being prefilled in chunks."""
        reqs = self.running + ([self.chunked] if self.chunked is not None else [])
        future = sum(min(r.max_new_tokens() - len(r.output_ids), CLIP_MAX_NEW_TOKENS) for r in reqs)
        reserved = future * self.new_token_ratio + self.worker.decode_headroom() * len(reqs)
        if self.chunked is not None:
            r = self.chunked
            reserved += self.allocator.pages_needed([r.kv_len], [r.seq_len]) * self.page_size
        return reserved

    def _after_prefill(self, batch: list[Req], result: StepResult) -> None:
        finished_prefill = []
        for req, tokens in zip(batch, result.tokens):
            # Share the computed prompt pages at once (chunk by chunk for long prompts).
            self.tree_cache.cache_unfinished_req(req, insert=req.kv_epoch == self.weight_epoch)
            if tokens:
                finished_prefill.append(req)
                self.running.append(req)
        if finished_prefill:
            idx = [i for i, t in enumerate(result.tokens) if t]
            sub = StepResult(
                tokens=[result.tokens[i] for i in idx],
                logprobs=[result.logprobs[i] for i in idx] if result.logprobs is not None else None,
                top_logprobs=[result.top_logprobs[i] for i in idx]
                if result.top_logprobs is not None
                else None,
                top_p_ids=[result.top_p_ids[i] for i in idx]
                if result.top_p_ids is not None
                else None,
            )
            self._process_outputs(finished_prefill, sub)

    # ------------------------------------------------------------ decode memory

    def _decode_kv_demand(self, groups: list[tuple[list[Req], Optional[int]]]) -> int:
        """KV the decode step of `groups` allocates: a plain group needs only its one token each."""
        return sum(
            self.worker.decode_kv_demand(reqs, depth)
            if depth != 0
            else self.worker.decode_plain_kv_demand(reqs)
            for reqs, depth in groups
        )

    def _ensure_decode_room(self) -> list[tuple[list[Req], Optional[int]]]:
        """Retract requests until the next decode step fits; returns its groups (asked once per
        step, and again after each retraction: a choice fits the cost model)."""
        retracted: list[Req] = []
        while self._decode_kv_demand(groups := self._decode_groups()) > self.available_tokens():
            if self.chunked is not None:
                # A prompt half-way through chunked prefill has made the least progress.
                victim, self.chunked = self.chunked, None
            elif len(self.running) > 1:
                # SGLang's choice: the request with the fewest outputs, then the longest prompt.
                victim = min(
                    self.running, key=lambda r: (len(r.output_ids), -len(r.input.origin_input_ids))
                )
                self.running.remove(victim)
            else:
                raise RuntimeError(
                    "a single request does not fit in the KV cache; admission should have refused "
                    "it"
                )
            self._release_kv(victim)
            victim.retractions += 1
            retracted.append(victim)
        if retracted:
            # Back to the head of the queue, in the order they were chosen.
            self.waiting.extendleft(reversed(retracted))
            self.num_retractions += len(retracted)
            self.new_token_ratio = self.init_ratio
            logger.warning(
                "KV cache full: retracted %d request(s); they resume when memory frees up "
                "(raise --max-total-tokens or lower --max-running-requests to avoid this)",
                len(retracted),
            )
        return groups

    # ------------------------------------------------------------ outputs

    def _process_outputs(self, reqs: list[Req], result: StepResult) -> int:
        """Append emitted tokens, finish and release requests that are done; returns tokens
        added."""
        added = 0
        for i, req in enumerate(reqs):
            before = len(req.output_ids)
            if req.max_new_tokens() == 0:  # prefill only: the prompt was scored
                req.finished_reason = {"type": "length", "length": 0}
            if i in result.failed and not req.finished:
                logger.error("request %s failed: %s", req.input.rid, result.failed[i])
                req.finished_reason = {
                    "type": "abort",
                    "message": result.failed[i],
                    "status_code": 500,
                }
            for j, token in enumerate([] if req.finished else result.tokens[i]):
                req.output_ids.append(token)
                if result.logprobs is not None:
                    req.output_logprobs.append(result.logprobs[i][j])
                if result.top_logprobs is not None:
                    req.output_top_logprobs.append(result.top_logprobs[i][j])
                if result.top_p_ids is not None and result.top_p_ids[i]:
                    req.output_top_p_ids.append(result.top_p_ids[i][j])
                req.check_finished(self.eos_token_ids, self.decode_tail)
                if req.finished:
                    break
            emitted = len(req.output_ids) - before
            added += emitted
            if result.drafted is not None:
                req.spec_verify_ct += 1
                req.spec_emitted += emitted
                req.spec_drafted += result.drafted[i]
                self.spec_verify_ct += 1
                self.spec_emitted += emitted
            if req.finished:
                self._trim_kv(req)
                self._keep_routing(req)
                self._release_kv(req)
                self._notify(req, True)
            elif (
                req.input.stream
                and len(req.output_ids) - req.delivered >= self.args.stream_interval
            ):
                self._notify(req, False)
        if any(r.finished for r in reqs):
            self.running = [r for r in self.running if not r.finished]
        return added

    def _keep_routing(self, req: Req) -> None:
        """SGLang's rows: every token whose KV exists at the finish (the prompt and the output but
        the last token), from routed_experts_start_len; a failed request's KV may be partial."""
        if req.input.return_routed_experts and "status_code" not in req.finished_reason:
            slots = self.req_to_token.read(
                req.req_pool_idx, req.seq_len - 1, start=req.input.routed_experts_start_len
            )
            req.routed_experts = self.worker.runner.routing.read(slots)

    def _trim_kv(self, req: Req) -> None:
        """A speculative step can compute KV past the token a request stopped at: free it."""
        if req.kv_len <= req.seq_len:
            return
        first_free = -(-req.seq_len // self.page_size) * self.page_size  # pages of kept tokens stay
        if first_free < req.kv_len:
            self.allocator.free(
                self.req_to_token.read(req.req_pool_idx, req.kv_len, start=first_free)
            )
        req.kv_len = req.seq_len

    def _notify(self, req: Req, finished: bool) -> None:
        if req.on_output is None:
            return
        try:
            req.on_output(req, finished)
        except Exception:  # a consumer's failure must not stop the engine; it is logged
            logger.exception("delivering output of request %s failed", req.input.rid)
        req.delivered = len(req.output_ids)

    def _finish_abort(self, req: Req, message: str) -> None:
        req.finished_reason = {"type": "abort", "message": message}
        if req.req_pool_idx is not None:
            self._release_kv(req)
        if req is self.chunked:
            self.chunked = None
        self.running = [r for r in self.running if r is not req]
        self.waiting = deque(r for r in self.waiting if r is not req)
        self._notify(req, True)

    def _active_reqs(self) -> list[Req]:
        reqs = list(self.running)
        if self.chunked is not None and self.chunked not in reqs:
            reqs.append(self.chunked)
        return reqs

    def _all_reqs(self) -> list[Req]:
        return list(self.waiting) + self._active_reqs()
