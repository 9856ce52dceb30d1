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

Transformer Engine's modules also save an `_extra_state` (their fp8 metadata, empty without fp8),
which a TE-built model asks a checkpoint for: megatron-core's local linears save one (None) for
that reason, its local norms and attention do not. `te_extra_states` gives the modules TE would
build as TENorm, TELinear or TEDotProductAttention one too, so Megatron-LM with TE (slime) reads
these checkpoints with its default `--dist-ckpt-strictness`; `match_saved_names` reads one
without them (this trainer's from before, Megatron-LM's with --transformer-impl local).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch

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


class _TEExtraState:
    """The `_extra_state` of the Transformer Engine module built in this one's place: None (no
    fp8 metadata, which every TE version reads back); what a TE checkpoint holds there is ignored,
    as megatron's local linears ignore theirs (this trainer runs no fp8)."""

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state: Any) -> None:
        """Ignored: fp8 metadata, of no use without fp8."""

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any):
        # a checkpoint without it (this trainer's before, Megatron-LM's local ones) still loads
        state_dict.setdefault(f"{prefix}_extra_state")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)  # type: ignore[misc]


_WITH_EXTRA_STATE: dict[type, type] = {}


def _with_extra_state(cls: type) -> type:
    """`cls` with _TEExtraState, made once per class and kept as this module's attribute (where
    pickle looks a class up by its qualified name); its __name__ stays `cls`'s."""
    if cls not in _WITH_EXTRA_STATE:
        qualname = f"{cls.__module__}.{cls.__qualname__}".replace(".", "_") + "_with_extra_state"
        made = type(cls.__name__, (_TEExtraState, cls), {"__qualname__": qualname})
        globals()[qualname] = _WITH_EXTRA_STATE[cls] = made
    return _WITH_EXTRA_STATE[cls]


# Where a TE-built layer has a module with an `_extra_state` that the local one's lacks (its other
# linears are megatron's local ones, which save theirs): attention kind -> submodule paths.
_TE_STATEFUL = {
    "mla": (
        "self_attention.core_attention",
        "self_attention.linear_kv_down_proj",
        "input_layernorm",
    ),
    "gqa": (
        "self_attention.core_attention",
        "self_attention.q_layernorm",
        "self_attention.k_layernorm",
    ),
}


def te_extra_states(model: torch.nn.Module) -> None:
    """Give every module of `model` that Transformer Engine's spec builds as a TE module with an
    `_extra_state` (TENorm: MLA's input norm, a MoE layer's pre-MLP norm, q/k norms, the final
    norms, the MTP layers' enorm and hnorm; TELinear: MLA's key/value down projection;
    TEDotProductAttention) one of its own where it has none."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for module in model.modules():
        if isinstance(module, TransformerLayer):
            paths = _TE_STATEFUL[
                "mla" if isinstance(module.self_attention, MLASelfAttention) else "gqa"
            ]
            if isinstance(module.mlp, MoELayer):
                paths += ("pre_mlp_layernorm",)
        elif isinstance(module, MultiTokenPredictionLayer):
            paths = ("enorm", "hnorm", "final_layernorm")
        elif isinstance(module, TransformerBlock):
            paths = ("final_layernorm",)
        else:
            continue
        for path in paths:
            sub = module
            for part in path.split("."):
                sub = getattr(sub, part, None)
            if sub is None or isinstance(sub, IdentityOp):
                continue
            cls = type(sub)
            if cls.get_extra_state is torch.nn.Module.get_extra_state:
                sub.__class__ = _with_extra_state(cls)


def match_saved_names(
    sharded: dict[str, Any], saved: Collection[str]
) -> tuple[list[str], list[str]]:
    """Point each of the model's sharded tensors (TE names) that `saved` (a checkpoint's keys)
    lacks at the local spec's name for it where the checkpoint has that one, and drop the
    `_extra_state` objects it lacks (te_extra_states: their modules load without them); returns
    the keys so renamed and those dropped. Done before the optimizer's entries are derived from the
    model's, they follow."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    renamed, dropped = [], []
    for name, obj in list(sharded.items()):
        if (
            isinstance(obj, ShardedObject)
            and obj.key.endswith("._extra_state")
            and obj.unique_key not in saved
        ):
            dropped.append(obj.key)
            del sharded[name]
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor) or tensor.key in saved:
            continue
        for ours, theirs in LOCAL_NAMES:
            alias = tensor.key.replace(ours, theirs, 1)
            if ours in tensor.key and alias in saved:
                renamed.append(tensor.key)
                tensor.key = alias
                break
    return renamed, dropped
