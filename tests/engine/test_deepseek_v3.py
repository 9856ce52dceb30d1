"""DeepSeek-V3 (models/deepseek_v3.py, deepseek_v3_nextn.py): MLA with the latent KV cache and
the MoE against transformers' DeepseekV3ForCausalLM (query bottleneck or none, YaRN with mscale,
a dense first layer), and its next-n layers as an MTP draft: greedy speculation is lossless
with one and two layers, a layer that imitates the target is accepted, and with
--enable-multi-layer-eagle draft step k runs layer k."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine import Engine
from spec_engine.attention import make_backend
from spec_engine.mem.kv_pool import MLAKVPool
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class, mtp_class
from spec_engine.speculative.adaptive.model import SpecCostModel
from spec_engine.weights.loader import weight_spec
from tests.conftest import random_prompts
from tests.engine.test_adaptive_drafts import verified  # noqa: F401  (fixture)
from tests.engine.test_engine_greedy import assert_matches_hf

GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
# Three trunk layers, the first dense (first_k_dense_replace=1): a query bottleneck with YaRN,
# or none with default rope; the MTP checkpoints carry 2 next-n layers (model.layers.3/4).
VARIANTS = {
    "q_lora_yarn": dict(num_layers=3, extra_config={"rope_scaling": YARN}),
    "no_q_lora": dict(num_layers=3, extra_config={"q_lora_rank": None}),
}
MTP = dict(num_layers=2, seed=5, extra_config={"num_nextn_predict_layers": 2})
CHAIN = dict(speculative_num_steps=2, speculative_eagle_topk=1)


@pytest.fixture(scope="session")
def variants(make_model) -> dict[str, str]:
    return {name: make_model("deepseek_v3", **kw) for name, kw in VARIANTS.items()}


@pytest.fixture(scope="session")
def mtp_model(make_model) -> str:
    return make_model("deepseek_v3", **MTP)


def _bigram(src: str, dst: str, good: tuple[bool, ...]) -> str:
    """A copy of `src` whose trunk adds nothing to the embedding (attention and MLP outputs
    zeroed), so the next token depends on the current one only, with next-n layer i made to
    imitate it where good[i] (its block zeroed, eh_proj passing the normed embedding, the
    target's final norm as shared_head.norm: it predicts the token after its input token) and
    left random elsewhere."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    w = load_file(path)
    n = ModelConfig.from_pretrained(src).num_hidden_layers
    for name, t in w.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        silent = name.endswith(("o_proj.weight", "down_proj.weight"))
        if layer is not None and silent and (layer < n or good[layer - n]):
            w[name] = torch.zeros_like(t)
    h = w["model.norm.weight"].shape[0]
    for i, ok in enumerate(good):
        if ok:
            p = f"model.layers.{n + i}."
            eye = torch.eye(h, dtype=torch.float32, device="cpu")
            w[p + "eh_proj.weight"] = torch.cat((eye, torch.zeros_like(eye)), dim=1)
            w[p + "enorm.weight"] = torch.ones(h, device="cpu")
            w[p + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    save_file(w, path, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def bigrams(mtp_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bigram")
    return {
        name: _bigram(mtp_model, str(root / name), good)
        for name, good in (("good_good", (True, True)), ("good_bad", (True, False)))
    }


def _run(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[dict], float]:
    with Engine(model_path=path, random_seed=0, **kwargs) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        info = engine.get_server_info()["internal_states"][0]
    return outs, info.get("avg_spec_accept_length", 1.0)


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["output_ids"] for o in outs]


def test_config_reads_mla_and_sizes_the_latent_cache(variants):
    c = ModelConfig.from_pretrained(variants["q_lora_yarn"])
    m = c.mla
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim) == (
        32,
        32,
        16,
        8,
    )
    assert (m.v_head_dim, m.cache_dim, c.num_key_value_heads, c.head_dim) == (16, 40, 1, 40)
    assert c.rope_scaling["rope_type"] == "yarn" and m.rope_interleave
    mscale = 0.1 * 0.7 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert m.softmax_scale == pytest.approx(24**-0.5 * mscale**2)
    assert c.kv_elements_per_token == 3 * 40  # latent + rope key per layer, no per-head K/V
    assert [c.moe.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert ModelConfig.from_pretrained(variants["no_q_lora"]).mla.q_lora_rank is None
    with pytest.raises(ValueError, match="torch_native"):
        make_backend("flashinfer", torch.device("cpu"), c, torch.float32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_tokens_and_logprobs_equal_transformers(variants, hf, variant):
    """Batched prefill and decode with CUDA-graph emulation (padding, self-check)."""
    path = variants[variant]
    prompts = random_prompts(4, 2, 30, seed=41)
    outs, _ = _run(path, prompts, cuda_graph_bs=[1, 2, 4], cuda_graph_self_check=True)
    assert_matches_hf(hf, path, prompts, outs, GREEDY["max_new_tokens"])


def test_deterministic_inference_runs_mla(variants, hf):
    path = variants["no_q_lora"]
    prompts = random_prompts(3, 2, 20, seed=42)
    outs, _ = _run(path, prompts, enable_deterministic_inference=True)
    assert_matches_hf(hf, path, prompts, outs, GREEDY["max_new_tokens"])
    alone, _ = _run(path, prompts[1:2], enable_deterministic_inference=True)
    assert (
        alone[0]["meta_info"]["output_token_logprobs"]
        == outs[1]["meta_info"]["output_token_logprobs"]
    )


def test_every_mtp_tensor_has_a_slot_and_the_pool_is_latent(mtp_model):
    config = ModelConfig.from_pretrained(mtp_model)
    names = set(load_file(os.path.join(mtp_model, "model.safetensors")))
    target = weight_spec(model_class(config)(config))
    assert names <= set(target)
    copies = {f"model.layers.{i}.{n}" for i in (2, 3) for n in ("embed_tokens.weight",)}
    copies |= {f"model.layers.{i}.shared_head.head.weight" for i in (2, 3)}
    assert copies <= names and all(target[n].param is None for n in copies)
    draft = weight_spec(mtp_class(config)(config, num_layers=2))
    mtp = {n for n in names if n.startswith(("model.layers.2.", "model.layers.3."))}
    assert set(draft) == mtp - copies
    with Engine(model_path=mtp_model, speculative_algorithm="EAGLE", **CHAIN) as engine:
        pool = engine.scheduler.worker.draft.kv_pool
        assert isinstance(pool, MLAKVPool) and isinstance(engine.runner.kv_pool, MLAKVPool)
        assert pool.k_buffer[0].shape[1:] == (1, 40) and len(pool.k_buffer) == 1


@pytest.mark.parametrize("multi_layer", [False, True], ids=["layer0", "multi_layer"])
def test_mtp_greedy_is_lossless(mtp_model, multi_layer):
    prompts = random_prompts(3, 3, 25, seed=43)
    plain, _ = _run(mtp_model, prompts)
    spec, _ = _run(
        mtp_model,
        prompts,
        speculative_algorithm="NEXTN",
        enable_multi_layer_eagle=multi_layer,
        **CHAIN,
    )
    assert _ids(spec) == _ids(plain)
    got = [lp for o in spec for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    ref = [lp for o in plain for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4


def test_step_k_runs_mtp_layer_k(bigrams):
    """Layer 0 imitates the target, layer 1 is random: with the flag the second draft token
    comes from layer 1 and is rejected (at most 2 tokens per verify); without it layer 0 drafts
    both and both are accepted (3). Two imitating layers reach 3 with the flag."""
    prompts = random_prompts(3, 3, 12, seed=44)
    plain, _ = _run(bigrams["good_bad"], prompts)
    spec = dict(speculative_algorithm="EAGLE", **CHAIN)
    layer0, accept0 = _run(bigrams["good_bad"], prompts, **spec)
    multi, accept_multi = _run(bigrams["good_bad"], prompts, enable_multi_layer_eagle=True, **spec)
    assert _ids(layer0) == _ids(multi) == _ids(plain)
    # 11 tokens after the prefill's: 3 per verify at best (2.75), 2 when only layer 0 is right.
    assert accept0 > 2.5 and accept_multi < 2.1
    both, accept_both = _run(bigrams["good_good"], prompts, enable_multi_layer_eagle=True, **spec)
    assert accept_both > 2.5 and _ids(both) == _ids(_run(bigrams["good_good"], prompts)[0])


def test_adaptive_plain_steps_keep_multi_layer_mtp_state(
    bigrams,
    monkeypatch,
    verified,  # noqa: F811
):
    """--speculative-adaptive switching every other step, between plain decoding and depths 2
    and 1: each plain step's draft extend leaves every layer's next-round level at the decoded
    position, so two imitating layers still have every draft of the chosen depth accepted in
    every verify (a stale level would be rejected)."""
    pattern = (2, 0, 1, 0)
    monkeypatch.setattr(
        SpecCostModel,
        "choose",
        lambda self, batch, catch_up=None: pattern[sum(self.decisions.values()) % len(pattern)],
    )
    prompts = random_prompts(3, 3, 12, seed=45)
    params = {**GREEDY, "max_new_tokens": 31}
    with Engine(model_path=bigrams["good_good"], random_seed=0) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params)
    spec = dict(speculative_algorithm="EAGLE", enable_multi_layer_eagle=True, **CHAIN)
    with Engine(
        model_path=bigrams["good_good"], random_seed=0, speculative_adaptive=True, **spec
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        report = engine.get_server_info()["internal_states"][0]["spec_adaptive"]
    assert _ids(outs) == _ids(plain)
    assert report["plain_steps"] > 0
    assert {step["depth"] for step in verified} == {1, 2}
    assert all(a == step["depth"] for step in verified for a in step["accepted"])


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
        ({"qk_rope_head_dim": 7}, "must be even"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0}}, "'longrope'"),
    ],
)
def test_config_refuses_what_is_not_run(variants, change, needle):
    cfg = ModelConfig.from_pretrained(variants["no_q_lora"]).hf_config
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**cfg, **change})


@pytest.mark.parametrize(
    "spec,needle",
    [
        (dict(speculative_num_steps=3, speculative_eagle_topk=1), "at most 2"),
        (
            dict(speculative_num_steps=2, speculative_eagle_topk=2, speculative_num_draft_tokens=4),
            "--speculative-eagle-topk 1",
        ),
    ],
)
def test_multi_layer_refusals(mtp_model, spec, needle):
    with pytest.raises(ValueError, match=needle):
        Engine(
            model_path=mtp_model,
            speculative_algorithm="EAGLE",
            enable_multi_layer_eagle=True,
            **spec,
        )
