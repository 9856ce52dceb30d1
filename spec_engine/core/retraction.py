"""Retraction: room for a decode step's KV, made by sending requests back to the queue.

Admission keeps a reserve for running requests' future tokens, but it is an estimate (the
new-token ratio): when the next decode step would allocate more KV than is free, requests are
retracted — their KV released, put back at the head of the queue — until it fits, and resumed
later from where they stopped (their prefill recomputes their KV). The victim is a prompt
half-way through chunked prefill if there is one (it made the least progress), else SGLang's
choice: the running request with the fewest outputs, then the longest prompt.
"""

from __future__ import annotations

import logging

from spec_engine.core.admission import Admission
from spec_engine.core.policy import DecodeGroup, DecodePolicy
from spec_engine.core.req_kv import RequestKV
from spec_engine.core.request import Req
from spec_engine.core.worker import ModelWorker

logger = logging.getLogger(__name__)


class Retraction:
    """Owns the count of retractions."""

    def __init__(
        self, worker: ModelWorker, policy: DecodePolicy, kv: RequestKV, admission: Admission
    ) -> None:
        self.worker = worker
        self.policy = policy
        self.kv = kv
        self.admission = admission
        self.num_retractions = 0

    def plan_decode(self, running: list[Req]) -> tuple[list[DecodeGroup], list[Req]]:
        """The groups of the next decode step, retracting requests until its KV fits, and the
        running requests left. The plan is asked again after each retraction: it may depend on
        the batch (--speculative-adaptive's cost model)."""
        running = list(running)
        retracted: list[Req] = []
        while self._kv_demand(groups := self.policy.plan(running)) > self.kv.available_tokens():
            victim = self._victim(running)
            self.retract([victim])
            retracted.append(victim)
        if retracted:
            # Back to the head of the queue, in the order they were chosen.
            self.admission.requeue(retracted)
            self.admission.decode_retracted()
            self.num_retractions += len(retracted)
            logger.warning(
                "KV cache full: retracted %d request(s); they resume when memory frees up "
                "(raise --max-total-tokens or lower --max-running-requests to avoid this)",
                len(retracted),
            )
        return groups, running

    def retract(self, reqs: list[Req]) -> None:
        """Release the KV of `reqs` (recomputed when they run again)."""
        for req in reqs:
            self.kv.release(req)
            req.retractions += 1

    def _kv_demand(self, groups: list[DecodeGroup]) -> int:
        return sum(self.worker.decode_kv_demand(g.reqs, g.depth) for g in groups)

    def _victim(self, running: list[Req]) -> Req:
        """The next request to retract, taken out of `running` (or out of chunked prefill)."""
        chunked = self.admission.take_chunked()
        if chunked is not None:
            return chunked
        if len(running) > 1:
            victim = min(running, key=lambda r: (len(r.output_ids), -len(r.input.origin_input_ids)))
            running.remove(victim)
            return victim
        raise RuntimeError(
            "a single request does not fit in the KV cache; admission should have refused it"
        )
