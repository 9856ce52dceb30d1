"""DeepSeek's multi-head latent attention on the trainer side: megatron-core's MLA options
(MLATransformerConfig) for a DeepSeek-V3 checkpoint (spec_engine's MLAConfig).

Megatron's MLA always de-interleaves the rope dims before rotating (DeepSeek-V3's
rope_interleave=true); its YaRN (inverse frequencies, the cos/sin mscale ratio and the softmax's
mscale(mscale_all_dim) ** 2) is DeepSeek's. The variants it would compute differently are refused,
naming the config key. Under tensor parallelism every MLA projection splits along its output
rows (the down projections are gathered again before their norms), whole heads per rank.
"""

from __future__ import annotations

from typing import Any

from spec_engine.models.hf_config import ModelConfig


def check_mla(arch: ModelConfig) -> None:
    """Raise unless megatron's MLA layers reproduce `arch`'s attention here."""
    mla = arch.mla
    if mla is None:
        return
    refusals = (
        (
            not mla.rope_interleave,
            "rope_interleave=false",
            "megatron's MLA always de-interleaves the rope dims first",
        ),
        (
            arch.rope_scaling is not None and arch.rope_scaling["rope_type"] != "yarn",
            f"rope scaling {arch.rope_scaling}",
            "megatron's MLA has default rope and YaRN only",
        ),
        (mla.attention_bias, "attention_bias=true", "megatron's MLA projections have no bias"),
    )
    for refused, what, why in refusals:
        if refused:
            raise ValueError(
                f"{arch.architecture} with {what} is not supported for training ({why})"
            )


def mla_config_fields(arch: ModelConfig) -> dict[str, Any]:
    """MLATransformerConfig fields of `arch`'s attention ({} without MLA)."""
    mla = arch.mla
    if mla is None:
        return {}
    return dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,  # megatron's name for the dims without rope
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        # megatron's local core attention sizes its output by kv_channels (megatron_compat)
        kv_channels=mla.v_head_dim,
        # every head reads its own expanded key and value (ModelConfig's one latent "kv head" is
        # the engine's cache layout)
        num_query_groups=arch.num_attention_heads,
        qk_layernorm=True,  # q_a_layernorm and kv_a_layernorm
        rotary_base=arch.rope_theta,
        **_rope_fields(arch),
    )


def _rope_fields(arch: ModelConfig) -> dict[str, Any]:
    scaling = arch.rope_scaling
    if scaling is None:
        return dict(rope_type="rope")
    # transformers' defaults for the keys a DeepSeek config may leave out
    return dict(
        rope_type="yarn",
        rotary_scaling_factor=float(scaling["factor"]),
        original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        beta_fast=float(scaling.get("beta_fast") or 32.0),
        beta_slow=float(scaling.get("beta_slow") or 1.0),
        mscale=float(scaling.get("mscale") or 1.0),
        mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0),
    )
