"""torch_native attention: PyTorch SDPA over K/V gathered from the paged pool (CPU and CUDA).

Decode steps, verify steps and other short extends gather every request's K/V into one padded
[batch, max_len] block (padding points at the dummy slot 0, zeroed before each use, and is
masked) and run a single SDPA call, with each KV head's query group laid along the query axis so
grouped-query attention needs no K/V repetition. Long prefills loop over requests, since their
query lengths differ widely and a padded score block would be large.

Batch-invariant mode (--enable-deterministic-inference): SDPA's result for a query row depends
on how many query rows and keys the call has (its kernel tiles them), so a token's attention
would change with what it is batched with, and after a prefix-cache hit (fewer query rows).
Instead every batch takes the padded path and attention is computed as explicit products and
sums, whose reductions run over the head dim and the key axis in a fixed order: a row's result
is the same for any batch, any number of queries and any padded key width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from spec_engine.attention.base import AttentionBackend
from spec_engine.forward_batch import ForwardBatch, causal_mask

if TYPE_CHECKING:
    from spec_engine.layers.attention import Attention

# Extends whose every request adds at most this many tokens take the padded batched path.
SHORT_EXTEND = 32
# The smallest key width of a graph (see graph_kv_width).
MIN_GRAPH_KEYS = 64
# Batch-invariant attention materialises [queries, keys, heads, head_dim] products; this bounds
# the elements of one chunk of queries.
INVARIANT_CHUNK_ELEMENTS = 1 << 24


@dataclass
class _Padded:
    batch: int
    queries: int  # padded queries per request
    kv_idx: torch.Tensor  # [B * L] slots (0 where invalid)
    mask: torch.Tensor  # [B, Q, L] bool
    q_rows: Optional[torch.Tensor]  # [B * Q] flat token row of each padded query (None: identity)
    out_rows: Optional[torch.Tensor]  # [T] padded position of each flat token (None: identity)
    pinned: Optional[dict] = None  # a graph's gather buffers, pinned at capture (None: eager)


# Per request of a long prefill: (query start, query length, KV slots or None to use the new
# K/V, mask or None for causal over the new tokens alone).
_PerRequest = list[tuple[int, int, Optional[torch.Tensor], Optional[torch.Tensor]]]


class TorchNativeBackend(AttentionBackend):
    # SDPA attends over every key of the static block, so graphs come per key-width bucket.
    bucketed_graph_widths = True

    def __init__(self, device: torch.device, batch_invariant: bool = False) -> None:
        self.device = device
        self.batch_invariant = batch_invariant
        # Graph metadata buffers by (queries per row, kv width), sized by the first (largest)
        # capture; every captured size uses a view, as the graph runner's input buffers do.
        self._graph_buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        # CPU gathers land in kept buffers (see _gather), one per K or V, dtype and row shape.
        self._workspace: dict[tuple, torch.Tensor] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if (
            self.batch_invariant
            or batch.mode.is_decode()
            or batch.kv_indices is not None
            or (batch.batch_size > 1 and max(batch.extend_seq_lens_cpu) <= SHORT_EXTEND)
        ):
            batch.attn_meta = self._batched(batch)
            return
        table = batch.req_to_token_pool.req_to_token
        meta: _PerRequest = []
        start = 0
        rows = batch.req_pool_indices.tolist()
        for i, (row, kv_len, q_len) in enumerate(
            zip(rows, batch.seq_lens_cpu, batch.extend_seq_lens_cpu)
        ):
            custom = batch.custom_masks[i] if batch.custom_masks is not None else None
            if kv_len == q_len and custom is None:
                meta.append((start, q_len, None, None))
            else:
                meta.append(
                    (
                        start,
                        q_len,
                        table[row, :kv_len].to(torch.int64),
                        custom
                        if custom is not None
                        else causal_mask(kv_len - q_len, kv_len, self.device),
                    )
                )
            start += q_len
        batch.attn_meta = meta

    def graph_kv_width(self, needed: int, kv_width: int) -> int:
        """Powers of two from MIN_GRAPH_KEYS up to the context width: a graph's SDPA reads every
        key of its width, so a short context should not pay for a long one."""
        return min(kv_width, max(MIN_GRAPH_KEYS, 1 << (needed - 1).bit_length()))

    def graph_metadata(self, batch: ForwardBatch, kv_width: int) -> _Padded:
        """Static metadata over `kv_width` keys per row, invalid keys masked."""
        rows = batch.batch_size
        queries = 1 if batch.mode.is_decode() else batch.extend_seq_lens_cpu[0]
        idx, mask = self._graph_buffers.get((queries, kv_width), (None, None))
        if mask is None or mask.shape[0] < rows:
            idx = torch.zeros(rows * kv_width, dtype=torch.int64, device=self.device)
            mask = torch.zeros(rows, queries, kv_width, dtype=torch.bool, device=self.device)
            self._graph_buffers[(queries, kv_width)] = idx, mask
        meta = _Padded(rows, queries, idx[: rows * kv_width], mask[:rows], None, None, pinned={})
        self.fill_graph_metadata(meta, batch)
        return meta

    def fill_graph_metadata(self, meta: _Padded, batch: ForwardBatch) -> None:
        fresh = self._batched(batch)
        width, used = meta.mask.shape[-1], fresh.mask.shape[-1]
        if fresh.q_rows is not None or fresh.mask.shape[:2] != meta.mask.shape[:2] or used > width:
            raise RuntimeError(
                f"graph attention metadata {tuple(meta.mask.shape)} cannot hold a batch of "
                f"{tuple(fresh.mask.shape)}; this is a graph-runner bug, run with "
                "--disable-cuda-graph"
            )
        idx = meta.kv_idx.view(meta.batch, width)
        idx[:, :used] = fresh.kv_idx.view(meta.batch, used)
        idx[:, used:] = 0
        meta.mask[..., :used] = fresh.mask
        meta.mask[..., used:] = False

    def _batched(self, batch: ForwardBatch) -> _Padded:
        """Every request's K/V in one padded [batch, max_len] block: decode rows (from their
        table row or their own KV indices) and short extends."""
        table = batch.req_to_token_pool.req_to_token
        if batch.mode.is_decode():
            if batch.kv_indices is not None:
                idx, valid = batch.kv_indices, batch.kv_mask
            else:
                max_len = max(batch.seq_lens_cpu)
                idx = table[batch.req_pool_indices, :max_len].to(torch.int64)
                valid = torch.arange(max_len, device=self.device)[None, :] < batch.seq_lens[:, None]
            return _Padded(
                batch.batch_size,
                1,
                idx.masked_fill(~valid, 0).view(-1),
                valid[:, None, :],
                None,
                None,
            )
        b, q_lens, kv_lens = batch.batch_size, batch.extend_seq_lens_cpu, batch.seq_lens_cpu
        if batch.kv_indices is not None:  # n rows per request, lengths on the device
            mask = batch.kv_mask
            valid = mask.any(1)
            idx = batch.kv_indices.masked_fill(~valid, 0).view(-1)
            return _Padded(b, mask.shape[1], idx, mask, None, None)
        q_max, kv_max = max(q_lens), max(kv_lens)
        idx = table[batch.req_pool_indices, :kv_max].to(torch.int64)
        mask = torch.zeros(b, q_max, kv_max, dtype=torch.bool, device=self.device)
        q_rows, out_rows, start = [], [], 0
        for i, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
            m = (
                batch.custom_masks[i]
                if batch.custom_masks is not None
                else causal_mask(kv_len - q_len, kv_len, self.device)
            )
            mask[i, :q_len, :kv_len] = m
            mask[i, q_len:, :kv_len] = m[
                0
            ]  # padded queries: any valid row; their output is dropped
            q_rows.extend(range(start, start + q_len))
            q_rows.extend([start] * (q_max - q_len))
            out_rows.extend(range(i * q_max, i * q_max + q_len))
            start += q_len
        valid = mask.any(1)
        if all(q == q_max for q in q_lens):  # every request fills its rows: no reordering
            return _Padded(b, q_max, idx.masked_fill(~valid, 0).view(-1), mask, None, None)
        return _Padded(
            b,
            q_max,
            idx.masked_fill(~valid, 0).view(-1),
            mask,
            torch.tensor(q_rows, device=self.device),
            torch.tensor(out_rows, device=self.device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool = batch.kv_pool
        nh, nkv, hd, vd = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        k = k.view(-1, nkv, hd)
        v = v.view(-1, nkv, vd)
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if isinstance(batch.attn_meta, _Padded):
            # Masked keys point at the dummy slot 0, which padded rows just wrote. SDPA gives
            # them weight 0, but 0 x NaN is NaN: a padded row that computed NaN or Inf (from a
            # broken request it pads) would poison every request in the batch. Zero it.
            pool.k_buffer[layer.layer_id][0].zero_()
            pool.v_buffer[layer.layer_id][0].zero_()
            if self.batch_invariant:
                return self._forward_invariant(q, layer, pool, batch.attn_meta)
            return self._forward_padded(q, layer, pool, batch.attn_meta)
        q = q.view(-1, nh, hd)
        out = q.new_empty(q.shape[0], nh, vd)
        for start, q_len, slots, mask in batch.attn_meta:
            qi = q[start : start + q_len].transpose(0, 1)
            if slots is None:
                ki = k[start : start + q_len].transpose(0, 1)
                vi = v[start : start + q_len].transpose(0, 1)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=True
                )
            else:
                ki = self._gather("k", pool.k_buffer[layer.layer_id], slots)
                vi = self._gather("v", pool.v_buffer[layer.layer_id], slots)
                ki, vi = ki.transpose(0, 1).to(q.dtype), vi.transpose(0, 1).to(q.dtype)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True
                )
            out[start : start + q_len] = oi.transpose(0, 1)
        return out.view(-1, nh * vd)

    def _gather(
        self,
        which: str,
        buffer: torch.Tensor,
        slots: torch.Tensor,
        pinned: Optional[dict] = None,
    ) -> torch.Tensor:
        """The pool rows `slots` of one layer's K or V buffer, [len(slots), heads, dim].

        index_select: several times faster than advanced indexing on CPU. On CPU the rows land in
        a kept buffer: a decode step gathers every running request's keys per layer (tens of MB
        at batch 128), and fresh blocks that size come from glibc's mmap or a trimmed heap, so
        each call paid its page faults again (4.4 million per 128-token batch-128 generation, a
        fifth of the step time). The buffer grows by powers of two; a graph pins its view of it
        at capture in `pinned` (its metadata's), so a later, larger buffer leaves the graph
        reading what it captured (--cuda-graph-self-check holds CPU graphs to CUDA's rule). CUDA
        keeps index_select's own output: its caching allocator already reuses blocks.
        """
        if self.device.type != "cpu":
            return buffer.index_select(0, slots)
        key = (which, buffer.dtype, buffer.shape[1:])
        out = None if pinned is None else pinned.get(key)
        if out is None:
            need = slots.numel() * buffer[0].numel()
            space = self._workspace.get(key)
            if space is None or space.numel() < need:
                space = self._workspace[key] = torch.empty(
                    1 << (need - 1).bit_length(), dtype=buffer.dtype, device=buffer.device
                )
            out = space[:need].view(slots.numel(), *buffer.shape[1:])
            if pinned is not None:
                pinned[key] = out
        return torch.index_select(buffer, 0, slots, out=out)

    def _forward_padded(self, q: torch.Tensor, layer: Attention, pool, p: _Padded) -> torch.Tensor:
        nh, nkv, hd, vd = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        group = nh // nkv
        b, nq = p.batch, p.queries
        k_all = self._gather("k", pool.k_buffer[layer.layer_id], p.kv_idx, p.pinned)
        v_all = self._gather("v", pool.v_buffer[layer.layer_id], p.kv_idx, p.pinned)
        k_all = k_all.view(b, -1, nkv, hd).transpose(1, 2)
        v_all = v_all.view(b, -1, nkv, vd).transpose(1, 2)
        q = q.view(-1, nh, hd)
        if p.q_rows is not None:
            q = q.index_select(0, p.q_rows)
        # Query heads of one KV head side by side along the query axis: [B, nkv, group * Q, hd].
        qg = (
            q.view(b, nq, nkv, group, hd)
            .permute(0, 2, 3, 1, 4)
            .reshape(b, nkv, group * nq, hd)
            .to(k_all.dtype)
        )
        mask = p.mask[:, None].expand(b, group, nq, -1).reshape(b, 1, group * nq, -1)
        out = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=mask, scale=layer.scaling)
        out = out.view(b, nkv, group, nq, vd).permute(0, 3, 1, 2, 4).reshape(b * nq, nh * vd)
        if p.out_rows is not None:
            out = out.index_select(0, p.out_rows)
        return out.to(q.dtype)

    def _forward_invariant(
        self, q: torch.Tensor, layer: Attention, pool, p: _Padded
    ) -> torch.Tensor:
        """The padded block's attention with batch-invariant reductions (module docstring)."""
        nh, nkv, hd, vd = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        group = nh // nkv
        b, nq, dtype = p.batch, p.queries, q.dtype
        # [B, 1, L, nkv, 1, hd]: broadcast over query rows and each KV head's query group.
        k_all = self._gather("k", pool.k_buffer[layer.layer_id], p.kv_idx, p.pinned)
        v_all = self._gather("v", pool.v_buffer[layer.layer_id], p.kv_idx, p.pinned)
        k_all, v_all = k_all.view(b, 1, -1, nkv, 1, hd), v_all.view(b, 1, -1, nkv, 1, vd)
        q = q.view(-1, nh, hd)
        if p.q_rows is not None:
            q = q.index_select(0, p.q_rows)
        q = (q.view(b, nq, 1, nkv, group, hd) * layer.scaling).to(k_all.dtype)
        width = k_all.shape[2]
        step = max(1, INVARIANT_CHUNK_ELEMENTS // (b * width * nh * hd))
        chunks = []
        for start in range(0, nq, step):
            scores = (q[:, start : start + step] * k_all).sum(-1)  # [B, c, L, nkv, group]
            keep = p.mask[:, start : start + step, :, None, None]
            probs = scores.masked_fill(~keep, float("-inf")).softmax(dim=2)
            chunks.append((probs[..., None] * v_all).sum(2))  # [B, c, nkv, group, hd]
        out = torch.cat(chunks, dim=1).reshape(b * nq, nh * vd)
        if p.out_rows is not None:
            out = out.index_select(0, p.out_rows)
        return out.to(dtype)
