"""Tensor names and layouts between Hugging Face Llama/Qwen2/Qwen3/MiMo and megatron's GPTModel.

Works on whole (tensor-parallel size 1) tensors; `tp.py` shards and gathers them. Megatron fuses
q/k/v into `linear_qkv` grouped per query group (that group's q heads, then its k head, then its
v head) and gate/up into `linear_fc1` (gate rows first). MiMo's MTP layer maps onto megatron's
MTP layer: token_layernorm -> enorm, hidden_layernorm -> hnorm, input_proj -> eh_proj,
the decoder layer -> transformer_layer, final_layernorm -> final_layernorm. MiMo's input_proj
reads [hidden, embedding] (as the engine's models/mimo.py does); megatron's eh_proj reads
[embedding, hidden], so the two column halves swap.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor

from spec_engine.models.hf_config import ModelConfig

# megatron layer suffix -> Hugging Face layer suffix, for tensors that only change name.
_LAYER_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_QK_NORM_RENAMES = {
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}
_MTP_RENAMES = {
    "enorm.weight": "token_layernorm.weight",
    "hnorm.weight": "hidden_layernorm.weight",
    "final_layernorm.weight": "final_layernorm.weight",
}
_QKV = "self_attention.linear_qkv."
_FC1 = "mlp.linear_fc1.weight"
# Fused gate/up rows: the dense MLP's, and in MoE models every expert's and the shared experts'.
_GATED = "linear_fc1.weight"
_EH_PROJ = "eh_proj.weight"


def _layer_names(arch: ModelConfig, mcore: str, hf: str) -> dict[str, tuple[str, ...]]:
    """megatron name -> its Hugging Face names, for one decoder layer under the given prefixes."""
    names = {mcore + m: (hf + h,) for m, h in _LAYER_RENAMES.items()}
    if arch.qk_norm:
        names.update({mcore + m: (hf + h,) for m, h in _QK_NORM_RENAMES.items()})
    names[mcore + _QKV + "weight"] = tuple(f"{hf}self_attn.{p}_proj.weight" for p in "qkv")
    if arch.qkv_bias:
        names[mcore + _QKV + "bias"] = tuple(f"{hf}self_attn.{p}_proj.bias" for p in "qkv")
    names[mcore + _FC1] = (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight")
    return names


def name_map(arch: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every megatron parameter name of `arch`, with the Hugging Face tensors it is made of, in HF
    order."""
    names: dict[str, tuple[str, ...]] = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight",)
    }
    for i in range(arch.num_hidden_layers):
        names.update(_layer_names(arch, f"decoder.layers.{i}.", f"model.layers.{i}."))
    names["decoder.final_layernorm.weight"] = ("model.norm.weight",)
    if not arch.tie_word_embeddings:
        names["output_layer.weight"] = ("lm_head.weight",)
    for i in range(arch.num_mtp_layers):
        mcore, hf = f"mtp.layers.{i}.", f"model.mtp_layers.{i}."
        names.update({mcore + m: (hf + h,) for m, h in _MTP_RENAMES.items()})
        names[mcore + _EH_PROJ] = (hf + "input_proj.weight",)
        names.update(_layer_names(arch, mcore + "transformer_layer.", hf))
    return names


def optional_names(arch: ModelConfig) -> Collection[str]:
    """Hugging Face names a checkpoint may lack: none (a tied head is not named at all)."""
    return ()


def _fuse_qkv(arch: ModelConfig, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    groups, d = arch.num_key_value_heads, arch.head_dim
    tail = q.shape[1:]
    q = q.reshape(groups, arch.heads_per_group * d, *tail)
    return torch.cat((q, k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)), dim=1).reshape(
        -1, *tail
    )


def _split_qkv(arch: ModelConfig, qkv: Tensor) -> tuple[Tensor, ...]:
    groups, d = arch.num_key_value_heads, arch.head_dim
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, -1, *tail).split([arch.heads_per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, *tail) for t in (q, k, v))


def _swap_halves(weight: Tensor) -> Tensor:
    """[A | B] -> [B | A] along the input dim: MiMo's [hidden, embedding] <-> megatron's
    [embedding, hidden]."""
    first, second = weight.chunk(2, dim=1)
    return torch.cat((second, first), dim=1)


def _is_qkv(name: str) -> bool:
    return _QKV in name


def to_mcore(name: str, hf_tensors: tuple[Tensor, ...], arch: ModelConfig) -> Tensor:
    """Build megatron tensor `name` from its Hugging Face tensors (in `name_map` order)."""
    if _is_qkv(name):
        return _fuse_qkv(arch, *hf_tensors)
    if name.endswith(_GATED):
        return torch.cat(hf_tensors, dim=0)
    if name.endswith(_EH_PROJ):
        return _swap_halves(hf_tensors[0])
    (tensor,) = hf_tensors
    return tensor


def to_hf(name: str, tensor: Tensor, arch: ModelConfig) -> tuple[Tensor, ...]:
    """The Hugging Face tensors (in `name_map` order) inside megatron tensor `name`; vocab padding
    removed."""
    if _is_qkv(name):
        return _split_qkv(arch, tensor)
    if name.endswith(_GATED):
        return tuple(tensor.chunk(2, dim=0))
    if name.endswith(_EH_PROJ):
        return (_swap_halves(tensor),)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (tensor[: arch.vocab_size],)
    return (tensor,)
