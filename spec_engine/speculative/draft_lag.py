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

Bounds: a request that lags MAX_LAG positions is caught up before the next step, so a record
holds at most MAX_LAG feature rows (views of their step's output, which lives until every
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

# Positions a request's draft may lag: while plain decoding wins for long (core.adaptive backs
# off its tries of speculation), catch-ups come every MAX_LAG steps, one extend of this width.
MAX_LAG = 128


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


def lagging(req: Req, full_only: bool = False) -> bool:
    """Whether `req`'s draft lags (`full_only`: by MAX_LAG positions, to catch up now)."""
    lag = req.draft_lag
    return lag is not None and (not full_only or len(lag.tokens) >= MAX_LAG)


def take(reqs: Sequence[Req]) -> tuple[list[DraftLag], Optional[torch.Tensor]]:
    """The records of `reqs` (all lagging), removed from them, and their feature rows stacked
    in order (None for a draft without features)."""
    lags = [r.draft_lag for r in reqs]
    for r in reqs:
        r.draft_lag = None
    rows = [f for lag in lags for f in lag.features]
    return lags, torch.stack(rows) if rows else None
