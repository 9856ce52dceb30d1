"""An engine as a Ray actor: `EngineActor` (wrap with `ray.remote`) and `RayEngineHandle`, the
router-facing handle that awaits the actor's calls.

    actor = ray.remote(EngineActor).options(num_cpus=1).remote(model_path=..., random_seed=0)
    manager = RolloutManager(args, [RayEngineHandle(actor)], tokenizer)

EngineActor's methods are coroutines, so Ray runs it as an async actor: many generate calls run
concurrently in its event loop, and blocking engine calls (weight updates, release/resume) run
in a thread so they do not stall the outputs of requests in flight. A run's engines, each in its
placement bundle, are a `rollout.engine_group.EngineGroup`.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from rollout.router import EngineDied
from spec_engine import Engine
from spec_engine.control_methods import ControlMethod, add_control_methods


async def _run_on_engine(
    actor: EngineActor, method: ControlMethod, args: tuple, kwargs: dict[str, Any]
) -> Any:
    call = getattr(actor.engine, method.name)
    if method.blocking:
        return await asyncio.to_thread(call, *args, **kwargs)
    return call(*args, **kwargs)


@add_control_methods(_run_on_engine)
class EngineActor:
    """Holds one `spec_engine.Engine`. Besides generation, its methods are the engine's
    control methods (spec_engine.control_methods), generated with the engine's signatures."""

    def __init__(self, **engine_kwargs: Any) -> None:
        self.engine = Engine(**engine_kwargs)

    async def async_generate(self, **kwargs: Any) -> Any:
        if kwargs.get("stream"):
            raise ValueError(
                "stream=True cannot cross a Ray actor call; generate without streaming"
            )
        return await self.engine.async_generate(**kwargs)

    async def health_generate(self) -> None:
        """A one-token generation, as SGLang's /health_generate (the launcher's health checks;
        its rid keeps it out of the engine's request counts)."""
        import uuid

        from spec_engine.core.stats import HEALTH_CHECK_RID_PREFIX

        await self.engine.async_generate(
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
    when it has one (killed, OOM, exited), else its first line (the rest is diagnostics)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    because = [line for line in lines if line.startswith("The actor is dead because")]
    reason = (because or lines or [type(error).__name__])[0]
    return reason if len(reason) <= 300 else reason[:297] + "..."
