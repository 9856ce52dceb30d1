"""ModelConfig: a Hugging Face config.json normalized into the fields a model needs.

The one reader of Hugging Face configs: the engine builds its models from it and the trainer
(trainer_bridge.model.provider) builds megatron-core models from it, so both read a checkpoint
the same way. Each side refuses what it cannot run on top of what is refused here.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from spec_engine.weights.fp8 import block_fp8

# architecture name -> family; the family decides biases and norms the config does not state.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MiMoForCausalLM": "qwen2",  # Qwen2 trunk + model.mtp_layers.*
    "Glm4MoeForCausalLM": "glm4_moe",  # GLM-4.5: MoE MLPs after the first dense layers
    "DeepseekV3ForCausalLM": "deepseek_v3",  # MLA attention + the same MoE
    # Draft-only formats (SGLang's names); refused as targets.
    "LlamaForCausalLMEagle": "llama",
    "LlamaForCausalLMEagle3": "llama",
}
DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLMEagle3")
# config.json files without `architectures`: the class their model_type stands for.
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mimo": "MiMoForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
# Architectures whose checkpoints carry next-n (MTP) layers counted by num_nextn_predict_layers.
MTP_ARCHITECTURES = ("MiMoForCausalLM", "Glm4MoeForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# YaRN is implemented for DeepSeek-V3's decoupled rope only (its mscale also scales the softmax).
YARN_FAMILIES = ("deepseek_v3",)
# A config directory or config.json path, a config dict, or a transformers PretrainedConfig.
ConfigSource = Union[str, "os.PathLike[str]", Mapping[str, Any], Any]


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (GLM-4.5 / DeepSeek-V3 style): sigmoid router with a selection
    bias, grouped top-k, shared experts; the first `first_k_dense_replace` layers stay dense."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace


@dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention: queries through an optional low-rank bottleneck,
    keys and values expanded per head from one shared `kv_lora_rank` latent, plus a
    `qk_rope_head_dim` rope key shared by every head (decoupled rope)."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float  # qk_head_dim ** -0.5, times YaRN's mscale(mscale_all_dim) squared
    rope_interleave: bool
    attention_bias: bool

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements one token's cache entry holds per layer: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: Optional[dict[str, Any]]
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    # Not part of the architecture: two readings of one checkpoint compare equal without them.
    torch_dtype: Optional[str] = field(default=None, compare=False)
    eos_token_ids: list[int] = field(default_factory=list, compare=False)
    # Multi-token-prediction layers carried by the checkpoint (MiMo's num_nextn_predict_layers).
    num_mtp_layers: int = 0
    # EAGLE-3 drafts: own head size, the target's hidden size, target layers whose outputs it reads.
    draft_vocab_size: Optional[int] = None
    target_hidden_size: Optional[int] = None
    eagle_aux_layer_ids: Optional[list[int]] = None
    # Rows of the rotary tables; the runner raises it above max_position_embeddings for drafts.
    rope_max_positions: Optional[int] = None
    # Rotary on the first head_dim * partial_rotary_factor dims of each head (GLM), rest passed.
    partial_rotary_factor: float = 1.0
    moe: Optional[MoEConfig] = None
    # MLA models (DeepSeek-V3): the KV cache holds one latent "head" of mla.cache_dim per token.
    mla: Optional[MLAConfig] = None
    # Block FP8 (a checkpoint's quantization_config quant_method fp8, or --quantization fp8):
    # the block of one weight scale; the engine holds its quantized linears' FP8 values
    # (weights/fp8.py). How the weights are stored, not the architecture.
    weight_block_size: Optional[tuple[int, int]] = field(default=None, compare=False)
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rotary embeddings rotate."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_draft(self) -> bool:
        return self.architecture in DRAFT_ARCHITECTURES

    @property
    def heads_per_group(self) -> int:
        """Query heads sharing one key/value head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def load(cls, source: ConfigSource) -> ModelConfig:
        """From a checkpoint directory, a config.json path, a config dict or a transformers
        config."""
        if isinstance(source, Mapping):
            return cls.from_dict(dict(source))
        if isinstance(source, (str, os.PathLike)):
            if os.path.isdir(source):
                return cls.from_pretrained(os.fspath(source))
            if not os.path.isfile(source):
                raise ValueError(
                    f"no Hugging Face config at {os.fspath(source)!r}: pass a checkpoint directory "
                    "or its config.json"
                )
            with open(source) as f:
                return cls.from_dict(json.load(f))
        if hasattr(source, "to_dict"):
            return cls.from_dict(source.to_dict())
        raise TypeError(
            f"expected a transformers config, a dict or a path, got {type(source).__name__}"
        )

    @classmethod
    def from_pretrained(cls, model_path: str) -> ModelConfig:
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(
                f"no config.json in {model_path!r}: --model-path must be a Hugging Face checkpoint "
                "directory"
            )
        with open(path) as f:
            cfg = json.load(f)
        eos = _as_list(cfg.get("eos_token_id"))
        gen_path = os.path.join(model_path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos += [t for t in _as_list(json.load(f).get("eos_token_id")) if t not in eos]
        return cls.from_dict(cfg, eos_token_ids=eos)

    @classmethod
    def from_dict(
        cls, cfg: dict[str, Any], eos_token_ids: Optional[list[int]] = None
    ) -> ModelConfig:
        arch, family = _architecture(cfg)
        if family == "deepseek_v3":
            cfg = _mla_geometry(cfg)
        _check_supported(cfg, arch)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        hidden = cfg["hidden_size"]
        rope_theta, rope_scaling = rope_from_config(cfg, yarn=family in YARN_FAMILIES)
        attention_bias = bool(cfg.get("attention_bias", False))
        glm = family == "glm4_moe"
        moe = family in ("glm4_moe", "deepseek_v3")
        head_dim = cfg.get("head_dim") or hidden // heads
        partial = _partial_rotary_factor(cfg, head_dim)
        fp8 = block_fp8(cfg)  # refuses quantization methods other than block FP8
        return cls(
            architecture=arch,
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 follow
            # attention_bias; GLM-4.5's attention_bias is q/k/v only (o_proj never has one).
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family in ("qwen2", "glm4_moe") else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3" or (glm and bool(cfg.get("use_qk_norm", False))),
            torch_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
            eos_token_ids=list(
                eos_token_ids if eos_token_ids is not None else _as_list(cfg.get("eos_token_id"))
            ),
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0)
            if arch in MTP_ARCHITECTURES
            else 0,
            draft_vocab_size=cfg.get("draft_vocab_size"),
            target_hidden_size=cfg.get("target_hidden_size"),
            eagle_aux_layer_ids=(cfg.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids"
            ),
            partial_rotary_factor=partial,
            moe=moe_from_config(cfg) if moe else None,
            mla=mla_from_config(cfg, rope_scaling) if family == "deepseek_v3" else None,
            weight_block_size=fp8.block if fp8 else None,
            hf_config=cfg,
        )

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V that one token occupies across all layers."""
        if self.mla is not None:  # one latent + rope key per token and layer, no separate V
            return self.num_hidden_layers * self.mla.cache_dim
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def moe_from_config(cfg: dict[str, Any]) -> MoEConfig:
    """The MoE fields of a GLM-4.5 (Glm4MoeConfig) config.json, refusing what is not run."""
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0)
    n_group = int(cfg.get("n_group") or 1)
    moe = MoEConfig(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        num_shared_experts=int(cfg.get("n_shared_experts") or 0),
        n_group=n_group,
        topk_group=int(cfg.get("topk_group") or 1),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(cfg.get("first_k_dense_replace") or 0),
    )
    if experts < 1 or experts % n_group or experts // n_group < 2:
        # Group scores are the sum of each group's two best experts (transformers' router).
        raise ValueError(
            f"n_routed_experts={experts} must split into n_group={n_group} groups of at least "
            "2 experts"
        )
    if not 1 <= moe.topk_group <= n_group or not 1 <= moe.top_k <= experts:
        raise ValueError(
            f"topk_group={moe.topk_group} must be in [1, n_group={n_group}] and "
            f"num_experts_per_tok={moe.top_k} in [1, n_routed_experts={experts}]"
        )
    if moe.top_k > moe.topk_group * (experts // n_group):
        raise ValueError(
            f"num_experts_per_tok={moe.top_k} exceeds the experts of topk_group={moe.topk_group} "
            "groups"
        )
    return moe


def rope_from_config(
    cfg: dict[str, Any], yarn: bool = False
) -> tuple[float, Optional[dict[str, Any]]]:
    """Rope theta and scaling (None for default rope) from transformers-5 `rope_parameters` or the
    older keys; `yarn`: the family implements YaRN scaling."""
    params = cfg.get("rope_parameters")
    if params is not None:
        params = dict(params)
        theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    else:
        theta = cfg.get("rope_theta", 10000.0)
        params = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else {}
    params.pop("partial_rotary_factor", None)  # ModelConfig.partial_rotary_factor
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    supported = SUPPORTED_ROPE_TYPES + (("yarn",) if yarn else ())
    if rope_type not in supported:
        raise ValueError(
            f"rope type {rope_type!r} is not supported for this model; supported: "
            f"{', '.join(supported)}"
        )
    if rope_type == "default":
        return float(theta), None
    if rope_type == "yarn" and params.get("factor") is None:
        # transformers: DeepSeek-style configs derive the factor from the context extension.
        old_ctx = params["original_max_position_embeddings"]
        params["factor"] = cfg["max_position_embeddings"] / old_ctx
    return float(theta), {"rope_type": rope_type, **params}


def _mla_geometry(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's config with the fields the shared reader expects: its KV cache is one
    latent head per token (num_key_value_heads 1, head_dim = latent + rope key). Router
    variants other than V3's (older configs name them) are refused."""
    for key, value in (
        ("scoring_func", "sigmoid"),
        ("topk_method", "noaux_tc"),
        ("moe_layer_freq", 1),
    ):
        if cfg.get(key, value) != value:
            raise ValueError(
                f"DeepSeek config with {key}={cfg[key]!r} is not supported; specrl runs "
                f"DeepSeek-V3's router ({key}={value!r})"
            )
    rope = int(cfg["qk_rope_head_dim"])
    if rope % 2:
        raise ValueError(f"qk_rope_head_dim={rope} must be even (rope rotates pairs of dims)")
    cache_dim = int(cfg["kv_lora_rank"]) + rope
    return {**cfg, "num_key_value_heads": 1, "head_dim": cache_dim}


