"""TrainBatch: the sequences of one rollout as a train step consumes them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass
class TrainBatch:
    """Sequences of one rollout, in group order (n samples per prompt next to each other)."""

    tokens: list[list[int]]  # prompt + response
    response_lengths: list[int]
    rewards: list[float]
    loss_masks: Optional[list[list[int]]] = None  # per response token (default all 1)
    rollout_log_probs: Optional[list[list[float]]] = None  # per response token, from the engine
    n_samples_per_prompt: int = 1

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
        )
