"""GLM-4.5 (Glm4MoeForCausalLM): the Llama decoder with GLM's attention and MoE MLPs.

Attention: GQA with q/k/v biases (`attention_bias`; o_proj never has one), optional per-head q/k
RMSNorm (`use_qk_norm`), rotary on the leading head_dim * partial_rotary_factor dims; all of it
expressed by ModelConfig, so LlamaAttention runs it. MLP: dense SwiGLU in the first
`first_k_dense_replace` layers, layers/moe.SparseMoE after. The checkpoint's multi-token-
prediction layers (`model.layers.{num_hidden_layers + i}.*`, num_nextn_predict_layers) are
accepted here; the first is the MTP draft's (models/glm4_moe_nextn.py).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from spec_engine.distributed.parallel_state import SINGLE, TPGroup
from spec_engine.layers.moe import SparseMoE, moe_weight_spec
from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    decoder_layer_spec,
)
from spec_engine.weights.loader import WeightSlot


def make_moe(config: ModelConfig) -> SparseMoE:
    m = config.moe
    return SparseMoE(
        config.hidden_size,
        m.num_experts,
        m.top_k,
        m.intermediate_size,
        m.num_shared_experts,
        m.n_group,
        m.topk_group,
        m.norm_topk_prob,
        m.routed_scaling_factor,
    )


class Glm4MoeModel(LlamaModel):
    def make_layer(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> nn.Module:
        mlp = make_moe(config) if config.moe.is_moe_layer(layer_id) else None
        return LlamaDecoderLayer(config, layer_id, rotary, mlp=mlp)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """GLM-4.5 causal LM; forward, heads and EAGLE-3 capture are LlamaForCausalLM's."""

    model_cls = Glm4MoeModel

    def layer_weight_spec(self, layer_id: int) -> dict[str, WeightSlot]:
        return glm4_moe_layer_spec(self.config, layer_id, f"model.layers.{layer_id}.", tp=self.tp)

    def mtp_weight_spec(self, index: int) -> dict[str, WeightSlot]:
        # Next-n layers follow the trunk's; the first is the MTP draft's
        # (models/glm4_moe_nextn.py).
        return glm4_moe_mtp_layer_spec(self.config, self.config.num_hidden_layers + index)


def glm4_moe_layer_spec(
    c: ModelConfig, layer_id: int, dst: str, moe: Optional[bool] = None, tp: TPGroup = SINGLE
) -> dict[str, WeightSlot]:
    """Slots of decoder layer `layer_id` (names `model.layers.{layer_id}.*`) under `dst`; its MLP
    is the MoE when `moe` says so (None: as the config places MoE layers); rank `tp.rank`'s
    blocks under tensor parallelism."""
    src = f"model.layers.{layer_id}."
    if moe is None:
        moe = c.moe.is_moe_layer(layer_id)
    spec = decoder_layer_spec(c, src, dst, dense_mlp=not moe, tp=tp)
    if moe:
        m = c.moe
        spec.update(
            moe_weight_spec(
                src + "mlp.",
                dst + "mlp.",
                c.hidden_size,
                m.num_experts,
                m.intermediate_size,
                m.num_shared_experts,
                tp,
            )
        )
    return spec


def glm4_moe_mtp_layer_spec(c: ModelConfig, layer_id: int) -> dict[str, WeightSlot]:
    """Slots of a GLM-4.5 MTP layer as checkpoints name it (SGLang's glm4_moe_nextn layout): a
    decoder layer plus enorm/hnorm/eh_proj and a shared head (embedding and head optional)."""
    src, h = f"model.layers.{layer_id}.", c.hidden_size
    spec = glm4_moe_layer_spec(c, layer_id, src, moe=True)  # SGLang: is_nextn layers are MoE
    spec.update(
        {
            f"{src}enorm.weight": WeightSlot(src + "enorm.weight", (h,)),
            f"{src}hnorm.weight": WeightSlot(src + "hnorm.weight", (h,)),
            f"{src}eh_proj.weight": WeightSlot(src + "eh_proj.weight", (h, 2 * h)),
            f"{src}shared_head.norm.weight": WeightSlot(src + "shared_head.norm.weight", (h,)),
            f"{src}shared_head.head.weight": WeightSlot(
                src + "shared_head.head.weight", (c.vocab_size, h)
            ),
            f"{src}embed_tokens.weight": WeightSlot(src + "embed_tokens.weight", (c.vocab_size, h)),
        }
    )
    return spec
