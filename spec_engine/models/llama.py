"""Llama-family decoder (Llama, Qwen2 with q/k/v biases, Qwen3 with q/k norms; MiMo's trunk).

Model code only: takes (input_ids, positions, forward batch), returns hidden states. KV storage
and scheduling live elsewhere; attention goes through the batch's backend. Built inside
distributed.parallel_state.use_tp_group, it is this rank's part of a tensor-parallel model
(heads, MLP features and vocabulary split; the weight spec says which block of each checkpoint
tensor the rank takes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import SINGLE, TPGroup, get_tp_group
from spec_engine.distributed.partition import attention_heads, vocab_range
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers import batch_invariant as bi
from spec_engine.layers.attention import Attention
from spec_engine.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.layers.vocab import Embedding, ParallelLMHead
from spec_engine.models.hf_config import ModelConfig
from spec_engine.weights.loader import WeightSlot
from spec_engine.weights.shard import Shard, block


def make_rotary(config: ModelConfig) -> RotaryEmbedding:
    positions = config.rope_max_positions or config.max_position_embeddings
    return RotaryEmbedding(
        config.head_dim, positions, config.rope_theta, config.rope_scaling, config.rotary_dim
    )


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        in_features: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            in_features or config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
        )
        # This rank's heads (all of them at one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.heads.q, self.qkv_proj.heads.kv
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.o_bias,
            what="num_attention_heads * head_dim",
        )
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(
            q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v.contiguous(), batch
        )
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    batch_invariant = False  # --enable-deterministic-inference (layers/batch_invariant.py)
    act_kernel: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # layers/fused.py

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [inter, inter], bias=config.mlp_bias, what="intermediate_size"
        )
        self.intermediate_size = self.gate_up_proj.output_sizes[0]  # this rank's features
        self.down_proj = RowParallelLinear(
            inter, config.hidden_size, bias=config.mlp_bias, what="intermediate_size"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_kernel is not None:
            return self.down_proj(self.act_kernel(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(bi.silu(gate, self.batch_invariant) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        input_norm: bool = True,
        mlp: Optional[nn.Module] = None,
        attn: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        # EAGLE-2 drafts have no input norm on their first layer (its input is already mixed by fc).
        self.input_layernorm = (
            RMSNorm(config.hidden_size, config.rms_norm_eps) if input_norm else None
        )
        # MLA models (models/deepseek_v3.py) pass their own attention; the others use GQA.
        self.self_attn = attn if attn is not None else LlamaAttention(config, layer_id, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A MoE model passes its own MLP (models/glm4_moe.py); dense models use SwiGLU.
        self.mlp = mlp if mlp is not None else LlamaMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            # The fused norm below adds into its residual in place: not into our input.
            residual = self.post_attention_layernorm.owned(hidden)
            if self.input_layernorm is not None:
                hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, batch)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack. `capture_layers`: layers whose input (the residual stream entering
    them; len(layers) = the final one) is also returned, concatenated (EAGLE-3 targets)."""

    def __init__(self, config: ModelConfig, capture_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        rotary = self.make_rotary(config)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, rotary) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.capture_layers = tuple(capture_layers)

    def make_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        """The rotary embedding every layer shares (MLA models rotate their rope dims only)."""
        return make_rotary(config)

    def make_layer(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        """Decoder layer `layer_id` (subclasses swap the MLP)."""
        return LlamaDecoderLayer(config, layer_id, rotary)

    def forward(
        self,
        input_ids: Optional[torch.Tensor],
        positions: torch.Tensor,
        batch: ForwardBatch,
        input_embeds: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Returns (final normed hidden states, concatenated captured states or None)."""
        hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        captured = []
        for i, layer in enumerate(self.layers):
            if i in self.capture_layers:
                state = hidden if residual is None else hidden + residual
                captured.extend([state] * self.capture_layers.count(i))
            hidden, residual = layer(positions, hidden, residual, batch)
        if len(self.layers) in self.capture_layers:
            captured.extend([hidden + residual] * self.capture_layers.count(len(self.layers)))
        hidden, _ = self.norm(hidden, residual)
        return hidden, (torch.cat(captured, dim=-1) if captured else None)


class LlamaForCausalLM(nn.Module):
    """Llama, Qwen2, Qwen3 (and MiMo's trunk) causal LMs; the differences come from ModelConfig."""

    model_cls: type[LlamaModel] = LlamaModel

    def __init__(self, config: ModelConfig, capture_layers: Sequence[int] = ()) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()
        self.model = self.model_cls(config, capture_layers)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()

    @staticmethod
    def eagle3_capture_layers(
        config: ModelConfig, aux_layer_ids: Optional[Sequence[int]]
    ) -> tuple[int, ...]:
        """The layers an EAGLE-3 draft reads: the outputs of the draft config's
        `eagle_aux_hidden_state_layer_ids`, else SGLang's default, the residual stream entering
        layers 2, N//2 and N-3 (clamped for tiny models)."""
        n = config.num_hidden_layers
        layers = [i + 1 for i in aux_layer_ids] if aux_layer_ids is not None else [2, n // 2, n - 3]
        return tuple(min(max(i, 0), n) for i in layers)

    def tie_weights(self) -> None:
        """Make a tied embedding share the head's storage again (after re-allocation)."""
        if self.config.tie_word_embeddings:
            self.model.embed_tokens.tie_to(self.lm_head)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return self.model(input_ids, positions, batch)

    def draft_forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As a STANDALONE draft: a plain LM step (no target features)."""
        out, _ = self.model(None, positions, batch, input_embeds=embeds)
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        """Every Hugging Face tensor name this model takes, and where it lands."""
        c = self.config
        h = c.hidden_size
        vocab = vocab_slot(c.vocab_size, self.tp)
        spec = {
            "model.embed_tokens.weight": WeightSlot(
                "model.embed_tokens.weight", (c.vocab_size, h), **vocab
            ),
            "model.norm.weight": WeightSlot("model.norm.weight", (h,)),
            "lm_head.weight": WeightSlot(
                "lm_head.weight", (c.vocab_size, h), optional=c.tie_word_embeddings, **vocab
            ),
        }
        for i in range(c.num_hidden_layers):
            spec.update(self.layer_weight_spec(i))
        for i in range(c.num_mtp_layers):
            # MTP layers belong to the MTP draft (mtp_class); the trunk accepts and skips them.
            spec.update(
                {
                    name: WeightSlot(None, slot.shape, optional=True)
                    for name, slot in self.mtp_weight_spec(i).items()
                }
            )
        return spec

    def layer_weight_spec(self, layer_id: int) -> dict[str, WeightSlot]:
        """Slots of decoder layer `layer_id` (a family with other layers overrides this)."""
        prefix = f"model.layers.{layer_id}."
        return decoder_layer_spec(self.config, prefix, prefix, tp=self.tp)

    def mtp_weight_spec(self, index: int) -> dict[str, WeightSlot]:
        """Checkpoint names and shapes of MTP layer `index` (MiMo's `model.mtp_layers.*`)."""
        return mtp_layer_spec(self.config, index, "")


def vocab_slot(vocab_size: int, tp: TPGroup) -> dict:
    """A vocabulary-parallel tensor's rows and shard for this rank (none at one rank)."""
    if tp.size == 1:
        return {}
    r = vocab_range(vocab_size, tp.rank, tp.size)
    return {"rows": (0, r.rows), "shard": Shard(0, r.start, r.rows)}


def decoder_layer_spec(
    c: ModelConfig,
    src: str,
    dst: str,
    attn_in: Optional[int] = None,
    input_norm: bool = True,
    dense_mlp: bool = True,
    tp: TPGroup = SINGLE,
) -> dict[str, WeightSlot]:
    """Weight slots of one decoder layer: Hugging Face names under `src`, parameters under `dst`
    (without the MLP's when `dense_mlp` is False: a MoE layer adds its own); rank `tp.rank`'s
    heads and MLP features of them under tensor parallelism."""
    q = c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    h = c.hidden_size
    d_in = attn_in or h
    attn, mlp = dst + "self_attn.", dst + "mlp."
    heads = attention_heads(c.num_attention_heads, c.num_key_value_heads, tp.rank, tp.size)
    q_l, kv_l = heads.q * c.head_dim, heads.kv * c.head_dim  # this rank's block of each
    spec: dict[str, WeightSlot] = {}
    for name, full, rows, index in (
        ("q_proj", q, (0, q_l), tp.rank),
        ("k_proj", kv, (q_l, q_l + kv_l), heads.kv_index),
        ("v_proj", kv, (q_l + kv_l, q_l + 2 * kv_l), heads.kv_index),
    ):
        shard = block(0, index, rows[1] - rows[0]) if tp.size > 1 else None
        spec[f"{src}self_attn.{name}.weight"] = WeightSlot(
            attn + "qkv_proj.weight", (full, d_in), rows, shard=shard
        )
        if c.qkv_bias:
            spec[f"{src}self_attn.{name}.bias"] = WeightSlot(
                attn + "qkv_proj.bias", (full,), rows, shard=shard
            )
    o_shard = block(1, tp.rank, q_l) if tp.size > 1 else None
    spec[f"{src}self_attn.o_proj.weight"] = WeightSlot(
        attn + "o_proj.weight", (h, q), shard=o_shard
    )
    if c.o_bias:
        spec[f"{src}self_attn.o_proj.bias"] = WeightSlot(attn + "o_proj.bias", (h,))
    if c.qk_norm:
        spec[f"{src}self_attn.q_norm.weight"] = WeightSlot(attn + "q_norm.weight", (c.head_dim,))
        spec[f"{src}self_attn.k_norm.weight"] = WeightSlot(attn + "k_norm.weight", (c.head_dim,))
    if dense_mlp:
        spec.update(dense_mlp_spec(c, f"{src}mlp.", mlp, tp))
    if input_norm:
        spec[f"{src}input_layernorm.weight"] = WeightSlot(dst + "input_layernorm.weight", (h,))
    spec[f"{src}post_attention_layernorm.weight"] = WeightSlot(
        dst + "post_attention_layernorm.weight", (h,)
    )
    return spec


def dense_mlp_spec(
    c: ModelConfig, src: str, dst: str, tp: TPGroup = SINGLE
) -> dict[str, WeightSlot]:
    """Slots of a SwiGLU MLP (gate/up fused into gate_up_proj): names under `src`, params `dst`;
    rank `tp.rank`'s block of the intermediate features under tensor parallelism."""
    h, inter = c.hidden_size, c.intermediate_size
    local = inter // tp.size  # the layer refuses a size that does not divide
    column = block(0, tp.rank, local) if tp.size > 1 else None
    spec: dict[str, WeightSlot] = {}
    for name, rows in (("gate_proj", (0, local)), ("up_proj", (local, 2 * local))):
        spec[f"{src}{name}.weight"] = WeightSlot(
            dst + "gate_up_proj.weight", (inter, h), rows, shard=column
        )
        if c.mlp_bias:
            spec[f"{src}{name}.bias"] = WeightSlot(
                dst + "gate_up_proj.bias", (inter,), rows, shard=column
            )
    row = block(1, tp.rank, local) if tp.size > 1 else None
    spec[f"{src}down_proj.weight"] = WeightSlot(dst + "down_proj.weight", (h, inter), shard=row)
    if c.mlp_bias:
        spec[f"{src}down_proj.bias"] = WeightSlot(dst + "down_proj.bias", (h,))
    return spec


def mtp_layer_spec(
    c: ModelConfig, index: int, dst: str, tp: TPGroup = SINGLE
) -> dict[str, WeightSlot]:
    """Slots of MiMo's MTP layer `index` (names `model.mtp_layers.{index}.*`) under parameter
    prefix `dst`; rank `tp.rank`'s block of its decoder layer under tensor parallelism."""
    src = f"model.mtp_layers.{index}."
    h = c.hidden_size
    spec = decoder_layer_spec(c, src, dst + "block.", tp=tp)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        spec[f"{src}{norm}.weight"] = WeightSlot(f"{dst}{norm}.weight", (h,))
    spec[f"{src}input_proj.weight"] = WeightSlot(f"{dst}input_proj.weight", (h, 2 * h))
    return spec
