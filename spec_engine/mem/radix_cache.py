"""Prefix cache: a radix tree from token ids to KV slots, shared by requests, LRU-evicted.

Keys are cut to whole pages, so the tree only ever owns whole pages. A request owns the tree
nodes on the path to its `last_node` through a lock (lock_ref > 0 means not evictable), and
owns outright the slots from `prefix_len` to `kv_len` in its row of the request-to-token table.
With `disable=True` nothing is shared and the request-level calls just free.

With `next_token_keys` (drafts that read the target's features: EAGLE, EAGLE-3, MTP) position p
is keyed by (token p, token p + 1), SGLang's bigram keys: such a draft's KV at position p is
computed from token p + 1, so two sequences may share that slot only when both tokens agree.
Keyed by token p alone, a request whose prompt ends where a cached sequence goes on (the same
prompt sampled again, or a prompt that branches off a cached one) was given the cached slot and
with it a draft entry built from another next token: not wrong outputs, but other draft
proposals (lower acceptance; and sampled tokens that depend on which request cached first).
A sequence's last position has no next token yet, so it is never shared.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch

from spec_engine.mem.allocator import PageAllocator, Slots
from spec_engine.mem.kv_pool import ReqToTokenPool

_EMPTY = torch.empty(0, dtype=torch.int64, device="cpu")  # moved to the pool's device on use
_tick = itertools.count()


class HoldsKV(Protocol):
    """What the cache reads and updates of a request (core.request.Req)."""

    fill_ids: list[int]
    req_pool_idx: Optional[int]
    kv_len: int
    prefix_len: int
    last_node: Any


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(
        self,
        parent: Optional[TreeNode] = None,
        key: Optional[list[int]] = None,
        value: Optional[torch.Tensor] = None,
    ) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key or []
        self.value: torch.Tensor = value if value is not None else _EMPTY
        self.lock_ref = 0
        self.last_access = next(_tick)

    def __lt__(self, other: TreeNode) -> bool:
        return self.last_access < other.last_access


class RadixCache:
    def __init__(
        self,
        allocator: PageAllocator,
        req_to_token: ReqToTokenPool,
        page_size: int,
        disable: bool = False,
        next_token_keys: bool = False,
    ) -> None:
        self.allocator = allocator
        self.req_to_token = req_to_token
        self.page_size = page_size
        self.disable = disable
        # Tokens of lookahead a position's key holds (1 with next-token keys).
        self.key_shift = 1 if next_token_keys else 0
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1
        # Trees made unmatchable by invalidate() while requests still held some of their nodes.
        self._stale_roots: list[TreeNode] = []
        self._evictable = 0
        self._protected = 0

    def invalidate(self) -> None:
        """Stop serving every cached prefix (the weights changed): unlocked entries are freed now,
        entries still locked by requests become evictable once those requests let go of them."""
        if self.disable:
            return
        self._stale_roots.append(self.root)
        self.root = TreeNode()
        self.root.lock_ref = 1
        self.evict(self._evictable)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ------------------------------------------------------------ tree operations

    def match_prefix(self, tokens: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """Longest cached prefix of `tokens` (whole pages): its KV slots and its last node."""
        if self.disable:
            return _EMPTY.to(self.allocator.device), self.root
        key = self.keyed(tokens)
        node, _, values = self._descend(key[: len(key) // self.page_size * self.page_size])
        value = torch.cat(values) if values else _EMPTY.to(self.allocator.device)
        return value, node

    def keyed(self, tokens: list[int]) -> list:
        """The tree's key of a token sequence: one entry per position that can be cached."""
        return list(zip(tokens, tokens[1:])) if self.key_shift else tokens

    def insert(self, key: list, value: torch.Tensor) -> int:
        """Insert key (see `keyed`) -> slots; returns how many leading positions were already
        cached (the caller still owns its own slots for those and must free the ones that are not
        the tree's)."""
        assert len(key) % self.page_size == 0 and len(key) == len(value)
        node, matched, _ = self._descend(key)
        if matched < len(key):
            rest = key[matched:]
            node.children[self._edge(rest)] = TreeNode(node, rest, value[matched:].clone())
            self._evictable += len(rest)
        return matched

    def _descend(self, key: list[int]) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `key` from the root (splitting the node where the match ends, so the match
        ends on a node); returns (last node, tokens matched, the slots along the way)."""
        node, matched, values = self.root, 0, []
        stamp = next(_tick)
        while matched < len(key):
            rest = key[matched:]
            child = node.children.get(self._edge(rest))
            if child is None:
                break
            n = self._match_len(child.key, rest)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            values.append(child.value)
            matched += n
            node = child
        return node, matched, values

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlocked_len(self, node: TreeNode) -> int:
        """Tokens on the path to `node` that are evictable now (what locking it would protect)."""
        total = 0
        while node.parent is not None:
            if node.lock_ref == 0:
                total += len(node.key)
            node = node.parent
        return total

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0, "radix cache lock released twice"
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` from unlocked leaves, least recently used first."""
        if self.disable or num_tokens <= 0:
            return 0
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed = 0
        while leaves and freed < num_tokens:
            leaf = heapq.heappop(leaves)
            self.allocator.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._edge(leaf.key)]
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        self._stale_roots = [r for r in self._stale_roots if r.children]
        return freed

    def alloc_slots(
        self, starts: Sequence[int], ends: Sequence[int], last_slots: Sequence[int]
    ) -> Slots:
        """KV slots for positions [start, end) of each request (see PageAllocator.alloc),
        evicting cached prefixes when the free pages do not suffice."""
        page = self.page_size
        short = self.allocator.pages_needed(starts, ends) * page - self.allocator.available_size()
        if short > 0:
            self.evict(short)
        slots = self.allocator.alloc_slots(starts, ends, last_slots)
        if slots is None:
            raise RuntimeError(
                "KV cache exhausted although the scheduler reserved room; this is a bug"
            )
        return slots

    # ------------------------------------------------------------ request-level

    def cache_unfinished_req(self, req: HoldsKV, insert: bool = True) -> None:
        """Move the request's computed whole pages into the tree and lock them for it (not when
        `insert` is False: KV computed with weights that have since changed is not shared)."""
        if self.disable or not insert:
            return
        aligned = self._cacheable(req)
        if aligned <= req.prefix_len:
            return
        tokens = req.fill_ids[: aligned + self.key_shift]
        slots = self.req_to_token.read(req.req_pool_idx, aligned)
        already = self.insert(self.keyed(tokens), slots)
        host = self.req_to_token.read_host(req.req_pool_idx, aligned)
        self.allocator.free(host[req.prefix_len : already])
        new_slots, node = self.match_prefix(tokens)
        assert len(new_slots) == aligned, "radix cache lost a just-inserted prefix"
        self.req_to_token.write(req.req_pool_idx, req.prefix_len, new_slots[req.prefix_len :])
        self.inc_lock_ref(node)
        self.dec_lock_ref(req.last_node)
        req.prefix_len, req.last_node = aligned, node

    def cache_finished_req(
        self, req: HoldsKV, insert: bool = True, upto: Optional[int] = None
    ) -> None:
        """Release a request's KV: whole pages go to the tree (unlocked), the rest is freed.
        With `insert` False (stale KV) nothing new enters the tree; `upto`: no position from
        there on does (a draft model's KV is missing there)."""
        row = req.req_pool_idx
        # Frees from the table's host mirror (no read); the tree keeps device slots.
        host = self.req_to_token.read_host(row, req.kv_len)
        if self.disable:
            self.allocator.free(host)
        elif not insert:
            self.allocator.free(host[req.prefix_len :])
            self.dec_lock_ref(req.last_node)
        else:
            limit = self._cacheable(req) if upto is None else min(self._cacheable(req), upto)
            aligned = max(limit // self.page_size * self.page_size, req.prefix_len)
            tokens = req.fill_ids[: aligned + self.key_shift]
            already = self.insert(self.keyed(tokens), self.req_to_token.read(row, aligned))
            self.allocator.free(host[req.prefix_len : already])
            self.allocator.free(host[aligned:])
            self.dec_lock_ref(req.last_node)
        self.req_to_token.free(row)
        req.req_pool_idx, req.last_node, req.prefix_len, req.kv_len = None, None, 0, 0

    # ------------------------------------------------------------ helpers

    def _cacheable(self, req: HoldsKV) -> int:
        """Positions of `req` the tree can hold: computed, with their key's tokens known, in
        whole pages."""
        known = min(req.kv_len, len(req.fill_ids) - self.key_shift)
        return known // self.page_size * self.page_size

    def _edge(self, key: list[int]) -> tuple[int, ...]:
        return tuple(key[: self.page_size])

    def _match_len(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n // self.page_size * self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child` so its first n tokens become a new parent node; returns that parent."""
        mid = TreeNode(child.parent, child.key[:n], child.value[:n].clone())
        mid.lock_ref = child.lock_ref
        mid.last_access = child.last_access
        child.parent.children[self._edge(child.key)] = mid
        child.key, child.value = child.key[n:], child.value[n:].clone()
        child.parent = mid
        mid.children[self._edge(child.key)] = child
        return mid

    def _nodes(self):
        stack = [self.root, *self._stale_roots]
        while stack:
            node = stack.pop()
            if node.parent is not None:
                yield node
            stack.extend(node.children.values())
