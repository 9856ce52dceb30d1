"""OutputProcessor: what a step's results do to its requests.

Emitted tokens (with their log-probs and top-p nuclei) are appended until a request finishes
(Req.check_finished: length, EOS and stop ids, stop strings); a finished request's KV computed
past its end is freed, its routed experts are read while its KV still exists, its KV goes to the
prefix cache, and its caller is told (`on_output`), as is a streaming caller every
--stream-interval tokens. Which requests run is the scheduler's to keep: it drops the finished
ones after each step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from typing import Optional

from spec_engine.core.req_kv import RequestKV
from spec_engine.core.request import Req
from spec_engine.core.worker import StepResult
from spec_engine.layers.routing_capture import RoutingCapture

logger = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(
        self,
        kv: RequestKV,
        eos_token_ids: frozenset[int],
        decode_tail: Optional[Callable[[list[int]], str]],
        stream_interval: int,
        routing: Optional[RoutingCapture],
    ) -> None:
        """`routing`: the target runner's routing capture (runner.routing; None without
        --enable-return-routed-experts)."""
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.decode_tail = decode_tail
        self.stream_interval = stream_interval
        self.routing = routing

    def after_prefill(self, batch: list[Req], result: StepResult) -> list[Req]:
        """Share each request's computed prompt pages; returns the requests whose prompt is
        complete (their first token sampled, processed here), which start decoding."""
        done = []
        for req, tokens in zip(batch, result.tokens):
            self.kv.cache_prefilled(req)
            if tokens:
                done.append(req)
        if done:
            self.process(done, _rows(result, [i for i, t in enumerate(result.tokens) if t]))
        return done

    def process(self, reqs: list[Req], result: StepResult, held: Container[int] = ()) -> int:
        """Append emitted tokens, finish and release requests that are done; returns tokens
        added. A request whose id is in `held` has KV written by a step in flight: it finishes
        (its routing kept), but its KV is released and its caller told by the scheduler, after
        that step (core/overlap.py)."""
        added = 0
        for i, req in enumerate(reqs):
            emitted = self._take(req, result, i)
            added += emitted
            if result.drafted is not None:
                req.spec_verify_ct += 1
                req.spec_emitted += emitted
                req.spec_drafted += result.drafted[i]
            if req.finished:
                self.finish(req, release=id(req) not in held)
            elif req.input.stream and len(req.output_ids) - req.delivered >= self.stream_interval:
                self.notify(req, False)
        return added

    def _take(self, req: Req, result: StepResult, i: int) -> int:
        """Append request `i`'s tokens of `result` to `req` up to its finish; returns how many."""
        before = len(req.output_ids)
        if req.max_new_tokens() == 0:  # prefill only: the prompt was scored
            req.finished_reason = {"type": "length", "length": 0}
        if i in result.failed and not req.finished:
            logger.error("request %s failed: %s", req.input.rid, result.failed[i])
            req.finished_reason = {"type": "abort", "message": result.failed[i], "status_code": 500}
        for j, token in enumerate([] if req.finished else result.tokens[i]):
            if req.grammar is not None and not req.grammar.accept_token(token):
                # The masks allow only what the grammar accepts: a bug, not the client's error.
                req.finished_reason = {
                    "type": "abort",
                    "message": f"the grammar does not allow token {token} emitted here",
                    "status_code": 500,
                }
                break
            req.output_ids.append(token)
            if result.logprobs is not None:
                req.output_logprobs.append(result.logprobs[i][j])
            if result.top_logprobs is not None:
                req.output_top_logprobs.append(result.top_logprobs[i][j])
            if result.token_ids_logprobs is not None:
                req.output_token_ids_logprobs.append(result.token_ids_logprobs[i][j])
            if result.top_p_ids is not None and result.top_p_ids[i]:
                req.output_top_p_ids.append(result.top_p_ids[i][j])
            req.check_finished(self.eos_token_ids, self.decode_tail)
            if req.finished:
                break
        return len(req.output_ids) - before

    def finish(self, req: Req, release: bool = True) -> None:
        """`req` is done: free KV past its end, keep its routing, release its KV, tell the
        caller; not `release`: a step in flight still writes its KV, keep the routing only."""
        if not release:
            self._keep_routing(req)
            return
        self.kv.trim(req)
        self._keep_routing(req)
        self.kv.release(req)
        self.notify(req, True)

    def _keep_routing(self, req: Req) -> None:
        """SGLang's rows: every token whose KV exists at the finish (the prompt and the output but
        the last token), from routed_experts_start_len; a failed request's KV may be partial."""
        if req.input.return_routed_experts and "status_code" not in req.finished_reason:
            slots = self.kv.slots(req, req.input.routed_experts_start_len, req.seq_len - 1)
            req.routed_experts = self.routing.read(slots)

    def notify(self, req: Req, finished: bool) -> None:
        """Hand `req`'s new output to its caller."""
        if req.on_output is None:
            return
        try:
            req.on_output(req, finished)
        except Exception:  # a consumer's failure must not stop the engine; it is logged
            logger.exception("delivering output of request %s failed", req.input.rid)
        req.delivered = len(req.output_ids)


def _rows(result: StepResult, idx: list[int]) -> StepResult:
    """The tokens (and log-probs, nuclei) of rows `idx` of a prefill's `result`."""

    def pick(values: Optional[list]) -> Optional[list]:
        return [values[i] for i in idx] if values is not None else None

    return StepResult(
        tokens=pick(result.tokens),
        logprobs=pick(result.logprobs),
        top_logprobs=pick(result.top_logprobs),
        token_ids_logprobs=pick(result.token_ids_logprobs),
        top_p_ids=pick(result.top_p_ids),
    )
