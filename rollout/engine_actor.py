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


class EngineActor:
    """Holds one `spec_engine.Engine`; its methods mirror the engine's (SGLang's names)."""

    def __init__(self, **engine_kwargs: Any) -> None:
        from spec_engine import Engine  # imported in the actor's process only

        self.engine = Engine(**engine_kwargs)

    async def async_generate(self, **kwargs: Any) -> Any:
        if kwargs.get("stream"):
            raise ValueError(
                "stream=True cannot cross a Ray actor call; generate without streaming"
            )
        return await self.engine.async_generate(**kwargs)

    async def abort_request(self, rid: str) -> None:
        self.engine.abort_request(rid)

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

    async def update_weights_from_tensor(
        self,
        named_tensors: Any = None,
        load_format: Optional[str] = None,
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
        serialized_named_tensors: Optional[list] = None,
    ) -> dict:
        return await asyncio.to_thread(
            self.engine.update_weights_from_tensor,
            named_tensors,
            load_format,
            flush_cache,
            weight_version,
            serialized_named_tensors,
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "gloo",
    ) -> dict:
        return await asyncio.to_thread(
            self.engine.init_weights_update_group,
            master_address,
            master_port,
            rank_offset,
            world_size,
            group_name,
            backend,
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list,
        shapes: list,
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: Optional[str] = None,
    ) -> dict:
        return await asyncio.to_thread(
            self.engine.update_weights_from_distributed,
            names,
            dtypes,
            shapes,
            group_name,
            flush_cache,
            weight_version,
        )

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: Optional[str] = None,
        component: str = "target",
        flush_cache: bool = True,
    ) -> dict:
        return await asyncio.to_thread(
            self.engine.update_weights_from_disk, model_path, weight_version, component, flush_cache
        )

    async def get_weights_checksum(self, names: Optional[list[str]] = None) -> dict[str, str]:
        return await asyncio.to_thread(self.engine.get_weights_checksum, names)

    async def pause_generation(self, mode: str = "abort") -> None:
        await asyncio.to_thread(self.engine.pause_generation, mode)

    async def continue_generation(self) -> None:
        await asyncio.to_thread(self.engine.continue_generation)

    async def flush_cache(self) -> bool:
        return await asyncio.to_thread(self.engine.flush_cache)

    async def release_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        await asyncio.to_thread(self.engine.release_memory_occupation, tags)

    async def resume_memory_occupation(self, tags: Optional[list[str]] = None) -> None:
        await asyncio.to_thread(self.engine.resume_memory_occupation, tags)

    async def get_server_info(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.engine.get_server_info)

    async def get_model_info(self) -> dict[str, Any]:
        return self.engine.get_model_info()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


class RayEngineHandle:
    """Adapts an EngineActor's Ray handle to the router's engine interface (awaitable calls).
    A dead actor's calls raise `rollout.router.EngineDied` (naming engine `index`), so the
    router needs no Ray import to tell a dead engine from a failed request."""

    def __init__(self, actor: Any, index: Optional[int] = None) -> None:
        self.actor = actor
        self.index = index

    async def async_generate(self, **kwargs: Any) -> Any:
        return await self._call("async_generate", **kwargs)

    async def abort_request(self, rid: str) -> None:
        await self._call("abort_request", rid)

    async def get_server_info(self) -> dict[str, Any]:
        return await self._call("get_server_info")

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
