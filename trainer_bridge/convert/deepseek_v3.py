"""Tensor names between Hugging Face DeepSeek-V3 (DeepseekV3ForCausalLM) and megatron's GPTModel
with multi-latent attention (the local MLA layer spec) and MoE layers.

Every MLA tensor keeps its layout, only its name changes (as megatron-bridge's DeepSeek mapping):
q_a_proj -> linear_q_down_proj, q_a_layernorm -> q_layernorm, q_b_proj -> linear_q_up_proj (or
q_proj -> linear_q_proj without a query bottleneck), kv_a_proj_with_mqa -> linear_kv_down_proj
(latent rows, then the rope key), kv_a_layernorm -> kv_layernorm, kv_b_proj -> linear_kv_up_proj
(per head: the no-rope key dims, then the value), o_proj -> linear_proj. The MLPs are GLM-4.5's
(glm4_moe.py); fused gate/up and the vocabulary are handled as for Llama.

Next-n (MTP) layers `model.layers.{N + i}` map as GLM-4.5's, their copies of the embedding
(`embed_tokens`) and the output head (`shared_head.head`) included (glm4_moe.py).
"""

from __future__ import annotations

from collections.abc import Collection

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.convert import glm4_moe
from trainer_bridge.convert.glm4_moe import MTP_RENAMES, moe_mlp_names

_ATTENTION = {
    "linear_kv_down_proj.weight": "kv_a_proj_with_mqa.weight",
    "kv_layernorm.weight": "kv_a_layernorm.weight",
    "linear_kv_up_proj.weight": "kv_b_proj.weight",
    "linear_proj.weight": "o_proj.weight",
}
_Q_LORA = {
    "linear_q_down_proj.weight": "q_a_proj.weight",
    "q_layernorm.weight": "q_a_layernorm.weight",
    "linear_q_up_proj.weight": "q_b_proj.weight",
}
_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}


def _layer_names(arch: ModelConfig, layer: int, mcore: str, hf: str) -> dict[str, tuple[str, ...]]:
    assert arch.mla is not None and arch.moe is not None
    names = {mcore + m: (hf + h,) for m, h in _NORMS.items()}
    attention = dict(_ATTENTION)
    if arch.mla.q_lora_rank:
        attention.update(_Q_LORA)
    else:
        attention["linear_q_proj.weight"] = "q_proj.weight"
    names.update(
        {f"{mcore}self_attention.{m}": (f"{hf}self_attn.{h}",) for m, h in attention.items()}
    )
    if arch.moe.is_moe_layer(layer):
        names.update(moe_mlp_names(arch, mcore, hf))
    else:
        names[mcore + "mlp.linear_fc1.weight"] = (
            hf + "mlp.gate_proj.weight",
            hf + "mlp.up_proj.weight",
        )
        names[mcore + "mlp.linear_fc2.weight"] = (hf + "mlp.down_proj.weight",)
    return names


def name_map(arch: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every megatron parameter name of `arch`, with the Hugging Face tensors it is made of, in HF
    order."""
    names: dict[str, tuple[str, ...]] = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight",)
    }
    for i in range(arch.num_hidden_layers):
        names.update(_layer_names(arch, i, f"decoder.layers.{i}.", f"model.layers.{i}."))
    names["decoder.final_layernorm.weight"] = ("model.norm.weight",)
    if not arch.tie_word_embeddings:
        names["output_layer.weight"] = ("lm_head.weight",)
    n = arch.num_hidden_layers
    for i in range(arch.num_mtp_layers):
        mcore, hf = f"mtp.layers.{i}.", f"model.layers.{n + i}."
        names.update({mcore + m: (hf + h,) for m, h in MTP_RENAMES.items()})
        names.update(_layer_names(arch, n + i, mcore + "transformer_layer.", hf))
    glm4_moe.add_mtp_copies(names, arch)
    return names


def optional_names(arch: ModelConfig) -> Collection[str]:
    """Hugging Face names a checkpoint may lack: the next-n layers' copies."""
    return glm4_moe.optional_names(arch)


# MLA tensors keep their layout; the MLPs, eh_proj and the next-n copies are GLM-4.5's.
to_mcore = glm4_moe.to_mcore
to_hf = glm4_moe.to_hf
