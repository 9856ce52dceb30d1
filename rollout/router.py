"""Router: spreads requests over engine handles, fewest outstanding requests first.

An engine handle is anything with `async_generate(**kwargs) -> dict` and
`abort_request(rid)` (sync or async): an in-process `spec_engine.Engine`, or a
`rollout.engine_actor.RayEngineHandle`. Every request goes out under a lease that carries its
rid, so the router can abort whatever is still in flight.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rollout.loader import call_maybe_async


class RequestAborted(Exception):
    """The lease was aborted before its request reached the engine."""


class Lease:
    """One request's hold on an engine: `async_generate` sends with the lease's rid."""

    def __init__(self, handle: Any, engine_index: int, rid: str) -> None:
        self.handle = handle
        self.engine_index = engine_index
        self.rid = rid
        self.aborted = False

    async def async_generate(self, **kwargs: Any) -> Any:
        if self.aborted:
            raise RequestAborted(f"request {self.rid} was aborted before it was sent")
        if kwargs.setdefault("rid", self.rid) != self.rid:
            raise ValueError(
                f"rid {kwargs['rid']!r} given to a routed engine whose lease is {self.rid!r}; "
                "leave rid out so the router can abort the request"
            )
        try:
            return await self.handle.async_generate(**kwargs)
        except asyncio.CancelledError:
            # A cancelled await does not stop a Ray actor call: tell the engine.
            await self.abort_request(self.rid)
            raise

    async def abort_request(self, rid: str) -> None:
        await call_maybe_async(self.handle.abort_request, rid)


class Router:
    """Least-outstanding-requests routing over engine handles; ties go round robin."""

    def __init__(self, engines: Sequence[Any]) -> None:
        if not engines:
            raise ValueError("the router needs at least one engine handle")
        self.engines = list(engines)
        self.outstanding = [0] * len(self.engines)
        self._leases: dict[str, Lease] = {}
        self._next = 0  # where the round-robin tie-break starts
        # Leases are taken from the event loop, but a launcher may also route from threads.
        self._lock = threading.Lock()

    def choose(self) -> int:
        """Index of the engine with the fewest outstanding requests (ties: round robin)."""
        with self._lock:
            return self._pick()

    def _pick(self) -> int:
        n = len(self.engines)
        order = [(self._next + k) % n for k in range(n)]
        best = min(order, key=lambda i: self.outstanding[i])
        self._next = (best + 1) % n
        return best

    @contextmanager
    def lease(self, rid: str) -> Iterator[Lease]:
        """Hold an engine for one request (counted as outstanding until the block exits)."""
        with self._lock:
            if rid in self._leases:
                raise ValueError(f"rid {rid!r} is already in flight; rids must be unique")
            index = self._pick()
            lease = Lease(self.engines[index], index, rid)
            self._leases[rid] = lease
            self.outstanding[index] += 1
        try:
            yield lease
        finally:
            with self._lock:
                del self._leases[rid]
                self.outstanding[index] -= 1

    @property
    def in_flight(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    async def abort_all(self, rid_prefix: str = "") -> int:
        """Abort every request in flight whose rid starts with `rid_prefix`; returns how many."""
        with self._lock:
            leases = [lease for rid, lease in self._leases.items() if rid.startswith(rid_prefix)]
        for lease in leases:
            lease.aborted = True
            await lease.abort_request(lease.rid)
        return len(leases)
