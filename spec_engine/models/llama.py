"""Llama-family decoder (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms).

Model code only: takes (input_ids, positions, forward batch), returns final hidden states.
KV storage and scheduling live elsewhere; attention goes through the batch's backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers.attention import Attention
from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.layers.linear import Linear
from spec_engine.layers.vocab import Embedding
from spec_engine.model_config import ModelConfig
from spec_engine.weights import WeightSlot


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v.contiguous(), batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, rotary) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Llama, Qwen2 and Qwen3 causal LMs; the differences come from ModelConfig."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make a tied embedding share the head's storage again (after re-allocation)."""
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.tie_to(self.lm_head)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        """Every Hugging Face tensor name this model takes, and where it lands."""
        c = self.config
        q = c.num_attention_heads * c.head_dim
        kv = c.num_key_value_heads * c.head_dim
        h, inter = c.hidden_size, c.intermediate_size
        spec = {
            "model.embed_tokens.weight": WeightSlot("model.embed_tokens.weight", (c.vocab_size, h)),
            "model.norm.weight": WeightSlot("model.norm.weight", (h,)),
            "lm_head.weight": WeightSlot("lm_head.weight_t", (c.vocab_size, h), transposed=True,
                                         optional=c.tie_word_embeddings),
        }
        for i in range(c.num_hidden_layers):
            src, dst = f"model.layers.{i}.", f"model.layers.{i}."
            attn, mlp = dst + "self_attn.", dst + "mlp."
            for name, rows in (("q_proj", (0, q)), ("k_proj", (q, q + kv)), ("v_proj", (q + kv, q + 2 * kv))):
                spec[f"{src}self_attn.{name}.weight"] = WeightSlot(attn + "qkv_proj.weight_t", (rows[1] - rows[0], h), rows, transposed=True)
                if c.qkv_bias:
                    spec[f"{src}self_attn.{name}.bias"] = WeightSlot(attn + "qkv_proj.bias", (rows[1] - rows[0],), rows)
            spec[f"{src}self_attn.o_proj.weight"] = WeightSlot(attn + "o_proj.weight_t", (h, q), transposed=True)
            if c.o_bias:
                spec[f"{src}self_attn.o_proj.bias"] = WeightSlot(attn + "o_proj.bias", (h,))
            if c.qk_norm:
                spec[f"{src}self_attn.q_norm.weight"] = WeightSlot(attn + "q_norm.weight", (c.head_dim,))
                spec[f"{src}self_attn.k_norm.weight"] = WeightSlot(attn + "k_norm.weight", (c.head_dim,))
            for name, rows in (("gate_proj", (0, inter)), ("up_proj", (inter, 2 * inter))):
                spec[f"{src}mlp.{name}.weight"] = WeightSlot(mlp + "gate_up_proj.weight_t", (inter, h), rows, transposed=True)
                if c.mlp_bias:
                    spec[f"{src}mlp.{name}.bias"] = WeightSlot(mlp + "gate_up_proj.bias", (inter,), rows)
            spec[f"{src}mlp.down_proj.weight"] = WeightSlot(mlp + "down_proj.weight_t", (h, inter), transposed=True)
            if c.mlp_bias:
                spec[f"{src}mlp.down_proj.bias"] = WeightSlot(mlp + "down_proj.bias", (h,))
            spec[f"{src}input_layernorm.weight"] = WeightSlot(dst + "input_layernorm.weight", (h,))
            spec[f"{src}post_attention_layernorm.weight"] = WeightSlot(dst + "post_attention_layernorm.weight", (h,))
        return spec
