"""A short run of bench/soak.py (docs/reliability.md has the minute-long one): 64 concurrent
mixed clients and three weight updates on a speculative engine lose nothing."""

from __future__ import annotations

import asyncio

from bench.soak import soak


def test_soak_loses_nothing():
    report = asyncio.run(soak(seconds=8, concurrency=64, weight_updates=3))
    assert report.weight_updates == 3 and report.requests > 64
    assert report.aborted_by_client > 0 and report.completed > report.requests // 2
    assert report.lost == 0 and report.mismatches == [] and report.kv_used_at_end == 0