def mla_from_config(cfg: dict[str, Any], rope_scaling: Optional[dict[str, Any]]) -> MLAConfig:
    """The MLA fields of a DeepseekV3Config, with the softmax scale transformers and SGLang use:
    qk_head_dim ** -0.5, times yarn_get_mscale(factor, mscale_all_dim) ** 2 under YaRN."""
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    scale = (nope + rope) ** -0.5
    if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
        m = yarn_mscale(float(rope_scaling["factor"]), float(rope_scaling["mscale_all_dim"]))
        scale *= m * m
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        softmax_scale=scale,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude correction (DeepSeek's yarn_get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _architecture(cfg: dict[str, Any]) -> tuple[str, str]:
    """The checkpoint's supported architecture name and its family."""
    archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type", ""), "")]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs!r} (model_type {cfg.get('model_type')!r}); "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch, SUPPORTED_ARCHITECTURES[arch]


def _check_supported(cfg: dict[str, Any], arch: str) -> None:
    """Refuse what the models here do not implement: sliding windows, activations other than
    SwiGLU's, query heads that do not group over the KV heads."""
    if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
        raise ValueError(
            f"{arch} with sliding-window attention is not supported; use a config with "
            "use_sliding_window=false"
        )
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{arch} with hidden_act={cfg['hidden_act']!r} is not supported; only silu (SwiGLU) is"
        )
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(
            f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )


def _partial_rotary_factor(cfg: dict[str, Any], head_dim: int) -> float:
    """The share of each head's dims that rotary embeddings turn (GLM-4.5: half)."""
    partial = float(
        (cfg.get("rope_parameters") or {}).get(
            "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)
        )
    )
    if int(head_dim * partial) % 2:
        raise ValueError(
            f"partial_rotary_factor={partial} leaves an odd number of rotary dims of "
            f"head_dim={head_dim}"
        )
    return partial
