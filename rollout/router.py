"""Router: spreads requests over engine handles, fewest outstanding requests first.

An engine handle is anything with `async_generate(**kwargs) -> dict` and
`abort_request(rid)` (sync or async): an in-process `spec_engine.Engine`, or a
`rollout.engine_actor.RayEngineHandle`. Every request goes out under a lease that carries its
rid, so the router can abort whatever is still in flight.

A handle whose engine is gone raises `EngineDied`. With a `restart_engine` callback installed
(the launcher's --use-fault-tolerance), the router has the engine replaced, once however many
requests it held, and sends each of those requests again (same rid, same sampling params and
seed) to a live engine; requests that had finished are not touched. Without one, the error
propagates.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

from rollout.loader import call_maybe_async

logger = logging.getLogger(__name__)


class RequestAborted(Exception):
    """The lease was aborted before its request reached the engine."""


class EngineDied(Exception):
    """An engine's process is gone (its actor died or was killed): the requests it held are
    lost, and every later call to it fails the same way."""

    def __init__(self, index: Optional[int], reason: str) -> None:
        where = "an engine" if index is None else f"engine {index}"
        super().__init__(f"{where} died ({reason})")
        self.index = index
        self.reason = reason


# (engine index, the error that showed it dead) -> a live handle in its place; raises to give up.
RestartFn = Callable[[int, EngineDied], Awaitable[Any]]


class Lease:
    """One request's hold on an engine: `async_generate` sends with the lease's rid. Its engine
    may change: a request whose engine died is sent again elsewhere (see Router)."""

    def __init__(
        self, handle: Any, engine_index: int, rid: str, router: Optional[Router] = None
    ) -> None:
        self.handle = handle
        self.engine_index = engine_index
        self.rid = rid
        self.aborted = False
        self.router = router

    async def async_generate(self, **kwargs: Any) -> Any:
        if self.aborted:
            raise RequestAborted(f"request {self.rid} was aborted before it was sent")
        if kwargs.setdefault("rid", self.rid) != self.rid:
            raise ValueError(
                f"rid {kwargs['rid']!r} given to a routed engine whose lease is {self.rid!r}; "
                "leave rid out so the router can abort the request"
            )
        while True:
            handle = self.handle
            try:
                return await handle.async_generate(**kwargs)
            except asyncio.CancelledError:
                # A cancelled await does not stop a Ray actor call: tell the engine.
                await self.abort_request(self.rid)
                raise
            except EngineDied as died:
                if self.router is None or self.router.restart_engine is None:
                    raise
                # Same kwargs (rid, sampling params, sampling_seed): the redone request
                # samples what the lost one would have.
                await self.router.replace_dead(self.engine_index, handle, died)
                if self.aborted:
                    raise RequestAborted(
                        f"request {self.rid} was aborted while its engine restarted"
                    ) from died
                self.router.move(self)
                self.router.requests_redone += 1

    async def abort_request(self, rid: str) -> None:
        try:
            await call_maybe_async(self.handle.abort_request, rid)
        except EngineDied:
            pass  # a dead engine holds no request to abort


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
        # Set by the launcher to replace dead engines; None: an EngineDied fails the request.
        self.restart_engine: Optional[RestartFn] = None
        self.requests_redone = 0  # requests sent again after their engine died
        # engine index -> (the dead handle, its replacement in progress or done)
        self._restarts: dict[int, tuple[Any, asyncio.Future]] = {}

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
            lease = Lease(self.engines[index], index, rid, self)
            self._leases[rid] = lease
            self.outstanding[index] += 1
        try:
            yield lease
        finally:
            with self._lock:
                del self._leases[rid]
                self.outstanding[lease.engine_index] -= 1  # where the lease ended up

    def move(self, lease: Lease) -> None:
        """Give `lease` the least busy engine (after its own died and was replaced)."""
        with self._lock:
            self.outstanding[lease.engine_index] -= 1
            index = self._pick()
            self.outstanding[index] += 1
            lease.handle, lease.engine_index = self.engines[index], index

    async def replace_dead(self, index: int, dead: Any, error: EngineDied) -> None:
        """Return once engine `index`, found dead behind handle `dead`, has a live replacement.
        Every request the engine held fails at once; the first starts the restart and the others
        wait for that same one. Raises what the restart raised (e.g. past the restart limit)."""
        if self.restart_engine is None:
            raise error
        if self.engines[index] is not dead:
            return  # replaced already, by a request that failed earlier
        entry = self._restarts.get(index)
        if entry is None or entry[0] is not dead:
            logger.warning("%s; restarting it", error)
            entry = (dead, asyncio.ensure_future(self._replace(index, error)))
            self._restarts[index] = entry
        # Shielded: one waiter cancelled (its group failed) must not stop the others' restart.
        await asyncio.shield(entry[1])

    async def _replace(self, index: int, error: EngineDied) -> None:
        assert self.restart_engine is not None
        handle = await self.restart_engine(index, error)
        with self._lock:
            self.engines[index] = handle

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
