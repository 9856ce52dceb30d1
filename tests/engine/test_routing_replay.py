"""Routing replay (slime's R3): --enable-return-routed-experts and a request's
return_routed_experts give SGLang's meta_info.routed_experts, base64 of int32
[prompt + output - 1, num_hidden_layers, num_experts_per_tok]. The oracle is transformers'
Glm4MoeForCausalLM (and DeepseekV3ForCausalLM): its router's top-k ids (a forward hook on each
gate) over the same tokens, for plain decoding with graph emulation, MTP speculation, a
prefix-cache hit and the server."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from spec_engine import Engine
from tests.conftest import FAMILIES, random_prompts

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
GRAPHS = dict(cuda_graph_bs=[1, 2, 4], cuda_graph_self_check=True, max_running_requests=4)
SPEC = dict(
    speculative_algorithm="EAGLE",
    speculative_num_steps=3,
    speculative_eagle_topk=2,
    speculative_num_draft_tokens=4,
)
LAYERS, TOP_K, DENSE = 3, 2, 1  # the tiny GLM: layer 0 dense, layers 1-2 MoE with top-2 of 8


@pytest.fixture(scope="module")
def glm(make_model) -> str:
    return make_model(**FAMILIES["glm4_moe"])


def hf_router(path: str, layers: int, top_k: int):
    """tokens -> transformers' expert ids [len(tokens), layers, top_k] (dense layers 0), from a
    forward hook on each MoE layer's gate (GLM-4.5's and DeepSeek-V3's return the ids third)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(
                lambda _m, _inp, out, i=i: seen.__setitem__(i, out[2].reshape(-1, top_k))
            )

    def routing(tokens: list[int]) -> torch.Tensor:
        seen.clear()
        with torch.no_grad():
            model(torch.tensor([tokens], device="cpu"))
        out = torch.zeros(len(tokens), layers, top_k, dtype=torch.int32, device="cpu")
        for i, ids in seen.items():
            out[:, i] = ids.to(torch.int32)
        return out

    return routing


@pytest.fixture(scope="module")
def hf_routing(glm):
    return hf_router(glm, LAYERS, TOP_K)


def decode(out: dict) -> np.ndarray:
    """slime's decode (Sample: decode_int32_meta_array, then the reshape)."""
    raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return raw.reshape(-1, LAYERS, TOP_K)


def assert_routing(hf_routing, prompt: list[int], out: dict, start: int = 0) -> None:
    tokens = prompt + out["output_ids"]
    got = torch.from_numpy(decode(out).copy())
    assert got.shape == (len(tokens) - 1 - start, LAYERS, TOP_K)
    assert out["meta_info"]["routed_experts_start_len"] == start
    want = hf_routing(tokens[:-1])[start:]  # the last token was never forwarded (SGLang's rows)
    assert (got[:, :DENSE] == 0).all()
    # Top-k order is an implementation detail: compare each token's set of experts.
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)


def test_plain_decoding_with_graphs_matches_transformers(glm, hf_routing):
    prompts = random_prompts(3, 4, 20, seed=7)
    with Engine(
        model_path=glm, random_seed=0, enable_return_routed_experts=True, **GRAPHS
    ) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True
        )
        plain = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    for prompt, out in zip(prompts, outs):
        assert_routing(hf_routing, prompt, out)
    assert "routed_experts" not in plain["meta_info"]  # only when asked for


@pytest.mark.parametrize("algorithm", ["EAGLE", "STANDALONE"])
def test_speculation_reports_the_accepted_tokens(glm, hf_routing, algorithm):
    """EAGLE on GLM-4.5 drafts with its MTP layer (a MoE layer that must not report); the
    target drafting for itself accepts whole tree paths, whose routing moves with their KV."""
    prompts = random_prompts(3, 4, 20, seed=8)
    draft = {"speculative_draft_model_path": glm} if algorithm == "STANDALONE" else {}
    spec = {**SPEC, "speculative_algorithm": algorithm, **draft}
    with Engine(
        model_path=glm, random_seed=0, enable_return_routed_experts=True, **spec, **GRAPHS
    ) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params=GREEDY, return_routed_experts=True
        )
        counters = engine.scheduler.policy.counters
        accepted = counters.emitted - counters.verify_ct
    assert accepted > 0 or algorithm == "EAGLE"  # the tiny random MTP layer rarely guesses
    for prompt, out in zip(prompts, outs):
        assert_routing(hf_routing, prompt, out)


