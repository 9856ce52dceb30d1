"""CUDA checks of what landed after the fifth lease (marked gpu; skipped without CUDA): a step's
inputs in one pinned copy (mem/upload.py), the overlap scheduler on by default, FP8 release
checkpoints on the GPU (dequantized at load, as on CPU), and speculative steps that never
synchronize the device (stage times from CUDA events)."""

from __future__ import annotations

import pytest
import torch

from spec_engine import Engine
from spec_engine.mem.upload import upload
from tests.conftest import random_prompts
from tests.engine.test_engine_greedy import assert_matches_hf
from tests.engine.test_fp8_checkpoints import GREEDY, fp8, oracle  # noqa: F401  (fixtures)
from tests.engine.test_speculative import models  # noqa: F401  (module fixture)

CUDA = torch.device("cuda")


@pytest.mark.gpu
def test_cuda_upload_sends_every_part_from_pinned_memory():
    parts = [([1, 2**40, -3], torch.int64), ([0.25, 3.0], torch.float32), ([], torch.int64)]
    parts += [([True, False], torch.bool), ([1 / 3], torch.float64)]
    # Uploads in a row, each overwriting nothing still in flight (the pinned cache's events).
    sent = [upload(CUDA, *parts) for _ in range(64)]
    torch.cuda.synchronize()
    for got in sent:
        for (values, dtype), tensor in zip(parts, got):
            assert tensor.device.type == "cuda" and tensor.dtype == dtype
            assert tensor.cpu().tolist() == torch.tensor(values, dtype=dtype).tolist()


@pytest.mark.gpu
def test_cuda_overlapped_plain_decoding_equals_step_by_step(llama_path):
    """The default (overlap on) against --disable-overlap-schedule: greedy and seeded sampled
    tokens and log-probs equal."""
    prompts = random_prompts(16, 3, 40, seed=61)
    runs = {}
    for disable in (False, True):
        with Engine(
            model_path=llama_path, device="cuda", random_seed=0, disable_overlap_schedule=disable
        ) as engine:
            greedy = engine.generate(
                input_ids=prompts,
                sampling_params={"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
                return_logprob=True,
            )
            sampled = engine.generate(
                input_ids=prompts,
                sampling_params={"temperature": 0.8, "top_k": 30, "max_new_tokens": 24},
                return_logprob=True,
            )
        runs[disable] = [
            (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
            for o in greedy + sampled
        ]
    assert runs[False] == runs[True]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["deepseek_v3", "qwen3"])
def test_cuda_fp8_release_matches_transformers_on_the_dequantized_weights(fp8, oracle, hf, name):  # noqa: F811
    prompts = random_prompts(4, 3, 30, seed=62)
    with Engine(model_path=fp8[name], device="cuda", dtype="float32", random_seed=0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
    assert_matches_hf(hf, oracle[name], prompts, outs, GREEDY["max_new_tokens"])


@pytest.mark.gpu
def test_cuda_speculative_tree_steps_never_synchronize_and_time_their_stages(models, monkeypatch):  # noqa: F811
    """An EAGLE-3 tree engine's decode steps call no torch.cuda.synchronize (each reads the device
    once, at its end); the stage breakdown comes from events, positive for every stage."""
    with Engine(
        model_path=models["target"],
        device="cuda",
        random_seed=0,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=models["eagle3"],
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    ) as engine:
        prompts = random_prompts(8, 3, 30, seed=63)
        params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
        engine.generate(input_ids=prompts, sampling_params=params)  # graphs captured
        synced = []
        real = torch.cuda.synchronize
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: synced.append(a) or real())
        engine.generate(input_ids=prompts, sampling_params=params)
        monkeypatch.setattr(torch.cuda, "synchronize", real)
        breakdown = engine.get_server_info()["internal_states"][0]["spec_time_breakdown"]
    assert synced == []
    assert all(breakdown[k] > 0 for k in ("draft_s", "verify_s", "bookkeeping_s")), breakdown
