"""A --custom-generate-function-path for tests/test_fault_tolerance.py (test-only, kept out of
the package): it kills the engine actor serving sample KILL_AT right after sending that sample's
request, as a crash of the engine's process would, once per run."""

from __future__ import annotations

import asyncio
from typing import Any

import ray

from rollout.generate import generate
from rollout.sample import Sample

KILL_AT = 1  # a sample of the first rollout (sample indices go on across rollouts)
_killed: set[int] = set()


async def generate_then_kill_engine(
    args: Any, sample: Sample, sampling_params: dict[str, Any], engine: Any
) -> Sample:
    if sample.index != KILL_AT or sample.index in _killed:
        return await generate(args, sample, sampling_params, engine)
    _killed.add(sample.index)  # the redone request must not kill again
    request = asyncio.ensure_future(generate(args, sample, sampling_params, engine))
    await asyncio.sleep(0)  # the request is on its way to the actor
    ray.kill(engine.handle.actor)  # engine: the routed Lease; handle: its RayEngineHandle
    return await request
