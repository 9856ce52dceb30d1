"""Hugging Face config -> megatron-core TransformerConfig and GPTModel (local, non-TE layer spec).

Covers the Llama family the engine serves: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm),
MiMo (Qwen2 trunk + multi-token-prediction layers, built as megatron's MTP block), GLM-4.5 MoE
(megatron's MoE layers after the dense first layers, partial rotary; see moe.py) and DeepSeek-V3
(megatron's multi-latent attention, see mla.py, with the same MoE). RMSNorm,
SwiGLU, rope (default or llama3-scaled), GQA, explicit head_dim and tied embeddings map onto
megatron options; anything else is refused with the config key that is not supported.
The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp`, as Megatron does:
logits carry extra columns past `vocab_size` that callers must drop before a softmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from spec_engine.models.hf_config import ConfigSource, ModelConfig
from trainer_bridge.model.checkpoint_names import te_checkpoint_names, te_extra_states
from trainer_bridge.model.mla import check_mla, mla_config_fields
from trainer_bridge.model.moe import check_moe, count_real_tokens_only, moe_config_fields
from trainer_bridge.parallel.expert import (
    check_expert_parallel,
    reduce_experts_over_expert_data_parallel,
)
from trainer_bridge.parallel.sequence import (
    replicated_kv_down_proj,
    sequence_parallel_spec,
    uses_sequence_parallel,
)

if TYPE_CHECKING:  # megatron is imported when a model is built, so conversion alone stays light
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

# The targets megatron can train here (not the draft-only formats the engine also reads).
TRAINABLE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MiMoForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV3ForCausalLM",
)
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Megatron-LM's --make-vocab-size-divisible-by default.
DEFAULT_VOCAB_DIVISOR = 128


def read_model_config(source: ConfigSource) -> ModelConfig:
    """The checkpoint's config, read as the engine reads it (spec_engine.models.hf_config), and
    refused unless megatron-core can build it here, naming the config key that is not supported."""
    config = source if isinstance(source, ModelConfig) else ModelConfig.load(source)
    arch = config.architecture
    if arch not in TRAINABLE_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {arch!r} for training; supported: "
            f"{', '.join(TRAINABLE_ARCHITECTURES)}"
        )
    if config.o_bias:
        raise ValueError(
            f"{arch} with attention_bias=true (an o_proj bias) is not supported; "
            "megatron only adds it together with MLP biases"
        )
    if config.mlp_bias:
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    rope_type = "default" if config.rope_scaling is None else config.rope_scaling["rope_type"]
    # MLA's rope is megatron's MLA option (mla.py checks it), not GPTModel's
    if rope_type not in SUPPORTED_ROPE_TYPES and config.mla is None:
        raise ValueError(
            f"rope type {rope_type!r} is not supported by the megatron model provider; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    check_moe(config)
    check_mla(config)
    return config


def padded_vocab_size(
    vocab_size: int, tp: int = 1, divisible_by: int = DEFAULT_VOCAB_DIVISOR
) -> int:
    """The vocabulary Megatron allocates: `vocab_size` rounded up to a multiple of divisible_by *
    tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_tensor_parallel(arch: ModelConfig, tp: int) -> None:
    """Raise unless every tensor-parallel split of `arch` is whole (query groups, MLP, hidden)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    # Each rank holds whole query groups (its q heads with their k/v head): no k/v replication.
    splits = [
        ("num_key_value_heads", arch.num_key_value_heads),
        ("intermediate_size", arch.intermediate_size),
        ("hidden_size", arch.hidden_size),
    ]
    if arch.mla is not None:  # whole heads and even query down-projection rows per rank
        splits[0] = ("num_attention_heads", arch.num_attention_heads)
        if arch.mla.q_lora_rank:
            splits.append(("q_lora_rank", arch.mla.q_lora_rank))
    if arch.moe is not None:  # routed and shared experts split like a dense MLP
        splits.append(("moe_intermediate_size", arch.moe.intermediate_size))
    for key, value in splits:
        if value % tp:
            raise ValueError(
                f"tensor parallel size {tp} does not divide {key}={value} of {arch.architecture}; "
                f"pick a tp that divides it"
            )


def transformer_config(
    arch: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """The TransformerConfig for `arch` (`ep`: expert-parallel size, `etp`: expert tensor
    parallel size, default `tp`); `overrides` set any other TransformerConfig field (dropout,
    recompute, ...)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    check_tensor_parallel(arch, tp)
    check_expert_parallel(arch, ep, tp, expert_tp=etp)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=arch.num_mtp_layers or None,
        tensor_model_parallel_size=tp,
        # MoE and MLA models at TP > 1 (see trainer_bridge.parallel.sequence)
        sequence_parallel=uses_sequence_parallel(arch, tp),
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
        **moe_config_fields(arch),
    )
    kwargs.update(mla_config_fields(arch))
    kwargs.update(overrides)
    return (MLATransformerConfig if arch.mla else TransformerConfig)(**kwargs)


