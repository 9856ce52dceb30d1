"""GLM-4.5's next-n (MTP) layer as a draft: weights `model.layers.{num_hidden_layers}.*` of a
Glm4MoeForCausalLM checkpoint, run as SGLang's glm4_moe_nextn.Glm4MoeModelNextN does.

eh_proj (2H -> H, no bias) over [enorm(embedding), hnorm(target feature)] (embedding first; no
masking at position 0), one GLM-4.5 decoder layer whose MLP is always the MoE (SGLang builds the
next-n layer with is_nextn=True), then shared_head.norm over output + residual; the normed
output is both what the LM head reads and the next step's feature. Embedding and head are the
target's, as SGLang's EAGLE worker shares them (set_embed_and_head): the checkpoint's copies
`embed_tokens` and `shared_head.head` are accepted by the target's spec and not loaded, as
SGLang's loader skips them. Every draft step uses this first next-n layer
(--enable-multi-layer-eagle is implemented for DeepSeek-V3's, models/deepseek_v3_nextn.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers.linear import Linear
from spec_engine.layers.norm import RMSNorm
from spec_engine.models.glm4_moe import glm4_moe_layer_spec, make_moe
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import LlamaDecoderLayer, make_rotary
from spec_engine.weights.loader import WeightSlot


class SharedHead(nn.Module):
    """The checkpoint's `shared_head`; only its norm runs (the head is the target's)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Glm4MoeNextN(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()  # the target's: the layer is split as the target's layers
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        # Layer 0 of the draft's own one-layer KV pool.
        self.decoder = LlamaDecoderLayer(config, 0, make_rotary(config), mlp=make_moe(config))
        self.shared_head = SharedHead(config)

    def draft_forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x, residual = self.decoder(positions, x, None, batch)
        out, _ = self.shared_head.norm(x, residual)
        return out, out

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        c, h = self.config, self.config.hidden_size
        src = f"model.layers.{c.num_hidden_layers}."
        spec = glm4_moe_layer_spec(c, c.num_hidden_layers, "decoder.", moe=True, tp=self.tp)
        for name, shape in (
            ("enorm.weight", (h,)),
            ("hnorm.weight", (h,)),
            ("eh_proj.weight", (h, 2 * h)),
            ("shared_head.norm.weight", (h,)),
        ):
            spec[src + name] = WeightSlot(name, shape)
        return spec
