"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention (MLA) and GLM-4.5's MoE.

MLA: queries through an optional low-rank bottleneck (q_a_proj, q_a_layernorm, q_b_proj; or
q_proj when q_lora_rank is None); keys and values from one `kv_lora_rank` latent per token
(kv_a_proj_with_mqa, kv_a_layernorm) expanded per head by kv_b_proj, plus a `qk_rope_head_dim`
key that every head shares (decoupled rope, DeepSeek's interleaved pair layout by default).

The KV cache holds the compressed latent and the rope key, not per-head K/V (SGLang's MLA
pool, mem/kv_pool.MLAKVPool). Attention runs in the absorbed form: kv_b_proj's key half is
folded into each query head and its value half applied after attention, so the backend sees
multi-query attention with one cached "head" [latent | rope key] whose leading kv_lora_rank
columns are the values. Its scores equal the expanded form's, q_nope . k_nope + q_rope . k_rope,
so the softmax scale is transformers' (qk_head_dim ** -0.5, YaRN's mscale squared).

Tensor parallelism, as SGLang's DeepseekV2AttentionMLA: the query heads are split (q_proj or
q_b_proj and kv_b_proj column-parallel by heads, o_proj row-parallel, one all-reduce), while the
low-rank projections (q_a_proj, kv_a_proj_with_mqa) and their norms are replicated: every rank
computes and caches the whole latent and rope key of every token (the latent cache per rank),
and attends with its own heads over it.

MLP: dense SwiGLU in the first `first_k_dense_replace` layers, layers/moe.SparseMoE after (the
same sigmoid router with a correction bias, grouped top-k and shared experts as GLM-4.5). The
checkpoint's next-n layers (`model.layers.{num_hidden_layers + i}.*`) are accepted here and run
by the MTP draft (models/deepseek_v3_nextn.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import SINGLE, TPGroup, get_tp_group
from spec_engine.distributed.partition import divide
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers import batch_invariant as bi
from spec_engine.layers.attention import Attention
from spec_engine.layers.linear import Linear, RowParallelLinear
from spec_engine.layers.moe import moe_weight_spec
from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.models.glm4_moe import make_moe
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    dense_mlp_spec,
)
from spec_engine.weights.loader import WeightSlot
from spec_engine.weights.shard import block

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps,
# not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def make_mla_rotary(config: ModelConfig) -> RotaryEmbedding:
    positions = config.rope_max_positions or config.max_position_embeddings
    return RotaryEmbedding(
        config.mla.qk_rope_head_dim, positions, config.rope_theta, config.rope_scaling
    )


