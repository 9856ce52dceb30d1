"""--custom-generate-function-path functions for tests/e2e/test_fault_tolerance.py and
tests/e2e/test_engine_tp_loop.py (test-only, kept out of the package): right after sending a given
sample's request, once per run, kill the engine actor serving it (as a crash of its process
would), stop its process (SIGSTOP: hung, not dead), or kill one tensor-parallel rank of it."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import ray

from rollout.generate import generate
from rollout.sample import Sample

KILL_AT = 1  # a sample of the first rollout (sample indices go on across rollouts)
HANG_AT = KILL_AT + 8  # a sample of the second rollout (2 prompts x 4 samples a rollout)
_killed: set[int] = set()


async def generate_then_kill_then_hang_engine(
    args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any
) -> Sample:
    """Both faults in one run: kills the engine serving sample KILL_AT (rollout 0), then stops
    the one serving sample HANG_AT (rollout 1)."""
    if sample.index in _killed or sample.index not in (KILL_AT, HANG_AT):
        return await generate(args, sample, sampling_params, engine)
    fault = _kill if sample.index == KILL_AT else _hang
    return await fault(args, sample, sampling_params, engine)


async def _kill(args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any) -> Sample:
    _killed.add(sample.index)  # the redone request must not kill again
    request = asyncio.ensure_future(generate(args, sample, sampling_params, engine))
    await asyncio.sleep(0)  # the request is on its way to the actor
    ray.kill(engine.handle.actor)  # engine: the routed Lease; handle: its RayEngineHandle
    return await request


async def _hang(args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any) -> Sample:
    _killed.add(sample.index)
    actor = engine.handle.actor
    pid = await actor.__ray_call__.remote(lambda self: os.getpid())
    request = asyncio.ensure_future(generate(args, sample, sampling_params, engine))
    await asyncio.sleep(0)
    os.kill(pid, signal.SIGSTOP)  # the launcher's health check must notice; ray.kill ends it
    return await request


RANK_KILL_AT = 9  # a sample of the second rollout, after the first weight push


async def generate_then_kill_rank_1(
    args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any
) -> Sample:
    """Right after sending sample RANK_KILL_AT's request, once per run, kill tensor-parallel
    rank 1 of the engine serving it (a process the engine's actor spawned), as a crash would."""
    if sample.index != RANK_KILL_AT or sample.index in _killed:
        return await generate(args, sample, sampling_params, engine)
    _killed.add(sample.index)
    actor = engine.handle.actor
    ranks = await actor.__ray_call__.remote(
        lambda self: [p.pid for p in __import__("multiprocessing").active_children()]
    )
    assert len(ranks) == 1, ranks  # a tp-2 engine: rank 0 in the actor, rank 1 its child
    request = asyncio.ensure_future(generate(args, sample, sampling_params, engine))
    await asyncio.sleep(0)
    os.kill(ranks[0], signal.SIGKILL)
    return await request
