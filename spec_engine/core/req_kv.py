"""RequestKV: the KV that requests hold, from admission to release (mini-sglang's cache and table
managers in one).

A request admitted with a cached prefix locks it in the prefix cache (mem.radix_cache) and
takes a row of the request-to-token table; its computed prompt pages go to the cache as they are
prefilled, KV a speculative step computed past its finish is freed, and at its end (or
retraction, or abort) its whole pages go to the cache. The weight epoch keeps KV computed with
older weights from ever being shared: it is bumped when new weights flush the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from spec_engine.core.request import Req
from spec_engine.core.worker import ModelWorker
from spec_engine.mem.radix_cache import RadixCache


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a request's prompt: its slots and tree node, and how long a
    prefix the cache could hold (`cacheable`: whole pages of what may be reused)."""

    slots: torch.Tensor
    node: Any
    cacheable: int

    @property
    def length(self) -> int:
        return len(self.slots)


class RequestKV:
    """Owns the weight epoch; every request's KV is claimed and released here."""

    def __init__(self, worker: ModelWorker, tree_cache: RadixCache, page_size: int) -> None:
        self.worker = worker
        self.tree_cache = tree_cache
        self.allocator = tree_cache.allocator
        self.req_to_token = tree_cache.req_to_token
        self.page_size = page_size
        # Bumped when weights change and cached KV is dropped; KV from an older epoch is never
        # shared.
        self.weight_epoch = 0

    def available_tokens(self) -> int:
        """Free slots plus what the prefix cache could evict."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def has_free_row(self) -> bool:
        return self.req_to_token.available_size() > 0

    def match(self, req: Req) -> PrefixMatch:
        """The cached prefix `req` may start from. Prompt log-probs need the logits of the
        positions they score: as in SGLang, the prefix stops at the first of them
        (logprob_start_len)."""
        scored = req.positions_to_score()
        reusable = scored.start if scored else req.seq_len - 1
        slots, node = self.tree_cache.match_prefix(req.fill_ids[:reusable])
        cacheable = (reusable - self.tree_cache.key_shift) // self.page_size * self.page_size
        return PrefixMatch(slots, node, cacheable)

    def tokens_to_admit(self, req: Req, match: PrefixMatch, reserve: float) -> float:
        """KV room admitting `req` on `match` takes: the pages of its prompt past the prefix,
        `reserve` for its future tokens, and the matched prefix that locking takes out of the
        evictable room."""
        pages = self.allocator.pages_needed([match.length], [req.seq_len])
        return pages * self.page_size + reserve + self.tree_cache.unlocked_len(match.node)

    def tokens_to_finish_prompt(self, req: Req) -> int:
        """KV the rest of a partly prefilled prompt will take (whole pages)."""
        return self.allocator.pages_needed([req.kv_len], [req.seq_len]) * self.page_size

    def admit(self, req: Req, match: PrefixMatch) -> None:
        """Lock `match` for `req` and give it a table row holding the prefix's slots."""
        self.tree_cache.inc_lock_ref(match.node)
        req.kv_epoch = self.weight_epoch
        req.req_pool_idx = self.req_to_token.alloc()
        self.req_to_token.write(req.req_pool_idx, 0, match.slots)
        req.prefix_len = req.kv_len = match.length
        req.last_node = match.node
        if req.retractions == 0:
            req.cached_tokens = match.length

    def cache_prefilled(self, req: Req) -> None:
        """Share the prompt pages `req` computed so far (chunk by chunk for long prompts)."""
        self.tree_cache.cache_unfinished_req(req, insert=req.kv_epoch == self.weight_epoch)

    def trim(self, req: Req, end: Optional[int] = None) -> None:
        """A speculative step can compute KV past the token a request stopped at, an overlapped
        step past what the request would hold without it (`end`): free it."""
        end = req.seq_len if end is None else end
        if req.kv_len <= end:
            return
        first_free = -(-end // self.page_size) * self.page_size  # pages of kept tokens stay
        if first_free < req.kv_len:
            self.allocator.free(
                self.req_to_token.read_host(req.req_pool_idx, req.kv_len, start=first_free)
            )
        req.kv_len = end

    def slots(self, req: Req, start: int, end: int) -> torch.Tensor:
        """The slots of positions [start, end) of `req`."""
        return self.req_to_token.read(req.req_pool_idx, end, start=start)

    def release(self, req: Req) -> None:
        """Give `req`'s whole pages to the prefix cache (those the worker says may be shared;
        none if computed under older weights) and free the rest, with its row."""
        shared = self.worker.release(req)
        self.tree_cache.cache_finished_req(req, req.kv_epoch == self.weight_epoch, upto=shared)

    def weights_changed(self, flush: bool) -> None:
        """New weights are in: with `flush`, cached prefixes stop being served (KV that running
        requests hold stays theirs, but is never shared again)."""
        if flush:
            self.weight_epoch += 1
            self.tree_cache.invalidate()

    def drop_prefix_cache(self) -> None:
        """Free every cached prefix and start an empty tree (no request may hold one)."""
        self.tree_cache.evict(self.tree_cache.total_size())
        self.tree_cache.reset()

    def reset(self, reqs: Sequence[Req]) -> None:
        """Start KV memory afresh after a failed step (it may have left slots half-assigned):
        `reqs`, every request there was, hold nothing any more."""
        self.allocator.reset()
        self.req_to_token.reset()
        self.tree_cache.reset()
        for req in reqs:
            self.worker.release(req)
            req.req_pool_idx, req.last_node = None, None

    def memory_report(self, active: Sequence[Req]) -> dict[str, int]:
        """Where every KV slot is: free, cached (tree), owned by the `active` requests (whole
        pages); the three sum to the total."""
        page = self.page_size
        owned = sum(-(-r.kv_len // page) * page - r.prefix_len for r in active)
        return {
            "total": self.allocator.total_tokens,
            "free": self.allocator.available_size(),
            "cached": self.tree_cache.total_size(),
            "owned_by_requests": owned,
        }
