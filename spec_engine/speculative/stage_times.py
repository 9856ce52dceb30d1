"""Seconds per stage of the speculative steps (get_server_info's `spec_time_breakdown`): the
draft, the verify, the bookkeeping after it.

Kernels run asynchronously on CUDA, so the host's clock at a stage boundary says when the host
queued the stage, not when the device ran it. Synchronizing the device at each boundary would
give the device's time but make the host wait there, every step, where it would otherwise queue
the next stage's kernels (a speculative step reads the device once, at its end). So on CUDA a
boundary records an event on the current stream (`torch.cuda.Event`, no wait), and a stage's
seconds are the time between its two events, collected once its end event has completed
(`query`, no wait); `seconds` waits for the rest when asked. Elsewhere a boundary is the host's
clock (the CPU runs a kernel as it is called).
"""

from __future__ import annotations

import time
from typing import Any, Union

import torch

STAGES = ("draft_s", "verify_s", "bookkeeping_s")
Mark = Union[float, Any]  # a host time, or a recorded CUDA event


def _event() -> Any:
    """A timing event recorded on the current CUDA stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class StageTimes:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._pending: list[tuple[str, Any, Any]] = []  # (stage, start, end) events, in order

    def now(self) -> Mark:
        """A mark at this point of the step."""
        return _event() if self.device.type == "cuda" else time.perf_counter()

    def add(self, stage: str, start: Mark) -> Mark:
        """Charge the time from `start` to now to `stage`; returns the new start."""
        end = self.now()
        if self.device.type != "cuda":
            self._seconds[stage] += end - start
            return end
        self._pending.append((stage, start, end))
        self._collect(wait=False)
        return end

    def elapsed(self, start: Mark, end: Mark) -> float:
        """Seconds between two marks now (on CUDA: waits for `end` to complete)."""
        if self.device.type != "cuda":
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    @property
    def seconds(self) -> dict[str, float]:
        """Seconds per stage so far (on CUDA: waits for the stages still running)."""
        self._collect(wait=True)
        return dict(self._seconds)

    def _collect(self, wait: bool) -> None:
        """Add the stages whose end has completed, oldest first (`wait`: all of them)."""
        done = 0
        for stage, start, end in self._pending:
            if not wait and not end.query():
                break
            if wait:
                end.synchronize()
            self._seconds[stage] += start.elapsed_time(end) / 1e3
            done += 1
        del self._pending[:done]
