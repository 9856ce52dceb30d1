"""EAGLE-2 draft in the format SGLang loads as `LlamaForCausalLMEagle`.

fc mixes [token embedding, target feature] (2H -> H, with bias); then Llama decoder layers, the
first without an input norm; the output (hidden + residual, no final norm) is both the next
step's feature and what the target's LM head reads. Embedding and head are the target's.
Checkpoint names carry no `model.` prefix; its frozen embedding/head copies are not used.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers.linear import Linear
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import LlamaDecoderLayer, decoder_layer_spec, make_rotary
from spec_engine.weights.loader import WeightSlot


class LlamaForCausalLMEagle(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # The target's group: the decoder layers are split as the target's; fc is replicated.
        self.tp = get_tp_group()
        h = config.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        rotary = make_rotary(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, input_norm=i > 0)
            for i in range(config.num_hidden_layers)
        )

    def draft_forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        out = x + residual
        return out, out

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        c = self.config
        h = c.hidden_size
        spec = {
            "fc.weight": WeightSlot("fc.weight", (h, 2 * h)),
            "fc.bias": WeightSlot("fc.bias", (h,)),
            # Frozen copies of the target's tensors that EAGLE checkpoints ship; the target's are
            # used.
            "embed_tokens.weight": WeightSlot(None, (c.vocab_size, h), optional=True),
            "lm_head.weight": WeightSlot(None, (c.vocab_size, h), optional=True),
        }
        for i in range(c.num_hidden_layers):
            spec.update(
                decoder_layer_spec(c, f"layers.{i}.", f"layers.{i}.", input_norm=i > 0, tp=self.tp)
            )
        return spec
