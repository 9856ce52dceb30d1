"""GLM-4.5 (Glm4MoeForCausalLM): config reading, the MoE block against transformers' own, and the
engine's greedy tokens and log-probs against transformers with CUDA-graph emulation, NGRAM
speculation, weight updates by name, bfloat16 and device discipline. (Plain batched decoding of
both GLM variants is in test_engine_greedy via FAMILIES.)"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

import spec_engine.layers.moe as moe_module
from spec_engine import Engine
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.registry import model_class
from spec_engine.weights.loader import load_checkpoint, tensor_checksum, weight_spec
from tests.conftest import FAMILIES, random_prompts
from tests.engine.test_engine_greedy import assert_matches_hf
from tests.support.device_guard import DeviceGuard, guarded_engine_threads

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
GRAPHS = dict(cuda_graph_bs=[1, 2, 4], cuda_graph_self_check=True, max_running_requests=4)


@pytest.fixture(scope="module")
def glm(make_model) -> str:
    """GLM-4.5 tiny: q/k norm, partial rotary, 1 dense + 2 MoE layers, one MTP layer."""
    return make_model(**FAMILIES["glm4_moe"])


@pytest.fixture(scope="module")
def glm_no_qk_norm(make_model) -> str:
    return make_model(**FAMILIES["glm4_moe_no_qk_norm"])


def _outputs(engine: Engine, prompts: list[list[int]]) -> list[dict]:
    return engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)


def test_config_reads_the_glm_fields(glm, glm_no_qk_norm):
    c = ModelConfig.from_pretrained(glm)
    assert (c.family, c.qkv_bias, c.o_bias, c.qk_norm) == ("glm4_moe", True, False, True)
    assert (c.head_dim, c.rotary_dim, c.num_mtp_layers) == (32, 16, 1)
    m = c.moe
    assert (m.num_experts, m.top_k, m.n_group, m.topk_group, m.num_shared_experts) == (
        8,
        2,
        2,
        1,
        1,
    )
    assert (m.routed_scaling_factor, m.first_k_dense_replace, m.intermediate_size) == (2.5, 1, 32)
    assert [m.is_moe_layer(i) for i in range(3)] == [False, True, True]
    d = ModelConfig.from_pretrained(glm_no_qk_norm)
    assert not d.qk_norm and not d.moe.norm_topk_prob and d.rotary_dim == 8
    assert d.num_mtp_layers == 0


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"n_group": 3}, "must split into n_group=3"),
        ({"topk_group": 3}, "topk_group=3 must be in"),
        ({"num_experts_per_tok": 5}, "exceeds the experts of topk_group=1"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3}}, "odd number"),
    ],
)
def test_config_refuses_what_the_router_cannot_run(glm, change, needle):
    cfg = ModelConfig.from_pretrained(glm).hf_config
    with pytest.raises(ValueError, match=needle):
        ModelConfig.from_dict({**cfg, **change})


def _moe_pair(path: str, layer: int):
    """(transformers' Glm4MoeMoE of `layer`, the engine's SparseMoE of it), same weights."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = ModelConfig.from_pretrained(path)
    ours = model_class(config)(config)
    load_checkpoint(ours, path)
    return hf.model.layers[layer].mlp, ours.model.layers[layer].mlp


