"""CUDA checks (marked gpu; skipped without CUDA): the torch_native path on a GPU."""

from __future__ import annotations

import pytest

from spec_engine import Engine
from tests.conftest import random_prompts


@pytest.mark.gpu
def test_cuda_float32_greedy_matches_transformers(family_path, hf):
    prompts = random_prompts(6, 3, 50, seed=30)
    with Engine(model_path=family_path, device="cuda", dtype="float32", random_seed=0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16},
                               return_logprob=True)
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf.greedy(family_path, prompt, 16)
        assert out["output_ids"] == ref
        assert max(abs(a - b) for (a, _, _), b in zip(out["meta_info"]["output_token_logprobs"], ref_lp)) < 1e-3


@pytest.mark.gpu
def test_cuda_bfloat16_runs_and_agrees_mostly(llama_path, hf):
    prompts = random_prompts(8, 3, 30, seed=31)
    with Engine(model_path=llama_path, device="cuda", random_seed=0) as engine:
        assert engine.args.dtype == "bfloat16"
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 8})
    agree = sum(o["output_ids"][0] == hf.greedy(llama_path, p, 1)[0][0] for p, o in zip(prompts, outs))
    assert agree >= 6
