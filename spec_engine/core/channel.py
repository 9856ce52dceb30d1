"""Channel: the deliveries of one call's requests, from the scheduler thread to the caller
(a thread blocked in Engine.generate, or an event loop awaiting Engine.async_generate)."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable
from typing import Optional

from spec_engine.core.outputs import Delivery

_POLL_S = 1.0  # how often a waiting caller checks that the scheduler thread is alive


class Channel:
    """Deliveries for one call's requests, put by the scheduler thread."""

    def __init__(
        self, alive: Callable[[], bool], loop: Optional[asyncio.AbstractEventLoop] = None
    ) -> None:
        self._alive = alive
        self._loop = loop
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: Optional[asyncio.Queue] = asyncio.Queue() if loop is not None else None

    def put(self, item: Delivery) -> bool:
        """False when the caller's event loop is gone (nobody will read this)."""
        if self._loop is None:
            self._sync.put(item)
            return True
        try:
            self._loop.call_soon_threadsafe(self._async.put_nowait, item)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def get(self) -> Delivery:
        while True:
            try:
                return self._sync.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive()

    async def aget(self) -> Delivery:
        while True:
            try:
                return await asyncio.wait_for(self._async.get(), _POLL_S)
            except TimeoutError:
                self._check_alive()

    def _check_alive(self) -> None:
        if not self._alive():
            raise RuntimeError("the engine's scheduler thread has stopped")
