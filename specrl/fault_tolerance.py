"""What the launcher does when an actor dies (slime's --use-fault-tolerance, for dead engines).

An engine that dies during a rollout or an evaluation is replaced (`EngineRestarter`, the
router's restart callback): a fresh EngineActor in the same placement bundle, given the policy's
current weights and weight version, at most --max-engine-restarts times per run; the router
then sends the requests the dead engine held again. Anything else that dies (a trainer rank, an
engine outside a rollout, an engine past the limit or without --use-fault-tolerance) ends the
run: `fatal_message` says what died and which checkpoint to resume from.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Optional

from rollout.engine_actor import RayEngineHandle, actor_error_reason
from rollout.engine_group import EngineGroup
from rollout.router import EngineDied
from specrl.checkpoint import iter_dir, read_latest

logger = logging.getLogger(__name__)


class EngineRestartsExhausted(Exception):
    """An engine died after the run had used all of its --max-engine-restarts."""


class EngineRestarter:
    """The router's restart callback: `await restarter(index, error)` -> a live handle in place
    of dead engine `index`. `push_weights(actor)` gives a fresh engine the policy's current
    weights and version; None (--debug-rollout-only) leaves it with --hf-checkpoint's, which is
    what the other engines hold since nothing updates them."""

    def __init__(
        self,
        engines: EngineGroup,
        limit: int,
        push_weights: Optional[Callable[[Any], object]] = None,
    ) -> None:
        self.engines = engines
        self.limit = limit
        self.push_weights = push_weights
        self.used = 0

    async def __call__(self, index: int, error: EngineDied) -> RayEngineHandle:
        if self.used >= self.limit:
            raise EngineRestartsExhausted(
                f"{error}, and the run has used its {self.limit} engine restart(s) "
                f"(--max-engine-restarts {self.limit})"
            )
        # Counted before the restart runs, so that two engines dying together cannot both
        # pass the limit.
        self.used += 1
        start = time.perf_counter()
        # Starting an actor and pushing weights block: off the rollout's event loop, so the
        # other engines' requests keep flowing meanwhile.
        handle = await asyncio.to_thread(self._restart, index)
        logger.warning(
            "engine %d restarted in %.1f s (%s); %d restart(s) left (--max-engine-restarts %d)",
            index,
            time.perf_counter() - start,
            error.reason,
            self.limit - self.used,
            self.limit,
        )
        return handle

    def _restart(self, index: int) -> RayEngineHandle:
        self.engines.restarting.add(index)
        try:
            actor = self.engines.restart(index)
            if self.push_weights is not None:
                self.push_weights(actor)
        finally:
            self.engines.restarting.discard(index)
        return self.engines.handle(index)


def last_checkpoint(args: argparse.Namespace) -> str:
    """Where a rerun resumes from, as a sentence naming the directory and the flag."""
    root = getattr(args, "save", None)
    if not root:
        load = getattr(args, "load", None)
        latest = _latest(load) if load else None
        if latest is not None:
            return (
                f"no checkpoint was saved (--save not set); the run had resumed from "
                f"{iter_dir(load, latest)}: rerun the same command to resume from it again"
            )
        return "no checkpoint was saved (--save not set): a rerun starts from --hf-checkpoint"
    latest = _latest(root)
    if latest is None:
        return f"--save {root} holds no checkpoint yet: a rerun starts from --hf-checkpoint"
    return (
        f"the last checkpoint is {iter_dir(root, latest)}: rerun the same command with "
        f"--load {root} to resume"
    )


def _latest(root: str) -> Optional[int]:
    """The latest checkpoint's id; None without one, or when its file is unreadable (this runs
    while reporting another error, which must not be hidden)."""
    try:
        return read_latest(root) if os.path.isdir(root) else None
    except (OSError, ValueError):
        return None


def fatal_message(error: BaseException, args: argparse.Namespace) -> str:
    """The run's last words after an actor died: what died, why, what to do."""
    what = describe(error)
    if isinstance(error, EngineDied) and not args.use_fault_tolerance:
        what += " (add --use-fault-tolerance to restart dead engines)"
    return f"error: {what}; {last_checkpoint(args)}"


def describe(error: BaseException) -> str:
    """One line for an actor's death: ours are one line already; Ray's name the actor's class
    and why it died (a Ray task that failed because an actor it called died: that actor)."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException) and cause is not error:
        return f"{describe(cause)} (in {getattr(error, 'function_name', 'a Ray task')})"
    lines = [line.strip() for line in str(error).splitlines()]
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("class_name:")]
    if names:
        return f"a {names[0]} actor died ({actor_error_reason(error)})"
    return actor_error_reason(error)
