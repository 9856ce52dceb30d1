"""SpecCostModel: whether a decode step should speculate (--speculative-adaptive).

Speculation pays when the tokens a verify step emits per request (the accept length) outweigh
what the step costs over a plain decode step. Both costs depend on the batch size: on a
memory-bound GPU a plain step at batch 1 leaves compute idle that a verify fills for free, while
a compute-bound batch pays for every verified row. So the model keeps, per batch-size bucket
(powers of two: 1, 2, 3-4, 5-8, ...), an exponential moving average of the seconds one request
spends in a plain step and in a speculative step (the step's time / its batch size), and one
average of the accept length over recent speculative steps (a property of the text more than of
the batch). A step of batch B speculates when accept / spec_seconds(B) > 1 / plain_seconds(B),
i.e. when it is expected to emit more tokens per second.

Measuring is online: the first step of a mode in a bucket is not counted (it pays one-off costs
such as a graph captured on first use), then each mode is tried until it has
`WARM_STEPS` measurements there, and afterwards the mode not chosen is tried again once every
`EXPLORE_EVERY` steps of the bucket, so the averages follow changes (a draft falling behind new
weights, longer contexts). `speculate(batch)` is a pure function of the state, so the scheduler
may ask it several times per step (KV demand, retraction, the step itself); `observe` moves it.

Every speculative worker may switch per step: NGRAM has no draft state, and under this flag
the draft-model workers record what their draft needs of each plainly decoded position and
catch it up in one extend when speculation resumes (speculative/draft_lag.py), so a plain step
runs no draft and switching loses nothing. That catch-up runs outside the step the model
times: it is paid once per switch, not per step of a stretch. The tree flags
(--speculative-num-steps, -eagle-topk, -num-draft-tokens) stay the shape a speculative step uses.

Runs on the scheduler thread only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

ALPHA = 0.25  # weight of the newest measurement in the moving averages
WARM_STEPS = 2  # measurements per mode and bucket before the averages decide
EXPLORE_EVERY = 64  # steps of a bucket between two tries of the mode not chosen


def bucket(batch: int) -> int:
    """The bucket of a batch size: the smallest power of two >= it."""
    return 1 << max(batch - 1, 0).bit_length()


@dataclass
class ModeCost:
    """One mode's measurements in one bucket."""

    seconds: Optional[float] = None  # EMA of seconds per request per step
    steps: int = 0  # counted measurements
    seen: bool = False  # the uncounted first step ran
    since: int = 0  # steps of the bucket since this mode last ran

    def add(self, seconds: float) -> None:
        self.since = 0
        if not self.seen:
            self.seen = True
            return
        self.steps += 1
        self.seconds = (
            seconds if self.seconds is None else (1 - ALPHA) * self.seconds + ALPHA * seconds
        )


class SpecCostModel:
    def __init__(self) -> None:
        self.costs: dict[int, dict[bool, ModeCost]] = {}
        self.accept_length: Optional[float] = None  # EMA of tokens per request per verify
        self.frozen = False  # tests: measurements no longer move the model
        self.decisions = {True: 0, False: 0}  # steps run per mode

    def _bucket(self, batch: int) -> dict[bool, ModeCost]:
        return self.costs.setdefault(bucket(batch), {True: ModeCost(), False: ModeCost()})

    def speculate(self, batch: int) -> bool:
        """Whether the next decode step of `batch` requests should speculate."""
        modes = self._bucket(batch)
        if not self.frozen:
            for mode in (True, False):  # speculation first: it also measures the accept length
                if modes[mode].steps < WARM_STEPS:
                    return mode
        best = self.expected_speculative_gain(batch) > 1.0
        if not self.frozen and modes[not best].since >= EXPLORE_EVERY:
            return not best
        return best

    def expected_speculative_gain(self, batch: int) -> float:
        """Expected tokens/s of speculating over plain decoding at `batch` (nan-free: 1.0 when
        a measurement is missing)."""
        modes = self._bucket(batch)
        spec, plain = modes[True].seconds, modes[False].seconds
        if spec is None or plain is None or self.accept_length is None:
            return 1.0
        return self.accept_length * plain / spec

    def observe(
        self, speculated: bool, batch: int, seconds: float, verify_ct: int = 0, emitted: int = 0
    ) -> None:
        """A decode step ran: its mode, batch size, duration and, speculating, its verify
        count and emitted tokens."""
        self.decisions[speculated] += 1
        if self.frozen or batch <= 0:
            return
        modes = self._bucket(batch)
        for cost in modes.values():
            cost.since += 1
        modes[speculated].add(seconds / batch)
        if speculated and verify_ct:
            accept = emitted / verify_ct
            self.accept_length = (
                accept
                if self.accept_length is None
                else (1 - ALPHA) * self.accept_length + ALPHA * accept
            )

    def set_costs(self, batch: int, plain_s: float, spec_s: float, accept_length: float) -> None:
        """Tests and tools: set the bucket of `batch` as measured (seconds per request per step)
        and the accept length, and freeze the model so steps do not move it."""
        modes = self._bucket(batch)
        for mode, seconds in ((False, plain_s), (True, spec_s)):
            modes[mode] = ModeCost(seconds, WARM_STEPS, True, 0)
        self.accept_length = accept_length
        self.frozen = True

    def report(self) -> dict[str, Any]:
        """For get_server_info: the averages per bucket, the decision each implies, the steps
        run in each mode."""
        return {
            "accept_length": self.accept_length,
            "speculative_steps": self.decisions[True],
            "plain_steps": self.decisions[False],
            "buckets": {
                b: {
                    "plain_s_per_req": modes[False].seconds,
                    "spec_s_per_req": modes[True].seconds,
                    "speculate": self.expected_speculative_gain(b) > 1.0,
                }
                for b, modes in sorted(self.costs.items())
            },
        }
