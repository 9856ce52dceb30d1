"""DecodePolicy: which running requests decode together, and how — the scheduler's one view of
speculation.

Before a decode step the scheduler asks its policy for the step's groups (`plan`: each group one
forward of the worker, with a depth), lets it `prepare` each group, runs the group's decode and
tells the policy what the group emitted and cost (`observe`). This class is plain decoding's
policy: every running request in one step of the worker's own decode, nothing measured or
remembered. With --speculative-algorithm, speculative.policy.SpecPolicy is the policy
(acceptance alarm, adaptive depths, draft staleness, engine-wide speculation counters);
speculative.factory.create_policy builds the one the engine injects into the Scheduler, as it
does the worker, so core imports nothing from speculative/.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from spec_engine.core.request import Req
from spec_engine.core.worker import StepResult


@dataclass(frozen=True)
class DecodeGroup:
    """Requests that decode in one forward, and how: `depth` None is the worker's configured
    decode, 0 a plain step, another value a speculative depth (--speculative-adaptive)."""

    reqs: list[Req]
    depth: Optional[int] = None


@dataclass(frozen=True)
class StepCost:
    """What a group's decode cost, measured by the scheduler: `seconds` of the worker's decode
    (its tokens are on the host then: synchronized) and `prepare_seconds` of the policy's
    `prepare` before it (a lagging draft's catch-up)."""

    seconds: float
    prepare_seconds: float


class DecodePolicy:
    """Plain decoding: one group of every running request, at the worker's configured decode."""

    # A decision made from values measured in this process, as rank 0 made it: every rank of a
    # tensor-parallel engine then plans alike (the engine sets it; identity at one rank).
    rank0_value: Callable[[Any], Any] = staticmethod(lambda value: value)

    def plan(self, running: list[Req]) -> list[DecodeGroup]:
        """The groups of the next decode step of `running`. A pure function of the policy's state
        and the batch: the scheduler asks again after each retraction."""
        return [DecodeGroup(running)]

    def prefilling(self, reqs: Sequence[Req]) -> None:
        """`reqs` are about to be prefilled (a chunk of their prompt, or all of it)."""

    def prepare(self, group: DecodeGroup) -> None:
        """Right before `group` decodes (timed apart from its decode)."""

    def observe(self, group: DecodeGroup, result: StepResult, emitted: int, cost: StepCost) -> None:
        """`group` decoded: the worker's `result`, the tokens its requests took from it
        (`emitted`: none past a finish) and what it cost. The one place measured seconds enter
        the policy."""

    def weights_updated(self, version: str) -> None:
        """A weight update (target or draft) is in under `version`."""

    def relabel(self, version: str) -> None:
        """The loaded weights got a new label (update_weight_version): same weights."""

    @property
    def accept_alarm(self) -> bool:
        """Whether the acceptance alarm is up (outputs carry it as spec_accept_alarm)."""
        return False

    def report(self) -> dict[str, Any]:
        """get_server_info's internal_states entries of the policy."""
        return {}

    def load(self) -> Optional[dict[str, float]]:
        """/v1/loads' `speculative` section (None: nothing verified yet)."""
        return None
