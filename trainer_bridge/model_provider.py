"""Hugging Face config -> megatron-core TransformerConfig and GPTModel (local, non-TE layer spec).

Covers the Llama family the engine serves: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorm),
MiMo (Qwen2 trunk + multi-token-prediction layers, built as megatron's MTP block). RMSNorm,
SwiGLU, rope (default or llama3-scaled), GQA, explicit head_dim and tied embeddings map onto
megatron options; anything else is refused with the config key that is not supported.
The vocabulary is padded to a multiple of `make_vocab_size_divisible_by * tp`, as Megatron does:
logits carry extra columns past `vocab_size` that callers must drop before a softmax.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Union

import torch

from spec_engine.models.hf_config import rope_from_config

if TYPE_CHECKING:  # megatron is imported when a model is built, so conversion alone stays light
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig
    from transformers import PretrainedConfig

# architecture -> family; the family decides what the config does not state (Qwen2's q/k/v biases).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "qwen2",
}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mimo": "MiMoForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "llama3")
# Megatron-LM's --make-vocab-size-divisible-by default.
DEFAULT_VOCAB_DIVISOR = 128

HFConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any], "PretrainedConfig"]


@dataclass(frozen=True)
class HFArch:
    """The architecture facts of a Hugging Face checkpoint that conversion and model building need."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_mtp_layers: int
    hf_config: dict[str, Any] = field(repr=False, compare=False)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, config: HFConfigLike) -> "HFArch":
        """From a transformers config, a config dict, a config.json path or a checkpoint directory."""
        cfg = load_hf_config(config)
        archs = cfg.get("architectures") or [_MODEL_TYPES.get(cfg.get("model_type", ""), "")]
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs!r} (model_type {cfg.get('model_type')!r}); "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        _refuse_unsupported(cfg, arch)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        theta, scaling = _rope(cfg)
        return cls(
            architecture=arch, family=family, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"], num_heads=heads,
            num_kv_heads=kv_heads, head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=theta, rope_scaling=scaling, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0) if arch == "MiMoForCausalLM" else 0,
            hf_config=cfg,
        )


def load_hf_config(config: HFConfigLike) -> dict[str, Any]:
    """The config.json dict of a transformers config, a dict, a config.json path or a checkpoint directory."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(config, "config.json") if os.path.isdir(config) else os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no Hugging Face config at {path!r}: pass a checkpoint directory or its config.json")
        with open(path) as f:
            return json.load(f)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"expected a transformers config, a dict or a path, got {type(config).__name__}")


def _refuse_unsupported(cfg: dict[str, Any], arch: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{arch} with hidden_act={cfg['hidden_act']!r} is not supported; only silu (SwiGLU) is")
    if cfg.get("attention_bias") and SUPPORTED_ARCHITECTURES[arch] != "qwen2":
        raise ValueError(f"{arch} with attention_bias=true (an o_proj bias) is not supported; "
                         "megatron only adds it together with MLP biases")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{arch} with mlp_bias=true is not supported")
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise ValueError(f"{arch} with sliding-window attention is not supported; use use_sliding_window=false")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """The engine's reading of the rope keys, restricted to the types megatron can reproduce."""
    theta, scaling = rope_from_config(cfg)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported by the megatron model provider; "
                         f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    return theta, scaling


def padded_vocab_size(vocab_size: int, tp: int = 1, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """The vocabulary Megatron allocates: `vocab_size` rounded up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_tensor_parallel(arch: HFArch, tp: int) -> None:
    """Raise unless every tensor-parallel split of `arch` is whole (query groups, MLP, hidden)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {tp}")
    # Each rank holds whole query groups (its q heads with their k/v head): no k/v replication.
    for key, value in (("num_key_value_heads", arch.num_kv_heads), ("intermediate_size", arch.intermediate_size),
                       ("hidden_size", arch.hidden_size)):
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {key}={value} of {arch.architecture}; "
                             f"pick a tp that divides it")


def transformer_config(arch: HFArch, *, tp: int = 1, pp: int = 1, params_dtype: torch.dtype = torch.float32,
                       **overrides: Any) -> TransformerConfig:
    """The TransformerConfig for `arch`; `overrides` set any other TransformerConfig field (dropout, recompute, ...)."""
    from megatron.core.transformer import TransformerConfig

    check_tensor_parallel(arch, tp)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads, num_query_groups=arch.num_kv_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm, hidden_dropout=0.0, attention_dropout=0.0,
        mtp_num_layers=arch.num_mtp_layers or None,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        pipeline_dtype=params_dtype,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(hf_config: HFConfigLike, *, params_dtype: torch.dtype = torch.float32,
                    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR, pre_process: bool = True,
                    post_process: bool = True, parallel_output: bool = True, **config_overrides: Any) -> GPTModel:
    """A randomly initialised GPTModel for this rank of the current megatron parallel state.

    Needs `megatron_compat.init_model_parallel()` (or an equivalent set-up) first; TP/PP sizes
    come from megatron's parallel_state. Load weights with `trainer_bridge.convert`.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    arch = HFArch.from_hf(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = transformer_config(arch, tp=tp, pp=pp, params_dtype=params_dtype, **config_overrides)
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    mtp_spec = None
    if arch.num_mtp_layers:
        mtp_spec = get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
    model = GPTModel(
        config=config, transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp, make_vocab_size_divisible_by),
        max_sequence_length=arch.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        parallel_output=parallel_output, share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope", rotary_base=arch.rope_theta, mtp_block_spec=mtp_spec,
    )
    if arch.rope_scaling is not None:
        _apply_llama3_scaling(model, arch.rope_scaling)
    return model


def _apply_llama3_scaling(model: Any, scaling: dict[str, Any]) -> None:
    """Megatron's llama3 rope scaling hard-codes low/high frequency factors 1/4 and an original
    context of 8192; rescale its inverse frequencies with the checkpoint's own values instead."""
    rotary = model.rotary_pos_emb
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=scaling["factor"], low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"])
