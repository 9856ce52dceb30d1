"""TrainBatch: the sequences of one rollout as a train step consumes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass
class TrainBatch:
    """Sequences of one rollout, in group order (n samples per prompt next to each other)."""

    tokens: list[list[int]]  # prompt + response
    response_lengths: list[int]
    rewards: list[float]
    loss_masks: Optional[list[list[int]]] = None  # per response token (default all 1)
    rollout_log_probs: Optional[list[list[float]]] = None  # per response token, from the engine
    n_samples_per_prompt: int = 1
    # --use-rollout-routing-replay: the engine's int32 [len(tokens) - 1, num_hidden_layers, top_k]
    rollout_routed_experts: Optional[list[Tensor]] = None

    def __len__(self) -> int:
        return len(self.tokens)

    def select(self, rows: Sequence[int]) -> TrainBatch:
        pick = lambda xs: None if xs is None else [xs[i] for i in rows]  # noqa: E731
        return TrainBatch(
            [self.tokens[i] for i in rows],
            [self.response_lengths[i] for i in rows],
            [self.rewards[i] for i in rows],
            pick(self.loss_masks),
            pick(self.rollout_log_probs),
            self.n_samples_per_prompt,
            pick(self.rollout_routed_experts),
        )


def pad_batch(batch: TrainBatch, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """tokens [b, S] (right-padded with 0), mask [b, S-1] of response positions to score
    (position t scores token t + 1), and rollout log-probs at the same positions; laid out on
    the host, then moved to `device` in one copy each."""
    width = max(len(t) for t in batch.tokens)
    host = {"device": "cpu"}
    tokens = torch.zeros(len(batch), width, dtype=torch.long, **host)
    mask = torch.zeros(len(batch), width - 1, dtype=torch.float32, **host)
    rollout = torch.zeros(len(batch), width - 1, dtype=torch.float32, **host)
    for i, (seq, n) in enumerate(zip(batch.tokens, batch.response_lengths)):
        tokens[i, : len(seq)] = torch.tensor(seq, dtype=torch.long, **host)
        start = len(seq) - n - 1
        if batch.loss_masks:
            mask[i, start : start + n] = torch.tensor(
                batch.loss_masks[i], dtype=torch.float32, **host
            )
        else:
            mask[i, start : start + n] = 1.0
        if batch.rollout_log_probs is not None:
            rollout[i, start : start + n] = torch.tensor(
                batch.rollout_log_probs[i], dtype=torch.float32, **host
            )
    return tokens.to(device), mask.to(device), rollout.to(device)
