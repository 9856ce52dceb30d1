"""EAGLE-3 draft in the format SGLang loads as `LlamaForCausalLMEagle3`.

fc maps three captured target hidden states (3 x target H) to H; one decoder layer whose
attention reads [input_layernorm(embedding), hidden_norm(feature)] (2H wide) with the feature
as residual; a final norm feeds its own LM head over a draft vocabulary, whose ids map to
target ids through `d2t` (target = draft + d2t[draft]). The pre-norm sum is the next step's
feature. The embedding is the target's.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.forward_batch import ForwardBatch
from spec_engine.layers.linear import Linear
from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.vocab import ParallelLMHead
from spec_engine.models.hf_config import ModelConfig
from spec_engine.models.llama import (
    LlamaAttention,
    LlamaMLP,
    decoder_layer_spec,
    make_rotary,
    vocab_slot,
)
from spec_engine.weights.loader import WeightSlot


class Eagle3Layer(nn.Module):
    def __init__(self, config: ModelConfig, rotary) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, 0, rotary, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = self.post_attention_layernorm.owned(hidden)  # the fused norm adds in place
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLMEagle3(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.num_hidden_layers != 1:
            raise ValueError(
                f"EAGLE-3 drafts with {config.num_hidden_layers} layers are not supported (one "
                "midlayer only)"
            )
        self.config = config
        # The target's group: the midlayer is split as the target's layers, the draft head over
        # the draft vocabulary (SGLang's ParallelLMHead); fc over the aux features is replicated.
        self.tp = get_tp_group()
        h = config.hidden_size
        target_h = config.target_hidden_size or h
        self.fc = Linear(3 * target_h, h, bias=bool(config.hf_config.get("bias", False)))
        self.midlayer = Eagle3Layer(config, make_rotary(config))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.draft_vocab_size = config.draft_vocab_size
        if self.draft_vocab_size is not None:
            self.lm_head = ParallelLMHead(h, self.draft_vocab_size)
            self.d2t = nn.Parameter(
                torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False
            )

    def draft_forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        hidden: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)  # target features (3 layers concatenated) at draft extend
        x, residual = self.midlayer(positions, embeds, hidden, batch)
        to_logits, to_next = self.norm(x, residual)
        return to_logits, to_next

    def draft_head(self) -> Optional[ParallelLMHead]:
        return self.lm_head if self.draft_vocab_size is not None else None

    def hot_token_ids(self) -> Optional[torch.Tensor]:
        """Target id of each draft-vocabulary id (None: the draft uses the target vocabulary)."""
        if self.draft_vocab_size is None:
            return None
        return self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)

    def hf_weight_spec(self) -> dict[str, WeightSlot]:
        c = self.config
        h = c.hidden_size
        target_h = c.target_hidden_size or h
        spec = decoder_layer_spec(c, "midlayer.", "midlayer.", attn_in=2 * h, tp=self.tp)
        spec.update(
            {
                "midlayer.hidden_norm.weight": WeightSlot("midlayer.hidden_norm.weight", (h,)),
                "fc.weight": WeightSlot("fc.weight", (h, 3 * target_h)),
                "norm.weight": WeightSlot("norm.weight", (h,)),
                "embed_tokens.weight": WeightSlot(None, (c.vocab_size, h), optional=True),
            }
        )
        if self.fc.bias is not None:
            spec["fc.bias"] = WeightSlot("fc.bias", (h,))
        if self.draft_vocab_size is not None:
            vd = self.draft_vocab_size
            spec["lm_head.weight"] = WeightSlot(
                "lm_head.weight", (vd, h), **vocab_slot(vd, self.tp)
            )
            spec["d2t"] = WeightSlot("d2t", (vd,), integer=True)
            spec["t2d"] = WeightSlot(None, (c.vocab_size,), optional=True, integer=True)
        return spec
