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
kept across buckets as moving averages of the survival P(a >= k) of the drafts a request
accepts (a), per k. A chain's first d draft tokens do not depend on how deep it drafts
(args.spec_shapes.nested_shapes), so accept(d) = 1 + sum_{k<=d} P(a >= k) with P(a >= k) from
every step run at a depth >= k: running deep measures every shallower depth too. An NGRAM tree
of d + 1 nodes is the first d + 1 nodes of a larger tree's trie walk
(args.spec_shapes.contained_shapes): a step's accepted path (node indices, which grow along it)
says exactly what each smaller tree would have accepted, its leading nodes numbered <= d, so
every step feeds the averages of its own depth and of every shallower one. A draft model's tree
of fewer tokens keeps other branches: its survival is kept from its own steps. Each request a
step verified counts as one sample, up to STEP_SAMPLES per step (its requests sit at the same
point of their generations: 64 requests of one step are not 64 independent samples): the
averages are plain means of the first 1 / ALPHA_PER_REQUEST samples, then move by
ALPHA_PER_REQUEST per sample, so a step of one request (batch 1, where each step either accepts
everything or not) moves them as little as its one sample warrants, and a depth's estimate does
not rest on its first lucky or unlucky step.

Costs are monotone in the same way: a deeper step verifies more rows (and drafts more steps), so
the per-request seconds of plain decoding and the depths, in that order, are read through their
isotonic fit (pool adjacent violators, weighted by measurements): two warm-up steps on a noisy
machine can measure depth 2 slower than depth 4, which no step of the batch could be.

A machine shared with other processes runs at different speeds from one minute to the next, and a
mode not chosen is measured only in its tries: compared as measured, a plain step timed in a slow
minute loses to a depth timed in a fast one. So each measurement keeps its step, and a mode is
compared with the bucket's reference mode (the one whose RECENT latest measurements are the
newest: the mode chosen, which runs every step) as measured around that step: its cost is the
median of its measurements each scaled by how the reference's cost moved since (the reference's
median now over its median at the RECENT measurements nearest that step, from its last HISTORY),
less the first NOISE of the move, which is the steps' own noise. The reference's own cost is its
median as measured.

