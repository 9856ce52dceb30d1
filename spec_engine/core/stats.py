"""Counters over finished requests (Prometheus metrics, --log-requests): updated from the
scheduler thread when a request finishes, read from any thread."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from spec_engine.core.request import Req

logger = logging.getLogger("spec_engine.requests")

# e2e latency histogram buckets in seconds (SGLang's sglang:e2e_request_latency_seconds).
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
# /health_generate's probes carry rids with this prefix and are not counted (SGLang's
# log_metrics=False for them).
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"


@dataclass
class RequestStats:
    log_requests: bool = False
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    requests: dict[str, int] = field(default_factory=dict)  # by finish reason type
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0
    spec_verify_ct: int = 0
    spec_emitted: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.log_requests:  # asked for: shown whatever --log-level says
            logger.setLevel(logging.INFO)

    def record(self, req: Req) -> None:
        """A finished request: count it, and log one line with --log-requests."""
        if req.input.rid.startswith(HEALTH_CHECK_RID_PREFIX):
            return
        latency = time.perf_counter() - req.input.created_time
        kind = (req.finished_reason or {}).get("type", "unknown")
        with self._lock:
            self.prompt_tokens += len(req.input.origin_input_ids)
            self.generation_tokens += len(req.output_ids)
            self.cached_tokens += req.cached_tokens
            self.requests[kind] = self.requests.get(kind, 0) + 1
            bucket = next((i for i, b in enumerate(LATENCY_BUCKETS) if latency <= b), -1)
            self.latency_counts[bucket] += 1
            self.latency_sum += latency
            self.spec_verify_ct += req.spec_verify_ct
            self.spec_emitted += req.spec_emitted
        if self.log_requests:
            logger.info(
                "request %s finished (%s): %d prompt tokens (%d cached), %d generated, %.3f s",
                req.input.rid,
                kind,
                len(req.input.origin_input_ids),
                req.cached_tokens,
                len(req.output_ids),
                latency,
            )

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "prompt_tokens": self.prompt_tokens,
                "generation_tokens": self.generation_tokens,
                "cached_tokens": self.cached_tokens,
                "requests": dict(self.requests),
                "latency_counts": list(self.latency_counts),
                "latency_sum": self.latency_sum,
                "spec_verify_ct": self.spec_verify_ct,
                "spec_emitted": self.spec_emitted,
            }
