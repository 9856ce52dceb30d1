"""SpecCostModel: whether a decode step should speculate, and how deep (--speculative-adaptive).

Speculation pays when the tokens a verify step emits per request (the accept length) outweigh
what the step costs over a plain decode step. The model compares, for a step of batch B, the
candidate modes (args.spec_shapes.candidate_depths: the configured depth and the powers of two
below it, and plain decoding) by their expected tokens per second per request: 1 / plain_s(B),
or accept(d) / spec_s(B, d) for depth d. The costs are measured per batch-size bucket
(costs.py), the accept lengths across buckets (accept_lengths.py).

Measuring is online: each mode is tried until it has `WARM_STEPS` measurements in a bucket,
round-robin (the deepest first: it measures the shallower depths' accept lengths; then plain
decoding, the comparison that matters most, then the shallower depths), so that no mode is
measured only in the first steps of the generations, which accept differently from later ones
(NGRAM finds more repetition as a generation goes on). Afterwards the chosen mode measures
itself every step, and a mode not chosen is tried again so the averages follow changes (a draft
learning or falling behind new weights, longer contexts), but each try costs a step in a slower
mode, so tries back off: a mode is retried once it has not run for its interval of steps of the
bucket (`EXPLORE_EVERY` at first, or as many as keep a try's measured loss against the chosen
mode within its share of `EXPLORE_BUDGET` of the steps between tries, where that is more: a try
of a verify three times a plain step's cost waits longer than one of a cheap one; the modes
tried share the budget, so a tree's three depths each get a third), which doubles each time a
try leaves it behind (up to `MAX_EXPLORE_EVERY`) and starts over when it wins or new weights
arrive (`weights_updated`) or a try's own step beats the chosen mode (a draft that got better is
tried at that first interval until the averages agree). A try's loss includes the draft catch-up
a lagging draft model pays before it: the worker's estimate for the positions the requests lag
now (speculative/draft_lag.ExtendCost, fitted to the draft's prefill extends and catch-ups),
else the median of that mode's recent switches. The longer the plain stretch, the more a try
costs, so tries come when the lag is short (new requests, or right after the catch-up a full lag
forces). A mode that could not win even if every draft token were accepted ((depth + 1) / its
cost below the chosen mode's rate; plain decoding: its measured rate) waits `MAX_EXPLORE_EVERY`
steps once its cost rests on `RECENT` measurements: its cost, not the draft, keeps it behind (on
fewer, the warm-up's alone, it may have been measured cold, and is tried as any losing mode).
`choose(batch)` is a pure function of the state, so the scheduler may ask it again within a step
(after a retraction changed the batch); `observe` moves it. Settled (no try due) and clear (its
expected tokens/s HOLD_MARGIN ahead of the runner-up's), a choice holds for up to RECHECK_EVERY
steps without the model being read (`held`; the policy then asks the worker for
no catch-up estimate either): the held mode's steps are measured as ever, so a choice they overturn
runs at most that many steps longer, and a hold ends before a try may come due (a try whose
interval moved with the fitted costs meanwhile comes at most a hold later).

Every speculative worker may switch mode per step: NGRAM has no draft state, a draft model
drafts any depth from the same state, and under this flag the draft-model workers record what
their draft needs of each plainly decoded position and catch it up in one extend when
speculation resumes (speculative/draft_lag.py), so a plain step runs no draft and switching
loses nothing. That catch-up runs outside the step the model times (it is paid once per
switch, not per step of a stretch) and is charged to the tries.

Runs on the scheduler thread only; measurements enter through `observe` alone
(speculative.policy.SpecPolicy.observe).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

from spec_engine.args.spec_shapes import contained_shapes, nested_shapes, spec_shapes
from spec_engine.speculative.adaptive.accept_lengths import AcceptLengths
from spec_engine.speculative.adaptive.costs import (
    EXPLORE_EVERY,
    HISTORY,
    PLAIN,
    RECENT,
    ModeCost,
    bucket,
    fitted_seconds,
)

WARM_STEPS = 2  # measurements per mode and bucket before the averages decide
MAX_EXPLORE_EVERY = 2048  # the longest interval between tries of a mode
# The most a mode's tries may cost, as a share of the steps between them, against the chosen
# mode: a try that costs 2.6 best-mode steps (a verify of random drafts at batch 32 on CPU) waits
# 260 steps, not EXPLORE_EVERY.
EXPLORE_BUDGET = 0.01
LATEST_STEPS = 256  # steps the report lists (mode, batch, milliseconds): a generation or two
# Settled (no mode due for a try), a choice holds for up to this many steps of its bucket without
# the model being read: on a host-bound engine (a one-layer model: a 2-4 ms step) reading it every
# step cost ~5% of the step. A mode's costs move by one measurement in RECENT a step, so a
# choice that the measurements overturn runs at most this many steps longer.
RECHECK_EVERY = 16
# A choice holds only while its expected tokens/s lead the runner-up's by this factor: in a near
# tie noisy step times flip the choice, and a wrong flip held RECHECK_EVERY steps costs more than
# reading the model every step (NGRAM at batch 64 on a loaded VM, a near tie by its wall-clock
# costs, held depth 3 for stretches: a third of its steps, at 0.57 of plain by the CPU clocks).
HOLD_MARGIN = 1.2


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
        self.costs: dict[int, dict[int, ModeCost]] = {}
        self.fitted: dict[int, tuple] = {}  # bucket -> (its measurements' key, fitted seconds)
        self.accept = AcceptLengths(self.depths, nested, contained)
        self.frozen = False  # tests: measurements no longer move the model
        self.decisions = dict.fromkeys(self.modes, 0)  # steps run per mode
        self.last_mode: Optional[int] = None
        self.clock = 0  # decode steps observed: the time of a measurement
        # (bucket, mode, steps left): the choice `choose` made while no try was due, which holds
        # until a try may come due (or RECHECK_EVERY steps) unless a step of another mode or
        # bucket runs
        self.hold: Optional[tuple[int, int, int]] = None
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
        held = self.held(batch)
        if held is not None:
            return held
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
        # A mode's interval is never below its own `interval` (_interval): most steps, no mode
        # is near it, and the full interval is not worked out.
        due, wait = [], RECHECK_EVERY
        for m in self.modes:
            if m == best:
                continue
            cost = modes[m]
            need = cost.interval
            if cost.since >= need:
                need = self._interval(m, modes, seconds, rates, best, catch_up, batch)
            if cost.since >= need:
                due.append(m)
            else:
                wait = min(wait, need - cost.since)
        if due:
            return max(due, key=lambda m: modes[m].since)
        runner_up = max((r for m, r in rates.items() if m != best), default=0.0)
        clear = rates.get(best, 0.0) >= HOLD_MARGIN * runner_up
        self.hold = (bucket(batch), best, wait if clear else 1)
        return best

    def held(self, batch: int) -> Optional[int]:
        """The mode of the next step of `batch` requests while a settled choice holds (see
        RECHECK_EVERY), without reading the model; None: `choose` works it out."""
        hold = self.hold
        if hold is not None and hold[2] > 0 and hold[0] == bucket(batch):
            return hold[1]
        return None

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
        return self.accept.length(depth)

    def seconds(self, batch: int) -> dict[int, float]:
        """Seconds per request of every measured mode at `batch`, as the reference mode runs now
        (costs.fitted_seconds), fitted again only once a measurement came: a step's `observe`
        and the next step's `choose` read the same fit."""
        modes = self._bucket(batch)
        key = tuple((len(c.history), c.history[-1] if c.history else None) for c in modes.values())
        fit = self.fitted.get(bucket(batch))
        if fit is None or fit[0] != key:
            fit = self.fitted[bucket(batch)] = (key, fitted_seconds(modes))
        return dict(fit[1])

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
        hold = self.hold
        held = hold is not None and hold[1] == mode and hold[0] == bucket(batch)
        self.hold = (hold[0], mode, hold[2] - 1) if held else None
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
            self.accept.observe(mode, tokens, paths)
        if cost.steps > WARM_STEPS:  # a held choice was the best mode: _next_interval's first
            cost.interval = (
                EXPLORE_EVERY if held else self._next_interval(batch, mode, seconds / batch, tokens)
            )

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
        self.hold = None
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
        self.hold = None

    def set_accept(self, survival: Sequence[float]) -> None:
        """Tests and tools: set P(a >= k) for k = 1, 2, ... (0 past the list) at every depth,
        and freeze the model."""
        self.accept.set(survival)
        self.frozen = True
        self.hold = None

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
