"""What decode steps cost, per mode and batch-size bucket, as the adaptive cost model compares them.

Both costs speculation weighs depend on the batch size: on a memory-bound GPU a plain step at
batch 1 leaves compute idle that a verify fills for free, while a compute-bound batch pays for
every verified row. So costs are kept per batch-size bucket (powers of two: 1, 2, 3-4, 5-8,
...): the median of the last RECENT measurements of the seconds one request spends in a step of
each mode (PLAIN, or a speculative depth).

Costs are monotone: a deeper step verifies more rows (and drafts more steps), so the per-request
seconds of plain decoding and the depths, in that order, are read through their isotonic fit
(pool adjacent violators, weighted by measurements): two warm-up steps on a noisy machine can
measure depth 2 slower than depth 4, which no step of the batch could be.

A machine shared with other processes runs at different speeds from one minute to the next, and a
mode not chosen is measured only in its tries: compared as measured, a plain step timed in a slow
minute loses to a depth timed in a fast one. So each measurement keeps its step, and a mode is
compared with the bucket's reference mode (the one whose RECENT latest measurements are the
newest: the mode chosen, which runs every step) as measured around that step: its cost is the
median of its measurements each scaled by how the reference's cost moved since (the reference's
median now over its median at the RECENT measurements nearest that step, from its last HISTORY),
less the first NOISE of the move, which is the steps' own noise. The reference's own cost is its
median as measured.

The first step of a mode in a bucket is not counted (it pays one-off costs such as a graph
captured on first use), and a step much faster than a mode's median replaces its measurements
(`STALE_SHARE`: they were taken cold, and would otherwise keep a mode that loses on them unchosen
for several tries).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Optional

PLAIN = 0  # the mode of a plain decode step; speculative modes are their depth
RECENT = 5  # a mode's cost in a bucket: the median of its last RECENT measurements there
HISTORY = 512  # measurements per mode and bucket kept to compare later measurements with
# A measurement below this share of a mode's median says the earlier ones were cold (an H200's
# first speculative steps of an 8B model measured 48 ms where steady ones take 33): they are
# dropped. Another process on the machine only slows steps, so a fast one is not noise of that
# kind, while a slow one moves the median only once it is the rule.
STALE_SHARE = 0.75
# How far the reference mode's cost may move (either way) before the costs compared with it are
# scaled: within it, the moves are the steps' own noise, and the two medians' ratio would add
# that noise to every other mode's cost.
NOISE = 1.1
EXPLORE_EVERY = 128  # steps of a bucket a mode may first go unrun before it is tried again
# A mode measured fewer times costs its fastest step, not the median: another process only slows
# steps, and the median of two is their mean, so one warm-up step taken in a load spike (a
# one-layer model's depth 3 timed at 20x its cost on a loaded VM) would keep the mode unchosen
# until its next try; a mode rated too fast is chosen, and so measured, at once instead.
MEDIAN_OF = 3


def _median(values: Iterable[float]) -> float:
    """statistics.median, without its overhead (read several times a decode step)."""
    data = sorted(values)
    half = len(data) // 2
    return data[half] if len(data) % 2 else (data[half - 1] + data[half]) / 2


def bucket(batch: int) -> int:
    """The bucket of a batch size: the smallest power of two >= it."""
    return 1 << max(batch - 1, 0).bit_length()


def _beyond_noise(factor: float) -> float:
    """How far `factor` moved past the steps' noise (NOISE either way)."""
    return max(1.0, factor / NOISE) if factor >= 1.0 else min(1.0, factor * NOISE)


