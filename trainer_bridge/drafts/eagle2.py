"""An EAGLE-2 draft (`LlamaForCausalLMEagle`, as the engine loads it) on the trainer side, and
EAGLE's training loss (Li et al. 2024; SafeAILab/EAGLE, eagle/train/main.py).

What the engine computes (spec_engine/models/llama_eagle.py, speculative/draft_runner.py): fc
(2H -> H, with bias) over [the token's embedding, the target's final hidden state], the Llama
decoder layers, the first without an input norm, and no final norm: hidden + residual is both
the next step's feature and what the target's LM head reads. The embedding and the head are the
target's (the policy's, pushed with it): they are arguments here, detached, neither trained nor
pushed under `draft.`. The feature is the target's last hidden state after its final norm (the
engine's `ForwardOutput.hidden`, the megatron decoder's output), as EAGLE's `hidden_states[-1]`.

The module's parameters carry the checkpoint's own names (`fc.*`, `layers.{i}.*`), so a state
dict is a checkpoint and the names pushed to the engines are these with the `draft.` prefix.

The loss is EAGLE's, not EAGLE-3's training-time test: an EAGLE-2 draft feeds its own output
back as the next step's feature, which works because training regresses that output onto the
target's feature space (SpecForge's TTT loss has no such term, and EAGLE-2 checkpoints were
trained this way, so online training keeps the draft where it started). At position t the draft
reads the target's feature at t and the embedding of token t + 1 and predicts the target's
feature at t + 1: the loss is smooth-L1 to that feature (mean over H, weight v_w = 1.0) plus
0.1 (p_w) x the cross-entropy of head(prediction) to the target's distribution of token t + 2
(softmax of its logits at t + 1), averaged over response positions (token t + 2 a response
token). EAGLE's uniform noise on the input features (a data augmentation for offline epochs
over fixed features) is left out: RL's features are new each step, and the loss stays a
deterministic function of the batch.

Layout of a batch as trainer_bridge.drafts.eagle3's: tokens [b, S]; `features` [b, S, H];
`target_logits` [b, S, V], position t predicting token t + 1; `mask` [b, S - 1], t marking
token t + 1 as a response token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.drafts.layers import (
    DraftAttention,
    DraftMLP,
    draft_config,
    load_checkpoint,
    save_pretrained,
)

EAGLE2_ARCHITECTURE = "LlamaForCausalLMEagle"
# EAGLE's train_config (eagle/train/main.py): loss = v_w x vloss + p_w x ploss.
FEATURE_WEIGHT = 1.0
TOKEN_WEIGHT = 0.1


class _Layer(nn.Module):
    """A Llama decoder layer (the engine's LlamaDecoderLayer), optionally without input norm."""

    def __init__(
        self, config: ModelConfig, rotary: RotaryEmbedding, device: torch.device, input_norm: bool
    ) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps).to(device) if input_norm else None
        self.self_attn = DraftAttention(config, rotary, device, in_features=h)
        self.post_attention_layernorm = RMSNorm(h, eps).to(device)
        self.mlp = DraftMLP(config, device)

    def forward(
        self, x: Tensor, residual: Optional[Tensor], positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual = x
            if self.input_layernorm is not None:
                x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, [])  # one step: causal attention over the sequence
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Eagle2Draft(nn.Module):
    """The draft's weights and its forward over a sequence; see the module docstring."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        if config.architecture != EAGLE2_ARCHITECTURE:
            raise ValueError(
                f"Eagle2Draft is a {EAGLE2_ARCHITECTURE} draft; got {config.architecture}"
            )
        self.config = config
        h = config.hidden_size
        rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_max_positions or config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rotary_dim,
        )
        self.fc = nn.Linear(2 * h, h, bias=True, device=device)
        self.layers = nn.ModuleList(
            _Layer(config, rotary, device, input_norm=i > 0)
            for i in range(config.num_hidden_layers)
        )

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device, positions: int = 0) -> Eagle2Draft:
        """The draft in `path` (float32: its optimizer steps these weights directly), its rotary
        tables covering at least `positions` (layers.draft_config)."""
        model = cls(draft_config(path, positions), device)
        # Frozen copies of the target's embedding and head that EAGLE checkpoints ship: unused.
        load_checkpoint(model, path, "EAGLE-2", {"embed_tokens.weight", "lm_head.weight"})
        return model

    def forward(self, embeds: Tensor, hidden: Tensor, positions: Tensor) -> Tensor:
        """The predicted features [b, s, H] (what the head reads and the next step's input) from
        the tokens' embeddings and the features before them, at rotary `positions` [s]."""
        x = self.fc(torch.cat((embeds, hidden), dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions)
        return x + residual

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every checkpoint tensor under its own name (without the engine's `draft.` prefix)."""
        yield from self.state_dict().items()

    def save_pretrained(self, path: str, like: str) -> None:
        """A checkpoint directory the engine loads: `like`'s config.json and these weights (no
        embedding or head: the engine drafts with the target's)."""
        save_pretrained(self, path, like)


def _next(x: Tensor) -> Tensor:
    """x moved one position left along dim 1, zero-filled at the end."""
    return torch.cat((x[:, 1:], torch.zeros_like(x[:, :1])), dim=1)


def eagle_loss(
    draft: Eagle2Draft,
    embed_weight: Tensor,
    head_weight: Tensor,
    tokens: Tensor,
    features: Tensor,
    target_logits: Tensor,
    mask: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """EAGLE's loss: (FEATURE_WEIGHT x feature + TOKEN_WEIGHT x token, {"feature": the smooth-L1
    regression, "token": the cross-entropy}); see the module docstring. `embed_weight` [V, H] and
    `head_weight` [V, H]: the target's (constants of this loss)."""
    b, s = tokens.shape
    scored = torch.zeros(b, s, dtype=torch.float32, device=tokens.device)
    scored[:, : s - 2] = mask[:, 1:].float()  # position t is scored by token t + 2
    count = scored.sum().clamp(min=1.0)
    hidden = features.detach()
    embeds = F.embedding(_next(tokens), embed_weight.detach())  # token t + 1
    predicted = draft(embeds, hidden, torch.arange(s, device=tokens.device))
    with torch.no_grad():
        target = _next(hidden).float()  # the target's feature at t + 1
        target_p = torch.softmax(_next(target_logits.detach().float()), -1)
    regression = F.smooth_l1_loss(predicted.float(), target, reduction="none").mean(-1)
    feature = (regression * scored).sum() / count
    logits = F.linear(predicted, head_weight.detach()).float()
    ce = -(target_p * torch.log_softmax(logits, -1)).sum(-1)
    token = (ce * scored).sum() / count
    total = FEATURE_WEIGHT * feature + TOKEN_WEIGHT * token
    return total, {"feature": feature, "token": token}
