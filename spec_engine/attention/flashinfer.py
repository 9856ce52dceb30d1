"""FlashInfer attention (CUDA): paged decode, paged prefill/verify with the tree mask, draft steps.

The KV pool is used as FlashInfer's paged cache with page size 1 (slot = page), as SGLang
does: a request's pages are its request-to-token row, a draft tree row's pages are its own KV
indices. New K/V are written to the pool before attention, so extends (prefill after a cached
prefix, target verify, draft extend) all run the paged prefill kernel over prefix + new
tokens, causal or with the per-request custom mask.

FlashInfer splits work into `plan` (host-side scheduling into index buffers) and `run` (the
kernels). A captured graph gets wrappers created with `use_cuda_graph=True` over static
buffers; `fill_graph_metadata` re-plans them before each replay, outside the graph.
Imported only when `--attention-backend flashinfer` is chosen (the `[gpu]` extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import flashinfer
import torch

from spec_engine.attention.base import AttentionBackend
from spec_engine.forward_batch import ForwardBatch, causal_mask
from spec_engine.mem.upload import upload

if TYPE_CHECKING:
    from spec_engine.layers.attention import Attention

WORKSPACE_BYTES = 256 * 1024 * 1024
# FlashInfer's prefill/decode tiles hold this many query rows (its split-kv scratch is per tile).
CTA_TILE_Q = 128
# Query heads per KV head from which the tensor-core decode kernel is faster (SGLang's choice).
TENSOR_CORE_GROUP = 4


@dataclass
class _Meta:
    wrapper: Any  # a planned FlashInfer wrapper
    decode: bool


class FlashInferBackend(AttentionBackend):
    def __init__(
        self,
        device: torch.device,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        dtype: torch.dtype,
    ) -> None:
        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim, self.scaling = (
            num_heads,
            num_kv_heads,
            head_dim,
            scaling,
        )
        self.tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_GROUP
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=self.tensor_cores
        )
        # fa2 explicitly: "auto" settles on the first plan, and FA3 (chosen for a mask-free
        # prefill on Hopper) cannot run the verify step's custom mask.
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend="fa2"
        )
        # Graph workspace and index buffers: sized by the first (largest) capture of each kind,
        # every smaller size gets slices (each replay re-plans into them just before it runs).
        self.graph_workspace: Optional[torch.Tensor] = None
        self._graph_buffers: dict[tuple, dict[str, Any]] = {}

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.mode.is_decode():
            self._plan_decode(self.decode, batch)
            batch.attn_meta = _Meta(self.decode, True)
        else:
            self._plan_extend(self.prefill, batch, always_mask=False)
            batch.attn_meta = _Meta(self.prefill, False)

    def graph_metadata(self, batch: ForwardBatch, kv_width: int) -> _Meta:
        b, decode = batch.batch_size, batch.mode.is_decode()
        queries = 1 if decode else batch.extend_seq_lens_cpu[0]
        workspace = self._graph_workspace(b, queries)
        full = self._graph_buffers.setdefault(
            (decode, queries, kv_width), self._new_buffers(b, queries, kv_width)
        )
        ptr, idx = full["indptr"][: b + 1], full["indices"][: b * kv_width]
        last = full["last"][:b]
        if decode:
            bufs = dict(
                paged_kv_indptr_buffer=ptr,
                paged_kv_indices_buffer=idx,
                paged_kv_last_page_len_buffer=last,
            )
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.tensor_cores, **bufs
            )
        else:
            bufs = dict(
                qo_indptr_buf=full["qo_indptr"][: b + 1],
                paged_kv_indptr_buf=ptr,
                paged_kv_indices_buf=idx,
                paged_kv_last_page_len_buf=last,
                custom_mask_buf=full["mask"][: b * full["mask_row"]],
                mask_indptr_buf=full["mask_indptr"][: b + 1],
            )
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=True, backend="fa2", **bufs
            )
        meta = _Meta(wrapper, decode)
        self.fill_graph_metadata(meta, batch)
        return meta

    def _new_buffers(self, b: int, queries: int, kv_width: int) -> dict[str, Any]:
        i32 = dict(dtype=torch.int32, device=self.device)
        mask_row = (
            queries * kv_width + 7
        ) // 8  # each request's mask packed to bits, rounded up to a byte
        return dict(
            indptr=torch.zeros(b + 1, **i32),
            indices=torch.zeros(b * kv_width, **i32),
            last=torch.ones(b, **i32),
            qo_indptr=torch.zeros(b + 1, **i32),
            mask=torch.zeros(b * mask_row, dtype=torch.uint8, device=self.device),
            mask_row=mask_row,
            mask_indptr=torch.zeros(b + 1, **i32),
        )

    def _graph_workspace(self, b: int, queries: int) -> torch.Tensor:
        """Under CUDA graphs FlashInfer always splits KV and reserves split scratch for the worst
        case: num_heads x (ceil(rows * group / CTA_TILE_Q) + b - 1) tiles of CTA_TILE_Q x head_dim
        float32. Sized by the largest capture of each kind (captured first), with headroom."""
        group = self.num_heads // self.num_kv_heads
        tiles = -(-b * queries * group // CTA_TILE_Q) + b - 1
        need = int(1.25 * self.num_heads * tiles * CTA_TILE_Q * self.head_dim * 4) + WORKSPACE_BYTES
        if self.graph_workspace is None or self.graph_workspace.numel() < need:
            # Graphs captured earlier keep the smaller one they were planned with.
            self.graph_workspace = torch.zeros(need, dtype=torch.uint8, device=self.device)
        return self.graph_workspace

    def fill_graph_metadata(self, meta: _Meta, batch: ForwardBatch) -> None:
        if meta.decode:
            self._plan_decode(meta.wrapper, batch)
        else:
            # A graph's kernels are chosen at capture: every replay uses the custom-mask kernel.
            self._plan_extend(meta.wrapper, batch, always_mask=True)

    def _plan_decode(self, wrapper: Any, batch: ForwardBatch) -> None:
        if batch.kv_indices is not None:  # draft tree rows: their lengths live on the device
            valid = batch.kv_mask
            indices = batch.kv_indices[valid]
            lens = valid.sum(1)
        else:
            # From the host's lengths: the indptr FlashInfer's plan reads on the host is already
            # there (a host tensor, no copy), and the slots come from the device's (_table_slots).
            lens = torch.tensor(batch.seq_lens_cpu, dtype=torch.int32, device=torch.device("cpu"))
            indices = _table_slots(batch)
        wrapper.plan(
            _indptr(lens),
            indices.to(torch.int32),
            torch.ones_like(lens, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            q_data_type=self.dtype,
            kv_data_type=batch.kv_pool.dtype,
            sm_scale=self.scaling,
        )

    def _plan_extend(self, wrapper: Any, batch: ForwardBatch, always_mask: bool) -> None:
        q_lens, kv_lens = batch.extend_seq_lens_cpu, batch.seq_lens_cpu
        indices = _table_slots(batch).to(torch.int32)
        masks = batch.custom_masks
        if masks is None and always_mask:
            masks = [causal_mask(n - q, n, self.device) for q, n in zip(q_lens, kv_lens)]
        custom = torch.cat([m.reshape(-1) for m in masks]) if masks is not None else None
        wrapper.plan(
            _indptr(upload(self.device, (q_lens, torch.int64))[0]),
            _indptr(batch.seq_lens),
            indices,
            torch.ones(len(q_lens), dtype=torch.int32, device=self.device),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            1,
            custom_mask=custom,
            causal=custom is None,
            sm_scale=self.scaling,
            q_data_type=self.dtype,
            kv_data_type=batch.kv_pool.dtype,
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
        nh, nkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k.view(-1, nkv, hd), v.view(-1, nkv, hd))
        cache = (
            pool.k_buffer[layer.layer_id].unsqueeze(1),
            pool.v_buffer[layer.layer_id].unsqueeze(1),
        )
        out = batch.attn_meta.wrapper.run(q.view(-1, nh, hd).to(self.dtype), cache)
        return out.view(-1, nh * hd).to(q.dtype)


def _table_slots(batch: ForwardBatch) -> torch.Tensor:
    """Every request's slots 0 .. seq_len - 1, request after request, in one gather on the
    table's device: no read of the rows back (a sync), no kernel per request, and host work of
    the batch's size, not its contexts' (the total is a Python sum of the host lengths)."""
    lens = batch.seq_lens
    total = sum(batch.seq_lens_cpu)
    first = lens.cumsum(0) - lens
    cols = torch.arange(total, device=lens.device) - first.repeat_interleave(
        lens, output_size=total
    )
    rows = batch.req_pool_indices.repeat_interleave(lens, output_size=total)
    return batch.req_to_token_pool.req_to_token[rows, cols]


def _indptr(lens: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    out[1:] = lens.cumsum(0)
    return out
