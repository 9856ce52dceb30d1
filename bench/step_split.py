"""Where a decode step's time goes: bench_rollout run in one process (its flags, `--interleave`
added), with each engine's scheduler step and its worker and scheduler calls timed, summed per
engine over every round and the warm-up. What an adaptive engine's per-step bookkeeping and its
tries cost against a plain engine's step, which the engines' own timings (the worker's step
only) leave out:

    python -m scripts.bench_step_split --context-length 256 --algorithms mtp-plain mtp-adaptive \
        --batch-sizes 1 --input-len 64 --output-len 128 --repeats 3 --work-dir /tmp/bench5-models
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

from spec_engine.core.scheduler import Scheduler

# decode: timed as decode, or decode_plain at depth 0; an overlapped one's read as decode_read
WORKER_CALLS = ("prefill", "catch_up")
# (the scheduler's part, its method): the policy's plans, retractions and output processing
SCHEDULER_CALLS = (("policy", "plan"), ("retraction", "plan_decode"), ("outputs", "process"))

# engine -> call -> [seconds, calls]
totals: dict[str, dict[str, list[float]]] = collections.defaultdict(
    lambda: collections.defaultdict(lambda: [0.0, 0])
)


def timed(fn: Callable, into: list[float]) -> Callable:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[0] += time.perf_counter() - start
            into[1] += 1

    return call


def engine_name(scheduler: Scheduler) -> str:
    adaptive = "+adaptive" if getattr(scheduler.policy, "adaptive", None) is not None else ""
    return f"{type(scheduler.worker).__name__}{adaptive} #{id(scheduler) % 10000}"


def instrument(scheduler: Scheduler) -> None:
    """Time this scheduler's calls (its instance attributes shadow the methods)."""
    calls = totals[engine_name(scheduler)]
    worker = scheduler.worker
    for name in WORKER_CALLS:
        if hasattr(worker, name):
            setattr(worker, name, timed(getattr(worker, name), calls[name]))
    spec, plain = timed(worker.decode, calls["decode"]), timed(worker.decode, calls["decode_plain"])
    worker.decode = lambda reqs, *depth: (plain if depth == (0,) else spec)(reqs, *depth)
    # An overlapped plain step (core/overlap.py, the default): its launch as decode, its read
    # (a step later) as decode_read.
    launch = timed(worker.launch_decode, calls["decode"])

    def launched(*args: Any) -> Any:
        pending = launch(*args)
        pending.finish = timed(pending.finish, calls["decode_read"])
        return pending

    worker.launch_decode = launched
    for part, name in SCHEDULER_CALLS:
        owner = getattr(scheduler, part)
        setattr(owner, name, timed(getattr(owner, name), calls[name]))
    scheduler.step_split = calls["step"]


def step(self: Scheduler, _step: Callable = Scheduler.step) -> None:
    if not hasattr(self, "step_split"):
        instrument(self)
    timed(_step, self.step_split)(self)


def main() -> None:
    from bench import rollout

    Scheduler.step = step
    sys.argv = [sys.argv[0], "--interleave", *sys.argv[1:]]
    rollout.main()
    print("\nseconds [calls] per engine, all rounds and the warm-up")
    for engine, calls in totals.items():
        shown = ", ".join(f"{n} {s:.3f} [{c}]" for n, (s, c) in sorted(calls.items()) if c)
        print(f"{engine}: {shown}")


if __name__ == "__main__":
    main()
