"""The batch size the engines ran at during a rollout: every engine's running requests (SGLang's
/v1/loads `num_running_reqs`, which slime reads too) sampled while the rollout fills its batch.

    trace = BatchSizeTrace()
    poller = asyncio.ensure_future(trace.poll(lambda: router.engines, interval=0.1))
    ...                      # the rollout
    await trace.stop(poller)
    trace.metrics()          # perf/engine_batch_size/{mean,max}
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

# Seconds between two polls: a poll is one get_load per engine, answered between two scheduler
# steps, so a few per second cost the engines nothing noticeable.
POLL_INTERVAL_S = 0.1


@dataclass
class BatchSizeTrace:
    """One rollout's polls: `times[i]` seconds after the polling began, engine e ran
    `running[i][e]` requests (None: it did not answer, or cannot report its load)."""

    times: list[float] = field(default_factory=list)
    running: list[list[Optional[int]]] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        """perf/engine_batch_size/{mean,max}: an engine's running requests over the polls and
        engines (the mean of polls at even intervals: over time); absent without any answer."""
        values = [n for poll in self.running for n in poll if n is not None]
        if not values:
            return {}
        return {
            "perf/engine_batch_size/mean": statistics.fmean(values),
            "perf/engine_batch_size/max": float(max(values)),
        }

    def to_dict(self) -> dict[str, list]:
        return {"time": self.times, "running_reqs": self.running}

    async def poll(self, engines: Callable[[], Sequence[Any]], interval: float) -> None:
        """Every `interval` seconds (the first after one: the requests are on their way), each of
        `engines()` asked for its running requests, until cancelled (`stop`)."""
        start = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            counts = await asyncio.gather(*(running_requests(e) for e in engines()))
            if any(n is not None for n in counts):
                self.times.append(time.monotonic() - start)
                self.running.append(list(counts))

    @staticmethod
    async def stop(poller: asyncio.Task) -> None:
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)


async def running_requests(engine: Any) -> Optional[int]:
    """The requests `engine` runs now (summed over its data-parallel ranks); None when it has no
    get_load (a test double, a custom handle) or the call fails: a poll never fails a rollout."""
    get_load = getattr(engine, "get_load", None)
    if get_load is None:
        return None
    try:
        if inspect.iscoroutinefunction(get_load):
            load = await get_load(include=["core"])
        else:  # an in-process Engine answers from its scheduler thread: do not block the loop
            load = await asyncio.to_thread(get_load, include=["core"])
        return sum(rank["num_running_reqs"] for rank in load["loads"])
    except Exception as e:  # a dead or restarting engine: the router deals with it
        logger.debug("engine load poll failed: %r", e)
        return None
