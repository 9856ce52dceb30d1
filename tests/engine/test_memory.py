"""Page allocator, radix cache and the CPU attention gather buffers, unit level."""

from __future__ import annotations

import pytest
import torch

from spec_engine.attention.torch_native import TorchNativeBackend
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


def test_cpu_attention_gathers_reuse_kept_buffers_and_graphs_keep_theirs():
    backend = TorchNativeBackend(CPU)
    pool = torch.randn(50, 2, 4, device=CPU)
    large = torch.randint(0, 50, (20,), device=CPU)
    small = torch.tensor([3, 1, 4], device=CPU)
    k = backend._gather("k", pool, large)
    assert torch.equal(k, pool[large]) and k.shape == (20, 2, 4)
    block = k.data_ptr()
    v = backend._gather("v", pool, small)
    assert torch.equal(v, pool[small]) and v.data_ptr() != block  # K and V live side by side
    again = backend._gather("k", pool, small)
    assert torch.equal(again, pool[small]) and again.data_ptr() == block
    # A graph pins its view at capture; a larger eager gather then grows the kept buffer, and
    # the graph's replays still read (and rewrite) the view it captured.
    graph: dict = {}
    captured = backend._gather("k", pool, small, graph)
    grown = backend._gather("k", pool, torch.cat([large, large, large]))
    assert torch.equal(grown, pool[torch.cat([large, large, large])])
    assert grown.data_ptr() != block
    other = torch.tensor([7, 0, 2], device=CPU)
    replay = backend._gather("k", pool, other, graph)
    assert replay.data_ptr() == captured.data_ptr() == block and torch.equal(replay, pool[other])
    half = backend._gather("k", pool.to(torch.bfloat16), small)
    assert half.dtype == torch.bfloat16 and torch.equal(half, pool[small].to(torch.bfloat16))
    wide = backend._gather("k", torch.randn(50, 1, 12, device=CPU), small)  # an MLA latent row
    assert wide.shape == (3, 1, 12)
    # Off CPU the gather is index_select's own fresh output (CUDA's caching allocator reuses
    # blocks): the meta device stands in for CUDA.
    meta = TorchNativeBackend(torch.device("meta"))
    out = meta._gather("k", pool.to("meta"), small.to("meta"))
    assert out.device.type == "meta" and out.shape == (3, 2, 4) and not meta._workspace


def test_the_table_reads_and_writes_many_ranges_as_row_by_row():
    table = ReqToTokenPool(5, 12, CPU)
    table.req_to_token[:5] = torch.randperm(60, device=CPU).view(5, 12).to(torch.int32)
    rows, starts, ends = [3, 0, 4, 0], [2, 0, 7, 5], [6, 1, 7, 12]  # an empty range among them
    want = torch.cat([table.read(r, e, start=s) for r, s, e in zip(rows, starts, ends)])
    got = table.read_ranges(rows, starts, ends)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    copy = ReqToTokenPool(5, 12, CPU)
    slots = torch.arange(100, 100 + len(want), device=CPU)
    copy.write_ranges([1, 2], [0, 9], [8, 12], slots[:11])
    assert copy.req_to_token[1, :8].tolist() == list(range(100, 108))
    assert copy.req_to_token[2, 9:].tolist() == [108, 109, 110]
    assert copy.req_to_token[[0, 3, 4]].eq(0).all() and copy.req_to_token[2, :9].eq(0).all()
    # The host mirror holds what the device table holds, read without a device read.
    assert (copy.host == copy.req_to_token.numpy()).all()
    assert copy.read_ranges_host([2, 1], [9, 2], [12, 4]).tolist() == [108, 109, 110, 102, 103]
    assert table.read_ranges([], [], []).shape == (0,)
    meta = ReqToTokenPool(5, 12, torch.device("meta"))  # stands in for CUDA: no device mixing
    assert meta.read_ranges(rows, starts, ends).device.type == "meta"
    # Fresh slots come with their host values (mem.allocator.Slots): nothing is read back.
    meta.write_ranges(rows, starts, ends, slots.to("meta"), slots.numpy())
    assert meta.read_ranges_host(rows, starts, ends).tolist() == slots.tolist()


