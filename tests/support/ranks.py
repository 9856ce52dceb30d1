"""Spawning a test's torch.distributed ranks without each importing torch and megatron anew."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# What every rank imports: a fork server imports it once (the first time a test starts ranks) and
# forks each rank from there; spawned, every rank spent seconds of CPU importing it again.
PRELOAD = ["torch", "megatron.core", "trainer_bridge.actor", "trainer_bridge.megatron_compat"]


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each rank forked from a clean server
    process that has PRELOAD imported: a fork of the test process itself would inherit its
    threads (OpenMP's, gloo's) and crash."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
