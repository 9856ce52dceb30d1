"""The caller's side of one generate call: the Channel that brings its requests' deliveries
from the scheduler thread (to a thread blocked in Engine.generate, or an event loop awaiting
Engine.async_generate), and the Collector that turns them into the call's results."""

from __future__ import annotations

import asyncio
import logging
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Optional, Union

from spec_engine.core.outputs import Delivery, RequestOutput

logger = logging.getLogger(__name__)
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


class Collector:
    """One call's results, shared by the sync and async paths: the outputs its requests
    delivered so far, how many are still running, and the abort of those left unfinished when
    the caller stops early (a stream closed, an await cancelled, an error)."""

    def __init__(
        self,
        outputs: list[RequestOutput],
        single: bool,
        channel: Channel,
        abort: Callable[[str], None],
    ) -> None:
        self.outputs = outputs
        self.single = single  # one prompt, one request: the result is a dict, not a list
        self.pending = len(outputs)
        self._channel = channel
        self._abort = abort

    def wait(self) -> Union[dict, list[dict]]:
        """Block until every request finished; their output dicts."""
        try:
            while self.pending:
                self._add(self._channel.get())
        finally:
            self.abort_unfinished()
        return self.results()

    async def await_all(self) -> Union[dict, list[dict]]:
        try:
            while self.pending:
                self._add(await self._channel.aget())
        finally:
            self.abort_unfinished()
        return self.results()

    def stream(self) -> Iterator[dict]:
        """Each delivery's cumulative output dict (batch items carry "index")."""
        try:
            while self.pending:
                yield self._snapshot(self._channel.get())
        finally:
            self.abort_unfinished()

    async def astream(self) -> AsyncIterator[dict]:
        try:
            while self.pending:
                yield self._snapshot(await self._channel.aget())
        finally:
            self.abort_unfinished()

    def results(self) -> Union[dict, list[dict]]:
        results = [out.to_dict() for out in self.outputs]
        return results[0] if self.single else results

    def abort_unfinished(self) -> None:
        """Stop the work of the requests nobody waits for any more."""
        if self.pending:
            for out in self.outputs:
                if not out.finished:
                    # As SGLang logs a disconnected client's request: one line per request.
                    logger.info("request %s aborted: its caller stopped waiting", out.req.input.rid)
                    self._abort(out.req.input.rid)

    def _add(self, delivery: Delivery) -> RequestOutput:
        out = self.outputs[delivery.index]
        out.add(delivery)
        self.pending -= delivery.finished
        return out

    def _snapshot(self, delivery: Delivery) -> dict:
        return self._add(delivery).to_dict(None if self.single else delivery.index)
