"""--speculative-adaptive on CUDA (marked gpu; skipped without CUDA): switching between plain
decoding and every depth under real CUDA graphs (a verify graph per candidate width) is
lossless, and the measured cost model runs on CUDA timings."""

from __future__ import annotations

import pytest

from spec_engine import Engine
from tests.conftest import random_prompts
from tests.engine.test_adaptive_drafts import (  # noqa: F401  (fixtures)
    GREEDY,
    alternating,
    engine_args,
    models,
    verified,
)


def _run(path: str, prompts: list, **kwargs) -> tuple[list[list[int]], dict | None, dict]:
    params = [{**GREEDY, "max_new_tokens": 10 + 6 * i} for i in range(len(prompts))]
    with Engine(
        model_path=path,
        device="cuda",
        dtype="float32",
        attention_backend="torch_native",
        random_seed=0,
        max_running_requests=8,
        **kwargs,
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        report = engine.get_server_info()["internal_states"][0].get("spec_adaptive")
        shapes = getattr(engine.scheduler.worker, "shapes", {})
    return [o["output_ids"] for o in outs], report, shapes


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["eagle3", "mtp", "standalone"])
def test_cuda_adaptive_switching_under_real_graphs_is_lossless(
    models,  # noqa: F811
    name,
    alternating,  # noqa: F811
    verified,  # noqa: F811
):
    """The depth forced per step (plain stretches, every depth), captured sizes 1 3 8 with the
    self-check, the batch shrinking 8 -> 1: tokens equal plain eager decoding, and every verify
    replayed the graph of its depth's width."""
    path, kwargs = engine_args(models, name)
    prompts = random_prompts(8, 3, 25, seed=75)
    plain, _, _ = _run(path, prompts, disable_cuda_graph=True)
    outs, report, shapes = _run(
        path,
        prompts,
        speculative_adaptive=True,
        cuda_graph_bs=[1, 3, 8],
        cuda_graph_self_check=True,
        **kwargs,
    )
    assert outs == plain
    assert report["speculative_steps"] > 0 and report["plain_steps"] > 0
    assert {step["depth"] for step in verified} == set(shapes) and len(shapes) > 1
    assert all(step["graph"] == shapes[step["depth"]].draft_tokens for step in verified)


@pytest.mark.gpu
def test_cuda_adaptive_cost_model_runs_on_cuda_timings(models):  # noqa: F811
    """Unforced: the cost model measures CUDA steps (synchronized by the sampled tokens on the
    host) and chooses; whatever it chooses, the tokens are plain decoding's."""
    path, kwargs = engine_args(models, "eagle3")
    prompts = random_prompts(8, 3, 25, seed=76)
    plain, _, _ = _run(path, prompts, disable_cuda_graph=True)
    outs, report, _ = _run(path, prompts, speculative_adaptive=True, **kwargs)
    assert outs == plain
    assert report["plain_steps"] + report["speculative_steps"] > 0
    assert report["buckets"], report
    assert all(
        b["plain_s_per_req"] and b["plain_s_per_req"] > 0 for b in report["buckets"].values()
    )
