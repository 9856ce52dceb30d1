"""torch_native attention: PyTorch SDPA over K/V gathered from the paged pool (CPU and CUDA).

Decode gathers every request's K/V into one padded [batch, max_len] block (padding points at
the zeroed dummy slot and is masked) and runs a single SDPA call, with each KV head's query
group laid along the query axis so grouped-query attention needs no K/V repetition. Extend
and verify loop over requests, since their query lengths differ.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from spec_engine.attention.base import AttentionBackend
from spec_engine.forward_batch import ForwardBatch

if TYPE_CHECKING:
    from spec_engine.layers.attention import Attention


class TorchNativeBackend(AttentionBackend):
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._decode_idx: torch.Tensor
        self._decode_mask: torch.Tensor
        self._extend_meta: list[tuple[int, int, torch.Tensor, torch.Tensor | None]] = []

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token_pool.req_to_token
        if batch.mode.is_decode():
            if batch.kv_indices is not None:
                idx, valid = batch.kv_indices, batch.kv_mask
            else:
                max_len = max(batch.seq_lens_cpu)
                idx = table[batch.req_pool_indices, :max_len].to(torch.int64)
                valid = torch.arange(max_len, device=self.device)[None, :] < batch.seq_lens[:, None]
            self._decode_idx = idx.masked_fill(~valid, 0).view(-1)
            self._decode_mask = valid[:, None, None, :]
            return
        # Per request: (query start, query length, KV slots or None to use the new K/V, mask).
        meta = []
        start = 0
        rows = batch.req_pool_indices.tolist()
        for i, (row, kv_len, q_len) in enumerate(zip(rows, batch.seq_lens_cpu, batch.extend_seq_lens_cpu)):
            prefix = kv_len - q_len
            custom = batch.custom_masks[i] if batch.custom_masks is not None else None
            if prefix == 0 and custom is None:
                meta.append((start, q_len, None, None))
            else:
                slots = table[row, :kv_len].to(torch.int64)
                if custom is None:
                    q_pos = torch.arange(prefix, kv_len, device=self.device)[:, None]
                    custom = torch.arange(kv_len, device=self.device)[None, :] <= q_pos
                meta.append((start, q_len, slots, custom))
            start += q_len
        self._extend_meta = meta

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention",
                batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        k = k.view(-1, nkv, hd)
        v = v.view(-1, nkv, hd)
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.mode.is_decode():
            bs = batch.batch_size
            # index_select: several times faster than advanced indexing on CPU.
            k_all = pool.k_buffer[layer.layer_id].index_select(0, self._decode_idx).view(bs, -1, nkv, hd).transpose(1, 2)
            v_all = pool.v_buffer[layer.layer_id].index_select(0, self._decode_idx).view(bs, -1, nkv, hd).transpose(1, 2)
            qg = q.view(bs, nkv, nh // nkv, hd).to(k_all.dtype)
            out = F.scaled_dot_product_attention(qg, k_all, v_all, attn_mask=self._decode_mask, scale=layer.scaling)
            return out.reshape(bs, nh * hd).to(q.dtype)

        q = q.view(-1, nh, hd)
        out = torch.empty_like(q)
        for start, q_len, slots, mask in self._extend_meta:
            qi = q[start:start + q_len].transpose(0, 1)
            if slots is None:
                ki = k[start:start + q_len].transpose(0, 1)
                vi = v[start:start + q_len].transpose(0, 1)
                oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=layer.scaling, enable_gqa=True)
            else:
                ki = pool.k_buffer[layer.layer_id].index_select(0, slots).transpose(0, 1).to(q.dtype)
                vi = pool.v_buffer[layer.layer_id].index_select(0, slots).transpose(0, 1).to(q.dtype)
                oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=layer.scaling, enable_gqa=True)
            out[start:start + q_len] = oi.transpose(0, 1)
        return out.view(-1, nh * hd)
