"""The scheduler loop: every call into an engine runs on one thread, between steps.

Calls from the outside (generate, abort, flush, weight updates) are posted to the loop through a
queue (`_post`), and their results come back in futures. At --tp-size N the engine is N ranks
(SGLang's SPMD scheduler): rank 0 runs this loop in a thread of the caller's process, ranks
1..N-1 in their own processes (distributed.launch). What changes scheduler state is posted as a
`Command` (the engine's method at a path and its arguments, no closure); every iteration rank 0
broadcasts the Commands it took from its queue (distributed.broadcast.broadcast_pyobj, SGLang's
per-iteration broadcast of requests), so every rank runs them in the same order and then the
same step. Read-only calls (reports) are closures and run on rank 0 alone. An idle rank 0
broadcasts an empty list every HEARTBEAT_S, so a rank that died is noticed within seconds, not at
the next request.

A failed step or a failed broadcast at tp > 1 ends the engine: the ranks may have left their
collectives at different points, and no later step could be trusted. Every request and call in
flight fails with a message naming the rank that died, when one did.
"""

from __future__ import annotations

import concurrent.futures
import logging
import operator
import queue
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Optional, Union

import torch

from spec_engine.distributed.broadcast import broadcast_pyobj

logger = logging.getLogger(__name__)

# How often an idle rank 0 tells the other ranks it is alive (an empty broadcast).
HEARTBEAT_S = 2.0


class Command(NamedTuple):
    """A change to scheduler state that every rank makes: the engine's method at `path`
    ("scheduler.abort") called with `args`, all picklable."""

    path: str
    args: tuple = ()


STOP = Command("stop")
# The path of a submission (Engine._add_requests): it only queues requests.
SUBMIT = "_add_requests"
# What the other ranks run when rank 0 drains its step in flight for a closure (a report): a
# drain reads and processes a step, which every rank must do at the same point.
DRAIN = Command("scheduler.drain")


def _drains(commands: Iterable[Any]) -> bool:
    """Whether these commands (or closures) first drain the step in flight: all but
    submissions do."""
    return any(getattr(command, "path", None) != SUBMIT for command in commands)