Measuring is online: the first step of a mode in a bucket is not counted (it pays one-off costs
such as a graph captured on first use), a step much faster than a mode's median replaces its
measurements (`STALE_SHARE`: they were taken cold, and would otherwise keep a mode that loses on
them unchosen for several tries), then each mode is tried until it has `WARM_STEPS`
measurements there, round-robin (the deepest first: it measures the shallower depths' accept
lengths; then plain decoding, the comparison that matters most, then the shallower depths), so
that no mode is measured only in the first steps of the generations, which accept differently
from later ones (NGRAM finds more repetition as a generation goes on). Afterwards the
chosen mode measures itself every step, and a mode not chosen is tried again so the averages
follow changes (a draft learning or falling behind new weights, longer contexts), but each try
costs a step in a slower mode, so tries back off: a mode is retried once it has not run for its
interval of steps of the bucket (`EXPLORE_EVERY` at first, or as many as keep a try's measured
loss against the chosen mode within its share of `EXPLORE_BUDGET` of the steps between tries,
where that is more: a try of a verify three times a plain step's cost waits longer than one of a
cheap one; the modes tried share the budget, so a tree's three depths each get a third),
which doubles each time a try leaves it behind (up to `MAX_EXPLORE_EVERY`) and starts over when
it wins or new weights arrive (`weights_updated`) or a try's own step beats the chosen mode (a
draft that got better is tried at that first interval until the averages agree). A try's loss
includes the draft catch-up a lagging draft model pays before it: the worker's estimate for the
positions the requests lag now (speculative/draft_lag.ExtendCost, fitted to the draft's prefill
extends and catch-ups), else the median of that mode's recent switches. The longer the plain
stretch, the more a try costs, so tries come when the lag is short (new requests, or right
after the catch-up a full lag forces). A mode that
could not win even if every draft token were accepted ((depth + 1) / its cost below the chosen
mode's rate; plain decoding: its measured rate) waits `MAX_EXPLORE_EVERY` steps once its cost
rests on `RECENT` measurements: its cost, not the draft, keeps it behind (on fewer, the warm-up's
alone, it may have been measured cold, and is tried as any losing mode).
`choose(batch)` is a pure function of the state, so the scheduler may ask it again within a step
(after a retraction changed the batch); `observe` moves it.

Every speculative worker may switch mode per step: NGRAM has no draft state, a draft model
drafts any depth from the same state, and under this flag the draft-model workers record what
their draft needs of each plainly decoded position and catch it up in one extend when
speculation resumes (speculative/draft_lag.py), so a plain step runs no draft and switching
loses nothing. That catch-up runs outside the step the model times (it is paid once per
switch, not per step of a stretch) and is charged to the tries.

Runs on the scheduler thread only.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from spec_engine.args.spec_shapes import contained_shapes, nested_shapes, spec_shapes

STEP_SAMPLES = 8  # the most samples one step's requests count for in the survival averages
RECENT = 5  # a mode's cost in a bucket: the median of its last RECENT measurements there
ALPHA_PER_REQUEST = 1 / 32  # weight of one request's accepted drafts in the survival averages
WARM_STEPS = 2  # measurements per mode and bucket before the averages decide
EXPLORE_EVERY = 128  # steps of a bucket a mode may first go unrun before it is tried again
MAX_EXPLORE_EVERY = 2048  # the longest interval between tries of a mode
# The most a mode's tries may cost, as a share of the steps between them, against the chosen
# mode: a try that costs 2.6 best-mode steps (a verify of random drafts at batch 32 on CPU) waits
# 260 steps, not EXPLORE_EVERY.
EXPLORE_BUDGET = 0.01
# A measurement below this share of a mode's median says the earlier ones were cold (an H200's
# first speculative steps of an 8B model measured 48 ms where steady ones take 33): they are
# dropped. Another process on the machine only slows steps, so a fast one is not noise of that
# kind, while a slow one moves the median only once it is the rule.
STALE_SHARE = 0.75
# How far the reference mode's cost may move (either way) before the costs compared with it are
# scaled: within it, the moves are the steps' own noise, and the two medians' ratio would add
# that noise to every other mode's cost.
NOISE = 1.1
PLAIN = 0  # the mode of a plain decode step; speculative modes are their depth
HISTORY = 512  # measurements per mode and bucket kept to compare later measurements with
LATEST_STEPS = 256  # steps the report lists (mode, batch, milliseconds): a generation or two


def _affordable_interval(
    seconds: Optional[float],
    rate: Optional[float],
    best_seconds: Optional[float],
    top: float,
    switch: float = 0.0,
    budget: float = EXPLORE_BUDGET,
) -> int:
    """The fewest steps of the best mode (`best_seconds` per request, `top` tokens/s per
    request) over which one try of a mode (`seconds` per request, `rate` tokens/s per request,
    `switch` seconds per request of draft catch-up before it) costs at most `budget` of their
    time: the try's loss is its time and its catch-up less what the best mode takes for the
    tokens it emits. 0 while a figure is unmeasured."""
    if not (seconds and rate and best_seconds and top):
        return 0
    loss = seconds * max(0.0, 1.0 - rate / top) + switch
    return math.ceil(loss / (budget * best_seconds))


def _beyond_noise(factor: float) -> float:
    """How far `factor` moved past the steps' noise (NOISE either way)."""
    return max(1.0, factor / NOISE) if factor >= 1.0 else min(1.0, factor * NOISE)


def bucket(batch: int) -> int:
    """The bucket of a batch size: the smallest power of two >= it."""
    return 1 << max(batch - 1, 0).bit_length()


def _leading(path: Sequence[int], depth: int) -> int:
    """Drafts of the accepted `path` (node indices, root 0 first) that the tree of its first
    depth + 1 nodes holds: node indices grow along a path, so its leading nodes numbered
    <= depth."""
    return next((i for i, node in enumerate(path[1:]) if node > depth), len(path) - 1)


@dataclass
class ModeCost:
    """One mode's measurements in one bucket."""

    # (step, seconds per request) of the counted measurements
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    steps: int = 0  # counted measurements
    seen: bool = False  # the uncounted first step ran
    since: int = 0  # steps of the bucket since this mode last ran
    # seconds per request of the draft catch-up before the mode's steps that followed another mode
    switch: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    interval: int = EXPLORE_EVERY  # steps unrun after which it is tried again
    scaled: tuple = ()  # (key, cost) of SpecCostModel._now: the reference and both step counts

    @property
    def latest(self) -> list[tuple[int, float]]:
        """The RECENT latest measurements (fewer at first)."""
        n = len(self.history)
        return [self.history[i] for i in range(max(n - RECENT, 0), n)]

    @property
    def seconds(self) -> Optional[float]:
        """Seconds per request per step: the median of the recent measurements (a step slowed by
        another process on the machine moves it only once it is the rule)."""
        return statistics.median(s for _, s in self.latest) if self.history else None

    def add(self, seconds: float, step: int) -> None:
        """A measurement (seconds per request) taken at `step`."""
        self.since = 0
        if not self.seen:
            self.seen = True
            return
        self.steps += 1
        if self.history and seconds < STALE_SHARE * self.seconds:
            self.history.clear()
        self.history.append((step, seconds))

    def seconds_at(self, step: int) -> float:
        """The median of the RECENT measurements nearest `step` (of the last HISTORY)."""
        at = bisect.bisect(self.history, step, key=lambda h: h[0])
        start = min(max(at - RECENT // 2, 0), max(len(self.history) - RECENT, 0))
        last = min(start + RECENT, len(self.history))
        return statistics.median(self.history[i][1] for i in range(start, last))

    def newest_window(self) -> int:
        """The step of the oldest of the RECENT latest measurements (-1 if fewer)."""
        return self.history[-RECENT][0] if len(self.history) >= RECENT else -1


class SpecCostModel:
    def __init__(self, depths: Sequence[int], nested: bool, contained: bool = False) -> None:
        """`depths`: the candidate speculative depths (ascending); `nested`: whether a
        shallower draft is the start of a deeper one (a chain); `contained`: whether a tree of
        d + 1 nodes is the first d + 1 nodes of a deeper one (NGRAM), so that a step's accepted
        paths tell what each shallower depth would have accepted."""
        if not depths or any(d < 1 for d in depths) or list(depths) != sorted(set(depths)):
            raise ValueError(f"speculative depths must be ascending and >= 1, got {list(depths)}")
        self.depths = list(depths)
        self.modes = [PLAIN, *self.depths]
        self.nested = nested
        self.contained = contained
        self.costs: dict[int, dict[int, ModeCost]] = {}
        # (pool, k) -> EMA of the share of requests that accepted >= k drafts; the pool is 0
        # for nested shapes, else the depth whose draft accepted them.
        self.survival: dict[tuple[int, int], float] = {}
        self.samples: dict[tuple[int, int], int] = {}  # samples each survival average has seen
        self.frozen = False  # tests: measurements no longer move the model
        self.decisions = dict.fromkeys(self.modes, 0)  # steps run per mode
        self.last_mode: Optional[int] = None
        self.clock = 0  # decode steps observed: the time of a measurement
        # (mode, batch, milliseconds) of the latest steps: why a mode was chosen, for the report
        self.latest: deque = deque(maxlen=LATEST_STEPS)

    @classmethod
    def from_args(cls, args: Any) -> SpecCostModel:
        """The model over the candidate shapes of resolved engine `args`."""
        depths = [s.depth for s in spec_shapes(args, adaptive=True)]
        return cls(depths, nested_shapes(args), contained_shapes(args))

    def _bucket(self, batch: int) -> dict[int, ModeCost]:
        key = bucket(batch)
        if key not in self.costs:  # not setdefault: it would build the unused default every step
            self.costs[key] = {m: ModeCost() for m in self.modes}
        return self.costs[key]

    def choose(self, batch: int, catch_up: Optional[float] = None) -> int:
        """The mode of the next decode step of `batch` requests: PLAIN or a depth; `catch_up`:
        the seconds a lagging draft's catch-up would take before a speculative step now (None:
        not known; the mode's recent switches stand in for it)."""
        modes = self._bucket(batch)
        if not self.frozen:
            order = [self.depths[-1], PLAIN, *reversed(self.depths[:-1])]
            cold = [m for m in order if modes[m].steps < WARM_STEPS]
            if cold:  # the first of those run least so far: round-robin
                return min(cold, key=lambda m: modes[m].steps + modes[m].seen)
        seconds = self.seconds(batch)
        rates = self._rates(seconds)
        best = self._best(rates)
        if self.frozen:
            return best
        due = [
            m
            for m in self.modes
            if m != best
            and modes[m].since >= self._interval(m, modes, seconds, rates, best, catch_up, batch)
        ]
        return max(due, key=lambda m: modes[m].since) if due else best

    def _interval(
        self,
        mode: int,
        modes: dict[int, ModeCost],
        seconds: Mapping[int, float],
        rates: Mapping[int, float],
        best: int,
        catch_up: Optional[float] = None,
        batch: int = 1,
    ) -> int:
        """Steps of its bucket (`modes`) `mode` may go unrun before it is tried again, the
        bucket's fitted `seconds` per request and expected `rates` being these, `best` the
        chosen mode and `catch_up` the seconds a try's catch-up of `batch` requests would take
        (see choose)."""
        if self.nested and PLAIN < mode < self.depths[-1]:
            return MAX_EXPLORE_EVERY  # the deepest depth's steps measure its accept length
        own, top = seconds.get(mode), max(rates.values(), default=0.0)
        ceiling = (mode + 1) / own if own else float("inf")
        if ceiling < top and len(modes[mode].history) >= RECENT:
            return MAX_EXPLORE_EVERY
        # One budget for all the modes tried: a tree's depths share it with plain decoding.
        tried = [
            m for m in self.modes if m != best and not (self.nested and PLAIN < m < self.depths[-1])
        ]
        if mode == PLAIN:
            switch = 0.0
        elif catch_up is not None:
            switch = catch_up / batch
        else:
            switch = statistics.median(modes[mode].switch) if modes[mode].switch else 0.0
        affordable = _affordable_interval(
            own, rates.get(mode), seconds.get(best), top, switch, EXPLORE_BUDGET / len(tried)
        )
        return max(modes[mode].interval, min(affordable, MAX_EXPLORE_EVERY))

    def accept_length(self, depth: int) -> Optional[float]:
        """Expected tokens a verify at `depth` emits per request (None until measured)."""
        pool = PLAIN if self.nested else depth
        survival = [self.survival.get((pool, k)) for k in range(1, depth + 1)]
        return None if None in survival else 1.0 + sum(survival)

    def seconds(self, batch: int) -> dict[int, float]:
        """Seconds per request of every measured mode at `batch`, as the reference mode runs now:
        the isotonic fit (non-decreasing from plain decoding to the deepest depth) of the
        averages, weighted by measurements."""
        modes = self._bucket(batch)
        measured = [(m, c) for m, c in modes.items() if c.seconds is not None]
        reference = max(modes.values(), key=ModeCost.newest_window)
        blocks: list[tuple[float, int, int]] = []  # (mean, weight, modes pooled)
        for _, cost in measured:
            mean, weight, count = self._now(cost, reference), min(len(cost.history), RECENT), 1
            while blocks and blocks[-1][0] > mean:
                prev_mean, prev_weight, prev_count = blocks.pop()
                total = prev_weight + weight
                mean = (prev_mean * prev_weight + mean * weight) / total
                weight, count = total, prev_count + count
            blocks.append((mean, weight, count))
        fitted = [mean for mean, _, count in blocks for _ in range(count)]
        return {mode: s for (mode, _), s in zip(measured, fitted)}

    @staticmethod
    def _now(cost: ModeCost, reference: ModeCost) -> float:
        """`cost`'s seconds per request with each measurement scaled by how `reference`'s cost
        moved since it (kept until either is measured again: choose asks several times a
        step)."""
        if cost is reference or reference.newest_window() < 0:
            return cost.seconds
        key = (id(reference), reference.steps, cost.steps)
        if not cost.scaled or cost.scaled[0] != key:
            now = reference.seconds
            scaled = [s * _beyond_noise(now / reference.seconds_at(t)) for t, s in cost.latest]
            cost.scaled = (key, statistics.median(scaled))
        return cost.scaled[1]

    def rates(self, batch: int) -> dict[int, float]:
        """Expected tokens per second per request of every measured mode at `batch`."""
        return self._rates(self.seconds(batch))

    def _rates(self, costs: Mapping[int, float]) -> dict[int, float]:
        rates = {}
        for mode, seconds in costs.items():
            accept = 1.0 if mode == PLAIN else self.accept_length(mode)
            if accept is not None:
                rates[mode] = accept / seconds
        return rates

    def best(self, batch: int) -> int:
        """The measured mode with the most expected tokens/s at `batch`; plain decoding while it
        has no measurement to compare with (ties go to the shallower mode)."""
        return self._best(self.rates(batch))

    @staticmethod
    def _best(rates: Mapping[int, float]) -> int:
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
        self,
        mode: int,
        batch: int,
        seconds: float,
        tokens: Sequence[Sequence[int]] = (),
        paths: Optional[Sequence[Sequence[int]]] = None,
        catch_up: float = 0.0,
    ) -> None:
        """A decode step ran: its mode, batch size, duration and, speculating, the tokens each
        request's verify emitted (the accepted drafts and the bonus token), the tree nodes each
        accepted (root first; used for contained shapes) and the seconds the draft's catch-up
        took before it (not in `seconds`)."""
        self.decisions[mode] += 1
        self.clock += 1
        self.latest.append((mode, batch, round(1000 * seconds, 3)))
        switched, self.last_mode = mode != self.last_mode, mode
        if self.frozen or batch <= 0:
            return
        modes = self._bucket(batch)
        for cost in modes.values():
            cost.since += 1
        cost = modes[mode]
        cost.add(seconds / batch, self.clock)
        if mode != PLAIN and switched:  # a try: what a switch to it costs the draft
            cost.switch.append(catch_up / batch)
        if mode != PLAIN and tokens:
            for pool, depth, accepted in self._accepted(mode, tokens, paths):
                self._add_survival(pool, depth, accepted)
        if cost.steps > WARM_STEPS:
            cost.interval = self._next_interval(batch, mode, seconds / batch, tokens)

    def _accepted(
        self,
        mode: int,
        tokens: Sequence[Sequence[int]],
        paths: Optional[Sequence[Sequence[int]]],
    ) -> list[tuple[int, int, list[int]]]:
        """(pool, depth, drafts each request accepted) for every depth a step of `mode` measures:
        a chain's shared pool up to `mode`; with accepted paths of contained trees, each depth
        up to `mode`, what its smaller tree would have accepted; else `mode` alone."""
        accepted = [len(t) - 1 for t in tokens]
        if self.nested:
            return [(PLAIN, mode, accepted)]
        if not (self.contained and paths):
            return [(mode, mode, accepted)]
        return [(d, d, [_leading(p, d) for p in paths]) for d in self.depths if d <= mode]

    def _add_survival(self, pool: int, depth: int, accepted: Sequence[int]) -> None:
        n = min(len(accepted), STEP_SAMPLES)
        for k in range(1, depth + 1):
            share = sum(a >= k for a in accepted) / len(accepted)
            seen = self.samples.get((pool, k), 0)
            mean = n / (seen + n) if seen * ALPHA_PER_REQUEST < 1 else 0.0
            weight = max(1 - (1 - ALPHA_PER_REQUEST) ** n, mean)
            old = self.survival.get((pool, k), share)
            self.survival[(pool, k)] = old + weight * (share - old)
            self.samples[(pool, k)] = seen + n

    def _next_interval(
        self, batch: int, mode: int, seconds: float, tokens: Sequence[Sequence[int]]
    ) -> int:
        """After a step of `mode` past warm-up: the first interval if it is now the best mode or
        this step alone beat the best (one step moves the averages only part of the way: a
        draft that got better is tried again soon, not after ever longer waits); else the
        interval doubled. (Not at once: one step that accepted everything beats the deeper
        mode's average though that mode would have accepted more in the same step.)"""
        rates = self.rates(batch)
        best = self._best(rates)
        accept = sum(map(len, tokens)) / len(tokens) if mode != PLAIN and tokens else 1.0
        if best == mode or accept / seconds >= rates.get(best, float("inf")):
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
            modes[mode] = ModeCost(deque([(0, seconds)], maxlen=HISTORY), WARM_STEPS, True, 0)
        self.frozen = True

    def set_accept(self, survival: Sequence[float]) -> None:
        """Tests and tools: set P(a >= k) for k = 1, 2, ... (0 past the list) at every depth,
        and freeze the model."""
        if any(not 0.0 <= p <= 1.0 for p in survival):
            raise ValueError(f"survival probabilities must lie in [0, 1], got {list(survival)}")
        if any(b > a for a, b in zip(survival, survival[1:])):
            raise ValueError(f"survival probabilities must not grow with k, got {list(survival)}")
        for pool in [PLAIN] if self.nested else self.depths:
            for k in range(1, self.depths[-1] + 1):
                self.survival[(pool, k)] = survival[k - 1] if k <= len(survival) else 0.0
        self.frozen = True

    def report(self) -> dict[str, Any]:
        """For get_server_info: the accept length per depth, the costs per bucket (as fitted:
        the values the choice compares) and the mode each implies (`depth`: 0 for plain
        decoding), the steps run in each mode and the latest steps' (mode, batch, ms)."""
        fitted = {b: self.seconds(b) for b in self.costs}
        return {
            "depths": self.depths,
            "accept_length": {d: self.accept_length(d) for d in self.depths},
            "speculative_steps": sum(n for m, n in self.decisions.items() if m != PLAIN),
            "plain_steps": self.decisions[PLAIN],
            "steps_by_depth": {d: self.decisions[d] for d in self.depths},
            "buckets": {
                b: {
                    "plain_s_per_req": fitted[b].get(PLAIN),
                    "spec_s_per_req": {d: fitted[b].get(d) for d in self.depths},
                    "depth": self.best(b),
                    "speculate": self.best(b) != PLAIN,
                }
                for b in sorted(self.costs)
            },
            "latest_steps": list(self.latest),
        }
