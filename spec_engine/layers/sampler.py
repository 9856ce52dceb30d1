"""Sampler: next tokens and their log-probs from logits, per-request params in one batch.

Filtering follows transformers' generate order: temperature, top-k, top-p (on the top-k
renormalised distribution), min-p. A token is drawn by inverse-CDF with one uniform per row
that is a hash of (request seed, output index): the draw does not depend on which other
requests share the batch, so outputs repeat exactly under a fixed seed, across retractions too.

Returned log-probs are log_softmax(logits / temperature) of the chosen token, before any
top-k/top-p/min-p filtering (what a trainer recomputes); temperature 0 counts as 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def request_uniform(seed: int, index: int, stream: int = 0) -> float:
    """A uniform in [0, 1) that depends only on (seed, index, stream)."""
    return (_splitmix64(_splitmix64(seed) ^ _splitmix64((index << 8) | stream)) >> 11) * 2.0**-53


def derive_seed(base: int, index: int) -> int:
    return _splitmix64(base ^ _splitmix64(index)) >> 1


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step from the requests."""

    temperatures: torch.Tensor  # [B] float; 1.0 where the temperature is 0 (greedy)
    top_ks: torch.Tensor  # [B] int64, vocab size when disabled
    top_ps: torch.Tensor  # [B] float
    min_ps: torch.Tensor  # [B] float
    uniforms: torch.Tensor  # [B] float64
    all_greedy: bool
    unit_temperature: bool  # every row has temperature 1 (no division needed)
    plain_rows: Optional[torch.Tensor]  # sampled rows without filters
    filter_rows: Optional[torch.Tensor]  # sampled rows with a top-k/top-p/min-p filter
    need_logprobs: bool
    top_logprobs_num: int
    banned: Optional[tuple[torch.Tensor, torch.Tensor]]  # (rows, token ids) that may not be drawn
    # [B, K] int64: the ids whose log-probs each row reports (token_ids_logprob, padded).
    token_ids: Optional[torch.Tensor] = None
    filter_k_max: Optional[int] = None  # the largest top-k of filter_rows, known on the host


@dataclass
class DrawnTokens:
    """A step's draws on the device, before anything is read back."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: Optional[torch.Tensor]  # [B] float32 when asked
    top_values: Optional[torch.Tensor]  # [B, top_logprobs_num] when asked
    top_ids: Optional[torch.Tensor]
    token_ids_values: Optional[torch.Tensor] = None  # [B, K] log-probs of batch.token_ids


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: Optional[list[float]]
    top_logprobs: Optional[list[list[tuple[float, int]]]]
    token_ids_logprobs: Optional[list[list[float]]] = None  # per row, of batch.token_ids


def filtered_probs(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    k_max: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply top-k, top-p, min-p to rows of probabilities.

    Returns (kept probabilities sorted descending, unnormalised, zero where filtered; their
    token ids). Only the largest top-k across rows is sorted when every row has a top-k
    (`k_max`: that largest, when the caller knows it on the host; else it is read back).
    """
    vocab = probs.shape[-1]
    k_max = int(top_ks.max()) if k_max is None else k_max
    if k_max < vocab:
        sorted_p, sorted_ids = probs.topk(k_max, dim=-1)
    else:
        sorted_p, sorted_ids = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(sorted_p.shape[-1], device=probs.device)[None, :]
    sorted_p = sorted_p.masked_fill(ranks >= top_ks[:, None], 0.0)
    # top-p on the renormalised top-k distribution: keep a token while the mass before it < p.
    mass_before = (sorted_p.cumsum(-1) - sorted_p) / sorted_p.sum(-1, keepdim=True)
    sorted_p = sorted_p.masked_fill(mass_before >= top_ps[:, None], 0.0)
    sorted_p = sorted_p.masked_fill(sorted_p < min_ps[:, None] * sorted_p[:, :1], 0.0)
    return sorted_p, sorted_ids


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index drawn from each row of unnormalised `probs` using that row's uniform."""
    cdf = probs.double().cumsum(-1)
    target = (uniforms * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """logits: [B, vocab] float32. The draws read back to the host."""
        return self.read(self.draw(logits, batch))

    @staticmethod
    def read(drawn: DrawnTokens) -> SampleOutput:
        """`drawn` on the host (reads per part; a step reads them with its flags in one copy:
        core.readback.read_back)."""
        top = None
        if drawn.top_values is not None:
            top = [
                list(zip(v, i)) for v, i in zip(drawn.top_values.tolist(), drawn.top_ids.tolist())
            ]
        logprobs = drawn.logprobs.tolist() if drawn.logprobs is not None else None
        chosen = drawn.token_ids_values
        return SampleOutput(
            drawn.token_ids.tolist(), logprobs, top, None if chosen is None else chosen.tolist()
        )

    def draw(self, logits: torch.Tensor, batch: SamplingBatch) -> DrawnTokens:
        """The tokens (and asked log-probs) of logits [B, vocab] float32, on the device."""
        scaled = logits if batch.unit_temperature else logits / batch.temperatures[:, None]
        logp = None
        if not batch.all_greedy or batch.need_logprobs or batch.top_logprobs_num:
            # top and chosen-id log-probs come from this same distribution.
            logp = torch.log_softmax(scaled, -1)
        allowed = logits
        if batch.banned is not None:
            # Draws exclude banned tokens; reported log-probs stay those of the model.
            allowed = logits.index_put(
                batch.banned, torch.tensor(float("-inf"), device=logits.device)
            )
            scaled = scaled.index_put(
                batch.banned, torch.tensor(float("-inf"), device=logits.device)
            )
        token_ids = allowed.argmax(-1)
        if not batch.all_greedy:
            probs = logp.exp() if batch.banned is None else torch.softmax(scaled, -1)
            if batch.plain_rows is not None:
                rows = batch.plain_rows
                token_ids[rows] = inverse_cdf(probs[rows], batch.uniforms[rows])
            if batch.filter_rows is not None:
                rows = batch.filter_rows
                kept, ids = filtered_probs(
                    probs[rows],
                    batch.top_ks[rows],
                    batch.top_ps[rows],
                    batch.min_ps[rows],
                    batch.filter_k_max,
                )
                token_ids[rows] = ids.gather(
                    1, inverse_cdf(kept, batch.uniforms[rows])[:, None]
                ).squeeze(1)
        logprobs = vals = ids = None
        if batch.need_logprobs:
            logprobs = logp.gather(1, token_ids[:, None]).squeeze(1)
        if batch.top_logprobs_num:
            vals, ids = logp.topk(batch.top_logprobs_num, dim=-1)
        chosen = None if batch.token_ids is None else logp.gather(1, batch.token_ids)
        return DrawnTokens(token_ids, logprobs, vals, ids, chosen)
