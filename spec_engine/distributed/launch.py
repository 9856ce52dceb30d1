"""The ranks an engine starts beside its own.

Rank 0 stays in the caller's process: it keeps the Engine API and runs the scheduler thread.
Ranks 1..N-1 are processes it spawns (as SGLang's Engine spawns its scheduler processes), each
running the same engine on its shard and the same scheduler loop on what rank 0 broadcasts.
Rank 0 serves the engine's TCPStore (on `--dist-init-addr`, else a free loopback port); each
rank checks in on it before the process groups form, so a rank that dies while starting is
reported by number with its traceback instead of leaving the others waiting in a collective.

Over --nnodes machines (SGLang's multi-node engines) each node runs --tp-size / --nnodes ranks:
node r's process is global rank r * per_node and spawns the next per_node - 1. Node 0's
process is rank 0; another node's (`launch_server --node-rank r`) joins node 0's store at
--dist-init-addr, serves nothing and returns when rank 0 stops the engine. Ranks on other
nodes report ready or their startup traceback through the store (`ready/R`, `failed/R`), and
while they live they beat (`alive/R`, a counter every BEAT_S): node 0 has no process to watch
for them, so when a collective fails, a rank of another node whose beat stopped is the one
named as dead (`dead_rank`), as a dead local rank is by its exit code.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from spec_engine.distributed.parallel_state import TPGroup, connect

logger = logging.getLogger(__name__)

# A rank's target: target(payload, group, ready) builds its engine, calls ready(), then serves.
RankTarget = Callable[[Any, TPGroup, Callable[[], None]], None]
_POLL_S = 0.05
# A rank on another node adds to its `alive/R` counter this often; one whose counter stood still
# for STALE_S is taken for dead (its process or its node died).
BEAT_S = 0.5
STALE_S = 4 * BEAT_S


class RankFailed(RuntimeError):
    """A rank of the engine failed while starting (the message names it)."""


def rank_device(device: torch.device, base_gpu_id: int, rank: int) -> torch.device:
    """Rank `rank`'s device: GPU base_gpu_id + rank on CUDA (SGLang's gpu_id), else the CPU."""
    return torch.device("cuda", base_gpu_id + rank) if device.type == "cuda" else device


class Ranks:
    """The ranks of one engine this node spawns (beside this process's own rank, the node's
    first); `connect()` gives this process's group."""

    def __init__(
        self,
        target: RankTarget,
        payload: Any,
        size: int,
        device: torch.device,
        address: tuple[str, int] = ("127.0.0.1", 0),
        base_gpu_id: int = 0,
        timeout_s: Optional[int] = None,
        nnodes: int = 1,
        node_rank: int = 0,
    ) -> None:
        """`address`: where rank 0 serves the store (port 0: a free one, on one node only);
        `size` ranks over `nnodes` nodes, of which this is `node_rank`."""
        host, port = address
        self.size, self.device, self.base_gpu_id = size, device, base_gpu_id
        self.per_node = size // nnodes
        self.rank = node_rank * self.per_node  # this process's
        self.local = range(self.rank + 1, self.rank + self.per_node)  # spawned here
        self.timeout = timedelta(seconds=timeout_s) if timeout_s else None
        # Another node's client waits (up to the timeout) for node 0's store to come up.
        self.store = dist.TCPStore(
            host,
            port,
            size,
            is_master=node_rank == 0,
            wait_for_workers=False,
            timeout=self.timeout or timedelta(minutes=30),
        )
        ctx = multiprocessing.get_context("spawn")
        self._messages = ctx.Queue()
        threads = max(1, (os.cpu_count() or 1) // self.per_node)
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(target, payload, rank, size, host, self.store.port, device.type),
                kwargs=dict(
                    local_rank=rank - self.rank,
                    beats=node_rank > 0,
                    base_gpu_id=base_gpu_id,
                    timeout=self.timeout,
                    threads=threads,
                    messages=self._messages,
                ),
                name=f"spec-engine-tp{rank}",
                daemon=True,
            )
            for rank in self.local
        ]
        for p in self.procs:
            p.start()
        self._ready: set[int] = set()
        if node_rank > 0:
            beat(self.store, self.rank)

    def connect(self) -> TPGroup:
        """This process's group, once every rank has checked in on the store."""
        self.store.set(f"joined/{self.rank}", "1")
        deadline = self._deadline()
        for rank in range(self.size):
            while not self.store.check([f"joined/{rank}"]):
                self._raise_if_failed()
                self._raise_if_late(deadline, rank, "join")
                time.sleep(_POLL_S)
        return connect(self.store, self.rank, self.size, self.device, self.timeout)

    def _deadline(self) -> Optional[float]:
        """When waiting for ranks on other nodes gives up (--dist-timeout; none without it)."""
        return time.monotonic() + self.timeout.total_seconds() if self.timeout else None

    def _raise_if_late(self, deadline: Optional[float], rank: int, what: str) -> None:
        if deadline is not None and time.monotonic() > deadline:
            node = rank // self.per_node
            raise RankFailed(
                f"tensor-parallel rank {rank} (node {node}) did not {what} within "
                f"--dist-timeout {self.timeout.total_seconds():g} s; is node {node} running "
                f"(`launch_server --node-rank {node}` with the same --dist-init-addr)?"
            )

    def report_ready(self) -> None:
        """This process's rank has built its engine (for rank 0 on another node)."""
        self.store.set(f"ready/{self.rank}", "1")

    def report_failed(self, error: str) -> None:
        """This process's rank failed to start (for rank 0 on another node)."""
        with contextlib.suppress(Exception):  # the store may be gone: the error raised stands
            self.store.set(f"failed/{self.rank}", error)

    def wait_ready(self) -> None:
        """Wait until every other rank has built its engine; a rank's failure raises, naming
        it."""
        deadline = self._deadline()
        while len(self._ready) < self.size - 1:
            self._raise_if_failed(wait=_POLL_S)
            missing = min(set(range(self.size)) - self._ready - {self.rank}, default=self.rank)
            self._raise_if_late(deadline, missing, "start")

    def failure(self, grace_s: float = 5.0) -> Optional[str]:
        """Why a rank failed (its traceback, or its exit code), if one did within `grace_s`."""
        deadline = time.monotonic() + grace_s
        while True:
            try:
                self._raise_if_failed(wait=_POLL_S)
            except RankFailed as e:
                return str(e)
            if time.monotonic() > deadline:
                return None

    def _raise_if_failed(self, wait: float = 0.0) -> None:
        self._check_other_nodes()
        try:
            rank, error = self._messages.get(timeout=wait) if wait else self._messages.get_nowait()
        except queue.Empty:
            for rank, p in zip(self.local, self.procs):
                if p.exitcode is not None and rank not in self._ready:
                    raise RankFailed(
                        f"tensor-parallel rank {rank} exited with code {p.exitcode} while "
                        "starting, before it could report why (its output says; a script "
                        "that starts a tensor-parallel engine needs an `if __name__ == "
                        "'__main__':` guard, as every multiprocessing spawn does)"
                    ) from None
            return
        if error is not None:
            raise RankFailed(f"tensor-parallel rank {rank} failed to start:\n{error}")
        self._ready.add(rank)

    def _check_other_nodes(self) -> None:
        """Ranks on other nodes: ready, or failed (raises with their traceback)."""
        for rank in range(self.size):
            if rank // self.per_node == self.rank // self.per_node or rank in self._ready:
                continue
            if self.store.check([f"failed/{rank}"]):
                error = self.store.get(f"failed/{rank}").decode()
                raise RankFailed(
                    f"tensor-parallel rank {rank} (node {rank // self.per_node}) failed to "
                    f"start:\n{error}"
                )
            if self.store.check([f"ready/{rank}"]):
                self._ready.add(rank)

    def dead_rank(self, grace_s: float = 2.0) -> Optional[str]:
        """Which rank has died, waiting up to `grace_s` for one whose connections broke to be
        reaped: a local rank by number, pid and exit code; on rank 0, a rank of another node
        whose beat stopped for STALE_S (waiting that long) or that reported its failure. None if
        every rank lives."""
        remote = [r for r in range(self.size) if r // self.per_node != self.rank // self.per_node]
        remote = remote if self.rank == 0 else []
        start = time.monotonic()
        deadline = start + max(grace_s, STALE_S + 2 * _POLL_S if remote else 0.0)
        beats = {rank: (-1, start) for rank in remote}  # rank: (count, when it last moved)
        while True:
            now = time.monotonic()
            for rank, p in zip(self.local, self.procs):
                if p.exitcode is not None:
                    return (
                        f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    )
            for rank in remote:
                dead = self._remote_death(rank, beats, now)
                if dead is not None:
                    return dead
            if now > deadline:
                return None
            time.sleep(_POLL_S)

    def _remote_death(
        self, rank: int, beats: dict[int, tuple[int, float]], now: float
    ) -> Optional[str]:
        """Why rank `rank` of another node is dead (its reported failure, or a beat that stopped
        for STALE_S), else None; `beats` keeps its last count and when it moved."""
        node = rank // self.per_node
        try:
            if self.store.check([f"failed/{rank}"]):
                error = self.store.get(f"failed/{rank}").decode().strip().splitlines()
                return f"tensor-parallel rank {rank} (node {node}) failed: {error[-1]}"
            count = self.store.add(f"alive/{rank}", 0)
        except Exception:  # the store is rank 0's own: gone only at shutdown
            return None
        if count != beats[rank][0]:
            beats[rank] = (count, now)
        elif now - beats[rank][1] > STALE_S:
            return (
                f"tensor-parallel rank {rank} (node {node}) stopped answering: no beat through "
                f"the store for {STALE_S:g} s (its process or node {node} died)"
            )
        return None

    def stop(self, timeout_s: float = 30.0) -> None:
        """Wait for the ranks to exit (rank 0 has told them to), then end the ones that did not."""
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                logger.warning("tensor-parallel rank process %s did not exit; killing it", p.name)
                p.kill()
                p.join(5)
        self._messages.close()


def _rank_main(
    target: RankTarget,
    payload: Any,
    rank: int,
    size: int,
    host: str,
    port: int,
    device_type: str,
    *,
    local_rank: int,
    beats: bool,
    base_gpu_id: int,
    timeout: Optional[timedelta],
    threads: int,
    messages: Any,
) -> None:
    """A spawned rank: join the store and the groups, then run `target`; any failure goes to
    its node's first rank with its traceback (and to rank 0 through the store)."""
    store = None
    try:
        device = rank_device(torch.device(device_type), base_gpu_id, local_rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(threads)
        store = dist.TCPStore(
            host, port, size, is_master=False, timeout=timeout or timedelta(minutes=30)
        )
        store.set(f"joined/{rank}", "1")
        if beats:
            beat(store, rank)
        group = connect(store, rank, size, device, timeout)

        def ready() -> None:
            store.set(f"ready/{rank}", "1")
            messages.put((rank, None))

        target(payload, group, ready)
    except BaseException:
        error = traceback.format_exc()
        messages.put((rank, error))
        if store is not None:
            with contextlib.suppress(Exception):  # rank 0 may be gone: the store with it
                store.set(f"failed/{rank}", error)
        raise SystemExit(1) from None


def beat(store: Any, rank: int) -> None:
    """Add to rank `rank`'s `alive/R` counter every BEAT_S, in a daemon thread, while the
    process lives and the store answers (rank 0 watches it: Ranks.dead_rank)."""

    def run() -> None:
        with contextlib.suppress(Exception):  # the store gone: the engine stopped
            while True:
                store.add(f"alive/{rank}", 1)
                time.sleep(BEAT_S)

    threading.Thread(target=run, name=f"spec-engine-beat{rank}", daemon=True).start()
