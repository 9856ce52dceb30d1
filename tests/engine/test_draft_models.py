"""Draft models follow SGLang's checkpoint formats: their first draft level after a prefill equals
a reference built from transformers' decoder layers, rotary embeddings and norms, wired the way
the formats specify (EAGLE-2, EAGLE-3, MiMo MTP)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

from spec_engine import Engine
from tiny.checkpoints import add_mimo_mtp, build_eagle_draft

PROMPT = [17, 240, 33, 91, 5, 402, 77, 12, 300, 45, 8]
TOPK = 3


def engine_first_level(path: str, **spec) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(draft probs, target ids) of the engine's first draft level after prefilling PROMPT, and the
    output."""
    with Engine(
        model_path=path,
        random_seed=0,
        skip_tokenizer_init=True,
        speculative_eagle_topk=TOPK,
        speculative_num_steps=2,
        speculative_num_draft_tokens=4,
        **spec,
    ) as engine:
        worker = engine.scheduler.worker
        states = []
        prefill = worker.prefill

        def capture(reqs):
            result = prefill(reqs)
            states.extend(r.spec_state for r in reqs)
            return result

        worker.prefill = capture
        out = engine.generate(
            input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": 1}
        )
        layers = list(engine.runner.model.model.capture_layers)
    return states[0].probs, states[0].ids, out["output_ids"], layers


def target_states(hf, path):
    """Target hidden states of PROMPT (transformers), and its greedy next token."""
    with torch.no_grad():
        out = hf.model(path)(torch.tensor([PROMPT]), output_hidden_states=True)
    return out.hidden_states, int(out.logits[0, -1].argmax())


def load_layer(layer: torch.nn.Module, weights: dict, prefix: str) -> None:
    """Load `prefix.*` tensors into a transformers module; every module tensor must be found."""
    own = layer.state_dict()
    state = {
        k[len(prefix) :]: v
        for k, v in weights.items()
        if k.startswith(prefix) and k[len(prefix) :] in own
    }
    missing, _ = layer.load_state_dict(state, strict=False)
    assert all("input_layernorm" in m for m in missing), missing


def rotary(config, n):
    rope = LlamaRotaryEmbedding(config)
    return rope(torch.zeros(1, n, config.hidden_size), torch.arange(n)[None])


def hf_config(path: str, cls=LlamaConfig):
    config = cls.from_pretrained(path)
    config._attn_implementation = "sdpa"
    return config


def assert_first_level(
    ref_logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor, to_target=None
):
    ref_p, ref_ids = torch.softmax(ref_logits, -1).topk(TOPK)
    if to_target is not None:
        ref_ids = to_target[ref_ids]
    assert ids.tolist() == ref_ids.tolist()
    assert torch.allclose(probs, ref_p, atol=1e-5)


def test_eagle2_format(make_model, hf, tmp_path):
    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(str(tmp_path / "eagle"), target, version=2, num_layers=2)
    probs, ids, out, _ = engine_first_level(
        target, speculative_algorithm="EAGLE", speculative_draft_model_path=draft
    )
    hidden, nxt = target_states(hf, target)
    assert out == [nxt]
    w = load_file(os.path.join(draft, "model.safetensors"))
    embed = hf.model(target).model.embed_tokens.weight
    config = hf_config(draft)
    n = len(PROMPT)
    with torch.no_grad():
        # fc over [embedding of the next token, target feature (post final norm)] at positions
        # 0..n-1.
        x = F.linear(
            torch.cat((embed[PROMPT[1:] + [nxt]], hidden[-1][0]), -1), w["fc.weight"], w["fc.bias"]
        )[None]
        cos_sin = rotary(config, n)
        for i in range(2):
            layer = LlamaDecoderLayer(config, i)
            load_layer(layer, w, f"layers.{i}.")
            if i == 0:
                layer.input_layernorm = torch.nn.Identity()  # EAGLE's first layer has no input norm
            x = layer(x, position_embeddings=cos_sin)
        # No final norm: the target's head reads the layer output directly.
        logits = hf.model(target).lm_head(x[0, -1])
    assert_first_level(logits, probs, ids)


