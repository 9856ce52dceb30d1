"""Page allocator and radix cache, unit level."""

from __future__ import annotations

import torch

from spec_engine.mem.allocator import PageAllocator
from spec_engine.mem.kv_pool import ReqToTokenPool
from spec_engine.mem.radix_cache import RadixCache

CPU = torch.device("cpu")


def test_page_allocator_continues_the_last_page():
    alloc = PageAllocator(num_tokens=16, page_size=4, device=CPU)
    assert alloc.available_size() == 16
    first = alloc.alloc([0], [6], [0]).tolist()
    assert len(first) == 6 and first[:4] == list(range(first[0], first[0] + 4))
    assert all(s % 4 == p % 4 for p, s in enumerate(first))
    # Positions 6..8 continue page of slot first[5], then take a new page.
    more = alloc.alloc([6], [9], [first[5]]).tolist()
    assert more[:2] == [first[5] + 1, first[5] + 2] and more[2] % 4 == 0
    assert alloc.available_size() == 4
    assert alloc.alloc([9], [17], [more[-1]]) is None  # fills page 3, then needs 2 more; 1 is free
    alloc.free(torch.tensor(first + more))
    assert alloc.available_size() == 16


def test_radix_cache_match_insert_split_lock_evict():
    alloc = PageAllocator(num_tokens=64, page_size=1, device=CPU)
    cache = RadixCache(alloc, ReqToTokenPool(4, 64, CPU), page_size=1)
    a = alloc.alloc([0], [6], [0])
    assert cache.insert([1, 2, 3, 4, 5, 6], a) == 0
    b = alloc.alloc([0], [5], [0])
    assert cache.insert([1, 2, 3, 9, 9], b) == 3  # shares [1, 2, 3]; b[:3] are duplicates
    alloc.free(b[:3])
    slots, node = cache.match_prefix([1, 2, 3, 4, 7])
    assert slots.tolist() == a[:4].tolist()
    assert cache.total_size() == 8 and cache.evictable_size() == 8
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 4 and cache.unlocked_len(node) == 0
    # Only the unlocked leaves can go: [5, 6] and [9, 9].
    assert cache.evict(100) == 4
    assert cache.total_size() == 4
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 4
    assert alloc.available_size() == 64


def test_radix_cache_keys_are_whole_pages():
    alloc = PageAllocator(num_tokens=64, page_size=4, device=CPU)
    cache = RadixCache(alloc, ReqToTokenPool(4, 64, CPU), page_size=4)
    slots = alloc.alloc([0], [8], [0])
    cache.insert(list(range(8)), slots)
    assert len(cache.match_prefix(list(range(7)))[0]) == 4  # only the first whole page matches
    assert len(cache.match_prefix(list(range(8)) + [99])[0]) == 8
    assert len(cache.match_prefix([0, 1, 2, 99, 4, 5, 6, 7])[0]) == 0


def test_disabled_radix_cache_shares_nothing():
    alloc = PageAllocator(num_tokens=16, page_size=1, device=CPU)
    cache = RadixCache(alloc, ReqToTokenPool(2, 16, CPU), page_size=1, disable=True)
    slots, node = cache.match_prefix([1, 2, 3])
    assert len(slots) == 0 and node is cache.root


def test_next_token_keys_share_a_position_only_when_its_next_token_agrees():
    """Feature drafts (EAGLE, EAGLE-3, MTP) write KV at position p from token p + 1: a cached
    slot is reused only by a sequence that agrees on both; a last position is never cached."""
    alloc = PageAllocator(num_tokens=64, page_size=1, device=CPU)
    cache = RadixCache(alloc, ReqToTokenPool(4, 64, CPU), page_size=1, next_token_keys=True)
    a = alloc.alloc([0], [5], [0])
    tokens = [1, 2, 3, 4, 5, 6]  # positions 0..4 computed; token 5 at position 5 is next
    assert cache.insert(cache.keyed(tokens), a) == 0
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7])[0].tolist() == a.tolist()
    # Branching after token 3: position 2 (token 3) was cached with next token 4, not 9.
    assert cache.match_prefix([1, 2, 3, 9, 9])[0].tolist() == a[:2].tolist()
    # The same prompt again: its last position's key needs the token sampled after it.
    assert cache.match_prefix([1, 2, 3])[0].tolist() == a[:2].tolist()
    unigram = RadixCache(alloc, ReqToTokenPool(4, 64, CPU), page_size=1)
    unigram.insert(tokens[:5], a)
    assert len(unigram.match_prefix([1, 2, 3, 9, 9])[0]) == 3
