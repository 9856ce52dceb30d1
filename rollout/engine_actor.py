"""An engine as a Ray actor: `EngineActor` (wrap with `ray.remote`) and `RayEngineHandle`, the
router-facing handle that awaits the actor's calls.

    actor = ray.remote(EngineActor).options(num_cpus=1).remote(model_path=..., random_seed=0)
    manager = RolloutManager(args, [RayEngineHandle(actor)], tokenizer)

EngineActor's methods are coroutines, so Ray runs it as an async actor: many generate calls run
concurrently in its event loop, and blocking engine calls (weight updates, release/resume) run
in a thread so they do not stall the outputs of requests in flight. A run's engines, each in its
placement bundle, are a `rollout.engine_group.EngineGroup`.

An engine of several tensor-parallel ranks (`tp_size` > 1, --rollout-num-gpus-per-engine) is
still one actor: the engine in it spawns its other ranks. When a rank dies, the engine fails
what is in flight and stops (spec_engine.engine_loop); the actor then ends its process without
answering, so every caller sees a dead engine (`rollout.router.EngineDied`), which
--use-fault-tolerance restarts whole, rather than a failed request.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import threading
import time
from typing import Any, NoReturn, Optional

from rollout.router import EngineDied
from spec_engine import Engine
from spec_engine.control_methods import ControlMethod, add_control_methods

logger = logging.getLogger(__name__)

# Set by specrl.placement for a multi-GPU engine's actor (Ray then leaves CUDA_VISIBLE_DEVICES
# alone, so the engine's ranks see the GPUs of its other bundles).
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
# How often a multi-rank engine's actor looks whether a rank died while nothing was asked of it.
RANK_WATCH_S = 0.2


async def _run_on_engine(
    actor: EngineActor, method: ControlMethod, args: tuple, kwargs: dict[str, Any]
) -> Any:
    call = getattr(actor.engine, method.name)
    try:
        if method.blocking:
            return await asyncio.to_thread(call, *args, **kwargs)
        return call(*args, **kwargs)
    except Exception:
        actor.exit_if_a_rank_died()
        raise


def engine_base_gpu() -> int:
    """The CUDA index, in this process, of the GPU Ray gave this actor: its engine's rank 0
    (SGLang's base_gpu_id), the next ranks on the next GPUs."""
    import ray

    gpu = str(ray.get_gpu_ids()[0])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",").index(gpu) if visible else int(gpu)


@add_control_methods(_run_on_engine)
class EngineActor:
    """Holds one `spec_engine.Engine`. Besides generation, its methods are the engine's
    control methods (spec_engine.control_methods), generated with the engine's signatures."""

    def __init__(self, **engine_kwargs: Any) -> None:
        if engine_kwargs.get("tp_size", 1) > 1 and os.environ.get(NOSET_CUDA_VISIBLE_DEVICES):
            engine_kwargs["base_gpu_id"] = engine_base_gpu()
        self.engine = Engine(**engine_kwargs)
        if self.engine.args.tp_size > 1:
            threading.Thread(target=self._watch_ranks, name="engine-ranks", daemon=True).start()

    async def async_generate(self, **kwargs: Any) -> Any:
        if kwargs.get("stream"):
            raise ValueError(
                "stream=True cannot cross a Ray actor call; generate without streaming"
            )
        try:
            return await self.engine.async_generate(**kwargs)
        except Exception:
            self.exit_if_a_rank_died()
            raise

    def exit_if_a_rank_died(self) -> None:
        """After a failed call: if the engine stopped because a rank died, end this actor (the
        call then reports a dead engine, not a failed request)."""
        if self.engine.stopped_by is not None:
            self._exit()

    def _watch_ranks(self) -> None:
        while self.engine.stopped_by is None:
            time.sleep(RANK_WATCH_S)
        self._exit()

    def _exit(self) -> NoReturn:
        """End the process now, without answering any call, and the engine's other ranks."""
        logger.error("%s; the engine's actor exits", self.engine.stopped_by)
        for rank in multiprocessing.active_children():
            rank.kill()
        os._exit(1)

    async def health_generate(self) -> None:
        """A one-token generation, as SGLang's /health_generate (the launcher's health checks;
        its rid keeps it out of the engine's request counts)."""
        import uuid

        from spec_engine.core.stats import HEALTH_CHECK_RID_PREFIX

        await self.async_generate(
            input_ids=[0],
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            rid=f"{HEALTH_CHECK_RID_PREFIX}{uuid.uuid4().hex}",
        )


async def _call_actor(
    handle: RayEngineHandle, method: ControlMethod, args: tuple, kwargs: dict[str, Any]
) -> Any:
    return await handle._call(method.name, *args, **kwargs)


@add_control_methods(_call_actor)
class RayEngineHandle:
    """Adapts an EngineActor's Ray handle to the router's engine interface (awaitable calls),
    with the engine's control methods generated as the actor's are. A dead actor's calls raise
    `rollout.router.EngineDied` (naming engine `index`), so the router needs no Ray import to
    tell a dead engine from a failed request."""

    def __init__(self, actor: Any, index: Optional[int] = None) -> None:
        self.actor = actor
        self.index = index

    async def async_generate(self, **kwargs: Any) -> Any:
        return await self._call("async_generate", **kwargs)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(*args, **kwargs)
        except ray.exceptions.RayTaskError:
            raise  # the call itself failed (a bad request): the actor lives on
        except ray.exceptions.RayActorError as e:
            raise EngineDied(self.index, actor_error_reason(e)) from e


def actor_error_reason(error: BaseException) -> str:
    """One line of a Ray actor error for a log line: Ray's own "The actor is dead because ..."
    when it has one (killed, OOM, exited), else its first line (the rest is diagnostics); for an
    actor that failed while starting, the error it raised (`RankFailed: tensor-parallel rank 1
    failed to start:`, naming the rank of a multi-rank engine)."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    because = [line for line in lines if line.startswith("The actor is dead because")]
    reason = (because or lines or [type(error).__name__])[0]
    if "error raised in its creation task" in reason:
        # Ray's first line, then the creation task's traceback: its unindented "Name: ..." lines
        # are the errors raised, the last one the actor's own (its causes come first), unless a
        # rank's failure says which rank.
        raised = [line for line in text.splitlines()[1:] if _RAISED.match(line)]
        ranks = [line for line in raised if "RankFailed: " in line]
        if raised:
            reason = f"{reason.split(',')[0]}: {(ranks or raised)[-1]}"
    return reason if len(reason) <= 300 else reason[:297] + "..."


_RAISED = re.compile(r"[A-Za-z_][\w.]*: ")
