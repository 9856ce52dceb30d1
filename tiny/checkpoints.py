"""Tiny random Hugging Face checkpoints and a locally trained tokenizer (no hub access).

Targets (Llama, Qwen2, Qwen3, GLM-4.5 MoE, DeepSeek-V3), MiMo MTP layers, EAGLE-2/EAGLE-3
drafts; the command line is `python scripts/make_tiny_model.py --out DIR [--arch ...]`.
The checkpoint is written by transformers' own `save_pretrained` (config.json + safetensors),
the tokenizer is a byte-level BPE trained with `tokenizers` on a generated corpus, with a
ChatML chat template. Tests and examples use the same functions.
"""

from __future__ import annotations

import os
import random
from typing import Any

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a an one two three four five six seven eight nine ten cat dog bird fish tree river stone "
    "house road city light dark red green blue small large quick slow runs jumps sees finds makes "
    "takes gives and or but if then when where why how what who is are was were be been has have "
    "had do does did plus minus times equals answer question number sum of to in on at by for with"
).split()


def corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.append(f"{rng.randint(0, 999)} + {rng.randint(0, 999)} = {rng.randint(0, 1998)}")
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ""]))
    return lines


# GLM-4.5 (Glm4MoeForCausalLM) at tiny size: every routing feature on (grouped top-k with 2 of 8
# experts from the best of 2 groups, a shared expert, scaling) plus partial rotary and q/k/v
# biases; `extra_config` overrides any of it (use_qk_norm, num_nextn_predict_layers, ...).
GLM4_MOE_TINY: dict[str, Any] = dict(
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
)


# DeepSeek-V3 (DeepseekV3ForCausalLM) at tiny size: MLA with a query bottleneck (q_lora_rank
# None drops it), interleaved rope on 8 of each head's 24 query/key dims, and GLM's routing.
DEEPSEEK_V3_TINY: dict[str, Any] = dict(
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,  # transformers' rotary reads head_dim: DeepSeek sets it to qk_rope_head_dim
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
)


def build_tokenizer(out_dir: str, vocab_size: int = 512) -> Any:
    """Train a byte-level BPE tokenizer and save it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    fast.save_pretrained(out_dir)
    return fast


def build_checkpoint(
    out_dir: str,
    arch: str = "llama",
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
    rope_scaling: dict | None = None,
    initializer_range: float = 0.1,
    seed: int = 0,
    max_shard_size: str | None = None,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    dtype: str = "float32",
    extra_config: dict[str, Any] | None = None,
    init_device: str = "cpu",
) -> str:
    """Save a random model of the given family with `save_pretrained` (safetensors), in `dtype`;
    `extra_config`: more config keys (for glm4_moe, over GLM4_MOE_TINY); `init_device`: where the
    random weights are drawn ("cuda" builds an 8B model in seconds rather than minutes)."""
    import torch

    config_cls, model_cls = _family(arch)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    kwargs.update(_family_keys(arch, num_heads, head_dim, rope_scaling))
    kwargs.update(extra_config or {})
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = model_cls._from_config(config, dtype=getattr(torch, dtype))
    if arch in ("glm4_moe", "deepseek_v3"):
        _randomize_router_bias(model)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    if arch in ("glm4_moe", "deepseek_v3") and getattr(config, "num_nextn_predict_layers", 0):
        _add_nextn_layers(out_dir, config, model_cls, dtype)
    return out_dir


def _family(arch: str) -> tuple[Any, Any]:
    """transformers' config and model classes of a family."""
    from transformers import (
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
        Glm4MoeConfig,
        Glm4MoeForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM),
        "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
    }
    if arch not in families:
        raise ValueError(f"--arch must be one of {', '.join(families)}, got {arch!r}")
    return families[arch]


