"""Token embedding and LM head, split over the vocabulary under tensor parallelism (SGLang's
vocab_parallel_embedding.py, nano-vllm's embed_head.py), optionally tied to each other.

Rank r holds the vocabulary rows of distributed.partition.vocab_range: the embedding looks up
the ids in its block (zeros elsewhere) and sums over the ranks; the head computes its block of
the logits and gathers the others, so every rank gets every logit (and samples the same
token). The last block is padded to the others' size; its padding rows are zero and their
logits are cut after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.distributed.partition import vocab_range
from spec_engine.layers.linear import Linear


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.vocab = vocab_range(vocab_size, self.tp.rank, self.tp.size)
        self.weight = nn.Parameter(torch.empty(self.vocab.padded, hidden_size))

    def tie_to(self, head: Linear) -> None:
        """Share the head's weight (both are [vocab block, hidden])."""
        self.weight = head.weight

    def refresh_derived(self) -> None:
        """Zero the padding rows (after a load; they are never looked up)."""
        self.weight.data[self.vocab.rows :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab.start
        outside = (local < 0) | (local >= self.vocab.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside[:, None], 0.0))


class ParallelLMHead(Linear):
    """The LM head over this rank's vocabulary block; forward returns the full vocabulary's
    logits on every rank."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        self.vocab = vocab_range(vocab_size, self.tp.rank, self.tp.size)
        super().__init__(hidden_size, self.vocab.padded)

    def refresh_derived(self) -> None:
        self.weight.data[self.vocab.rows :].zero_()
        super().refresh_derived()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        return self.tp.all_gather(super().forward(x))[..., : self.vocab_size]
