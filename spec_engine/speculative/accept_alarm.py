"""AcceptAlarm: notices when a weight update leaves the draft behind.

In RL the target changes every step and an external draft (or a frozen MTP layer) does not,
so acceptance can collapse after an update while outputs stay correct (speculation is
lossless): the only symptom is a slower rollout. The alarm measures the accept length (SGLang's
spec_accept_length: tokens emitted per verify step) under each weight update, keeps the best a
completed update reached, and raises once the current weights, after enough verify steps
(--speculative-collapse-min-verify-steps, so a few unlucky steps do not fire it), fall below
--speculative-collapse-threshold x that best. With --speculative-on-collapse disable the
speculation policy (speculative.policy.SpecPolicy) then has the scheduler decode without
speculation until the next weight update (of target or draft), after which speculation resumes
and acceptance is measured afresh.

Runs on the scheduler thread only (the policy records, the engine's reports read).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

logger = logging.getLogger(__name__)

# Accept lengths kept for the report: the latest updates' (a long run has thousands).
MAX_REPORTED_VERSIONS = 32


@dataclass
class Measured:
    """Verify steps (one per request per speculative decode step) and the tokens they emitted,
    under one weight update."""

    version: str
    verify_ct: int = 0
    emitted: int = 0

    @property
    def accept_length(self) -> Optional[float]:
        return self.emitted / self.verify_ct if self.verify_ct else None


class AcceptAlarm:
    def __init__(
        self, threshold: float, min_verify_steps: int, on_collapse: str, version: str
    ) -> None:
        self.threshold = threshold
        self.min_verify_steps = min_verify_steps
        self.on_collapse = on_collapse
        self.current = Measured(version)
        self.best: Optional[Measured] = None  # the best completed update's measurement
        self.history: dict[str, float] = {}  # version -> accept length, completed updates
        self.up = False

    @property
    def speculating(self) -> bool:
        """Whether decode steps may speculate: not while a `disable` alarm is up."""
        return not (self.up and self.on_collapse == "disable")

    def record(self, verify_ct: int, emitted: int) -> None:
        """A speculative decode step's verify steps and emitted tokens, under the current
        weights; raises (or, in warn mode, clears) the alarm."""
        if not verify_ct:
            return
        self.current.verify_ct += verify_ct
        self.current.emitted += emitted
        if self.best is None or self.current.verify_ct < self.min_verify_steps:
            return
        accept, best = self.current.accept_length, self.best.accept_length
        collapsed = accept < self.threshold * best
        if collapsed and not self.up:
            self.up = True
            logger.warning(
                "speculative acceptance collapsed after a weight update: accept length %.2f under "
                "weight version %r (%d verify steps) is below %.2f x %.2f, the best (weight "
                "version %r); %s",
                accept,
                self.current.version,
                self.current.verify_ct,
                self.threshold,
                best,
                self.best.version,
                "decoding without speculation until the next weight update "
                "(--speculative-on-collapse disable)"
                if self.on_collapse == "disable"
                else "the draft no longer predicts the target: update or retrain the draft "
                "(--speculative-on-collapse disable stops speculating meanwhile)",
            )
        elif not collapsed and self.up:  # warn mode only: disable stops measuring
            self.up = False
            logger.info(
                "speculative acceptance recovered: accept length %.2f under weight version %r",
                accept,
                self.current.version,
            )

    def weights_updated(self, version: str) -> None:
        """New weights (target or draft) are in: the measurement so far counts towards the
        best if it is large enough, and the new weights start a measurement with speculation
        on (even an update with the same version label changes what the draft faces)."""
        done = self.current
        if done.verify_ct >= self.min_verify_steps:
            self.history.pop(done.version, None)  # a repeated label moves to the end
            self.history[done.version] = done.accept_length
            while len(self.history) > MAX_REPORTED_VERSIONS:
                del self.history[next(iter(self.history))]
            if self.best is None or done.accept_length > self.best.accept_length:
                self.best = done
        if self.up:
            logger.info(
                "weights updated (version %r): speculative acceptance is measured again", version
            )
        self.current = Measured(version)
        self.up = False

    def relabel(self, version: str) -> None:
        """The loaded weights got a new label (update_weight_version): same weights, same
        measurement."""
        self.current.version = version

    def report(self) -> dict[str, Any]:
        """For get_server_info: the alarm, the current measurement and the best."""
        return {
            "alarm": self.up,
            "speculating": self.speculating,
            "on_collapse": self.on_collapse,
            "threshold": self.threshold,
            "min_verify_steps": self.min_verify_steps,
            "weight_version": self.current.version,
            "accept_length": self.current.accept_length,
            "verify_ct": self.current.verify_ct,
            "best_accept_length": self.best.accept_length if self.best else None,
            "best_weight_version": self.best.version if self.best else None,
            "accept_length_by_version": dict(self.history),
        }
