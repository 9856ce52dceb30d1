"""The attention backend interface every kernel family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from spec_engine.forward_batch import ForwardBatch
    from spec_engine.layers.attention import Attention


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    `init_forward_metadata` runs once per eager forward and sets `batch.attn_meta` (index
    tensors, masks); `forward` runs per layer, reads `batch.attn_meta`, writes the new tokens'
    K/V into the pool and returns [T, heads * head_dim].

    Captured graphs cannot rebuild metadata of a new shape, so for them the backend allocates
    static metadata once per captured batch (`graph_metadata`, covering up to `kv_width` keys
    per row) and refills it in place before every replay (`fill_graph_metadata`, outside the
    graph, where host work is allowed). A backend whose kernels read every one of those keys
    sets `bucketed_graph_widths` and maps batches to smaller widths (`graph_kv_width`).
    """

    # True when a graph's metadata fixes its key width (then graphs exist per width bucket).
    bucketed_graph_widths = False

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    def graph_kv_width(self, needed: int, kv_width: int) -> int:
        """The key width of the graph that replays a batch needing `needed` keys per row."""
        return kv_width

    @abstractmethod
    def graph_metadata(self, batch: ForwardBatch, kv_width: int) -> Any: ...

    @abstractmethod
    def fill_graph_metadata(self, meta: Any, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor: ...
