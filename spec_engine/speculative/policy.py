"""SpecPolicy: which running requests speculate, and how deep — the one object the scheduler asks.

The scheduler sees it as a core.policy.DecodePolicy: it asks for each decode step's groups
(`plan`) and tells it what each group emitted and cost (`observe`). Its parts:

* the acceptance alarm (accept_alarm.py): with --speculative-on-collapse disable a collapse
  after a weight update has every request decode plainly until the next update;
* draft staleness (Req.draft_stale): without --speculative-adaptive a plain step leaves a draft
  model's KV and next-round state (spec_state) behind for good, so a request that decoded
  plainly keeps doing so until it finishes or a prefill (after a retraction) rebuilds its draft,
  rather than resync the draft (whose extend over the plain tokens would need the target's
  features there, which a plain step does not keep); requests admitted after the update
  speculate at once;
* with --speculative-adaptive the cost model (adaptive/), which picks every step's mode and
  depth for the whole batch (plain steps keep the draft recoverable: draft_lag.py), the worker
  catching a lagging draft up before a speculative step (`prepare`);
* the engine-wide counters /v1/loads and get_server_info report.

Measured seconds enter through `observe` alone (the scheduler's StepCost; on a CPU device whose
torch runs one thread, the scheduler thread's CPU time from `prepare` to `observe` instead: on a
machine shared with other processes the wall clock adds each step's waits for a core, which on a
loaded 2-core VM made a one-layer model's 3 ms plain step measure 10-35 ms, varying from minute
to minute, and a near tie any mode's; with several torch threads the work of torch's pool is not
on this thread's clock, so the wall clock stays), besides the draft
extends the worker times for its catch-up estimate (draft_lag.ExtendCost); both are read by one
decision, `_adaptive_depth`. They differ per process: with several ranks running this scheduler
(--tp-size > 1) that decision is made on rank 0 and broadcast (`rank0_value`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from spec_engine.args.engine_args import EngineArgs
from spec_engine.core.policy import DecodeGroup, DecodePolicy, StepCost
from spec_engine.core.request import Req
from spec_engine.core.worker import StepResult
from spec_engine.speculative.accept_alarm import AcceptAlarm
from spec_engine.speculative.adaptive.model import SpecCostModel
from spec_engine.speculative.base import SpecWorker


@dataclass
class SpecCounters:
    """Engine-wide: verify passes (one per request per speculative step), the tokens they
    emitted, and the most drafts they could accept (each pass's depth)."""

    verify_ct: int = 0
    emitted: int = 0
    depth_sum: int = 0


class SpecPolicy(DecodePolicy):
    def __init__(self, args: EngineArgs, worker: SpecWorker) -> None:
        self.worker = worker
        self.alarm = AcceptAlarm(
            args.speculative_collapse_threshold,
            args.speculative_collapse_min_verify_steps,
            args.speculative_on_collapse,
            args.weight_version,
        )
        self.adaptive = SpecCostModel.from_args(args) if args.speculative_adaptive else None
        # On CPU with one torch thread the cost model reads the step's CPU time on this thread
        # (module docstring): the time at the end of `prepare`, None elsewhere.
        self.cpu_clock = worker.device.type == "cpu" and torch.get_num_threads() == 1
        self.step_began: Optional[float] = None
        self.counters = SpecCounters()

    def plan(self, running: list[Req]) -> list[DecodeGroup]:
        """All plain while a `disable` alarm is up; with --speculative-adaptive one group at the
        cost model's depth; else the requests whose draft is in step at the configured depth
        and the stale ones plainly."""
        if not self.alarm.speculating:
            return [DecodeGroup(running, 0)]
        if self.adaptive is not None:  # no request is behind: any may switch at any step
            return [DecodeGroup(running, self._adaptive_depth(running))]
        plain = [r for r in running if r.draft_stale]
        spec = [r for r in running if not r.draft_stale]
        return [DecodeGroup(g, depth) for g, depth in ((spec, None), (plain, 0)) if g]

    def _adaptive_depth(self, running: list[Req]) -> int:
        """The cost model's mode for a step of `running`, charged what a try's catch-up would
        pay first (estimated only when the model works its choice out: not while one holds)."""
        mode = self.adaptive.held(len(running))
        if mode is None:
            catch_up = self.worker.catch_up_seconds(running)
            mode = self.adaptive.choose(len(running), catch_up)
        return self.rank0_value(mode)

    def prefilling(self, reqs: Sequence[Req]) -> None:
        for req in reqs:
            req.draft_stale = False  # the worker's prefill rebuilds the draft's KV and state

    def prepare(self, group: DecodeGroup) -> None:
        """A lagging draft caught up (before a plain step: only a full lag), timed apart from
        the step; a plain group's drafts fall behind unless plain steps keep them (never stale
        with NGRAM or --speculative-adaptive: draft_lag.py)."""
        self.worker.catch_up(group.reqs, full_only=group.depth == 0)
        if group.depth == 0 and not self.worker.plain_steps_keep_draft:
            for req in group.reqs:  # (never set otherwise: no per-request loop per plain step)
                req.draft_stale = True
        if self.adaptive is not None and self.cpu_clock:
            self.step_began = time.thread_time()

    def observe(self, group: DecodeGroup, result: StepResult, emitted: int, cost: StepCost) -> None:
        depth = group.depth
        passes = len(group.reqs) if result.drafted is not None else 0
        emitted = emitted if passes else 0
        self.counters.verify_ct += passes
        self.counters.emitted += emitted
        self.counters.depth_sum += passes * (depth or self.worker.max_depth)
        # The alarm compares accept lengths of one shape: the configured (deepest) one.
        if depth in (None, self.worker.max_depth):
            self.alarm.record(passes, emitted)
        if self.adaptive is not None:
            seconds = cost.seconds
            if self.step_began is not None:
                seconds, self.step_began = time.thread_time() - self.step_began, None
            self.adaptive.observe(
                depth,
                len(group.reqs),
                seconds,
                result.tokens,
                result.accept_paths,
                cost.prepare_seconds,
            )

    def weights_updated(self, version: str) -> None:
        """Acceptance is measured afresh and speculation, if the alarm stopped it, resumes for
        new requests; the cost model tries every mode again soon."""
        self.alarm.weights_updated(version)
        if self.adaptive is not None:
            self.adaptive.weights_updated()

    def relabel(self, version: str) -> None:
        self.alarm.relabel(version)

    @property
    def accept_alarm(self) -> bool:
        return self.alarm.up

    def report(self) -> dict[str, Any]:
        c = self.counters
        state = {
            "avg_spec_accept_length": c.emitted / c.verify_ct if c.verify_ct else None,
            "spec_verify_ct": c.verify_ct,
            "spec_time_breakdown": dict(self.worker.timings.seconds),
            "spec_accept_alarm": self.alarm.report(),
        }
        if self.adaptive is not None:
            state["spec_adaptive"] = self.adaptive.report()
        return state

    def load(self) -> Optional[dict[str, float]]:
        """Accepted drafts over the most the passes could accept: each pass's draft depth
        (--speculative-adaptive runs shallower passes than the configured depth)."""
        c = self.counters
        if not c.verify_ct:
            return None
        return {
            "accept_length": c.emitted / c.verify_ct,
            "accept_rate": (c.emitted - c.verify_ct) / max(c.depth_sum, 1),
        }
