"""ForwardBatch: the flat tensors one model forward consumes, and its forward mode.

Token-level tensors are flat over the batch ([num_tokens]); request-level tensors are [batch];
CPU-side copies of the lengths avoid device syncs in backends that loop over requests. The
same layout serves prefill (EXTEND), decode, and the speculative verify/draft modes, so a
graph runner can copy any of them into static buffers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Optional

import torch

from spec_engine.mem.kv_pool import KVPool, ReqToTokenPool
from spec_engine.mem.upload import upload


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
    # each row attends to, padded, and which of them are real. Also extends of the same number
    # of rows per request whose lengths live on the device (an overlapped chain step's verify
    # and draft extend): then the mask is per query row, [B, Q, L].
    kv_indices: Optional[torch.Tensor] = None  # [B, L] int64
    kv_mask: Optional[torch.Tensor] = None  # [B, L] or [B, Q, L] bool
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


def padded_masks(
    q_lens: Sequence[int],
    prefixes: Sequence[int],
    width: int,
    size: int,
    real: Optional[Sequence[torch.Tensor]],
    device: torch.device,
) -> list[torch.Tensor]:
    """The masks of an extend padded to `size` requests of `width` queries each: request i's
    [width, prefixes[i] + width] mask holds `real[i]` (else the causal mask) in its first
    q_lens[i] rows and prefixes[i] + q_lens[i] columns, its padded queries see key 0 alone (their
    output is dropped), a padded request sees every key. Views of one tensor built by a fixed
    number of kernels, whatever the batch size: a kernel or more per request costs a GPU step
    host time."""
    b = len(q_lens)
    cols = [p + width for p in prefixes] + [width] * (size - b)
    starts = list(accumulate((width * c for c in cols), initial=0))
    flat = torch.zeros(starts[-1], dtype=torch.bool, device=device)
    # Every element of each real request's [q, p + q] block: its request, row and column.
    blocks = [q * (p + q) for q, p in zip(q_lens, prefixes)]
    total = sum(blocks)
    host = [blocks, list(accumulate(blocks, initial=0))[:-1], starts[:b], cols[:b]]
    host.append([p + q for q, p in zip(q_lens, prefixes)])
    host.append(list(prefixes))
    ones = [
        k
        for i, q in enumerate(q_lens)
        for k in range(starts[i] + q * cols[i], starts[i + 1], cols[i])
    ]
    ones.extend(range(starts[b], starts[-1]))
    meta, ones_t = upload(device, (host, torch.int64), (ones, torch.int64))
    meta = meta.view(len(host), b)
    req = torch.arange(b, device=device).repeat_interleave(meta[0], output_size=total)
    first, start, stride, block_cols, prefix = (m[req] for m in meta[1:])
    local = torch.arange(total, device=device) - first
    row = local.div(block_cols, rounding_mode="floor")
    col = local - row * block_cols
    if real is None:
        values = col <= prefix + row
    else:
        values = torch.cat([m.reshape(-1) for m in real])
    flat[start + row * stride + col] = values
    flat[ones_t] = True
    return [v.view(width, c) for v, c in zip(flat.split([width * c for c in cols]), cols)]
