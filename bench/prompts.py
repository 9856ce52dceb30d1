"""The benchmarks' prompts: random token ids, or ids that repeat a pattern (what NGRAM drafts
from), the same for the same seed."""

from __future__ import annotations

import torch


def random_batches(batch: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, input_len), generator=g, device="cpu").tolist()


def prompts(batch: int, length: int, vocab: int, repetitive: bool, seed: int) -> list[list[int]]:
    if not repetitive:
        return random_batches(batch, length, vocab, seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        pattern = torch.randint(5, vocab, (16,), generator=g, device="cpu").tolist()
        out.append((pattern * (length // 16 + 1))[:length])
    return out
