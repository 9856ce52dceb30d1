"""Fresh processes for tests, forked from one server process that has torch, megatron and the
engine imported: spawned, each process spent seconds of CPU importing them again."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp

# What the processes import; the server imports it once (the first time a test asks for it).
PRELOAD = [
    "torch",
    "megatron.core",
    "trainer_bridge.actor",
    "trainer_bridge.megatron_compat",
    "spec_engine",
    "spec_engine.distributed.launch",
    "bench.isolate",
    "spec_engine.launch_server",
    "uvicorn",
]


def context() -> BaseContext:
    """A multiprocessing context whose processes are forked from that server: a new process each,
    as spawned ones, that starts with PRELOAD imported and nothing of the test process (a fork
    of the test process itself inherits its threads, OpenMP's and gloo's, and crashed)."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    return multiprocessing.get_context("forkserver")


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each rank started from the server."""
    context()
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")


@contextlib.contextmanager
def instead_of_spawn(module: ModuleType) -> Iterator[None]:
    """While open, the processes `module` starts with multiprocessing.get_context("spawn") (its
    only use of multiprocessing) start from the server."""
    ctx = context()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "multiprocessing", SimpleNamespace(get_context=lambda _: ctx))
        yield
