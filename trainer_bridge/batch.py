"""TrainBatch: the sequences of one rollout as a train step consumes them."""

from __future__ import annotations

import itertools
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
    if not batch.tokens:
        raise ValueError("an empty batch: a train step needs at least one sequence")
    host = {"device": "cpu"}
    # One host tensor per field, scattered into place (a tensor per row costs more than a tiny
    # model's whole layer).
    lengths = torch.tensor([len(t) for t in batch.tokens], dtype=torch.long, **host)
    responses = torch.tensor(batch.response_lengths, dtype=torch.long, **host)
    width = int(lengths.max())
    columns = torch.arange(width, **host)
    tokens = torch.zeros(len(batch), width, dtype=torch.long, **host)
    tokens[columns < lengths[:, None]] = torch.tensor(
        list(itertools.chain.from_iterable(batch.tokens)), dtype=torch.long, **host
    )
    start = (lengths - responses - 1)[:, None]
    scored = (columns[:-1] >= start) & (columns[:-1] < start + responses[:, None])
    mask = scored.to(torch.float32)
    if batch.loss_masks:
        mask[scored] = _flat(batch.loss_masks, batch.response_lengths)
    rollout = torch.zeros(len(batch), width - 1, dtype=torch.float32, **host)
    if batch.rollout_log_probs is not None:
        rollout[scored] = _flat(batch.rollout_log_probs, batch.response_lengths)
    return tokens.to(device), mask.to(device), rollout.to(device)


def _flat(per_response: list[list[float]], response_lengths: list[int]) -> Tensor:
    """Per-response-token values, one list per sequence, as one float32 host tensor."""
    for i, (values, n) in enumerate(zip(per_response, response_lengths)):
        if len(values) != n:
            raise ValueError(
                f"sequence {i} has {n} response tokens but {len(values)} per-token values: give "
                f"one value per response token"
            )
    return torch.tensor(
        list(itertools.chain.from_iterable(per_response)), dtype=torch.float32, device="cpu"
    )
