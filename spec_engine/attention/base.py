"""The attention backend interface every kernel family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spec_engine.forward_batch import ForwardBatch
    from spec_engine.layers.attention import Attention


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `init_forward_metadata` runs once per forward (index tensors, masks); `forward` runs per
    layer, writes the new tokens' K/V into the pool and returns [T, heads * head_dim].
    """

    @abstractmethod
    def init_forward_metadata(self, batch: "ForwardBatch") -> None: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "Attention",
                batch: "ForwardBatch") -> torch.Tensor: ...
