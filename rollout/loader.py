"""Resolving the extension-point flags: functions named by import path."""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable
from typing import Any


def load_function(path: str, flag: str) -> Callable[..., Any]:
    """Import `module.path:function` or `module.path.function`; errors name `flag`."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(
            f"{flag} must be an import path like 'my_pkg.my_module:my_function', got {path!r}"
        )
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(
            f"{flag} {path!r} is not an import path; write 'my_pkg.my_module:my_function' "
            "or 'my_pkg.my_module.my_function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"{flag} {path!r}: cannot import module {module_name!r} ({e}); check the path and that "
            "its package is on PYTHONPATH"
        ) from e
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise ImportError(f"{flag} {path!r}: {module_name!r} has no attribute {attr!r}")
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"{flag} {path!r} names a {type(fn).__name__}, not a function")
    return fn


async def call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a sync or async function (or one returning an awaitable) and return its result."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from sync code; refuses inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(
        "called the sync API from inside a running event loop; await the async form "
        "(agenerate / aeval) instead"
    )
