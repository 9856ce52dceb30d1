"""The names checkpoints give the layers' norm weights: Transformer Engine's, which slime's and
Megatron-LM's runs write, for the local (non-TE) layer spec the trainer builds here.

Transformer Engine fuses a norm into the linear after it (TELayerNormColumnParallelLinear: the
norm's weight is that linear's `layer_norm_weight`), and megatron-core's local spec maps its
separate norms onto those names for GPT layers with grouped-query attention and a dense MLP only.
A MoE layer keeps its `pre_mlp_layernorm` under TE (the router reads the normed input), which the
local spec renames anyway; a multi-latent attention layer fuses its q and kv norms into the up
projections and a dense one its pre-MLP norm into linear_fc1, which the local spec leaves
unrenamed. So a DeepSeek-V3 or GLM-4.5 checkpoint of slime's (`convert_hf_to_torch_dist.py`,
--save) would miss keys here. `te_checkpoint_names` gives every layer spec TE's names (saved that
way, read that way); `match_saved_names` reads a checkpoint holding the local spec's names
instead (one of Megatron-LM's --transformer-impl local runs, or this trainer's from before),
tensor by tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

from trainer_bridge.spec_rewrite import swap_in_spec

# TE's name (a layer's sharded-key prefix) -> the local spec's name for the same weight.
_QKV_NORM = ("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
_Q_NORM = ("self_attention.linear_q_up_proj.layer_norm_", "self_attention.q_layernorm.")
_KV_NORM = ("self_attention.linear_kv_up_proj.layer_norm_", "self_attention.kv_layernorm.")
_FC1_NORM = ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm.")
LOCAL_NAMES = (_Q_NORM, _KV_NORM, _FC1_NORM, _FC1_NORM[::-1])


def te_keys_map(submodules: Any) -> dict[str, str]:
    """The sharded_state_dict_keys_map giving one TransformerLayerSubmodules TE's checkpoint
    names: megatron-core's TE spec fuses the input norm into linear_qkv (grouped-query attention),
    the q/kv norms into the up projections (multi-latent attention), and the pre-MLP norm into a
    dense MLP's linear_fc1 (a MoE layer keeps it)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    def module(spec: Any) -> Any:
        return getattr(spec, "module", spec)

    attention, mlp = module(submodules.self_attention), module(submodules.mlp)
    keys: dict[str, str] = {}
    if isinstance(attention, type) and issubclass(attention, MLASelfAttention):
        keys.update((local, te) for te, local in (_Q_NORM, _KV_NORM))
    else:
        keys[_QKV_NORM[1]] = _QKV_NORM[0]
    if not (isinstance(mlp, type) and issubclass(mlp, MoELayer)):
        keys[_FC1_NORM[1]] = _FC1_NORM[0]
    return keys


def te_checkpoint_names(spec: Any) -> Any:
    """A copy of a layer/block/MTP spec whose transformer layers save and load their norms under
    Transformer Engine's names (te_keys_map)."""
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    def rule(_: str, value: Any) -> Any:
        if isinstance(value, TransformerLayerSubmodules):
            return dataclasses.replace(value, sharded_state_dict_keys_map=te_keys_map(value))
        return value

    return swap_in_spec(spec, rule)


def match_saved_names(sharded: dict[str, Any], saved: Collection[str]) -> list[str]:
    """Point each of the model's sharded tensors (TE names) that `saved` (a checkpoint's keys)
    lacks at the local spec's name for it where the checkpoint has that one; returns the keys so
    renamed. Done before the optimizer's entries are derived from the model's, they follow."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    renamed = []
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor) or tensor.key in saved:
            continue
        for ours, theirs in LOCAL_NAMES:
            alias = tensor.key.replace(ours, theirs, 1)
            if ours in tensor.key and alias in saved:
                renamed.append(tensor.key)
                tensor.key = alias
                break
    return renamed
