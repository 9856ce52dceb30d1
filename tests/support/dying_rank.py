"""A stand-in trainer rank for tests/e2e/test_fault_tolerance.py, in a module of its own so the Ray
workers that import it load nothing else: rank 1 dies, rank 0 would wait for it in a
collective."""

from __future__ import annotations

import os
import time


class Rank:
    def work(self, rank: int) -> int:
        if rank == 1:
            os._exit(1)
        time.sleep(60)
        return rank
