"""DeepSeek-V3's next-n (MTP) layers as a draft: weights `model.layers.{num_hidden_layers + i}.*`
of a DeepseekV3ForCausalLM checkpoint, run as SGLang's deepseek_nextn.DeepseekModelNextN does.

Each layer: eh_proj (2H -> H, no bias) over [enorm(embedding), hnorm(feature)] (embedding
first), one DeepSeek-V3 decoder layer (MLA, always the MoE MLP), then shared_head.norm over
output + residual; the normed output is what the LM head reads and the next step's feature.
Embedding and head are the target's, as SGLang's EAGLE worker shares them; the checkpoint's
copies (`embed_tokens`, `shared_head.head`) are accepted by the target's spec and not loaded.

`num_layers` next-n layers are built (1 unless --enable-multi-layer-eagle): layer i keeps its
KV in layer i of the draft's pool, and `draft_forward(..., layer=i)` runs it.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers.linear import Linear
from spec_engine.layers.norm import RMSNorm
from spec_engine.models.deepseek_v3 import (
    DeepseekV3DecoderLayer,
    deepseek_v3_layer_spec,
    make_mla_rotary,
)
from spec_engine.models.glm4_moe_nextn import SharedHead
from spec_engine.models.hf_config import ModelConfig
from spec_engine.weights.loader import WeightSlot


class DeepseekV3NextNLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.decoder = DeepseekV3DecoderLayer(
            config,
            config.num_hidden_layers + index,
            make_mla_rotary(config),
            moe=True,
            cache_layer=index,
        )
        self.shared_head = SharedHead(config)

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: torch.Tensor,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(hidden)), dim=-1))
        x, residual = self.decoder(positions, x, None, batch)
        out, _ = self.shared_head.norm(x, residual)
        return out


class DeepseekV3NextN(nn.Module):
    def __init__(self, config: ModelConfig, num_layers: int = 1) -> None:
        super().__init__()
        if not 1 <= num_layers <= config.num_mtp_layers:
            raise ValueError(
                f"{config.architecture} has {config.num_mtp_layers} MTP layers "
                f"(num_nextn_predict_layers); cannot draft with {num_layers}"
            )
        self.config = config
        self.tp = get_tp_group()  # the target's: the layers are split as the target's layers
        self.layers = nn.ModuleList(DeepseekV3NextNLayer(config, i) for i in range(num_layers))

    def draft_forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
        layer: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.layers[layer](embeds, positions, batch, hidden)
        return out, out

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        c, h = self.config, self.config.hidden_size
        spec: dict[str, WeightSlot] = {}
        for i in range(len(self.layers)):
            layer_id, dst = c.num_hidden_layers + i, f"layers.{i}."
            src = f"model.layers.{layer_id}."
            spec.update(deepseek_v3_layer_spec(c, layer_id, dst + "decoder.", moe=True, tp=self.tp))
            for name, shape in (
                ("enorm.weight", (h,)),
                ("hnorm.weight", (h,)),
                ("eh_proj.weight", (h, 2 * h)),
                ("shared_head.norm.weight", (h,)),
            ):
                spec[src + name] = WeightSlot(dst + name, shape)
        return spec
