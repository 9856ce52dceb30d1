"""MiMo's multi-token-prediction layer as a draft (weights `model.mtp_layers.0.*` of a
MiMoForCausalLM checkpoint).

input_proj (2H -> H, no bias) over [hidden_layernorm(target feature), token_layernorm(embedding)]
(feature first), one Qwen2 decoder layer, residual add, final_layernorm; the normed output is
both what the target's LM head reads and the next step's feature. The embedding at position 0
is zeroed, as MiMo was trained. Embedding and head are the target's. Every draft step uses this
first MTP layer (SGLang's behaviour without multi-layer EAGLE).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers.linear import Linear
from spec_engine.layers.norm import RMSNorm
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import LlamaDecoderLayer, make_rotary, mtp_layer_spec
from spec_engine.weights.loader import WeightSlot


class MiMoMTP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tp = get_tp_group()  # the target's: the block is split as the target's layers
        h = config.hidden_size
        self.token_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.input_proj = Linear(2 * h, h)
        self.block = LlamaDecoderLayer(config, 0, make_rotary(config))
        self.final_layernorm = RMSNorm(h, config.rms_norm_eps)

    def draft_forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        embeds = embeds.masked_fill((positions == 0)[:, None], 0.0)
        x = self.input_proj(
            torch.cat((self.hidden_layernorm(hidden), self.token_layernorm(embeds)), dim=-1)
        )
        x, residual = self.block(positions, x, None, batch)
        out = self.final_layernorm(x + residual)
        return out, out

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        return mtp_layer_spec(self.config, 0, "", tp=self.tp)
