"""Token embedding, optionally tied to the LM head's storage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.layers.linear import Linear


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))

    def tie_to(self, head: Linear) -> None:
        """Share the head's weight (both are [vocab, hidden])."""
        self.weight = head.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