class SchedulerLoop:
    """Needs Engine's scheduler, memory, tp (its TPGroup), _ranks (rank 0's distributed.launch
    Ranks at tp > 1, else None), _lock and _cuda_index."""

    def _start_scheduler_thread(self) -> None:
        """The thread that runs the scheduler and every command posted to it (see _loop)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: set[str] = set()  # rids of requests not finished yet
        self._closed = False
        self._stopped_by: Optional[str] = None  # why the loop ended on its own
        self._thread = threading.Thread(
            target=self._loop, name="spec-engine-scheduler", daemon=True
        )
        self._thread.start()

    def _post(self, fn: Union[Callable[[], Any], Command]) -> concurrent.futures.Future:
        """Run fn on the scheduler thread between steps (a Command: on every rank); its result
        (rank 0's) comes back in the future. A closure runs on rank 0 alone: it must only read."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(self._closed_message())
            self._inbox.put((fn, future))
        return future

    @property
    def stopped_by(self) -> Optional[str]:
        """Why the engine stopped on its own (a tensor-parallel rank died); None while it runs
        or after a shutdown."""
        return self._stopped_by

    def _closed_message(self) -> str:
        return "engine is shut down" + (f": {self._stopped_by}" if self._stopped_by else "")

    def _call(self, fn: Union[Callable[[], Any], Command]) -> Any:
        return self._post(fn).result()

    def _post_command(self, path: str, *args: Any) -> concurrent.futures.Future:
        return self._post(Command(path, args))

    def _call_command(self, path: str, *args: Any) -> Any:
        """Run the engine's method at `path` on every rank; rank 0's result."""
        return self._post(Command(path, args)).result()

    def _loop(self) -> None:
        """The scheduler loop, rank 0's in its thread and every other rank's in its process."""
        if self._cuda_index is not None:
            # This thread's CUDA calls (IPC handles of colocated pushes among them) must target
            # the engine's device, not the thread's default device 0.
            torch.cuda.set_device(self._cuda_index)
        while True:
            try:
                items = self._next_commands()
                if items is None or not self._run_commands(items):
                    return
                if self._can_step():
                    self.scheduler.step()
            except Exception as e:
                if self.tp.size > 1:
                    self._lose_ranks([], e)
                    return
                logger.exception("engine step failed; failing the requests in flight")
                try:
                    self.scheduler.fail_all(f"engine error: {e!r}")
                except Exception:  # keep the thread alive: callers poll it
                    logger.exception("failing the requests in flight failed too")

    def _can_step(self) -> bool:
        return self.memory.generation_allowed and self.scheduler.has_work()

    def _next_commands(self) -> Optional[list[tuple[Any, Any]]]:
        """This iteration's commands: rank 0 takes what is queued (waiting when idle) and
        broadcasts the Commands among it; another rank receives them. None: the engine's
        ranks are no longer all there, and this loop ends."""
        if self.tp.rank > 0:
            try:
                return [(c, None) for c in broadcast_pyobj([], self.tp)]
            except Exception as e:
                # Kept for the process: a rank whose rank 0 vanished exits with an error.
                self._stopped_by = f"tensor-parallel rank 0 is gone ({e})"
                logger.error("%s; rank %d exits", self._stopped_by, self.tp.rank)
                return None
        items = self._take_queued()
        if self.tp.size > 1:
            commands = [c for c, _ in items if isinstance(c, Command)]
            if _drains(c for c, _ in items) and not _drains(commands):
                commands.append(DRAIN)  # a closure drains rank 0: every rank drains alike
            try:
                broadcast_pyobj(commands, self.tp)
            except Exception as e:
                self._lose_ranks(items, e)
                return None
        return items

    def _take_queued(self) -> list[tuple[Any, Any]]:
        """Everything queued; when idle, wait for the first (at tp > 1 at most HEARTBEAT_S)."""
        idle = not self._can_step()
        try:
            items = [self._inbox.get(idle, HEARTBEAT_S if idle and self.tp.size > 1 else None)]
        except queue.Empty:
            return []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _run_commands(self, items: list[tuple[Any, Any]]) -> bool:
        """Run the commands in order; False once shut down. Every command but a submission
        first sees the decode step in flight read and processed (core/overlap.py): it finds
        the state a step-by-step scheduler leaves."""
        if _drains(c for c, _ in items):
            self.scheduler.drain()
        for command, future in items:
            if command == STOP:
                self.scheduler.abort_all("engine shut down")
                return False
            try:
                if isinstance(command, Command):
                    result = operator.attrgetter(command.path)(self)(*command.args)
                else:
                    result = command()
            except Exception as e:  # handed to the caller through the future
                if future is None:
                    logger.debug("command %s failed on rank %d: %r", command.path, self.tp.rank, e)
                else:
                    future.set_exception(e)
            else:
                if future is not None:
                    future.set_result(result)
        return True

    def _lose_ranks(self, items: list[tuple[Any, Any]], error: Exception) -> None:
        """A step or a broadcast failed at tp > 1 (on rank 0: most likely another rank died):
        fail every request and call in flight, naming the dead rank, and stop."""
        dead = self._ranks.dead_rank() if self._ranks is not None else None
        if dead is not None:
            message = f"{dead}; the engine stopped ({error!r})"
        else:
            message = f"tensor-parallel rank {self.tp.rank} failed a step: {error!r}"
        logger.error("%s; the engine stops", message)
        with self._lock:
            self._closed = True
            self._stopped_by = message
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        try:
            self.scheduler.fail_all(message)
        except Exception:  # the collectives are gone; the requests are failed all the same
            logger.exception("failing the requests in flight failed too")
        for _, future in items:
            if future is not None:
                future.set_exception(RuntimeError(message))