def test_flashinfer_extend_plan_gathers_every_requests_slots(monkeypatch):
    """FlashInfer's extend plan (CUDA-only) with a stand-in module: the paged KV indices are
    each request's slots 0 .. kv_len - 1, gathered on the table's device."""
    import dataclasses
    import importlib.util
    import sys
    import types
    from pathlib import Path

    from spec_engine.forward_batch import ForwardBatch, ForwardMode

    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    path = Path(__file__).parents[2] / "spec_engine" / "attention" / "flashinfer.py"
    spec = importlib.util.spec_from_file_location("_flashinfer_under_test", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)

    class Wrapper:
        def plan(self, qo_indptr, kv_indptr, kv_indices, *args, **kwargs):
            self.args = (qo_indptr, kv_indptr, kv_indices, kwargs)

    for device in (CPU, torch.device("meta")):
        backend = module.FlashInferBackend.__new__(module.FlashInferBackend)
        backend.device, backend.dtype, backend.scaling = device, torch.float32, 1.0
        backend.num_heads, backend.num_kv_heads, backend.head_dim = 2, 1, 4
        table = ReqToTokenPool(4, 10, device)
        values = torch.randperm(40, device=CPU).view(4, 10).to(torch.int32)
        table.req_to_token[:4] = values.to(device)
        rows, q_lens, kv_lens = [2, 0, 3], [2, 1, 3], [5, 1, 10]
        batch = ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=torch.zeros(6, dtype=torch.int64, device=device),
            positions=torch.zeros(6, dtype=torch.int64, device=device),
            out_cache_loc=torch.zeros(6, dtype=torch.int64, device=device),
            req_pool_indices=torch.tensor(rows, device=device),
            seq_lens=torch.tensor(kv_lens, device=device),
            seq_lens_cpu=kv_lens,
            extend_seq_lens_cpu=q_lens,
            extend_prefix_lens_cpu=[n - q for q, n in zip(q_lens, kv_lens)],
            req_to_token_pool=table,
            kv_pool=types.SimpleNamespace(dtype=torch.float32),
        )
        wrapper = Wrapper()
        backend._plan_extend(wrapper, batch, always_mask=True)
        qo_indptr, kv_indptr, indices, kwargs = wrapper.args
        assert indices.device == device and indices.dtype == torch.int32
        assert kwargs["custom_mask"].device == device and kwargs["custom_mask"].dtype == torch.bool
        if device == CPU:
            want = torch.cat([values[r, :n] for r, n in zip(rows, kv_lens)])
            assert torch.equal(indices, want)
            assert kv_indptr.tolist() == [0, 5, 6, 16] and qo_indptr.tolist() == [0, 2, 3, 6]
        # The decode plan: the same slots, its indptr built on the host (FlashInfer reads it
        # there) without reading the device's lengths back.
        decode = dataclasses.replace(batch, mode=ForwardMode.DECODE, extend_seq_lens_cpu=None)
        backend._plan_decode(wrapper, decode)
        kv_indptr, indices = wrapper.args[0], wrapper.args[1]
        assert kv_indptr.device == CPU and kv_indptr.tolist() == [0, 5, 6, 16]
        assert indices.device == device and indices.dtype == torch.int32
        if device == CPU:
            assert torch.equal(indices, want)


def test_upload_sends_each_part_in_its_own_dtype_from_one_buffer():
    """mem.upload: parts of odd byte lengths (each next part stays aligned for its dtype),
    empty parts, every dtype a step sends; off the CPU one copy (the meta device stands in)."""
    from spec_engine.mem.upload import upload

    parts = [
        ([0.1, -2.5, 3e38], torch.float32),
        ([2**62, -1, 0], torch.int64),
        ([True, False, True], torch.bool),
        ([], torch.int64),
        ([7, 9], torch.int32),
        ([1 / 3], torch.float64),
    ]
    got = upload(CPU, *parts)
    for (values, dtype), tensor in zip(parts, got):
        assert tensor.dtype == dtype and torch.equal(tensor, torch.tensor(values, dtype=dtype))
    assert len({t.untyped_storage().data_ptr() for t in got}) == 1  # views of one buffer
    meta = upload(torch.device("meta"), *parts)
    assert [(t.device.type, t.dtype, t.shape) for t in meta] == [
        ("meta", t.dtype, t.shape) for t in got
    ]
    with pytest.raises(ValueError, match="torch.float16"):
        upload(CPU, ([1.0], torch.float16))