@dataclass
class ModeCost:
    """One mode's measurements in one bucket, and when it is tried next (model.py's tries)."""

    # (step, seconds per request) of the counted measurements
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))
    steps: int = 0  # counted measurements
    seen: bool = False  # the uncounted first step ran
    since: int = 0  # steps of the bucket since this mode last ran
    # seconds per request of the draft catch-up before the mode's steps that followed another mode
    switch: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    interval: int = EXPLORE_EVERY  # steps unrun after which it is tried again
    scaled: tuple = ()  # (key, cost) of _scaled_seconds: what the scaled cost was computed from
    # The cost model reads these every decode step, which on a host-bound engine (a one-layer
    # model: a 2.5 ms step) it must not slow: `seconds` is kept until a measurement comes
    # ((history length, newest), median), seconds_at's medians by their window.
    median_of: tuple = ()
    at_memo: dict = field(default_factory=dict)
    # _then's (reference and steps, oldest step its windows hold, the reference's seconds around
    # each latest step)
    then: tuple = ()

    @property
    def latest(self) -> list[tuple[int, float]]:
        """The RECENT latest measurements (fewer at first)."""
        n = len(self.history)
        return [self.history[i] for i in range(max(n - RECENT, 0), n)]

    @property
    def seconds(self) -> Optional[float]:
        """Seconds per request per step: the median of the recent measurements (a step slowed by
        another process on the machine moves it only once it is the rule); of fewer than
        MEDIAN_OF, the fastest (a median of two is their mean: one slow step would move it)."""
        if not self.history:
            return None
        key = (len(self.history), self.history[-1])  # steps only grow: a new newest, new key
        if not self.median_of or self.median_of[0] != key:
            recent = [s for _, s in self.latest]
            robust = len(recent) >= MEDIAN_OF
            self.median_of = (key, _median(recent) if robust else min(recent))
        return self.median_of[1]

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
        start, last = self.window(step)
        # Steps are unique and only grow along the history: a window's first step and length
        # name its measurements.
        key = (self.history[start][0], last - start)
        median = self.at_memo.get(key)
        if median is None:
            if len(self.at_memo) >= HISTORY:
                self.at_memo.clear()
            median = self.at_memo[key] = _median(self.history[i][1] for i in range(start, last))
        return median

    def window(self, step: int) -> tuple[int, int]:
        """The indices (start, end) of the RECENT measurements nearest `step`."""
        n = len(self.history)
        if step < self.history[0][0]:  # a mode not run for long: before the whole history
            at = 0
        else:
            at = bisect.bisect(self.history, step, key=lambda h: h[0])
        start = min(max(at - RECENT // 2, 0), max(n - RECENT, 0))
        return start, min(start + RECENT, n)

    def newest_window(self) -> int:
        """The step of the oldest of the RECENT latest measurements (-1 if fewer)."""
        return self.history[-RECENT][0] if len(self.history) >= RECENT else -1


def fitted_seconds(modes: dict[int, ModeCost]) -> dict[int, float]:
    """Seconds per request of every measured mode of a bucket (`modes`, in mode order), as the
    reference mode runs now: the isotonic fit (non-decreasing from plain decoding to the deepest
    depth) of the averages, weighted by measurements."""
    measured = [(m, c) for m, c in modes.items() if c.seconds is not None]
    reference = max(modes.values(), key=ModeCost.newest_window)
    blocks: list[tuple[float, int, int]] = []  # (mean, weight, modes pooled)
    for _, cost in measured:
        mean, weight, count = _scaled_seconds(cost, reference), min(len(cost.history), RECENT), 1
        while blocks and blocks[-1][0] > mean:
            prev_mean, prev_weight, prev_count = blocks.pop()
            total = prev_weight + weight
            mean = (prev_mean * prev_weight + mean * weight) / total
            weight, count = total, prev_count + count
        blocks.append((mean, weight, count))
    fitted = [mean for mean, _, count in blocks for _ in range(count)]
    return {mode: s for (mode, _), s in zip(measured, fitted)}


def _scaled_seconds(cost: ModeCost, reference: ModeCost) -> float:
    """`cost`'s seconds per request with each measurement scaled by how `reference`'s cost moved
    since it (kept while the reference's cost now and around each of them stay as they were: a
    step of the reference mode often leaves its median where it was)."""
    if cost is reference or reference.newest_window() < 0:
        return cost.seconds
    now, then = reference.seconds, _then(cost, reference)
    key = (id(reference), now, cost.steps, then)
    if not cost.scaled or cost.scaled[0] != key:
        scaled = [s * _beyond_noise(now / at) for (_, s), at in zip(cost.latest, then)]
        cost.scaled = (key, _median(scaled))
    return cost.scaled[1]


def _then(cost: ModeCost, reference: ModeCost) -> list[float]:
    """`reference`'s seconds_at each of `cost`'s latest measurements, kept while none of their
    windows can move: the reference's later measurements come after the newest of them (whose
    window then holds RECENT measurements), and the oldest of them is still in its history."""
    if cost.then and cost.then[0] == (id(reference), cost.steps):
        if reference.history[0][0] <= cost.then[1]:
            return cost.then[2]
    latest = cost.latest
    then = [reference.seconds_at(t) for t, _ in latest]
    if reference.history[RECENT // 2 - RECENT][0] > latest[-1][0]:
        first = reference.history[reference.window(latest[0][0])[0]][0]
        cost.then = ((id(reference), cost.steps), first, then)
    return then
