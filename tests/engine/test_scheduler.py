"""Continuous batching: concurrency, retraction, chunked prefill, prefix sharing, abort, limits."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spec_engine import Engine
from tests.conftest import random_prompts
from tests.support.decode_steps import before_each_decode

GREEDY = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}


def assert_memory_clean(engine: Engine) -> None:
    report = engine.scheduler.memory_report()
    assert report["owned_by_requests"] == 0
    assert report["free"] + report["cached"] == report["total"]
    assert engine.flush_cache()
    assert engine.scheduler.memory_report()["free"] == report["total"]


def test_64_concurrent_requests_with_mixed_params_complete(llama_path):
    prompts = random_prompts(64, 1, 80, seed=10)
    params = []
    for i in range(64):
        p = {"max_new_tokens": 8 + (i * 7) % 40}
        kind = i % 6
        if kind == 0:
            p["temperature"] = 0.0
        elif kind == 1:
            p.update(temperature=0.8, top_p=0.9)
        elif kind == 2:
            p.update(temperature=1.2, top_k=20)
        elif kind == 3:
            p.update(temperature=0.7, min_p=0.05, stop_token_ids=[7, 8, 9])
        elif kind == 4:
            p.update(temperature=1.0, stop=["e", "the"], ignore_eos=True)
        else:
            p.update(temperature=0.5, top_k=5, top_p=0.8, min_new_tokens=3)
        params.append(p)
    with Engine(model_path=llama_path, random_seed=1, max_running_requests=64) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert_memory_clean(engine)
    assert len(outs) == 64
    for p, out in zip(params, outs):
        meta = out["meta_info"]
        n = len(out["output_ids"])
        assert meta["finish_reason"]["type"] in ("length", "stop")
        assert n >= p.get("min_new_tokens", 1) and n <= p["max_new_tokens"]
        if meta["finish_reason"]["type"] == "length":
            assert n == p["max_new_tokens"]
        assert len(meta["output_token_logprobs"]) == n
        assert all(lp <= 0.0 for lp, _, _ in meta["output_token_logprobs"])


def test_retraction_under_small_kv_pool_gives_same_greedy_outputs(llama_path):
    prompts = random_prompts(24, 10, 40, seed=11)
    params = {**GREEDY, "max_new_tokens": 48}
    with Engine(model_path=llama_path, random_seed=0) as engine:
        ample = engine.generate(input_ids=prompts, sampling_params=params)
        assert engine.scheduler.retraction.num_retractions == 0
    # 24 requests need ~1800 KV tokens at once; 300 forces admission limits and retractions.
    with Engine(model_path=llama_path, random_seed=0, max_total_tokens=300) as engine:
        tight = engine.generate(input_ids=prompts, sampling_params=params)
        assert engine.scheduler.retraction.num_retractions > 0
        assert_memory_clean(engine)
    assert [o["output_ids"] for o in tight] == [o["output_ids"] for o in ample]


def test_retraction_keeps_sampled_outputs_reproducible(llama_path):
    prompts = random_prompts(12, 10, 30, seed=12)
    params = {"temperature": 1.0, "top_p": 0.95, "max_new_tokens": 40, "ignore_eos": True}
    with Engine(model_path=llama_path, random_seed=5) as engine:
        ample = engine.generate(input_ids=prompts, sampling_params=params)
    with Engine(model_path=llama_path, random_seed=5, max_total_tokens=200) as engine:
        tight = engine.generate(input_ids=prompts, sampling_params=params)
        assert engine.scheduler.retraction.num_retractions > 0
    assert [o["output_ids"] for o in tight] == [o["output_ids"] for o in ample]


def test_chunked_prefill_matches_unchunked(llama_path, hf):
    prompts = random_prompts(5, 50, 120, seed=13)
    with Engine(model_path=llama_path, random_seed=0, chunked_prefill_size=16) as engine:
        chunk_sizes = []
        prefill = engine.scheduler.worker.prefill
        engine.scheduler.worker.prefill = lambda reqs: (
            chunk_sizes.append(sum(r.extend_len for r in reqs)) or prefill(reqs)
        )
        outs = engine.generate(
            input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 12}, return_logprob=True
        )
        assert_memory_clean(engine)
    assert max(chunk_sizes) <= 16
    for prompt, out in zip(prompts, outs):
        ref, ref_lp = hf.greedy(llama_path, prompt, 12)
        assert out["output_ids"] == ref
        assert (
            max(
                abs(a - b)
                for (a, _, _), b in zip(out["meta_info"]["output_token_logprobs"], ref_lp)
            )
            < 1e-4
        )


def test_n_samples_share_the_prompt_kv(llama_path):
    prompt = random_prompts(1, 64, 64, seed=14)[0]
    params = {
        "temperature": 1.0,
        "max_new_tokens": 6,
        "n": 8,
        "ignore_eos": True,
        "sampling_seed": 3,
    }
    with Engine(model_path=llama_path, random_seed=0, max_total_tokens=4096) as engine:
        peak = []

        def tracking_decode(reqs):
            r = engine.scheduler.memory_report()
            peak.append(r["total"] - r["free"])

        before_each_decode(engine, tracking_decode)
        shared = engine.generate(input_ids=prompt, sampling_params=params)
        tree_after = engine.scheduler.memory_report()["cached"]
    with Engine(model_path=llama_path, random_seed=0, disable_radix_cache=True) as engine:
        unshared = engine.generate(input_ids=prompt, sampling_params=params)
    assert len(shared) == 8
    # The prompt (64 tokens) is stored once: the 7 later samples find 63 of its tokens cached,
    # and KV in use never exceeds one prompt plus each sample's own tokens.
    assert sorted(o["meta_info"]["cached_tokens"] for o in shared) == [0] + [63] * 7
    assert max(peak) <= 64 + 8 * (1 + 6)
    assert tree_after <= 64 + 8 * 6
    assert [o["output_ids"] for o in shared] == [o["output_ids"] for o in unshared]
    assert len({tuple(o["output_ids"]) for o in shared}) > 1


def test_abort_by_rid_ends_request_and_frees_memory(llama_path):
    with Engine(model_path=llama_path, random_seed=0) as engine:
        results = {}
        t = threading.Thread(
            target=lambda: results.setdefault(
                "out",
                engine.generate(
                    input_ids=[5, 6, 7],
                    sampling_params={"max_new_tokens": 400, "ignore_eos": True},
                    rid="victim",
                ),
            )
        )
        t.start()
        deadline = time.time() + 30
        while not engine.scheduler.running and time.time() < deadline:
            time.sleep(0.001)
        engine.abort_request("victim")
        t.join(timeout=30)
        out = results["out"]
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(out["output_ids"]) < 400
        assert out["meta_info"]["id"] == "victim"
        assert_memory_clean(engine)
        # The engine keeps serving.
        assert (
            len(
                engine.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3})[
                    "output_ids"
                ]
            )
            <= 3
        )


def test_max_running_requests_is_respected(llama_path):
    with Engine(model_path=llama_path, random_seed=0, max_running_requests=3) as engine:
        sizes = []
        before_each_decode(engine, lambda reqs: sizes.append(len(reqs)))
        outs = engine.generate(input_ids=random_prompts(10, 3, 10, seed=15), sampling_params=GREEDY)
    assert max(sizes) == 3
    assert all(len(o["output_ids"]) == 32 for o in outs)


@pytest.mark.parametrize(
    "options",
    [{"page_size": 4}, {"page_size": 4, "chunked_prefill_size": 8}, {"disable_radix_cache": True}],
)
def test_memory_options_keep_greedy_outputs(llama_path, hf, options):
    prompts = random_prompts(6, 3, 40, seed=16)
    prompts.append(prompts[0] + [9, 10, 11])  # shares a prefix with the first prompt
    with Engine(model_path=llama_path, random_seed=0, **options) as engine:
        first = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
        again = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 10})
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        assert_memory_clean(engine)
    for prompt, out in zip(prompts, first):
        assert out["output_ids"] == hf.greedy(llama_path, prompt, 10)[0]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in first]
    if options.get("disable_radix_cache"):
        assert cached == [0] * len(prompts)
    else:
        page = options["page_size"]
        assert cached == [(len(p) - 1) // page * page for p in prompts]


def test_stop_conditions(llama_path, hf):
    prompt = random_prompts(1, 8, 8, seed=17)[0]
    plain = {"temperature": 0.0, "max_new_tokens": 20}
    with Engine(model_path=llama_path, random_seed=0) as engine:
        eos = engine.tokenizer.eos_token_id
        assert eos in engine.scheduler.outputs.eos_token_ids
        free = engine.generate(input_ids=prompt, sampling_params={**plain, "ignore_eos": True})
        ids, text = free["output_ids"], free["text"]
        # stop_token_ids: the first occurrence ends the output (the token is kept, its text
        # dropped).
        stop_id = ids[4]
        out = engine.generate(
            input_ids=prompt, sampling_params={**plain, "stop_token_ids": [stop_id]}
        )
        cut = ids[: ids.index(stop_id) + 1]
        assert out["output_ids"] == cut
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
        assert out["text"] == engine.tokenizer.decode(cut[:-1], skip_special_tokens=True)
        # As in SGLang, ignore_eos ignores stop_token_ids too.
        out = engine.generate(
            input_ids=prompt,
            sampling_params={**plain, "stop_token_ids": [stop_id], "ignore_eos": True},
        )
        assert out["output_ids"] == ids
        # Before min_new_tokens, stop tokens (and EOS) are never drawn; the log-probs stay the
        # model's.
        first = ids[0]
        out = engine.generate(
            input_ids=prompt,
            return_logprob=True,
            sampling_params={**plain, "stop_token_ids": [first], "min_new_tokens": 3},
        )
        assert first not in out["output_ids"][:3] and eos not in out["output_ids"][:3]
        assert out["output_ids"][0] != first
        model_logprobs = torch.log_softmax(hf.next_token_logits(llama_path, prompt), -1)
        assert (
            abs(
                out["meta_info"]["output_token_logprobs"][0][0]
                - model_logprobs[out["output_ids"][0]].item()
            )
            < 1e-4
        )
        # A stop string cuts the text before it; no_stop_trim keeps it.
        stop_str = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop_str.strip()
        out = engine.generate(
            input_ids=prompt, sampling_params={**plain, "stop": stop_str, "ignore_eos": True}
        )
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_str}
        assert out["text"] == text[: text.find(stop_str)]
        kept = engine.generate(
            input_ids=prompt,
            sampling_params={**plain, "stop": [stop_str], "no_stop_trim": True, "ignore_eos": True},
        )
        assert stop_str in kept["text"]
        # Streaming never shows text that the final output trims.
        chunks = list(
            engine.generate(
                input_ids=prompt,
                stream=True,
                sampling_params={**plain, "stop": stop_str, "ignore_eos": True},
            )
        )
        assert all(out["text"].startswith(c["text"]) for c in chunks)
        assert chunks[-1]["text"] == out["text"]


def test_sampling_is_reproducible_and_batch_invariant(llama_path):
    prompts = random_prompts(6, 5, 20, seed=18)
    params = {"temperature": 0.9, "top_k": 50, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=llama_path, random_seed=7) as engine:
        together = engine.generate(input_ids=prompts, sampling_params=params)
    with Engine(model_path=llama_path, random_seed=7) as engine:
        again = engine.generate(input_ids=prompts, sampling_params=params)
        alone = [
            engine.generate(input_ids=p, sampling_params={**params, "sampling_seed": 11})
            for p in prompts[:2]
        ]
        batched = engine.generate(
            input_ids=prompts[:2], sampling_params={**params, "sampling_seed": 11}
        )
    with Engine(model_path=llama_path, random_seed=8) as engine:
        other_seed = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in together]
    assert [o["output_ids"] for o in alone] == [o["output_ids"] for o in batched]
    assert [o["output_ids"] for o in other_seed] != [o["output_ids"] for o in together]


def test_chunked_prefill_under_a_tight_pool_never_overcommits(llama_path, hf):
    """The rest of a chunked prompt is reserved, so later admissions cannot take its KV."""
    prompts = [list(range(5, 45)), list(range(100, 130)), list(range(200, 236))]
    params = [
        {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 1, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    ]
    with Engine(
        model_path=llama_path, random_seed=0, max_total_tokens=64, chunked_prefill_size=16
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_memory_clean(engine)
    for prompt, p, out in zip(prompts, params, outs):
        assert out["output_ids"] == hf.greedy(llama_path, prompt, p["max_new_tokens"])[0]