def test_prefix_cache_hit_reports_the_cached_tokens(glm, hf_routing):
    shared = random_prompts(1, 24, 24, seed=9)[0]
    first, second = shared + [11, 12], shared + [13]
    with Engine(model_path=glm, random_seed=0, enable_return_routed_experts=True) as engine:
        engine.generate(input_ids=first, sampling_params=GREEDY)
        out = engine.generate(input_ids=second, sampling_params=GREEDY, return_routed_experts=True)
        tail = engine.generate(
            input_ids=second,
            sampling_params=GREEDY,
            return_routed_experts=True,
            routed_experts_start_len=20,
        )
    assert out["meta_info"]["cached_tokens"] >= 16
    assert_routing(hf_routing, second, out)
    assert_routing(hf_routing, second, tail, start=20)


def test_refusals_name_the_fix(glm, make_model):
    with Engine(model_path=glm, random_seed=0) as engine:
        with pytest.raises(ValueError, match="--enable-return-routed-experts"):
            engine.generate(input_ids=[5, 6], return_routed_experts=True)
    dense = make_model(**FAMILIES["qwen2"])
    with Engine(model_path=dense, random_seed=0) as engine:
        with pytest.raises(ValueError, match="no MoE layers"):
            engine.generate(input_ids=[5, 6], return_routed_experts=True)
    with pytest.raises(ValueError, match="no MoE layers.*drop the flag"):
        Engine(model_path=dense, enable_return_routed_experts=True)


def test_server_returns_routed_experts(glm, hf_routing):
    from fastapi.testclient import TestClient

    from spec_engine.server.http_server import create_app

    prompt = [5, 9, 17, 33, 65]
    with Engine(model_path=glm, random_seed=0, enable_return_routed_experts=True) as engine:
        client = TestClient(create_app(engine))
        body = {"input_ids": prompt, "sampling_params": GREEDY, "return_routed_experts": True}
        out = client.post("/generate", json=body).json()
        bad = client.post("/generate", json={**body, "routed_experts_start_len": 99})
        assert client.get("/server_info").json()["enable_return_routed_experts"] is True
    assert_routing(hf_routing, prompt, out)
    assert (
        bad.status_code == 400 and "routed_experts_start_len 99" in bad.json()["error"]["message"]
    )


def test_deepseek_v3_reports_its_experts(tmp_path_factory):
    """The same hook serves DeepSeek-V3 (MLA, grouped top-k): its experts equal transformers'."""
    from tiny.checkpoints import build_checkpoint

    path = build_checkpoint(str(tmp_path_factory.mktemp("dsv3")), arch="deepseek_v3")
    config = AutoModelForCausalLM.from_pretrained(path).config
    layers, top_k = config.num_hidden_layers, config.num_experts_per_tok
    prompt = random_prompts(1, 6, 12, seed=3)[0]
    with Engine(
        model_path=path, skip_tokenizer_init=True, random_seed=0, enable_return_routed_experts=True
    ) as engine:
        out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_routed_experts=True)
    tokens = prompt + out["output_ids"]
    raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    got = torch.from_numpy(raw.reshape(-1, layers, top_k).copy())
    want = hf_router(path, layers, top_k)(tokens[:-1])
    assert got.shape == want.shape and (got[:, : config.first_k_dense_replace] == 0).all()
    assert torch.equal(got.sort(dim=-1).values, want.sort(dim=-1).values)
