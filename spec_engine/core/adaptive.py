"""SpecCostModel: whether a decode step should speculate, and how deep (--speculative-adaptive).

Speculation pays when the tokens a verify step emits per request (the accept length) outweigh
what the step costs over a plain decode step. Both costs depend on the batch size: on a
memory-bound GPU a plain step at batch 1 leaves compute idle that a verify fills for free, while
a compute-bound batch pays for every verified row, so a shallower draft (fewer verify rows and
draft steps) can win where the configured depth loses. The model keeps, per batch-size bucket
(powers of two: 1, 2, 3-4, 5-8, ...), the median of the last RECENT measurements of the seconds
one request spends in a plain step and in a speculative step at each candidate depth
(args.spec_shapes.candidate_depths: the configured depth and the powers of two below it). A step
of batch B runs the mode with the most expected tokens per second per request: 1 / plain_s(B),
or accept(d) / spec_s(B, d) for depth d.

Accept lengths are a property of the text and the draft more than of the batch, so they are
kept across buckets, as the survival of the drafts a request accepts (a): accept(d) =
1 + sum_{k<=d} P(a >= k), with P(a >= k) the product of the continuation rates
h_j = P(a >= j | a >= j - 1), j <= k (Kaplan-Meier: a step at depth d says nothing about
k > d, and a rate conditioned on reaching j - 1 depends less on where in their generations the
requests were than P(a >= k) does: a repetitive stretch accepts more at every k). A chain's first
d draft tokens do not depend on how deep it drafts (args.spec_shapes.nested_shapes), and an
NGRAM tree of fewer nodes is the start of the same breadth-first trie walk
(args.spec_shapes.contained_shapes), so their rates come from every step run at a depth >= j:
running deep measures every shallower depth too (exactly for a chain; for NGRAM the smaller
tree accepts at most as much, so its rate reads a little high), and the deeper depths' first
rates follow the text as it goes. Trees of a draft model keep other branches at fewer tokens:
their rates are kept per depth. Each request at risk (a >= j - 1) counts as one sample: the
averages are plain means of the first 1 / ALPHA_PER_REQUEST requests, then move by
ALPHA_PER_REQUEST per request, so a step of one request (batch 1, where each step either accepts
everything or not) moves them as little as its one sample warrants, and a depth's estimate does
not rest on its first lucky or unlucky step. One step moves them by ALPHA at most past the first
samples: its requests sit at the same point of their generations, so 64 requests of one step are
not 64 independent samples.

Costs are monotone in the same way: a deeper step verifies more rows (and drafts more steps), so
the per-request seconds of plain decoding and the depths, in that order, are read through their
isotonic fit (pool adjacent violators, weighted by measurements): two warm-up steps on a noisy
machine can measure depth 2 slower than depth 4, which no step of the batch could be.

Measuring is online: the first step of a mode in a bucket is not counted (it pays one-off costs
such as a graph captured on first use), then each mode is tried until it has `WARM_STEPS`
measurements there (the deepest first: it measures the shallower chains' accept lengths; then
plain decoding, the comparison that matters most, then the shallower depths). Afterwards the
chosen mode measures itself every step, and a mode not chosen is tried again so the averages
follow changes (a draft learning or falling behind new weights, longer contexts), but each try
costs a step in a slower mode, so tries back off: a mode is retried once it has not run for its
interval of steps of the bucket (`EXPLORE_EVERY` at first), which doubles each time a try leaves
it behind (up to `MAX_EXPLORE_EVERY`) and starts over when it wins or new weights arrive
(`weights_updated`) or a try's own step beats the chosen mode (a draft that got better is tried
every `EXPLORE_EVERY` steps until the averages agree). A mode that could not win even if every
draft token were accepted ((depth + 1) / its cost below the chosen mode's rate; plain decoding:
its measured rate) waits `MAX_EXPLORE_EVERY` steps: its cost, not the draft, keeps it behind.
`choose(batch)` is a pure function of the state, so the scheduler may ask it several times per
step (KV demand, retraction, the step itself); `observe` moves it.

Every speculative worker may switch mode per step: NGRAM has no draft state, a draft model
drafts any depth from the same state, and under this flag the draft-model workers record what
their draft needs of each plainly decoded position and catch it up in one extend when
speculation resumes (speculative/draft_lag.py), so a plain step runs no draft and switching
loses nothing. That catch-up runs outside the step the model times: it is paid once per
switch, not per step of a stretch.

Runs on the scheduler thread only.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from spec_engine.args.spec_shapes import contained_shapes, nested_shapes, spec_shapes

ALPHA = 0.25  # the most one step moves the survival averages (past their first samples)
RECENT = 5  # a mode's cost in a bucket: the median of its last RECENT measurements there
ALPHA_PER_REQUEST = 1 / 32  # weight of one request's accepted drafts in the survival averages
WARM_STEPS = 2  # measurements per mode and bucket before the averages decide
EXPLORE_EVERY = 128  # steps of a bucket a mode may first go unrun before it is tried again
MAX_EXPLORE_EVERY = 2048  # the longest interval between tries of a mode
PLAIN = 0  # the mode of a plain decode step; speculative modes are their depth


def bucket(batch: int) -> int:
    """The bucket of a batch size: the smallest power of two >= it."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class ModeCost:
    """One mode's measurements in one bucket."""

    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))  # seconds per request
    steps: int = 0  # counted measurements
    seen: bool = False  # the uncounted first step ran
    since: int = 0  # steps of the bucket since this mode last ran
    interval: int = EXPLORE_EVERY  # steps unrun after which it is tried again

    @property
    def seconds(self) -> Optional[float]:
        """Seconds per request per step: the median of the recent measurements (a step slowed by
        another process on the machine moves it only once it is the rule)."""
        return statistics.median(self.recent) if self.recent else None

    def add(self, seconds: float) -> None:
        self.since = 0
        if not self.seen:
            self.seen = True
            return
        self.steps += 1
        self.recent.append(seconds)


