"""Tensor names and layouts between Hugging Face GLM-4.5 (Glm4MoeForCausalLM) and megatron's
GPTModel with MoE layers (SequentialMLP experts, the local layer spec).

Attention and the dense first layers are Llama's (llama.py: fused q/k/v with biases, q/k norms).
A MoE layer's MLP maps as slime's mbridge GLM-4.5 bridge maps it:

    mlp.gate.weight                     -> mlp.router.weight
    mlp.gate.e_score_correction_bias    -> mlp.router.expert_bias
    mlp.experts.{e}.{gate,up}_proj      -> mlp.experts.local_experts.{e}.linear_fc1 (gate rows
                                           first)
    mlp.experts.{e}.down_proj           -> mlp.experts.local_experts.{e}.linear_fc2
    mlp.shared_experts.*                -> mlp.shared_experts.linear_fc1 / linear_fc2

GLM's next-n (MTP) layers follow the decoder layers as `model.layers.{N + i}` and map onto
megatron's MTP layer i: enorm, hnorm, eh_proj (both read [embedding, hidden]: no swap, unlike
MiMo), shared_head.norm -> final_layernorm, the decoder layer -> transformer_layer.
"""

from __future__ import annotations

from torch import Tensor

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.convert import llama

_DENSE_MLP = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
MTP_RENAMES = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
_FC1 = "linear_fc1.weight"


def moe_mlp_names(arch: ModelConfig, mcore: str, hf: str) -> dict[str, tuple[str, ...]]:
    """A MoE layer's MLP (router, expert bias, routed and shared experts) under the prefixes."""
    assert arch.moe is not None
    names = {
        mcore + "mlp.router.weight": (hf + "mlp.gate.weight",),
        mcore + "mlp.router.expert_bias": (hf + "mlp.gate.e_score_correction_bias",),
    }
    experts = [
        (f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.")
        for e in range(arch.moe.num_experts)
    ]
    if arch.moe.num_shared_experts:
        experts.append(("mlp.shared_experts.", "mlp.shared_experts."))
    for m, h in experts:
        names[mcore + m + _FC1] = (hf + h + "gate_proj.weight", hf + h + "up_proj.weight")
        names[mcore + m + "linear_fc2.weight"] = (hf + h + "down_proj.weight",)
    return names


def _layer_names(arch: ModelConfig, layer: int, mcore: str, hf: str) -> dict[str, tuple[str, ...]]:
    """One decoder layer (`layer` counts from 0 over decoder then MTP layers)."""
    assert arch.moe is not None
    names = llama._layer_names(arch, mcore, hf)
    if arch.moe.is_moe_layer(layer):
        for suffix in _DENSE_MLP:
            del names[mcore + suffix]
        names.update(moe_mlp_names(arch, mcore, hf))
    return names


def name_map(arch: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every megatron parameter name of `arch`, with the Hugging Face tensors it is made of, in HF
    order."""
    n = arch.num_hidden_layers
    names: dict[str, tuple[str, ...]] = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight",)
    }
    for i in range(n):
        names.update(_layer_names(arch, i, f"decoder.layers.{i}.", f"model.layers.{i}."))
    names["decoder.final_layernorm.weight"] = ("model.norm.weight",)
    if not arch.tie_word_embeddings:
        names["output_layer.weight"] = ("lm_head.weight",)
    for i in range(arch.num_mtp_layers):
        mcore, hf = f"mtp.layers.{i}.", f"model.layers.{n + i}."
        names.update({mcore + m: (hf + h,) for m, h in MTP_RENAMES.items()})
        names.update(_layer_names(arch, n + i, mcore + "transformer_layer.", hf))
    return names


def to_mcore(name: str, hf_tensors: tuple[Tensor, ...], arch: ModelConfig) -> Tensor:
    """Build megatron tensor `name` from its Hugging Face tensors (in `name_map` order)."""
    if name.endswith("eh_proj.weight"):
        return hf_tensors[0]
    return llama.to_mcore(name, hf_tensors, arch)


def to_hf(name: str, tensor: Tensor, arch: ModelConfig) -> tuple[Tensor, ...]:
    """The Hugging Face tensors (in `name_map` order) inside megatron tensor `name`; vocab padding
    removed."""
    if name.endswith("eh_proj.weight"):
        return (tensor,)
    return llama.to_hf(name, tensor, arch)
