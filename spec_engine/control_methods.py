"""The engine's control API as one list, and the wrappers generated from it.

CONTROL_METHODS names every Engine method a caller outside the engine's process uses besides
generation: weight updates, memory, pause, reports, profiling. Each wrapper is generated from
it with the engine method's own signature and docstring (functools.wraps), so none can drop or
rename a parameter: the HTTP server's POST /<name> routes (server.http_server), the rollout's
Ray actor and its handle (rollout.engine_actor, through `add_control_methods`).
tests/engine/test_control_api.py compares every wrapper's parameters with the engine's."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from spec_engine.engine import Engine

POST = ("POST",)
# SGLang serves these on GET too (a body-less GET takes every default).
GET_OR_POST = ("GET", "POST")
# No generated route: the server answers it with a route of its own (another path or answer,
# in http_server or admin_api), or not at all.
NO_ROUTE: tuple[str, ...] = ()


@dataclass(frozen=True)
class ControlMethod:
    name: str  # the Engine method, the HTTP route /<name>, the actor's method
    http: tuple[str, ...] = POST  # the HTTP methods of its generated route
    # It waits for the scheduler thread or does work: async wrappers run it in a thread, so the
    # outputs of requests in flight keep flowing.
    blocking: bool = True


CONTROL_METHODS: tuple[ControlMethod, ...] = (
    # weights
    ControlMethod("update_weights_from_tensor"),
    ControlMethod("init_weights_update_group"),
    ControlMethod("update_weights_from_distributed"),
    ControlMethod("update_weights_from_disk"),
    ControlMethod("destroy_weights_update_group"),
    ControlMethod("get_weights_checksum"),
    ControlMethod("weights_checker", GET_OR_POST),
    ControlMethod("post_process_weights"),
    ControlMethod("update_weight_version", NO_ROUTE),
    ControlMethod("get_weight_version", NO_ROUTE, blocking=False),
    ControlMethod("get_weights_by_name", NO_ROUTE),
    # requests and memory
    ControlMethod("abort_request", NO_ROUTE, blocking=False),
    ControlMethod("pause_generation"),
    ControlMethod("continue_generation"),
    ControlMethod("flush_cache", NO_ROUTE),
    ControlMethod("release_memory_occupation", GET_OR_POST),
    ControlMethod("resume_memory_occupation", GET_OR_POST),
    # reports, profiling, shutdown
    ControlMethod("get_server_info", NO_ROUTE),
    ControlMethod("get_model_info", NO_ROUTE, blocking=False),
    ControlMethod("get_load", NO_ROUTE),
    ControlMethod("start_profile", GET_OR_POST),
    ControlMethod("stop_profile", GET_OR_POST),
    ControlMethod("shutdown", NO_ROUTE),
)

# How a generated async method runs: call(wrapper's self, the method, args, kwargs).
Call = Callable[[Any, ControlMethod, tuple, dict], Awaitable[Any]]
C = TypeVar("C", bound=type)


def add_control_methods(call: Call) -> Callable[[C], C]:
    """Class decorator: give the class one async method per CONTROL_METHODS entry, with the
    engine method's name, signature and docstring, that returns `await call(self, method,
    args, kwargs)`. A class that writes one of them itself is refused: it would restate it."""

    def decorate(cls: C) -> C:
        for method in CONTROL_METHODS:
            if method.name in vars(cls):
                raise TypeError(
                    f"{cls.__name__}.{method.name} restates an engine control method; leave it "
                    "out (it is generated from spec_engine.control_methods.CONTROL_METHODS)"
                )
            setattr(cls, method.name, _async_method(cls, method, call))
        return cls

    return decorate


def _async_method(cls: type, method: ControlMethod, call: Call) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(getattr(Engine, method.name))
    async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        return await call(self, method, args, kwargs)

    wrapper.__qualname__ = f"{cls.__qualname__}.{method.name}"
    wrapper.__module__ = cls.__module__
    return wrapper