def _family_keys(
    arch: str, num_heads: int, head_dim: int | None, rope_scaling: dict | None
) -> dict[str, Any]:
    """Config keys beyond the common shape: those given, and the MoE families' tiny defaults."""
    keys: dict[str, Any] = {}
    if head_dim is not None:
        keys["head_dim"] = head_dim
    if rope_scaling is not None:
        keys["rope_scaling"] = rope_scaling
    if arch == "glm4_moe":
        keys.update(GLM4_MOE_TINY)
    if arch == "deepseek_v3":
        # MLA expands its keys to every head; transformers' DeepSeek needs kv heads == heads.
        keys.update(DEEPSEEK_V3_TINY, num_key_value_heads=num_heads)
    return keys


def _randomize_router_bias(model: Any) -> None:
    """transformers initialises e_score_correction_bias to zeros; a random one makes expert
    selection (biased scores) differ from expert weighting (unbiased), as in trained models."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.e_score_correction_bias.normal_(0.0, 0.1)


def _add_nextn_layers(out_dir: str, config: Any, model_cls: Any, dtype: str) -> None:
    """Append GLM-4.5's or DeepSeek-V3's MTP layers (`model.layers.{N + i}.*`: a MoE decoder
    layer plus enorm/hnorm/eh_proj/shared_head.norm), which transformers' classes do not build:
    the layer tensors come from the same class built with N + num_nextn_predict_layers layers.
    Each also carries the copies of the embedding and the head that both releases publish
    (`embed_tokens`, `shared_head.head`)."""
    import copy
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    n, extra = config.num_hidden_layers, config.num_nextn_predict_layers
    bigger = copy.deepcopy(config)
    bigger.num_hidden_layers = n + extra
    with tempfile.TemporaryDirectory() as tmp:
        model_cls._from_config(bigger, dtype=getattr(torch, dtype)).save_pretrained(tmp)
        more = load_file(os.path.join(tmp, "model.safetensors"))
    weights_path = os.path.join(out_dir, "model.safetensors")
    tensors = load_file(weights_path)
    tensors.update(
        {
            k: v
            for k, v in more.items()
            if k.startswith("model.layers.") and int(k.split(".")[2]) >= n
        }
    )
    h, g = config.hidden_size, torch.Generator().manual_seed(n)
    for i in range(n, n + extra):
        prefix = f"model.layers.{i}."
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(h, dtype=getattr(torch, dtype))
        tensors[f"{prefix}eh_proj.weight"] = _random((h, 2 * h), 0.1, g).to(getattr(torch, dtype))
        tensors[f"{prefix}embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied
        tensors[f"{prefix}shared_head.head.weight"] = head.clone()
    save_file(tensors, weights_path, metadata={"format": "pt"})


def _draft_config(
    target_dir: str, architecture: str, num_layers: int, **extra: Any
) -> dict[str, Any]:
    import json

    with open(os.path.join(target_dir, "config.json")) as f:
        target = json.load(f)
    keep = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    )
    config = {k: target[k] for k in keep if k in target}
    config.update(
        architectures=[architecture],
        model_type="llama",
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        **extra,
    )
    return config


def _random(shape: tuple[int, ...], std: float, generator: Any) -> Any:
    import torch

    return torch.randn(shape, generator=generator) * std


def _llama_layer(
    prefix: str,
    config: dict[str, Any],
    generator: Any,
    attn_in: int | None = None,
    input_norm: bool = True,
    qkv_bias: bool = False,
    std: float = 0.1,
) -> dict[str, Any]:
    import torch

    h, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    d_in = attn_in or h
    t = {
        f"{prefix}self_attn.q_proj.weight": _random((q, d_in), std, generator),
        f"{prefix}self_attn.k_proj.weight": _random((kv, d_in), std, generator),
        f"{prefix}self_attn.v_proj.weight": _random((kv, d_in), std, generator),
        f"{prefix}self_attn.o_proj.weight": _random((h, q), std, generator),
        f"{prefix}mlp.gate_proj.weight": _random((inter, h), std, generator),
        f"{prefix}mlp.up_proj.weight": _random((inter, h), std, generator),
        f"{prefix}mlp.down_proj.weight": _random((h, inter), std, generator),
        f"{prefix}post_attention_layernorm.weight": torch.ones(h),
    }
    if qkv_bias:
        for name, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            t[f"{prefix}self_attn.{name}.bias"] = _random((n,), std, generator)
    if input_norm:
        t[f"{prefix}input_layernorm.weight"] = torch.ones(h)
    return t


def build_eagle_draft(
    out_dir: str,
    target_dir: str,
    version: int = 2,
    num_layers: int = 1,
    draft_vocab_size: int | None = None,
    aux_layer_ids: list[int] | None = None,
    seed: int = 1,
    std: float = 0.1,
) -> str:
    """A random EAGLE-2 (`LlamaForCausalLMEagle`) or EAGLE-3 (`LlamaForCausalLMEagle3`) draft for
    the target, in the checkpoint layout SGLang loads (no `model.` prefix)."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    if version == 2:
        config = _draft_config(target_dir, "LlamaForCausalLMEagle", num_layers)
        h = config["hidden_size"]
        tensors = {
            "fc.weight": _random((h, 2 * h), std, g),
            "fc.bias": _random((h,), std, g),
            "embed_tokens.weight": _random((config["vocab_size"], h), std, g),
        }
        for i in range(num_layers):
            tensors.update(_llama_layer(f"layers.{i}.", config, g, input_norm=i > 0, std=std))
    elif version == 3:
        extra: dict[str, Any] = {}
        if draft_vocab_size is not None:
            extra["draft_vocab_size"] = draft_vocab_size
        if aux_layer_ids is not None:
            extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
        config = _draft_config(target_dir, "LlamaForCausalLMEagle3", 1, **extra)
        h, vocab = config["hidden_size"], config["vocab_size"]
        tensors = {
            "fc.weight": _random((h, 3 * h), std, g),
            "norm.weight": torch.ones(h),
            "midlayer.hidden_norm.weight": torch.ones(h),
        }
        tensors.update(_llama_layer("midlayer.", config, g, attn_in=2 * h, std=std))
        if draft_vocab_size is not None:
            hot = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab_size]).values
            tensors["lm_head.weight"] = _random((draft_vocab_size, h), std, g)
            tensors["d2t"] = hot - torch.arange(draft_vocab_size)
            tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True)
    else:
        raise ValueError(f"EAGLE version must be 2 or 3, got {version}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))
    return out_dir


def add_mimo_mtp(
    checkpoint_dir: str, num_mtp_layers: int = 1, seed: int = 2, std: float = 0.1
) -> str:
    """Turn a Qwen2 checkpoint into a MiMo one: `model.mtp_layers.*` tensors and a MiMo config."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    path = os.path.join(checkpoint_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(
        architectures=["MiMoForCausalLM"],
        model_type="mimo",
        num_nextn_predict_layers=num_mtp_layers,
    )
    weights_path = os.path.join(checkpoint_dir, "model.safetensors")
    tensors = load_file(weights_path)
    g = torch.Generator().manual_seed(seed)
    h = config["hidden_size"]
    for i in range(num_mtp_layers):
        prefix = f"model.mtp_layers.{i}."
        tensors.update(_llama_layer(prefix, config, g, qkv_bias=True, std=std))
        tensors[f"{prefix}token_layernorm.weight"] = torch.ones(h)
        tensors[f"{prefix}hidden_layernorm.weight"] = torch.ones(h)
        tensors[f"{prefix}final_layernorm.weight"] = torch.ones(h)
        tensors[f"{prefix}input_proj.weight"] = _random((h, 2 * h), std, g)
    save_file(tensors, weights_path)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return checkpoint_dir


def build_tiny_model(out_dir: str, arch: str = "llama", **kwargs: Any) -> str:
    """A tokenizer and a checkpoint in one directory, ready for --model-path."""
    tokenizer = build_tokenizer(out_dir, vocab_size=kwargs.get("vocab_size", 512))
    ids = tokenizer.convert_tokens_to_ids(["<s>", "</s>"])
    return build_checkpoint(out_dir, arch=arch, bos_token_id=ids[0], eos_token_id=ids[1], **kwargs)