@pytest.mark.parametrize("capturing", [False, True], ids=["sparse", "dense"])
def test_moe_block_equals_transformers(glm, glm_no_qk_norm, monkeypatch, capturing):
    # The dense path is the one graph capture takes; here it is forced.
    monkeypatch.setattr(moe_module, "_capturing", lambda x: capturing)
    for path in (glm, glm_no_qk_norm):
        ref, ours = _moe_pair(path, 1)
        x = torch.randn(37, ref.config.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            _, ref_w, ref_ids = ref.gate(x)
            weights, ids = ours.gate(x)
            order, ref_order = ids.sort(-1), ref_ids.sort(-1)
            assert order.values.equal(ref_order.values)
            assert torch.allclose(
                weights.gather(1, order.indices), ref_w.gather(1, ref_order.indices), atol=1e-6
            )
            assert torch.allclose(ours(x), ref(x), atol=1e-5)


def test_router_stays_float32_in_a_bfloat16_model(glm):
    config = ModelConfig.from_pretrained(glm)
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.w13_weight.dtype == torch.bfloat16


def test_every_checkpoint_tensor_is_named_and_mtp_layers_are_accepted(glm):
    names = set(load_file(os.path.join(glm, "model.safetensors")))
    config = ModelConfig.from_pretrained(glm)
    model = model_class(config)(config)
    spec = weight_spec(model)
    assert names <= set(spec)
    mtp = {n for n in names if n.startswith("model.layers.3.")}
    assert "model.layers.3.eh_proj.weight" in mtp and "model.layers.3.mlp.gate.weight" in mtp
    assert all(spec[n].param is None and spec[n].optional for n in mtp)


@pytest.mark.parametrize("variant", ["glm4_moe", "glm4_moe_no_qk_norm"])
def test_graphs_and_ngram_match_transformers(make_model, hf, variant):
    """CUDA-graph emulation with padding and the capture self-check (the MoE's dense path),
    and NGRAM speculation over the same graphs: tokens and log-probs equal transformers'."""
    path = make_model(**FAMILIES[variant])
    prompts = random_prompts(4, 2, 30, seed=11)
    # Repetitive prompts give NGRAM matches to draft from.
    prompts += [p * 3 for p in random_prompts(2, 3, 6, seed=12)]
    with Engine(model_path=path, random_seed=0, **GRAPHS) as engine:
        graphed = _outputs(engine, prompts)
    assert_matches_hf(hf, path, prompts, graphed, GREEDY["max_new_tokens"])
    with Engine(
        model_path=path,
        random_seed=0,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,
        **GRAPHS,
    ) as engine:
        spec = _outputs(engine, prompts)
        accepted = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    assert_matches_hf(hf, path, prompts, spec, GREEDY["max_new_tokens"])
    assert accepted > 1.0


def test_weight_updates_by_name_reach_experts_and_router(make_model):
    old, new = (make_model(**{**FAMILIES["glm4_moe_no_qk_norm"], "seed": s}) for s in (21, 22))
    tensors = load_file(os.path.join(new, "model.safetensors"))
    assert any(".experts.5.down_proj" in n for n in tensors)
    assert any("e_score_correction_bias" in n for n in tensors)
    prompts = random_prompts(3, 3, 20, seed=13)
    with Engine(model_path=new, random_seed=0) as engine:
        expected = [o["output_ids"] for o in _outputs(engine, prompts)]
    with Engine(model_path=old, random_seed=0, **GRAPHS) as engine:
        assert [o["output_ids"] for o in _outputs(engine, prompts)] != expected
        result = engine.update_weights_from_tensor(list(tensors.items()), weight_version="v2")
        assert result["success"]
        assert [o["output_ids"] for o in _outputs(engine, prompts)] == expected
        sums = engine.get_weights_checksum()
        assert sums == {n: tensor_checksum(t) for n, t in tensors.items()}


def test_engine_names_every_device_and_runs_bfloat16(glm):
    prompts = random_prompts(3, 5, 12, seed=14)
    guard = DeviceGuard()
    with guarded_engine_threads(guard):
        with Engine(
            model_path=glm,
            random_seed=0,
            speculative_algorithm="NGRAM",
            speculative_num_draft_tokens=4,
            **GRAPHS,
        ) as engine:
            _outputs(engine, prompts)
    assert not guard.violations, "\n".join(guard.violations)
    with Engine(model_path=glm, random_seed=0, dtype="bfloat16", **GRAPHS) as engine:
        outs = _outputs(engine, prompts)
        gate = engine.runner.model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
    assert all(lp <= 0.0 for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"])
