"""Admission: which waiting requests the next prefill takes (SGLang's and mini-sglang's prefill
adder).

First-come-first-served, bounded by --max-running-requests, the prefill token budget
(--max-prefill-tokens, and --chunked-prefill-size when chunking) and free KV: what
RequestKV.available_tokens counts (free pages plus what the prefix cache could evict) less what
admitted requests keep back — their future tokens times the new-token ratio, the worker's decode
headroom each, and the rest of a prompt being prefilled in chunks. A request is admitted on the
longest cached prefix of its prompt. A prompt longer than the budget is prefilled in chunks, one
per step, before anything else is admitted; a prompt identical to one in the batch waits a step
to reuse its KV.

The new-token ratio (SGLang's) starts at --schedule-conservativeness x INIT_NEW_TOKEN_RATIO,
decays with every decode step towards its minimum (most requests stop well before
max_new_tokens) and starts over when a decode step had to retract requests.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from spec_engine.args.engine_args import EngineArgs
from spec_engine.core.req_kv import RequestKV
from spec_engine.core.request import Req

CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's future tokens counted in the reserve
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # steps to decay from the initial to the minimum ratio


@dataclass
class PrefillBatch:
    """A prefill batch as it is built: its requests, and what they have left of the budget
    and of the KV room."""

    budget: int
    room: float
    reqs: list[Req] = field(default_factory=list)


class Admission:
    """Owns the waiting queue, the request being prefilled in chunks and the new-token ratio."""

    def __init__(self, args: EngineArgs, kv: RequestKV, decode_headroom: int) -> None:
        self.kv = kv
        self.decode_headroom = decode_headroom
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
        self.chunked: Optional[Req] = None
        # --schedule-policy random: SGLang shuffles the queue before every prefill.
        self.shuffle = random.Random(args.random_seed) if args.schedule_policy == "random" else None

    # ------------------------------------------------------------ the queue

    def add(self, req: Req) -> None:
        req.wait_queue_entry_time = time.perf_counter()
        self.waiting.append(req)

    def requeue(self, reqs: list[Req]) -> None:
        """Back to the head of the queue, in this order (retracted requests)."""
        now = time.perf_counter()
        for req in reqs:
            req.wait_queue_entry_time = now
        self.waiting.extendleft(reversed(reqs))

    def take_chunked(self) -> Optional[Req]:
        """The request half-way through chunked prefill, no longer being prefilled."""
        req, self.chunked = self.chunked, None
        return req

    def remove(self, req: Req) -> None:
        if req is self.chunked:
            self.chunked = None
        self.waiting = deque(r for r in self.waiting if r is not req)

    def clear(self) -> None:
        self.waiting.clear()
        self.chunked = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked)

    # ------------------------------------------------------------ the new-token ratio

    def decode_ran(self) -> None:
        self.new_token_ratio = max(
            self.min_ratio,
            self.new_token_ratio - (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS,
        )

    def decode_retracted(self) -> None:
        self.new_token_ratio = self.init_ratio

    # ------------------------------------------------------------ the next prefill

    def schedule(self, running: list[Req]) -> list[Req]:
        """The next prefill batch (empty: none), `running` being the requests that decode. The
        admitted requests leave the queue with their prefix locked and a table row, each with
        the tokens to prefill now in extend_len."""
        if not self.waiting and self.chunked is None:
            return []
        batch = PrefillBatch(
            self.prefill_budget, self.kv.available_tokens() - self.reserved_tokens(running)
        )
        if self.chunked is not None and not self._next_chunk(self.chunked, batch):
            return batch.reqs
        if self.shuffle is not None:
            queue = list(self.waiting)
            self.shuffle.shuffle(queue)
            self.waiting = deque(queue)
        admitted = self._admit(batch, running)
        if admitted:
            taken = set(map(id, admitted))
            self.waiting = deque(r for r in self.waiting if id(r) not in taken)
        return batch.reqs

    def _next_chunk(self, req: Req, batch: PrefillBatch) -> bool:
        """Add the next chunk of the request prefilled in chunks; whether it is its last (its KV
        was reserved, see reserved_tokens), so that others may join the batch."""
        remaining = req.seq_len - req.kv_len
        req.extend_len = min(remaining, batch.budget) if self.chunking else remaining
        batch.budget -= req.extend_len
        batch.reqs.append(req)
        if req.extend_len < remaining:
            return False
        self.chunked = None
        return True

    def _admit(self, batch: PrefillBatch, running: list[Req]) -> list[Req]:
        """Add waiting requests, in order, while they fit; returns those added."""
        cache_on = not self.kv.tree_cache.disable
        prompts = {tuple(r.input.origin_input_ids) for r in batch.reqs} if cache_on else set()
        admitted: list[Req] = []
        for req in self.waiting:
            if batch.budget <= 0 or len(running) + len(batch.reqs) >= self.max_running:
                break
            if not self.kv.has_free_row():
                break
            match = self.kv.match(req)
            if match.length < match.cacheable and tuple(req.input.origin_input_ids) in prompts:
                continue  # an identical prompt is being prefilled: reuse its KV next step
            extend = req.seq_len - match.length
            reserve = self._future_tokens(req) * self.new_token_ratio
            need = self.kv.tokens_to_admit(req, match, reserve) + self.decode_headroom
            if need > batch.room and (batch.reqs or running):
                break
            n = min(extend, batch.budget) if self.chunking else extend
            if not self.chunking and extend > batch.budget and batch.reqs:
                break
            self.kv.admit(req, match)
            req.forward_entry_time = req.forward_entry_time or time.perf_counter()
            req.extend_len = n
            batch.room -= need
            batch.budget -= n
            batch.reqs.append(req)
            admitted.append(req)
            if cache_on:
                prompts.add(tuple(req.input.origin_input_ids))
            if n < extend:
                self.chunked = req
                break
        return admitted

    def reserved_tokens(self, running: list[Req]) -> float:
        """KV kept back for requests already admitted: their future tokens, and the rest of the
        prompt of the request being prefilled in chunks."""
        reqs = running + ([self.chunked] if self.chunked is not None else [])
        future = sum(self._future_tokens(r) for r in reqs)
        reserved = future * self.new_token_ratio + self.decode_headroom * len(reqs)
        if self.chunked is not None:
            reserved += self.kv.tokens_to_finish_prompt(self.chunked)
        return reserved

    @staticmethod
    def _future_tokens(req: Req) -> int:
        return min(req.max_new_tokens() - len(req.output_ids), CLIP_MAX_NEW_TOKENS)
