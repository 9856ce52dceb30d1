"""ForwardBatch: the flat tensors one model forward consumes, and its forward mode.

Token-level tensors are flat over the batch ([num_tokens]); request-level tensors are [batch];
CPU-side copies of the lengths avoid device syncs in backends that loop over requests. The
same layout serves prefill (EXTEND), decode, and the speculative verify/draft modes, so a
graph runner can copy any of them into static buffers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch

from spec_engine.mem.kv_pool import KVPool, ReqToTokenPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"  # prefill of new tokens (possibly after a cached prefix)
    DECODE = "decode"  # one new token per request
    TARGET_VERIFY = "target_verify"  # draft tokens per request under a tree mask
    DRAFT_EXTEND = "draft_extend"  # draft model over accepted tokens

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] KV slot each token writes
    req_pool_indices: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B] KV length after this forward
    seq_lens_cpu: list[int]
    # EXTEND: tokens computed per request and the cached prefix before them.
    extend_seq_lens_cpu: Optional[list[int]] = None
    extend_prefix_lens_cpu: Optional[list[int]] = None
    # Rows of the hidden states that need logits ([B] for decode/prefill ends).
    logits_indices: Optional[torch.Tensor] = None
    # Optional [B] list of bool masks [q_len, kv_len] replacing the causal mask (tree verify).
    custom_masks: Optional[list[torch.Tensor]] = None
    # DECODE rows that do not read a request's table row (draft tree branches): the KV slots
    # each row attends to, padded, and which of them are real.
    kv_indices: Optional[torch.Tensor] = None  # [B, L] int64
    kv_mask: Optional[torch.Tensor] = None  # [B, L] bool
    # Return hidden states for every token (speculative drafts read them), not only logits rows.
    capture_hidden: bool = False
    # Set by the runner: the memory this forward reads and writes, and the attention backend
    # (an attention.base.AttentionBackend; not imported here, since backends read this batch).
    kv_pool: Optional[KVPool] = None
    req_to_token_pool: Optional[ReqToTokenPool] = None
    attn_backend: Any = None
    # The backend's per-forward metadata (index tensors, masks): set by init_forward_metadata,
    # or, for a captured graph, static buffers the graph runner refills before each replay.
    attn_meta: Any = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def causal_mask(prefix: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[kv_len - prefix, kv_len] bool: query i (at position prefix + i) sees keys 0..prefix + i."""
    q_pos = torch.arange(prefix, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos
