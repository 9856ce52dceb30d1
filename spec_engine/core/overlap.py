"""The overlap scheduler's in-flight step (SGLang's event_loop_overlap, mini-sglang's
overlap_loop), for plain decoding.

Without overlap a decode step launches its forward, reads its tokens back (core/readback.py's
one read, which waits for the device) and processes them before the next step is scheduled: the
device idles while the host schedules. With overlap, step N+1 is scheduled and launched before
step N is read back:

* **Who owns what.** The scheduler (core/scheduler.py) owns the one step in flight, an
  `InFlight`: its decode group and the worker's `PendingDecode` (requests, KV lengths before it,
  its sampled tokens on the device, and `finish`, its read). Nothing else holds device results.
* **Inputs.** `ModelWorker.launch_decode` gives each request of the step in flight a placeholder
  input id (-1 - its row) that a device gather resolves from that step's sampled tokens (SGLang's
  FutureMap); sampling counts the in-flight token (its seed's index, min_new_tokens' bans).
* **The one read** of step N (`PendingDecode.finish`) happens after step N+1 is launched; then
  OutputProcessor processes step N one step late (finishing, stop strings, streaming).
* **KV.** A request that finished at step N was also launched in step N+1: its token there is
  dropped, and its KV is released (trimmed back to where it was before that step) only once
  step N+1 is read (`release_after`), never while a step in flight writes it. Its caller is
  told at once; when step N+1 holds only finished requests, their KV is released before they
  are told, as without overlap, and step N+1 is read at the next drain (Scheduler._complete),
  which comes before any launch: every step reads once, and no slot is reused meanwhile.
* **Sync points.** The scheduler drains the step in flight (reads and processes it, launching
  nothing) before any step that is not a plain decode of the same requests: a prefill, a
  retraction, a request that needs its output ids on the host to sample (`overlappable`), a
  timeout; and the engine loop drains before every command but a submission, so aborts, pause,
  weight updates and flushes see exactly the state a step-by-step scheduler would.

Outputs are identical with and without overlap (tests/engine/test_overlap.py). It is on by
default for plain decoding, as in SGLang; SGLang's --disable-overlap-schedule turns it off, and
speculative workers do not overlap yet (args/resolve.py's `overlap_schedule`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from spec_engine.core.policy import DecodeGroup
from spec_engine.core.req_kv import RequestKV
from spec_engine.core.request import Req
from spec_engine.core.worker import PendingDecode, StepResult


@dataclass
class InFlight:
    """The decode step launched and not yet read back; `launched`: when (perf_counter)."""

    group: DecodeGroup
    pending: PendingDecode
    launched: float


def overlappable(req: Req) -> bool:
    """Whether `req` samples without its latest output ids on the host: no penalties or logit
    bias over its output, no grammar, no custom logit processor."""
    sp = req.input.sampling_params
    return (
        not sp.changes_logits and req.grammar is None and req.input.custom_logit_processor is None
    )


def live_rows(pending: PendingDecode, result: StepResult) -> tuple[list[Req], StepResult]:
    """The requests of a read step not finished meanwhile, and their rows of `result`."""
    idx = [j for j, r in enumerate(pending.reqs) if not r.finished]

    def pick(values: Optional[list]) -> Optional[list]:
        return [values[j] for j in idx] if values is not None else None

    failed = {k: result.failed[j] for k, j in enumerate(idx) if j in result.failed}
    rows = StepResult(
        tokens=pick(result.tokens),
        logprobs=pick(result.logprobs),
        top_logprobs=pick(result.top_logprobs),
        token_ids_logprobs=pick(result.token_ids_logprobs),
        top_p_ids=pick(result.top_p_ids),
        failed=failed,
        drafted=pick(result.drafted),
        accept_paths=pick(result.accept_paths),
    )
    return [pending.reqs[j] for j in idx], rows


def release_after(kv: RequestKV, pending: PendingDecode) -> None:
    """Release the KV of the requests that finished while `pending` was in flight, trimmed back
    to what they held before it (what a step-by-step scheduler would have cached)."""
    for req, start in zip(pending.reqs, pending.starts):
        if req.finished and req.req_pool_idx is not None:
            kv.trim(req, start)
            kv.release(req)
