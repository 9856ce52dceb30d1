"""DraftLag: what a draft model still has to see of the positions its target decoded plainly.

Under --speculative-adaptive a plain decode step runs the target alone: a draft with a KV cache
of its own (EAGLE, EAGLE-3, MTP, STANDALONE; not a self-draft) falls behind its request, with no
KV at the plainly decoded positions and a next-round state (spec_state) from an older one.
Running the draft's extend after every plain step instead cost 30-40% of the step on CPU, paid
even when speculation never resumes. So each plain step only records, per request, what that
extend would read at the decoded position — the draft's input token there (a feature draft's
is the token sampled next, a STANDALONE draft's the token decoded) and, for a feature draft, the
target's feature there, captured by the plain forward — and the next speculative step first
catches every lagging request up with one batched draft extend over all its recorded positions
(EagleWorker.catch_up), leaving the draft exactly where the per-step extends would have.

Bounds: a request that lags lag_limit() positions is caught up before the next step, so a
record holds at most that many feature rows (views of their step's output, which lives until every
request of that step has caught up or been released). A record is dropped when the request's KV
is released (finished, aborted, retracted: a retracted request's prefill rebuilds its draft from
the target's prefill), and the positions it covers stay out of the prefix cache (their draft KV
is missing; EagleWorker.release).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from spec_engine.core.request import Req

# Positions a request's draft may lag before it catches up: as many as its share of
# LAG_BUDGET_BYTES of feature rows holds (all running requests lagging at once), at least MIN_LAG
# and at most MAX_LAG (the widest catch-up extend per request; token-only drafts: MAX_LAG). While
# plain decoding wins for long (core.adaptive backs off its tries of speculation) a catch-up
# comes every that many plain steps, and a request that finishes lagging skips it.
MIN_LAG = 128
MAX_LAG = 1024
LAG_BUDGET_BYTES = 256 << 20


def lag_limit(features: Optional[torch.Tensor], max_running: int) -> int:
    """Positions a request's draft may lag, for `features` rows like these (None: tokens only)
    and at most `max_running` requests lagging."""
    if features is None:
        return MAX_LAG
    row_bytes = features[0].numel() * features.element_size()
    return max(MIN_LAG, min(MAX_LAG, LAG_BUDGET_BYTES // (max_running * row_bytes)))


@dataclass
class DraftLag:
    """A request's draft inputs at positions start, start + 1, ... (req.draft_lag)."""

    start: int  # the first position without draft KV
    tokens: list[int] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)  # feature drafts: one row each


def record(reqs: Sequence[Req], tokens: Sequence[int], features: Optional[torch.Tensor]) -> None:
    """After a plain step decoded position kv_len - 1 of each request: add the draft's input
    token and (feature drafts) the target's feature row there."""
    rows = features.unbind(0) if features is not None else None
    for i, (r, token) in enumerate(zip(reqs, tokens)):
        if r.draft_lag is None:
            r.draft_lag = DraftLag(r.kv_len - 1)
        r.draft_lag.tokens.append(token)
        if rows is not None:
            r.draft_lag.features.append(rows[i])


def lagging(req: Req, limit: Optional[int] = None) -> bool:
    """Whether `req`'s draft lags (by `limit` positions or more: it must catch up now)."""
    lag = req.draft_lag
    return lag is not None and (limit is None or len(lag.tokens) >= limit)


def take(reqs: Sequence[Req]) -> tuple[list[DraftLag], Optional[torch.Tensor]]:
    """The records of `reqs` (all lagging), removed from them, and their feature rows stacked
    in order (None for a draft without features)."""
    lags = [r.draft_lag for r in reqs]
    for r in reqs:
        r.draft_lag = None
    rows = [f for lag in lags for f in lag.features]
    return lags, torch.stack(rows) if rows else None
