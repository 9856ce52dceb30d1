"""Block-FP8 checkpoints in the engine (weights/fp8.py, dequantized at load): a tiny DeepSeek-V3
and a tiny Qwen3 written in DeepSeek-V3's FP8 release layout (tiny/releases.py: float8_e4m3fn
linears with float32 `weight_scale_inv` per 16 x 16 block, partial blocks at the edges, BF16
embeddings/heads/norms/routers/eh_proj, a float32 correction bias, two shards with a scale in
the other shard than its weight, DeepSeek's quantization_config) give transformers' greedy
tokens and log-probs when transformers runs the weights dequantized by DeepSeek's reference
formula (tests/support/fp8_reference.py); the loaded weights are that formula's bit for bit;
the FP8 next-n layer drafts losslessly; other quantizations and inconsistent FP8 files are
refused with the reason."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from spec_engine import Engine
from spec_engine.models.hf_config import ModelConfig
from spec_engine.weights.fp8 import dequantize, quantize
from spec_engine.weights.loader import checkpoint_metadata, hf_tensor, iterate_checkpoint
from tests.conftest import random_prompts
from tests.engine.test_engine_greedy import assert_matches_hf
from tests.support.fp8_reference import (
    dequantized_copy,
    dequantized_tensors,
    weight_dequant,
    weight_quant,
)
from tiny.releases import to_fp8_release

BLOCK = (16, 16)
GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
# q_lora_rank 40: q_a_proj's rows and q_b_proj's columns end in a partial block, as
# kv_a_proj_with_mqa's rows (kv_lora_rank + rope = 40) do, like DeepSeek-V3's 576.
MODELS = {
    "deepseek_v3": dict(
        arch="deepseek_v3",
        num_layers=2,
        extra_config={"num_nextn_predict_layers": 1, "q_lora_rank": 40},
    ),
    "qwen3": dict(arch="qwen3", head_dim=24, intermediate_size=120),
}


@pytest.fixture(scope="module")
def fp8(make_model, tmp_path_factory) -> dict[str, str]:
    return {
        name: to_fp8_release(make_model(**kw), str(tmp_path_factory.mktemp(f"{name}-fp8")), BLOCK)
        for name, kw in MODELS.items()
    }


@pytest.fixture(scope="module")
def oracle(fp8, tmp_path_factory) -> dict[str, str]:
    """fp8_cast_bf16.py's output (in float32) of each FP8 checkpoint: what transformers runs."""
    return {
        name: dequantized_copy(path, str(tmp_path_factory.mktemp(f"{name}-dequantized")))
        for name, path in fp8.items()
    }


def _run(path: str, prompts: list[list[int]], **kw) -> list[dict]:
    with Engine(model_path=path, random_seed=0, **kw) as engine:
        return engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)


