"""Stand-ins, in a module of its own so the Ray workers that import it load nothing else: a trainer
rank for tests/e2e/test_fault_tolerance.py (rank 1 dies, rank 0 would wait for it in a
collective), and an engine actor whose rank 1 fails while starting for
tests/rollout/test_rollout_ray.py."""

from __future__ import annotations

import os
import time


class Rank:
    def work(self, rank: int) -> int:
        if rank == 1:
            os._exit(1)
        time.sleep(60)
        return rank


class EngineFailsToStart:
    """An engine actor whose engine's rank 1 failed while starting (what Engine raises then)."""

    def __init__(self) -> None:
        from spec_engine.distributed.launch import RankFailed

        try:
            raise ValueError("no such file: model.safetensors")
        except ValueError as e:
            raise RankFailed(f"tensor-parallel rank 1 failed to start:\n{e!r}") from e

    def get_server_info(self) -> dict:
        return {}