def test_eagle3_format(make_model, hf, tmp_path):
    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(
        str(tmp_path / "eagle3"), target, version=3, draft_vocab_size=96, aux_layer_ids=[0, 1, 2]
    )
    probs, ids, out, layers = engine_first_level(
        target, speculative_algorithm="EAGLE3", speculative_draft_model_path=draft
    )
    assert layers == [1, 2, 3]  # the outputs of layers 0, 1, 2
    hidden, nxt = target_states(hf, target)
    w = load_file(os.path.join(draft, "model.safetensors"))
    embed = hf.model(target).model.embed_tokens.weight
    config = hf_config(draft)
    n, heads, kv_heads = len(PROMPT), config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads

    def norm(name, x):
        layer = LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        layer.weight.data = w[name]
        return layer(x)

    with torch.no_grad():
        # transformers' hidden_states[i] is the residual stream entering layer i.
        feature = F.linear(torch.cat([hidden[i][0] for i in (1, 2, 3)], -1), w["fc.weight"])
        x = torch.cat(
            (
                norm("midlayer.input_layernorm.weight", embed[PROMPT[1:] + [nxt]]),
                norm("midlayer.hidden_norm.weight", feature),
            ),
            -1,
        )
        q = (
            F.linear(x, w["midlayer.self_attn.q_proj.weight"])
            .view(n, heads, head_dim)
            .transpose(0, 1)[None]
        )
        k = (
            F.linear(x, w["midlayer.self_attn.k_proj.weight"])
            .view(n, kv_heads, head_dim)
            .transpose(0, 1)[None]
        )
        v = (
            F.linear(x, w["midlayer.self_attn.v_proj.weight"])
            .view(n, kv_heads, head_dim)
            .transpose(0, 1)[None]
        )
        cos, sin = rotary(config, n)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = feature + F.linear(
            attn[0].transpose(0, 1).reshape(n, -1), w["midlayer.self_attn.o_proj.weight"]
        )
        mlp = LlamaMLP(config)
        load_layer(mlp, w, "midlayer.mlp.")
        h = h + mlp(norm("midlayer.post_attention_layernorm.weight", h))
        logits = F.linear(norm("norm.weight", h[-1]), w["lm_head.weight"])
    assert_first_level(logits, probs, ids, to_target=w["d2t"] + torch.arange(96))


def test_mimo_mtp_format(make_model, hf):
    target = add_mimo_mtp(make_model("qwen2", num_layers=2, seed=11))
    probs, ids, out, _ = engine_first_level(target, speculative_algorithm="EAGLE")
    from transformers import Qwen2ForCausalLM

    trunk = Qwen2ForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        result = trunk(torch.tensor([PROMPT]), output_hidden_states=True)
    nxt = int(result.logits[0, -1].argmax())
    assert out == [nxt]
    w = load_file(os.path.join(target, "model.safetensors"))
    config = hf_config(target, Qwen2Config)
    n = len(PROMPT)

    def norm(name, x):
        layer = Qwen2RMSNorm(config.hidden_size, config.rms_norm_eps)
        layer.weight.data = w[f"model.mtp_layers.0.{name}.weight"]
        return layer(x)

    with torch.no_grad():
        tokens = trunk.model.embed_tokens.weight[PROMPT[1:] + [nxt]].clone()
        tokens[0] = 0.0  # MiMo zeroes the embedding at position 0
        x = F.linear(
            torch.cat(
                (
                    norm("hidden_layernorm", result.hidden_states[-1][0]),
                    norm("token_layernorm", tokens),
                ),
                -1,
            ),
            w["model.mtp_layers.0.input_proj.weight"],
        )
        layer = Qwen2DecoderLayer(config, 0)
        load_layer(layer, w, "model.mtp_layers.0.")
        x = layer(x[None], position_embeddings=rotary(config, n))
        logits = trunk.lm_head(norm("final_layernorm", x[0, -1]))
    assert_first_level(logits, probs, ids)


@pytest.mark.parametrize("ids", [[5, 6, 5], [-1, 3]])
def test_bad_token_maps_are_refused(make_model, tmp_path, ids):
    target = make_model("llama", num_layers=4)
    draft = build_eagle_draft(str(tmp_path / "eagle"), target, version=2)
    path = str(tmp_path / "map.pt")
    torch.save(torch.tensor(ids), path)
    with pytest.raises(ValueError, match="token"):
        Engine(
            model_path=target,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path=draft,
            speculative_token_map=path,
        )