class SpecCostModel:
    def __init__(self, depths: Sequence[int], nested: bool, shared: Optional[bool] = None) -> None:
        """`depths`: the candidate speculative depths (ascending); `nested`: whether a
        shallower draft is the start of a deeper one (a chain); `shared` (default: `nested`):
        whether a shallower draft is contained in a deeper one (a chain or NGRAM), so that all
        depths share their continuation rates."""
        if not depths or any(d < 1 for d in depths) or list(depths) != sorted(set(depths)):
            raise ValueError(f"speculative depths must be ascending and >= 1, got {list(depths)}")
        self.depths = list(depths)
        self.modes = [PLAIN, *self.depths]
        self.nested = nested
        self.shared = nested if shared is None else shared
        self.costs: dict[int, dict[int, ModeCost]] = {}
        # (pool, k) -> average share of the requests that accepted >= k - 1 drafts which accepted
        # >= k; the pool is 0 for shared shapes, else the depth the step ran at.
        self.rate: dict[tuple[int, int], float] = {}
        self.samples: dict[tuple[int, int], int] = {}  # requests each rate average has seen
        self.frozen = False  # tests: measurements no longer move the model
        self.decisions = dict.fromkeys(self.modes, 0)  # steps run per mode

    @classmethod
    def from_args(cls, args: Any) -> SpecCostModel:
        """The model over the candidate shapes of resolved engine `args`."""
        depths = [s.depth for s in spec_shapes(args, adaptive=True)]
        return cls(depths, nested_shapes(args), contained_shapes(args))

    def _bucket(self, batch: int) -> dict[int, ModeCost]:
        return self.costs.setdefault(bucket(batch), {m: ModeCost() for m in self.modes})

    def choose(self, batch: int) -> int:
        """The mode of the next decode step of `batch` requests: PLAIN or a depth."""
        modes = self._bucket(batch)
        if not self.frozen:
            for mode in [self.depths[-1], PLAIN, *reversed(self.depths[:-1])]:
                if modes[mode].steps < WARM_STEPS:
                    return mode
        best = self.best(batch)
        if self.frozen:
            return best
        seconds = self.seconds(batch)
        top = max(self.rates(batch).values(), default=0.0)
        due = [
            m
            for m in self.modes
            if m != best and modes[m].since >= self._interval(m, modes, seconds.get(m), top)
        ]
        return max(due, key=lambda m: modes[m].since) if due else best

    def _interval(
        self, mode: int, modes: dict[int, ModeCost], seconds: Optional[float], top: float
    ) -> int:
        """Steps of its bucket (`modes`) `mode`, costing `seconds` per request, may go unrun
        before it is tried again, the bucket's best rate being `top`."""
        if self.nested and PLAIN < mode < self.depths[-1]:
            return MAX_EXPLORE_EVERY  # the deepest depth's steps measure its accept length
        ceiling = (mode + 1) / seconds if seconds else float("inf")
        return modes[mode].interval if ceiling >= top else MAX_EXPLORE_EVERY

    def accept_length(self, depth: int) -> Optional[float]:
        """Expected tokens a verify at `depth` emits per request (None until measured)."""
        pool = PLAIN if self.shared else depth
        rates = [self.rate.get((pool, k)) for k in range(1, depth + 1)]
        if None in rates:
            return None
        accept, survival = 1.0, 1.0
        for rate in rates:
            survival *= rate
            accept += survival
        return accept

    def seconds(self, batch: int) -> dict[int, float]:
        """Seconds per request of every measured mode at `batch`: the isotonic fit (non-decreasing
        from plain decoding to the deepest depth) of the averages, weighted by measurements."""
        measured = [(m, c) for m, c in self._bucket(batch).items() if c.seconds is not None]
        blocks: list[tuple[float, int, int]] = []  # (mean, weight, modes pooled)
        for _, cost in measured:
            mean, weight, count = cost.seconds, max(cost.steps, 1), 1
            while blocks and blocks[-1][0] > mean:
                prev_mean, prev_weight, prev_count = blocks.pop()
                total = prev_weight + weight
                mean = (prev_mean * prev_weight + mean * weight) / total
                weight, count = total, prev_count + count
            blocks.append((mean, weight, count))
        fitted = [mean for mean, _, count in blocks for _ in range(count)]
        return {mode: s for (mode, _), s in zip(measured, fitted)}

    def rates(self, batch: int) -> dict[int, float]:
        """Expected tokens per second per request of every measured mode at `batch`."""
        rates = {}
        for mode, seconds in self.seconds(batch).items():
            accept = 1.0 if mode == PLAIN else self.accept_length(mode)
            if accept is not None:
                rates[mode] = accept / seconds
        return rates

    def best(self, batch: int) -> int:
        """The measured mode with the most expected tokens/s at `batch`; plain decoding while it
        has no measurement to compare with (ties go to the shallower mode)."""
        rates = self.rates(batch)
        if PLAIN not in rates:
            return PLAIN
        return max(sorted(rates), key=lambda m: (rates[m], -m))

    def expected_speculative_gain(self, batch: int) -> float:
        """Expected tokens/s of the best depth over plain decoding at `batch` (1.0 when a
        measurement is missing)."""
        rates = self.rates(batch)
        spec = [r for m, r in rates.items() if m != PLAIN]
        return max(spec) / rates[PLAIN] if spec and PLAIN in rates else 1.0

    def observe(
        self, mode: int, batch: int, seconds: float, tokens: Sequence[Sequence[int]] = ()
    ) -> None:
        """A decode step ran: its mode, batch size, duration and, speculating, the tokens each
        request's verify emitted (the accepted drafts and the bonus token)."""
        self.decisions[mode] += 1
        if self.frozen or batch <= 0:
            return
        modes = self._bucket(batch)
        for cost in modes.values():
            cost.since += 1
        cost = modes[mode]
        cost.add(seconds / batch)
        if mode != PLAIN and tokens:
            pool = PLAIN if self.shared else mode
            accepted = [len(t) - 1 for t in tokens]
            for k in range(1, mode + 1):
                n = sum(a >= k - 1 for a in accepted)  # at risk
                if n == 0:
                    break
                share = sum(a >= k for a in accepted) / n
                seen = self.samples.get((pool, k), 0)
                mean = n / (seen + n) if seen * ALPHA_PER_REQUEST < 1 else 0.0
                weight = max(min(1 - (1 - ALPHA_PER_REQUEST) ** n, ALPHA), mean)
                old = self.rate.get((pool, k), share)
                self.rate[(pool, k)] = old + weight * (share - old)
                self.samples[(pool, k)] = seen + n
        if cost.steps > WARM_STEPS:
            cost.interval = self._next_interval(batch, mode, seconds / batch, tokens)

    def _next_interval(
        self, batch: int, mode: int, seconds: float, tokens: Sequence[Sequence[int]]
    ) -> int:
        """After a step of `mode` past warm-up: the first interval if it is now the best mode or
        this step alone beat the best (one step moves the averages only part of the way: a
        draft that got better is tried again soon, not after ever longer waits); else the
        interval doubled. (Not at once: one step that accepted everything beats the deeper
        mode's average though that mode would have accepted more in the same step.)"""
        best = self.best(batch)
        accept = sum(map(len, tokens)) / len(tokens) if mode != PLAIN and tokens else 1.0
        if best == mode or accept / seconds >= self.rates(batch).get(best, float("inf")):
            return EXPLORE_EVERY
        return min(2 * self._bucket(batch)[mode].interval, MAX_EXPLORE_EVERY)

    def weights_updated(self) -> None:
        """New weights: a draft may now predict better or worse, so every mode is tried again
        at the first interval."""
        for modes in self.costs.values():
            for cost in modes.values():
                cost.interval = EXPLORE_EVERY

    def set_costs(
        self, batch: int, plain_s: float, spec_s: Union[float, Mapping[int, float]]
    ) -> None:
        """Tests and tools: set the bucket of `batch` as measured (seconds per request per step;
        `spec_s` one for every depth or per depth) and freeze the model so steps do not move
        it."""
        per_depth = spec_s if isinstance(spec_s, Mapping) else dict.fromkeys(self.depths, spec_s)
        unknown = set(per_depth) - set(self.depths)
        if unknown:
            raise ValueError(f"depths {sorted(unknown)} are not candidates ({self.depths})")
        modes = self._bucket(batch)
        for mode, seconds in ((PLAIN, plain_s), *per_depth.items()):
            modes[mode] = ModeCost(deque([seconds], maxlen=RECENT), WARM_STEPS, True, 0)
        self.frozen = True

    def set_accept(self, survival: Sequence[float]) -> None:
        """Tests and tools: set P(a >= k) for k = 1, 2, ... (0 past the list) at every depth,
        and freeze the model."""
        if any(not 0.0 <= p <= 1.0 for p in survival):
            raise ValueError(f"survival probabilities must lie in [0, 1], got {list(survival)}")
        if any(b > a for a, b in zip(survival, survival[1:])):
            raise ValueError(f"survival probabilities must not grow with k, got {list(survival)}")
        padded = [1.0, *survival, *[0.0] * self.depths[-1]]
        for pool in [PLAIN] if self.shared else self.depths:
            for k in range(1, self.depths[-1] + 1):
                before = padded[k - 1]
                self.rate[(pool, k)] = padded[k] / before if before else 0.0
        self.frozen = True

    def report(self) -> dict[str, Any]:
        """For get_server_info: the accept length per depth, the averages per bucket and the
        mode each implies (`depth`: 0 for plain decoding), the steps run in each mode."""
        return {
            "depths": self.depths,
            "accept_length": {d: self.accept_length(d) for d in self.depths},
            "speculative_steps": sum(n for m, n in self.decisions.items() if m != PLAIN),
            "plain_steps": self.decisions[PLAIN],
            "steps_by_depth": {d: self.decisions[d] for d in self.depths},
            "buckets": {
                b: {
                    "plain_s_per_req": modes[PLAIN].seconds,
                    "spec_s_per_req": {d: modes[d].seconds for d in self.depths},
                    "depth": self.best(b),
                    "speculate": self.best(b) != PLAIN,
                }
                for b, modes in sorted(self.costs.items())
            },
        }