def test_the_checkpoint_has_the_release_layout(fp8):
    path = fp8["deepseek_v3"]
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [16, 16],
    }
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    stored = {n: (s, d) for n, s, d in checkpoint_metadata(path, as_stored=True)}
    assert stored.keys() == weight_map.keys()
    assert len(set(weight_map.values())) == 2
    assert any(
        weight_map[n] != weight_map[n + "_scale_inv"] for n in stored if n + "_scale_inv" in stored
    )
    p = "model.layers.2."  # the next-n layer
    assert stored[p + "self_attn.kv_a_proj_with_mqa.weight"] == ((40, 64), "F8_E4M3")
    assert stored[p + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ((3, 4), "F32")
    assert stored[p + "self_attn.q_b_proj.weight_scale_inv"] == ((6, 3), "F32")
    assert stored[p + "mlp.experts.7.down_proj.weight"][1] == "F8_E4M3"
    assert stored[p + "mlp.shared_experts.up_proj.weight"][1] == "F8_E4M3"
    for bf16 in ("eh_proj", "enorm", "embed_tokens", "shared_head.head", "mlp.gate"):
        assert stored[f"{p}{bf16}.weight"][1] == "BF16", bf16
    assert stored[p + "mlp.gate.e_score_correction_bias"][1] == "F32"
    assert stored["model.embed_tokens.weight"][1] == stored["lm_head.weight"][1] == "BF16"
    # read dequantized: the weights as F32, the scales consumed
    read = {n: (s, d) for n, s, d in checkpoint_metadata(path)}
    assert read.keys() == {n for n in stored if not n.endswith("_scale_inv")}
    assert read[p + "self_attn.kv_a_proj_with_mqa.weight"] == ((40, 64), "F32")
    assert ModelConfig.from_pretrained(path).weight_block_size == BLOCK


@pytest.mark.parametrize("name", sorted(MODELS))
def test_read_weights_are_deepseeks_dequantization_bit_for_bit(fp8, name):
    reference = dequantized_tensors(fp8[name])
    read = dict(iterate_checkpoint(fp8[name]))
    assert read.keys() == reference.keys()
    for key, tensor in reference.items():
        assert read[key].dtype == tensor.dtype and torch.equal(read[key], tensor), key


def test_a_layer_is_read_without_the_rest(fp8):
    """What the next-n draft loads of the checkpoint: its layer, dequantized with its scales."""
    path = fp8["deepseek_v3"]
    reference = dequantized_tensors(path)

    def next_n(name: str) -> bool:
        return name.startswith("model.layers.2.")

    read = dict(iterate_checkpoint(path, next_n))
    assert read.keys() == {n for n in reference if next_n(n)}
    assert all(torch.equal(t, reference[n]) for n, t in read.items())


def test_quantize_and_dequantize_are_deepseeks_kernels():
    """Edge blocks cut short both ways, blocks of very different magnitudes."""
    g = torch.Generator().manual_seed(53)
    w = torch.randn(40, 70, generator=g) * torch.logspace(-4, 1, 70)
    q, s = quantize(w, (16, 16))
    ref_q, ref_s = weight_quant(w, 16)
    assert s.shape == (3, 5) and torch.equal(s, ref_s)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(dequantize(q, s, (16, 16)), weight_dequant(q, s, 16))
    assert (dequantize(q, s, (16, 16)) - w).abs().max() < 0.07 * w.abs().max()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_and_logprobs_equal_transformers_on_the_dequantized_weights(
    fp8, oracle, hf, name
):
    prompts = random_prompts(3, 3, 20, seed=51)
    with Engine(model_path=fp8[name], random_seed=0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        model = engine.runner.model
        reference = dequantized_tensors(fp8[name])
        for key in (
            "model.layers.0.self_attn.o_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
        ):
            if key in reference:  # the engine holds the reference's values (float32 on CPU)
                assert torch.equal(hf_tensor(model, key), reference[key]), key
    assert_matches_hf(hf, oracle[name], prompts, outs, GREEDY["max_new_tokens"])


def test_fp8_next_n_layer_drafts_losslessly(fp8):
    """Greedy NEXTN over the FP8 next-n layer equals plain decoding, and the draft holds that
    layer's weights as the reference dequantizes them."""
    path = fp8["deepseek_v3"]
    prompts = random_prompts(3, 3, 25, seed=52)
    plain = _run(path, prompts)
    with Engine(
        model_path=path,
        random_seed=0,
        speculative_algorithm="NEXTN",
        speculative_num_steps=2,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=3,
    ) as engine:
        spec = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        draft = engine.scheduler.worker.draft.model
        reference = dequantized_tensors(path)
        for key in ("self_attn.kv_b_proj.weight", "mlp.experts.3.up_proj.weight"):
            key = "model.layers.2." + key
            assert torch.equal(hf_tensor(draft, key), reference[key]), key
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    got = [lp for o in spec for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    ref = [lp for o in plain for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in spec)


def _edit(src: str, dst: str, config=None, tensors=None) -> str:
    """A copy of checkpoint `src` with its config and tensors (of every shard) edited."""
    shutil.copytree(src, dst)
    if config is not None:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        config(cfg)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f)
    if tensors is not None:
        for file in sorted(os.listdir(dst)):
            if file.endswith(".safetensors"):
                path = os.path.join(dst, file)
                t = load_file(path)
                tensors(t)
                save_file(t, path, metadata={"format": "pt"})
    return dst


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def _drop_scale(t):
    t.pop(O_PROJ + "_scale_inv", None)


def _bad_scale(t):
    if O_PROJ + "_scale_inv" in t:
        t[O_PROJ + "_scale_inv"] = t[O_PROJ + "_scale_inv"][:, :3].contiguous()


@pytest.mark.parametrize(
    "config, tensors, needle",
    [
        (lambda c: c.update(quantization_config={"quant_method": "awq"}), None, "'awq'"),
        (
            lambda c: c["quantization_config"].pop("weight_block_size"),
            None,
            "without weight_block_size",
        ),
        (lambda c: c["quantization_config"].update(fmt="e5m2"), None, "'e5m2'"),
        (lambda c: c.pop("quantization_config"), None, "no quantization_config"),
        (None, _drop_scale, "o_proj.weight_scale_inv' in the checkpoint"),
        (None, _bad_scale, r"has shape \(4, 3\), expected \(4, 6\)"),
        (lambda c: c["quantization_config"].update(weight_block_size=[32, 32]), None, "expected"),
    ],
    ids=["awq", "per_tensor", "e5m2", "no_config", "no_scale", "bad_scale", "wrong_block"],
)
def test_what_cannot_be_read_is_refused(fp8, tmp_path, config, tensors, needle):
    path = _edit(fp8["qwen3"], str(tmp_path / "edited"), config, tensors)
    with pytest.raises(ValueError, match=needle):
        Engine(model_path=path)
