"""The long-tailed tiny task (rollout.tiny_task): its lengths follow the documented Pareto
distribution, the task file carries them, and its generate function limits each response to its
prompt's length; bench/long_tail.py's summary of a run."""

from __future__ import annotations

import asyncio
import json

import pytest

from bench.long_tail import summarize, table
from rollout import tiny_task
from rollout.sample import Sample


def test_lengths_are_long_tailed():
    lengths = tiny_task.long_tail_lengths(4096)
    assert min(lengths) == tiny_task.LONG_TAIL_SCALE and max(lengths) == tiny_task.LONG_TAIL_MAX
    # Pareto(4, 1.2): P(L >= k) = (4 / k) ** 1.2 below the cap
    for k in (8, 32):
        share = sum(n >= k for n in lengths) / len(lengths)
        assert share == pytest.approx((4 / k) ** 1.2, abs=0.02), k
    assert sorted(lengths)[len(lengths) // 2] <= 7  # the median short, the tail 10x longer


def test_the_task_file_carries_each_prompts_length(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    path = tmp_path / "task.jsonl"
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tiny_task.write_tiny_task(str(path), tokenizer, n=64, long_tail=True)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    lengths = [r["metadata"]["max_new_tokens"] for r in records]
    assert lengths == tiny_task.long_tail_lengths(64)


@pytest.mark.parametrize(("cap", "want"), [(64, 37), (16, 16), (None, 37)])
def test_generate_limits_a_response_to_its_prompts_length(monkeypatch, cap, want):
    seen = {}

    async def default_generate(args, sample, sampling_params, engine):
        seen.update(sampling_params)
        return sample

    monkeypatch.setattr(tiny_task, "generate", default_generate)
    sample = Sample(prompt="copy: b", tokens=[1, 2], metadata={"max_new_tokens": 37})
    params = {"temperature": 1.0} | ({} if cap is None else {"max_new_tokens": cap})
    asyncio.run(tiny_task.long_tail_generate(None, sample, params, engine=None))
    assert seen == {"temperature": 1.0, "max_new_tokens": want}


def test_the_bench_summary():
    rows = [
        {"perf/step_time": 10.0, "rollout/raw_reward": 0.0, "rollout/weight_version_lag/max": 0},
        {"perf/step_time": 2.0, "rollout/raw_reward": 0.5, "rollout/weight_version_lag/max": 1},
        {"perf/step_time": 4.0, "rollout/raw_reward": 1.0, "rollout/weight_version_lag/max": 1},
    ]
    got = summarize(rows)
    assert got["wall_per_rollout_s"] == got["wall_median_s"] == 3.0  # rollout 0 left out
    assert (got["reward_first_third"], got["reward_last_third"], got["lag_max"]) == (0, 1, 1)
    assert table({"sync/fixed": got}).splitlines()[2].startswith("| sync/fixed | 3 |")
