"""The attention layer a model calls: holds head geometry, delegates to the batch's backend."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spec_engine.forward_batch import ForwardBatch


class Attention(nn.Module):
    """`v_head_dim` (default head_dim) and `scaling` (default head_dim ** -0.5) differ for MLA,
    whose values are the leading v_head_dim columns of each cached key."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        v_head_dim: Optional[int] = None,
        scaling: Optional[float] = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads}"
            )
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return batch.attn_backend.forward(q, k, v, self, batch)
