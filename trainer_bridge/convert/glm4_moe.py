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
MiMo), shared_head.norm -> final_layernorm, the decoder layer -> transformer_layer. As released
(GLM-4.5, GLM-4.5-Air, and DeepSeek-V3 likewise), each also carries copies of the embedding
(`embed_tokens`) and the output head (`shared_head.head`), which megatron's MTP layers share
with the trunk (as slime and Megatron-Bridge train them): the copies fold into
`embedding.word_embeddings` / `output_layer` (refused when they differ from the trunk's, which
one shared tensor cannot hold) and are written back from them, so the round trip is exact. A
checkpoint without the copies converts too; its export carries them, as the releases do.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
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
_EMBEDDING = "embedding.word_embeddings.weight"
# megatron tensor shared by the MTP layers -> the copy each next-n layer carries (HF suffix).
SHARED_WITH_MTP = {
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "output_layer.weight": "shared_head.head.weight",
}


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
    add_mtp_copies(names, arch)
    return names


def add_mtp_copies(names: dict[str, tuple[str, ...]], arch: ModelConfig) -> None:
    """Append each next-n layer's embedding and head copies to the trunk tensors they copy (the
    embedding's Hugging Face names also stand for a tied head)."""
    shared = "output_layer.weight" if "output_layer.weight" in names else None
    for i in range(arch.num_mtp_layers):
        hf = f"model.layers.{arch.num_hidden_layers + i}."
        names["embedding.word_embeddings.weight"] += (hf + SHARED_WITH_MTP[_EMBEDDING],)
        head = hf + SHARED_WITH_MTP["output_layer.weight"]
        names[shared or _EMBEDDING] += (head,)


def optional_names(arch: ModelConfig) -> Collection[str]:
    """Hugging Face names a checkpoint may lack: the next-n layers' copies."""
    return {
        f"model.layers.{arch.num_hidden_layers + i}.{copy}"
        for i in range(arch.num_mtp_layers)
        for copy in SHARED_WITH_MTP.values()
    }


def fold_copies(name: str, hf_tensors: tuple[Tensor, ...], arch: ModelConfig) -> Tensor:
    """The trunk tensor `name` of its Hugging Face tensor and the next-n layers' copies of it
    (those the checkpoint has); ValueError when a copy differs."""
    first, *copies = hf_tensors
    if not all(c.shape == first.shape and torch.equal(first, c) for c in copies):
        raise ValueError(
            f"{arch.architecture} next-n layers carry an {SHARED_WITH_MTP['output_layer.weight']}"
            f" or {SHARED_WITH_MTP[_EMBEDDING]} that differs from the trunk's; megatron's MTP "
            f"layers share the trunk's {name}, so this checkpoint cannot be converted without "
            "losing one of them (set the copies equal to the trunk's lm_head / embed_tokens)"
        )
    return first


def to_mcore(name: str, hf_tensors: tuple[Tensor, ...], arch: ModelConfig) -> Tensor:
    """Build megatron tensor `name` from its Hugging Face tensors (in `name_map` order, the
    optional copies only where the checkpoint has them)."""
    if name in SHARED_WITH_MTP and arch.num_mtp_layers:
        return fold_copies(name, hf_tensors, arch)
    if name.endswith("eh_proj.weight"):
        return hf_tensors[0]
    return llama.to_mcore(name, hf_tensors, arch)


def to_hf(name: str, tensor: Tensor, arch: ModelConfig) -> tuple[Tensor, ...]:
    """The Hugging Face tensors (in `name_map` order) inside megatron tensor `name`; vocab padding
    removed."""
    if name in SHARED_WITH_MTP:
        (trimmed,) = llama.to_hf(name, tensor, arch)
        # a tied embedding is also every next-n layer's head
        per_layer = 2 if name == _EMBEDDING and arch.tie_word_embeddings else 1
        # copies, not views: safetensors refuses to save tensors that share memory
        return (trimmed, *(trimmed.clone() for _ in range(per_layer * arch.num_mtp_layers)))
    if name.endswith("eh_proj.weight"):
        return (tensor,)
    return llama.to_hf(name, tensor, arch)
