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
record holds at most that many feature rows (each as its step's output and a row index, the output
living until every request of that step has caught up or been released; the rows are gathered at
the catch-up, so a plain step makes no tensor per request). A record is dropped when the
request's KV is released (finished, aborted, retracted: a retracted request's prefill rebuilds
its draft from the target's prefill), and the positions it covers stay out of the prefix cache
(their draft KV is missing; EagleWorker.release).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch

from spec_engine.core.request import Req

# Positions a request's draft may lag before it catches up: as many as its share of
# LAG_BUDGET_BYTES of feature rows holds (all running requests lagging at once), at least MIN_LAG
# and at most MAX_LAG (the widest catch-up extend per request; token-only drafts: MAX_LAG). While
# plain decoding wins for long (speculative.adaptive backs off its tries of speculation) a catch-up
# comes every that many plain steps, and a request that finishes lagging skips it.
MIN_LAG = 128
MAX_LAG = 1024
LAG_BUDGET_BYTES = 256 << 20
EXTEND_SAMPLES = 32  # the latest draft extends the catch-up estimate is fitted to


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
    # feature drafts, one per position: (its step's feature rows, the request's row there)
    features: list[tuple[torch.Tensor, int]] = field(default_factory=list)


def record(reqs: Sequence[Req], tokens: Sequence[int], features: Optional[torch.Tensor]) -> None:
    """After a plain step decoded position kv_len - 1 of each request: add the draft's input
    token and (feature drafts) the target's feature row there (`features`: the step's rows, in
    the order of `reqs`)."""
    for i, (r, token) in enumerate(zip(reqs, tokens)):
        lag = r.draft_lag
        if lag is None:
            lag = r.draft_lag = DraftLag(r.kv_len - 1)
        lag.tokens.append(token)
        if features is not None:
            lag.features.append((features, i))


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
    offsets: dict[int, int] = {}  # id of a step's feature rows -> their first row in `outputs`
    outputs: list[torch.Tensor] = []
    index: list[int] = []
    total = 0
    for lag in lags:
        for rows, i in lag.features:
            offset = offsets.get(id(rows))
            if offset is None:
                offset = offsets[id(rows)] = total
                outputs.append(rows)
                total += len(rows)
            index.append(offset + i)
    if not outputs:
        return lags, None
    stacked = torch.cat(outputs)
    return lags, stacked[torch.tensor(index, dtype=torch.int64, device=stacked.device)]


class ExtendCost:
    """Seconds of the draft's extends against the positions they cover (each prefill's and each
    catch-up's), fitted as a fixed cost plus a cost per position: what catching up the lagging
    requests will cost before it runs. The adaptive cost model charges it to a try of
    speculation: after a long plain stretch the catch-up of every request's plain positions
    costs more than the step itself (a 1-second extend before a 0.1-second step at batch 64 on
    CPU), while the warm-up's catch-ups covered a position or two each."""

    def __init__(self) -> None:
        self.samples: deque = deque(maxlen=EXTEND_SAMPLES)  # (positions, seconds)
        self._fit: Optional[tuple[float, float]] = None  # (fixed, per position) of the samples

    def add(self, positions: int, seconds: float) -> None:
        self.samples.append((positions, seconds))
        self._fit = None

    def predict(self, positions: int) -> Optional[float]:
        """Seconds of an extend over `positions` (0: none runs); None until extends of two
        different sizes were measured (a prefill's and a catch-up's)."""
        if positions <= 0:
            return 0.0
        if self._fit is None:  # fitted once per sample: the policy asks every decode step
            xs = [x for x, _ in self.samples]
            if len(set(xs)) < 2:
                return None
            mean_x = sum(xs) / len(xs)
            mean_y = sum(y for _, y in self.samples) / len(xs)
            var = sum((x - mean_x) ** 2 for x in xs)
            cov = sum((x - mean_x) * (y - mean_y) for x, y in self.samples)
            per_position = max(cov / var, 0.0)
            self._fit = (max(mean_y - per_position * mean_x, 0.0), per_position)
        fixed, per_position = self._fit
        return fixed + per_position * positions


def positions(reqs: Sequence[Req]) -> int:
    """Positions the lagging requests among `reqs` would catch up now."""
    return sum(len(r.draft_lag.tokens) for r in reqs if r.draft_lag is not None)
