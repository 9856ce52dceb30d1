"""EngineGroup: the rollout engines of a run, one EngineActor Ray actor per engine (in the first
of its placement bundles when an engine spans several devices: its Engine spawns the other
tensor-parallel ranks).

    engines = EngineGroup(engine_args, reserve_bundles(2, 1, "--rollout-num-gpus"))
    engines.wait_until_up()
    manager = RolloutManager(rollout_args, engines.handles, tokenizer)
    trainer.push_weights(engines.actors, ...)
    engines.restart(0)          # a fresh actor in place of a dead engine 0, in its bundle
    engines.shutdown()

The caller reserves the bundles (specrl.placement.create_placements) and passes the Ray actor
options of each engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray

from rollout.engine_actor import EngineActor, RayEngineHandle
from spec_engine.args.engine_args import EngineArgs

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 60


class EngineGroup:
    """Starts one engine per bundle; `wait_until_up` returns once every one is up (calls made
    before are queued by Ray until then), so other actors can start meanwhile."""

    def __init__(self, engine_args: EngineArgs, placement: Sequence[dict[str, Any]]) -> None:
        self.engine_args = engine_args
        self.placement = list(placement)  # kept: a restarted engine takes its bundle again
        self.actors = [self._start(options) for options in self.placement]
        # Engines being restarted (until their weights are pushed): not health-checked, since
        # they cannot answer before they are up.
        self.restarting: set[int] = set()

    def _start(self, options: dict[str, Any]) -> Any:
        return ray.remote(EngineActor).options(**options).remote(**self.engine_args.to_dict())

    def restart(self, index: int) -> Any:
        """Replace engine `index` by a fresh actor with the same options (so the same bundle),
        started from the same engine args (the --hf-checkpoint weights, weight version "0");
        blocks until it is up and returns it. The old actor is killed first in case it is
        hung rather than dead, so its bundle is free for the new one."""
        start = time.perf_counter()
        ray.kill(self.actors[index], no_restart=True)
        self.actors[index] = self._start(self.placement[index])
        ray.get(self.actors[index].get_server_info.remote())
        logger.info("engine %d started again in %.1f s", index, time.perf_counter() - start)
        return self.actors[index]

    def handle(self, index: int) -> RayEngineHandle:
        """Engine `index` as the rollout router calls it."""
        return RayEngineHandle(self.actors[index], index)

    def wait_until_up(self) -> None:
        """Blocks until every engine has loaded its model; raises the error of one that failed."""
        ray.get([a.get_server_info.remote() for a in self.actors])

    @property
    def handles(self) -> list[RayEngineHandle]:
        """The engines as the rollout router calls them (awaitable)."""
        return [self.handle(i) for i in range(len(self.actors))]

    def release_memory(self) -> None:
        """Weights and KV cache out of device memory, for a colocated trainer to use."""
        ray.get([a.release_memory_occupation.remote() for a in self.actors])

    def resume_memory(self) -> None:
        """Weights and KV cache back, after the colocated trainer's step."""
        ray.get([a.resume_memory_occupation.remote() for a in self.actors])

    def shutdown(self) -> None:
        """Shut every engine down; one that is dead or does not answer is killed, and the others
        are still shut down (a dead engine must not hide the run's own error)."""
        for actor in self.actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
            except Exception as e:
                logger.warning("engine shutdown failed (%s); killing its actor", e)
                ray.kill(actor)
