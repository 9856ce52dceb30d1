"""Greedy outputs and log-probs equal transformers, for every supported family."""

from __future__ import annotations

import threading
import time

import pytest

from spec_engine import Engine
from tests.conftest import random_prompts
from tests.support.decode_steps import before_each_decode

LOGPROB_TOL = 1e-4


def assert_matches_hf(hf, path, prompts, outs, max_new_tokens):
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_logprobs = hf.greedy(path, prompt, max_new_tokens)
        assert out["output_ids"] == ref_tokens
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert [t for _, t, _ in out["meta_info"]["output_token_logprobs"]] == ref_tokens
        assert max(abs(a - b) for a, b in zip(got, ref_logprobs)) < LOGPROB_TOL


def test_batch_of_mixed_lengths_matches_transformers(family_path, hf):
    prompts = random_prompts(10, 1, 60, seed=1)
    with Engine(model_path=family_path, random_seed=0) as engine:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0.0, "max_new_tokens": 24},
            return_logprob=True,
        )
        report = engine.scheduler.memory_report()
    assert len(outs) == len(prompts)
    assert_matches_hf(hf, family_path, prompts, outs, 24)
    assert report["free"] + report["cached"] == report["total"]
    assert report["owned_by_requests"] == 0


def test_requests_arriving_while_others_run_match_transformers(llama_path, hf):
    first = random_prompts(4, 5, 30, seed=2)
    later = random_prompts(4, 5, 30, seed=3)
    params = {"temperature": 0.0, "max_new_tokens": 40}
    results = {}
    with Engine(model_path=llama_path, random_seed=0) as engine:
        decode_sizes = []
        before_each_decode(engine, lambda reqs: decode_sizes.append(len(reqs)))
        worker = threading.Thread(
            target=lambda: results.setdefault(
                "first",
                engine.generate(input_ids=first, sampling_params=params, return_logprob=True),
            )
        )
        worker.start()
        deadline = time.time() + 30
        while not engine.scheduler.running and time.time() < deadline:
            time.sleep(0.001)
        assert engine.scheduler.running, "the first batch never started"
        results["later"] = engine.generate(
            input_ids=later, sampling_params=params, return_logprob=True
        )
        worker.join()
    # The later requests joined the running batch: some decode steps ran all eight together.
    assert max(decode_sizes) == 8
    assert_matches_hf(hf, llama_path, first, results["first"], 40)
    assert_matches_hf(hf, llama_path, later, results["later"], 40)


def test_text_prompt_and_single_output_shape(llama_path, hf):
    with Engine(model_path=llama_path, random_seed=0) as engine:
        out = engine.generate(
            prompt="The cat runs to the house",
            sampling_params={"temperature": 0, "max_new_tokens": 8},
        )
        ids = engine.tokenizer("The cat runs to the house")["input_ids"]
    ref, _ = hf.greedy(llama_path, ids, 8)
    assert out["output_ids"] == ref
    assert out["text"] == engine.tokenizer.decode(ref, skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["weight_version"] == "default"
    assert "output_token_logprobs" not in meta


@pytest.mark.parametrize("variant", ["sharded", "linear_rope"])
def test_checkpoint_variants_match_transformers(make_model, hf, variant):
    if variant == "sharded":
        path = make_model("qwen3", head_dim=32, max_shard_size="60KB")
        import os

        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    else:
        path = make_model("qwen2", rope_scaling={"rope_type": "linear", "factor": 2.0})
    prompts = random_prompts(3, 4, 40, seed=4)
    with Engine(model_path=path, random_seed=0) as engine:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 0, "max_new_tokens": 12},
            return_logprob=True,
        )
    assert_matches_hf(hf, path, prompts, outs, 12)
