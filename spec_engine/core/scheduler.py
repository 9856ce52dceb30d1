"""Scheduler: continuous batching over one worker.

Each step either prefills (newly admitted requests, or the next chunk of a long prompt) or
decodes every running request. The scheduler decides and delegates: admission.py picks what to
prefill, retraction.py makes room for a decode step, the decode policy (core/policy.py, with
speculation speculative/policy.py) says which running requests decode together and how,
output_processor.py turns a step's results into finished or streamed requests, and req_kv.py
claims and releases every request's KV. Which requests run is the scheduler's own state, and so
is the plain decode step in flight when steps overlap (overlap.py: step N+1 is launched before
step N is read back and processed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from spec_engine.args.engine_args import EngineArgs
from spec_engine.core.admission import Admission
from spec_engine.core.output_processor import OutputProcessor
from spec_engine.core.overlap import InFlight, live_rows, overlappable, release_after
from spec_engine.core.policy import DecodeGroup, DecodePolicy, StepCost
from spec_engine.core.req_kv import RequestKV
from spec_engine.core.request import Req
from spec_engine.core.retraction import Retraction
from spec_engine.core.timeouts import RequestTimeouts
from spec_engine.core.worker import ModelWorker
from spec_engine.layers.routing_capture import RoutingCapture
from spec_engine.mem.radix_cache import RadixCache

# SGLang's finish_reason message for a queued request aborted by request (its tokenizer manager's
# default for an abort the scheduler answers from the waiting queue).
WAITING_QUEUE_ABORT = "Abort in waiting queue"


class Scheduler:
    """Owns the running requests. Whether generation may run at all (pause, released memory) is
    core.memory.MemoryController's to say, not the scheduler's."""

    def __init__(
        self,
        args: EngineArgs,
        worker: ModelWorker,
        policy: DecodePolicy,
        tree_cache: RadixCache,
        eos_token_ids: frozenset[int],
        decode_tail: Optional[Callable[[list[int]], str]] = None,
        routing: Optional[RoutingCapture] = None,
    ) -> None:
        """`routing`: the target runner's routing capture, read when a request that asked for its
        routed experts finishes (None without --enable-return-routed-experts)."""
        self.worker = worker
        self.policy = policy
        self.kv = RequestKV(worker, tree_cache, args.page_size)
        self.admission = Admission(args, self.kv, worker.decode_headroom())
        self.retraction = Retraction(worker, policy, self.kv, self.admission)
        self.outputs = OutputProcessor(
            self.kv, eos_token_ids, decode_tail, args.stream_interval, routing
        )
        self.timeouts = RequestTimeouts.from_env()
        self.running: list[Req] = []
        # A value measured in this process (a step's cost), as rank 0 measured it: every rank of
        # a tensor-parallel engine then decides alike (the engine sets it; identity at one rank).
        self.rank0_value: Callable[[StepCost], StepCost] = lambda value: value
        # The prefill batch being run: admitted, but not yet running (needed if the step fails).
        self.prefilling: list[Req] = []
        self.last_gen_throughput = 0.0
        # Decode steps overlap (core/overlap.py) where the worker can: plain decoding unless
        # --disable-overlap-schedule; speculative chain steps with --enable-overlap-schedule
        # (speculative/chain_overlap.py).
        self.overlap = (
            args.enable_overlap_schedule
            and not args.disable_overlap_schedule
            and worker.can_overlap
        )
        self.inflight: Optional[InFlight] = None

    # ------------------------------------------------------------ the step

    def step(self) -> None:
        """One prefill of what admission takes, else one decode of every running request."""
        now = time.perf_counter()
        if self.inflight is not None and (
            self.timeouts.expired(self.admission.waiting, self.active_reqs(), now)
            or not self._overlaps()
        ):
            self.drain()
        for req, message in self.timeouts.expired(self.admission.waiting, self.active_reqs(), now):
            self._finish_abort(req, message, self.timeouts.status_code)
        batch = self.admission.schedule(self.running)
        if batch:
            self._prefill(batch)
        elif self.running:
            groups, self.running = self.retraction.plan_decode(self.running)
            start = time.perf_counter()
            emitted = sum(self._decode(group) for group in groups)
            self.last_gen_throughput = emitted / max(time.perf_counter() - start, 1e-9)
            self.admission.decode_ran()

    def _prefill(self, batch: list[Req]) -> None:
        self.prefilling = batch
        self.policy.prefilling(batch)
        result = self.worker.prefill(batch)
        started = self.outputs.after_prefill(batch, result)
        self.running = [r for r in self.running + started if not r.finished]
        self.prefilling = []

    def _overlaps(self) -> bool:
        """Whether the next step may launch while the one in flight is unread: a plain decode of
        the running requests, nothing to admit, nothing to retract (a step-by-step scheduler
        would decide the same with the step in flight processed)."""
        return (
            self.overlap
            and bool(self.running)
            and not self.admission.has_work()
            and all(self._overlappable(r) for r in self.running)
            and self.worker.decode_kv_demand(self.running) <= self.kv.available_tokens()
        )

    def _overlappable(self, req: Req) -> bool:
        return overlappable(req) and self.worker.overlappable(req)

    def drain(self) -> int:
        """Read and process the step in flight, launching nothing; returns the tokens taken."""
        inflight, self.inflight = self.inflight, None
        return 0 if inflight is None else self._complete(inflight)

    def _launch(self, group: DecodeGroup) -> int:
        """Launch `group`'s plain decode step, then read and process the one in flight; returns
        the tokens that one's requests took."""
        previous = self.inflight
        self.policy.prepare(group)
        pending = self.worker.launch_decode(
            group.reqs, previous.pending if previous is not None else None
        )
        self.inflight = InFlight(group, pending, time.perf_counter())
        return 0 if previous is None else self._complete(previous)

    def _complete(self, done: InFlight) -> int:
        """Read `done` back and process it: requests that finished while it was in flight drop
        its token and release their KV now; the others take theirs. A request that finishes
        here but is in the step in flight is told now, its KV released after that step, unless
        that step holds only finished requests: then its KV is released at once (the step is
        read at the next drain)."""
        result = done.pending.finish()  # the step's one read
        cost = self.rank0_value(StepCost(time.perf_counter() - done.launched, 0.0))
        release_after(self.kv, done.pending)
        reqs, rows = live_rows(done.pending, result)
        held = {id(r) for r in self.inflight.pending.reqs} if self.inflight is not None else ()
        emitted = self.outputs.process(reqs, rows, held)
        self._drop_finished()
        self.policy.observe(done.group, result, emitted, cost)
        finished = [r for r in reqs if r.finished and id(r) in held]
        if finished and all(r.finished for r in self.inflight.pending.reqs):
            # Nothing live in flight: release its KV now, so that the callers told below find
            # it released, as without overlap. It is read (the device waited for) only at the
            # next drain, which comes before any launch, so no slot is reused meanwhile; a step
            # whose KV lengths are known only once read is read now.
            if self.inflight.pending.release_unread:
                release_after(self.kv, self.inflight.pending)
            else:
                emitted += self.drain()
        for req in finished:
            self.outputs.notify(req, True)
        return emitted

    def _decode(self, group: DecodeGroup) -> int:
        """Decode one group of the policy's plan; returns the tokens its requests took."""
        if self.overlap and group.depth is None and all(map(self._overlappable, group.reqs)):
            return self._launch(group)
        emitted = self.drain()
        start = time.perf_counter()
        self.policy.prepare(group)
        began = time.perf_counter()
        # None: the worker's configured decode (a plain worker's one shape).
        depth = () if group.depth is None else (group.depth,)
        result = self.worker.decode(group.reqs, *depth)
        # The tokens are on the host: the time is the step's.
        cost = self.rank0_value(StepCost(time.perf_counter() - began, began - start))
        taken = self.outputs.process(group.reqs, result)
        self._drop_finished()
        self.policy.observe(group, result, taken, cost)
        return emitted + taken

    def _drop_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]

    # ------------------------------------------------------------ commands

    def add_request(self, req: Req) -> None:
        self.admission.add(req)

    def has_work(self) -> bool:
        """Whether any request is queued or running, or a step is in flight."""
        return bool(self.running) or self.admission.has_work() or self.inflight is not None

    def holds_kv(self) -> bool:
        """Whether a running (or half-prefilled) request, or a step in flight, holds KV slots."""
        return bool(self.running or self.admission.chunked or self.inflight is not None)

    def retract_all(self) -> None:
        """Put every running request back at the head of the queue, its KV released (it is
        recomputed when the request runs again)."""
        active = self.active_reqs()
        self.retraction.retract(active)
        self.running = []
        self.admission.take_chunked()
        self.admission.requeue(active)

    def weights_changed(self, flush: bool) -> None:
        """New weights are in: with `flush`, cached prefixes stop being served (KV that running
        requests hold stays theirs, but is never shared again)."""
        self.kv.weights_changed(flush)

    def abort(self, rid: str, message: Optional[str] = None) -> int:
        """Abort every request with this rid (or whose n-sample parent has it); returns how many."""
        victims = [r for r in self._all_reqs() if r.input.rid == rid or r.input.parent_rid == rid]
        for req in victims:
            self._finish_abort(req, message)
        return len(victims)

    def abort_all(self, message: Optional[str] = None) -> None:
        for req in list(self._all_reqs()):
            self._finish_abort(req, message)

    def fail_all(self, message: str) -> None:
        """After a failed step: end every request with an error and start KV memory afresh
        (the step may have left slots half-assigned)."""
        reqs = list({id(r): r for r in self._all_reqs() + self.prefilling}.values())
        self.inflight = None  # its finished requests were told; kv.reset frees their KV
        self.admission.clear()
        self.running = []
        self.prefilling = []
        self.kv.reset(reqs)
        for req in reqs:
            req.finished_reason = {"type": "abort", "message": message, "status_code": 500}
            self.outputs.notify(req, True)

    def drop_prefix_cache(self) -> None:
        """Free every cached prefix and start an empty tree (no request may hold one)."""
        self.kv.drop_prefix_cache()

    def flush_cache(self, paused: bool) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running, unless
        generation is `paused` (then cached prefixes just stop being served)."""
        if not self.has_work():
            self.drop_prefix_cache()
            return True
        if paused:
            self.weights_changed(flush=True)
            return True
        return False

    def active_reqs(self) -> list[Req]:
        """The running requests and the one half-way through chunked prefill."""
        reqs = list(self.running)
        chunked = self.admission.chunked
        if chunked is not None and chunked not in reqs:
            reqs.append(chunked)
        return reqs

    def memory_report(self) -> dict[str, int]:
        """Where every KV slot is: free, cached (tree), owned by requests (whole pages); the
        three sum to the total."""
        return self.kv.memory_report(self.active_reqs())

    def _finish_abort(
        self, req: Req, message: Optional[str], status_code: Optional[int] = None
    ) -> None:
        """End `req` with finish_reason abort; `message` None is an abort by request, worded as
        SGLang words it: a queued request (retracted ones too, with their output so far) gets
        "Abort in waiting queue"."""
        if message is None:
            queued = any(r is req for r in self.admission.waiting)
            message = WAITING_QUEUE_ABORT if queued else "aborted by request"
        req.finished_reason = {"type": "abort", "message": message}
        if status_code is not None:
            req.finished_reason["status_code"] = status_code
        if req.req_pool_idx is not None:
            self.kv.release(req)
        self.admission.remove(req)
        self.running = [r for r in self.running if r is not req]
        self.outputs.notify(req, True)

    def _all_reqs(self) -> list[Req]:
        return list(self.admission.waiting) + self.active_reqs()