class MLAttention(nn.Module):
    batch_invariant = False  # --enable-deterministic-inference (layers/batch_invariant.py)

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        m, h = config.mla, config.hidden_size
        self.mla = m
        tp = get_tp_group()
        # This rank's query heads (all of them at one rank).
        self.num_heads = nh = divide(config.num_attention_heads, tp.size, "num_attention_heads")
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, nh * m.qk_head_dim)
        else:
            self.q_a_proj = Linear(h, m.q_lora_rank, bias=m.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, nh * m.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(h, m.cache_dim, bias=m.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(m.kv_lora_rank, nh * (m.qk_nope_head_dim + m.v_head_dim))
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * m.v_head_dim, h, bias=m.attention_bias
        )
        self.rotary = rotary
        self.attn = Attention(
            layer_id, nh, 1, m.cache_dim, v_head_dim=m.kv_lora_rank, scaling=m.softmax_scale
        )

    def _queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(-1, self.num_heads, self.mla.qk_head_dim)

    def _rope(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mla.rope_interleave:
            # Pairs (x0, x1), (x2, x3), ... rotate together: gathering evens then odds makes them
            # the neox halves, and the output stays in that order, as transformers leaves it
            # (q and k alike, so their dot products are unchanged).
            q = torch.cat((q[..., 0::2], q[..., 1::2]), dim=-1)
            k = torch.cat((k[..., 0::2], k[..., 1::2]), dim=-1)
        return self.rotary(positions, q, k)

    def _per_head(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x [T, heads, a] times w [heads, a, b] -> [T, heads, b] (each head its own matrix)."""
        heads, a, b = w.shape

        def matmul(rows: torch.Tensor) -> torch.Tensor:
            out = torch.bmm(rows.view(-1, heads, a).transpose(0, 1), w)
            return out.transpose(0, 1).reshape(-1, heads * b)

        flat = x.reshape(-1, heads * a)
        out = bi.row_blocked(matmul, flat) if self.batch_invariant else matmul(flat)
        return out.view(-1, heads, b)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        m, nh = self.mla, self.num_heads
        q_nope, q_rope = self._queries(hidden).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [m.kv_lora_rank, m.qk_rope_head_dim], -1
        )
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self._rope(positions, q_rope, k_rope[:, None, :])
        w = self.kv_b_proj.weight.view(nh, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_k, w_v = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        q = torch.cat((self._per_head(q_nope, w_k), q_rope), dim=-1)
        k = torch.cat((latent, k_rope[:, 0]), dim=-1)
        out = self.attn(q.reshape(-1, nh * m.cache_dim), k, k[:, : m.kv_lora_rank], batch)
        out = self._per_head(out.view(-1, nh, m.kv_lora_rank), w_v.transpose(1, 2))
        return self.o_proj(out.reshape(-1, nh * m.v_head_dim))


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with MLA; `moe` decides the MLP (None: as the config places it)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        rotary: RotaryEmbedding,
        moe: Optional[bool] = None,
        cache_layer: Optional[int] = None,
    ) -> None:
        # `cache_layer`: the layer's index in its KV pool (an MTP draft keeps its own pool).
        cache = layer_id if cache_layer is None else cache_layer
        use_moe = config.moe.is_moe_layer(layer_id) if moe is None else moe
        super().__init__(
            config,
            layer_id,
            rotary,
            mlp=make_moe(config) if use_moe else LlamaMLP(config),
            attn=MLAttention(config, cache, rotary),
        )


class DeepseekV3Model(LlamaModel):
    def make_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        return make_mla_rotary(config)

    def make_layer(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        return DeepseekV3DecoderLayer(config, layer_id, rotary)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 causal LM; forward, heads and EAGLE-3 capture are LlamaForCausalLM's."""

    model_cls = DeepseekV3Model

    def __init__(self, config: ModelConfig, capture_layers: Sequence[int] = ()) -> None:
        if config.mla is None or config.moe is None:
            raise ValueError(f"{config.architecture} is not an MLA + MoE config")
        super().__init__(config, capture_layers)

    def layer_weight_spec(self, layer_id: int) -> dict[str, WeightSlot]:
        return deepseek_v3_layer_spec(
            self.config, layer_id, f"model.layers.{layer_id}.", tp=self.tp
        )

    def mtp_weight_spec(self, index: int) -> dict[str, WeightSlot]:
        return deepseek_v3_nextn_spec(self.config, self.config.num_hidden_layers + index)


def mla_spec(c: ModelConfig, src: str, dst: str, tp: TPGroup = SINGLE) -> dict[str, WeightSlot]:
    """Slots of one MLA block: Hugging Face names under `src` (`...self_attn.`), params `dst`;
    rank `tp.rank`'s heads of the per-head projections under tensor parallelism."""
    m, h, nh = c.mla, c.hidden_size, c.num_attention_heads
    local = nh // tp.size  # MLAttention refuses a head count that does not divide
    # The per-head tensors: the block of this rank's heads along `dim` (head-major in HF).
    per_head = {
        "q_proj.weight": (0, m.qk_head_dim),
        "q_b_proj.weight": (0, m.qk_head_dim),
        "kv_b_proj.weight": (0, m.qk_nope_head_dim + m.v_head_dim),
        "o_proj.weight": (1, m.v_head_dim),
    }
    shapes: dict[str, tuple[int, ...]] = {
        "kv_a_proj_with_mqa.weight": (m.cache_dim, h),
        "kv_a_layernorm.weight": (m.kv_lora_rank,),
        "kv_b_proj.weight": (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        "o_proj.weight": (h, nh * m.v_head_dim),
    }
    if m.q_lora_rank is None:
        shapes["q_proj.weight"] = (nh * m.qk_head_dim, h)
    else:
        shapes["q_a_proj.weight"] = (m.q_lora_rank, h)
        shapes["q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes["q_b_proj.weight"] = (nh * m.qk_head_dim, m.q_lora_rank)
    if m.attention_bias:
        shapes["kv_a_proj_with_mqa.bias"] = (m.cache_dim,)
        shapes["o_proj.bias"] = (h,)
        if m.q_lora_rank is not None:
            shapes["q_a_proj.bias"] = (m.q_lora_rank,)
    spec = {}
    for name, shape in shapes.items():
        shard = None
        if tp.size > 1 and name in per_head:
            dim, width = per_head[name]
            shard = block(dim, tp.rank, local * width)
        spec[src + name] = WeightSlot(dst + name, shape, shard=shard)
    return spec


def deepseek_v3_layer_spec(
    c: ModelConfig, layer_id: int, dst: str, moe: Optional[bool] = None, tp: TPGroup = SINGLE
) -> dict[str, WeightSlot]:
    """Slots of decoder layer `layer_id` (names `model.layers.{layer_id}.*`) under `dst`; its MLP
    is the MoE when `moe` says so (None: as the config places MoE layers); rank `tp.rank`'s
    blocks under tensor parallelism."""
    src, h = f"model.layers.{layer_id}.", c.hidden_size
    spec = mla_spec(c, src + "self_attn.", dst + "self_attn.", tp)
    for norm in ("input_layernorm", "post_attention_layernorm"):
        spec[f"{src}{norm}.weight"] = WeightSlot(f"{dst}{norm}.weight", (h,))
    if c.moe.is_moe_layer(layer_id) if moe is None else moe:
        m = c.moe
        spec.update(
            moe_weight_spec(
                src + "mlp.",
                dst + "mlp.",
                h,
                m.num_experts,
                m.intermediate_size,
                m.num_shared_experts,
                tp,
            )
        )
    else:
        spec.update(dense_mlp_spec(c, src + "mlp.", dst + "mlp.", tp))
    return spec


def deepseek_v3_nextn_spec(c: ModelConfig, layer_id: int) -> dict[str, WeightSlot]:
    """Slots of a next-n layer as checkpoints name it: a decoder layer (always MoE, as SGLang's
    DeepseekModelNextN builds it) plus enorm/hnorm/eh_proj and a shared head, with the
    checkpoint's copies of the embedding and head."""
    src, h = f"model.layers.{layer_id}.", c.hidden_size
    spec = deepseek_v3_layer_spec(c, layer_id, src, moe=True)
    shapes = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (c.vocab_size, h),
        "embed_tokens.weight": (c.vocab_size, h),
    }
    spec.update({src + n: WeightSlot(src + n, shape) for n, shape in shapes.items()})
    return spec
