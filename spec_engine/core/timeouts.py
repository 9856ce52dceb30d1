"""SGLang's request timeouts, read from its environment variables: a request that waited in the
queue longer than SGLANG_REQ_WAITING_TIMEOUT seconds, or has run longer than
SGLANG_REQ_RUNNING_TIMEOUT seconds, is aborted with SGLang's message and HTTP status
SGLANG_TIMED_OUT_REQUEST_STATUS_CODE (503 by default). SGLang's older names in milliseconds,
SGLANG_QUEUED_TIMEOUT_MS and SGLANG_FORWARD_TIMEOUT_MS, count when the new ones are unset, as
SGLang's environ.py converts them. Unset or <= 0: no timeout (SGLang's -1)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from spec_engine.core.request import Req

WAITING_TIMEOUT_MESSAGE = "Request waiting timeout reached."
RUNNING_TIMEOUT_MESSAGE = "Request running timeout reached."


@dataclass(frozen=True)
class RequestTimeouts:
    waiting_s: float = -1.0
    running_s: float = -1.0
    status_code: int = 503

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> RequestTimeouts:
        return cls(
            _seconds(env, "SGLANG_REQ_WAITING_TIMEOUT", "SGLANG_QUEUED_TIMEOUT_MS"),
            _seconds(env, "SGLANG_REQ_RUNNING_TIMEOUT", "SGLANG_FORWARD_TIMEOUT_MS"),
            int(_number(env, "SGLANG_TIMED_OUT_REQUEST_STATUS_CODE", 503)),
        )

    def expired(
        self, waiting: Iterable[Req], running: Iterable[Req], now: float
    ) -> list[tuple[Req, str]]:
        """The requests past a timeout at `now` (perf_counter), each with SGLang's message."""
        out = []
        if self.waiting_s > 0:
            out += [
                (r, WAITING_TIMEOUT_MESSAGE)
                for r in waiting
                if 0 < r.wait_queue_entry_time < now - self.waiting_s
            ]
        if self.running_s > 0:
            out += [
                (r, RUNNING_TIMEOUT_MESSAGE)
                for r in running
                if 0 < r.forward_entry_time < now - self.running_s
            ]
        return out


def _seconds(env: Mapping[str, str], name: str, old_ms_name: str) -> float:
    if name in env or old_ms_name not in env:
        return _number(env, name, -1.0)
    ms = _number(env, old_ms_name, -1.0)
    return ms / 1000.0 if ms > 0 else -1.0


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number; unset it or give one") from None