def build_gpt_model(
    hf_config: ConfigSource,
    *,
    params_dtype: torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    pre_process: bool = True,
    post_process: bool = True,
    parallel_output: bool = True,
    device: Optional[torch.device] = None,
    packed: bool = False,
    **config_overrides: Any,
) -> GPTModel:
    """A randomly initialised GPTModel for this rank of the current megatron parallel state, on
    `device` (default: trainer_device()); `packed`: its attention takes packed sequences
    (--qkv-format thd, see trainer_bridge.micro_batches.packed_attention).

    Needs `megatron_compat.init_model_parallel()` (or an equivalent set-up) first; TP/PP/EP/ETP
    sizes come from megatron's parallel_state (this rank builds its share of the routed experts:
    trainer_bridge.parallel.expert). Load weights with `trainer_bridge.convert`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    arch = read_model_config(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = transformer_config(
        arch,
        tp=tp,
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
        params_dtype=params_dtype,
        **config_overrides,
    )
    layer_spec = _layer_spec(arch, config, packed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp, make_vocab_size_divisible_by),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,
        rotary_percent=arch.partial_rotary_factor,
        mtp_block_spec=_mtp_spec(arch, config, layer_spec),
    )
    if arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "llama3":
        _apply_llama3_scaling(model, arch.rope_scaling)
    reduce_experts_over_expert_data_parallel(model)
    te_extra_states(model)  # checkpoints that Megatron-LM with Transformer Engine reads as they are
    # Megatron puts its parallel layers on the current CUDA device but builds norms and other
    # plain modules on the default device: move the whole model, as Megatron-LM's get_model does.
    return model.to(device or trainer_device())


def _layer_spec(arch: ModelConfig, config: TransformerConfig, packed: bool) -> Any:
    """The decoder's layer spec: megatron's local (non-TE) one, one spec per layer for a MoE model
    (dense or MoE after config.moe_layer_freq), adapted to save under Transformer Engine's names
    (checkpoint_names), to sequence parallelism's norms and, `packed`, to packed attention."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )

    if arch.moe is None:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    else:
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm"
        )
        count_real_tokens_only()  # the routers' counts for --moe-router-bias-update-rate
    layer_spec = te_checkpoint_names(replicated_kv_down_proj(layer_spec))
    if config.sequence_parallel:  # its norms
        layer_spec = sequence_parallel_spec(layer_spec)
    if packed:
        from trainer_bridge.micro_batches.packed_attention import with_packed_attention
        from trainer_bridge.micro_batches.thd_ops import use_vectorized_thd_ops

        layer_spec = with_packed_attention(layer_spec, config)  # before the MTP layers copy it
        use_vectorized_thd_ops()
    return layer_spec


def _mtp_spec(arch: ModelConfig, config: TransformerConfig, layer_spec: Any) -> Any:
    """The MTP block's spec (None without MTP layers): megatron's, built on the decoder's
    `layer_spec`, with the same MLA and sequence-parallel adaptations."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not arch.num_mtp_layers:
        return None
    mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
    mtp_spec = replicated_kv_down_proj(mtp_spec)
    if config.sequence_parallel:
        mtp_spec = sequence_parallel_spec(mtp_spec)
    return mtp_spec


def trainer_device() -> torch.device:
    """This rank's device: the current CUDA device (set by init_model_parallel), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _apply_llama3_scaling(model: Any, scaling: dict[str, Any]) -> None:
    """Megatron's llama3 rope scaling hard-codes low/high frequency factors 1/4 and an original
    context of 8192; rescale its inverse frequencies with the checkpoint's own values instead."""
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq,
        factor=scaling["factor"],
        low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
    )
