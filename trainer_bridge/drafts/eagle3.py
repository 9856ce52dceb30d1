"""An EAGLE-3 draft (`LlamaForCausalLMEagle3`, as the engine loads it) on the trainer side, and its
training-time-test loss (SpecForge's `OnlineEagle3Model`, specforge/core/eagle3.py).

The module's parameters carry the checkpoint's own names (`fc.weight`, `midlayer.*`, `norm.weight`,
`lm_head.weight`) and the id maps `d2t` / `t2d` are buffers, so a state dict is a checkpoint and
the names pushed to the engines are these with the engine's `draft.` prefix. The embedding is the
target's: it comes in as an argument and gets no gradient.

Layout of a batch: tokens [b, S] right-padded; `aux` [b, S, 3H] the target's captured hidden
states at each position; `target_logits` [b, S, V] where position t predicts token t + 1; `mask`
[b, S - 1] where position t marks token t + 1 as a response token (the actor's loss mask).
"""

from __future__ import annotations

from collections.abc import Iterator

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

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
# SpecForge's defaults (scripts/train_eagle3.py): 7 unrolled steps, step k weighted 0.8 ** k.
TTT_LENGTH = 7
STEP_DECAY = 0.8


class _MidLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        rotary = RotaryEmbedding(
            config.head_dim,
            # Step k reads rotary position t + k: room for the last position's later steps.
            (config.rope_max_positions or config.max_position_embeddings) + TTT_LENGTH,
            config.rope_theta,
            config.rope_scaling,
            config.rotary_dim,
        )
        self.input_layernorm = RMSNorm(h, eps).to(device)
        self.hidden_norm = RMSNorm(h, eps).to(device)
        self.self_attn = DraftAttention(config, rotary, device, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, eps).to(device)
        self.mlp = DraftMLP(config, device)


class Eagle3Draft(nn.Module):
    """The draft's weights and one draft step; see the module docstring for names."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        if config.architecture != EAGLE3_ARCHITECTURE:
            raise ValueError(
                f"online draft training supports {EAGLE3_ARCHITECTURE} drafts; got "
                f"{config.architecture}"
            )
        if config.draft_vocab_size is None:
            raise ValueError(
                "online draft training needs an EAGLE-3 draft with its own head (draft_vocab_size "
                "and lm_head.weight in the checkpoint); this one drafts with the target's head"
            )
        self.config = config
        h, vd = config.hidden_size, config.draft_vocab_size
        target_h = config.target_hidden_size or h
        bias = bool(config.hf_config.get("bias", False))
        self.fc = nn.Linear(3 * target_h, h, bias=bias, device=device)
        self.midlayer = _MidLayer(config, device)
        self.norm = RMSNorm(h, config.rms_norm_eps).to(device)
        self.lm_head = nn.Linear(h, vd, bias=False, device=device)
        self.register_buffer("d2t", torch.zeros(vd, dtype=torch.int64, device=device))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool, device=device))

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device, positions: int = 0) -> Eagle3Draft:
        """The draft in `path` (float32: its optimizer steps these weights directly), its rotary
        tables covering at least `positions` (layers.draft_config)."""
        model = cls(draft_config(path, positions), device)
        # embed_tokens: a frozen copy of the target's, unused.
        found = load_checkpoint(model, path, "EAGLE-3", {"embed_tokens.weight"}, {"t2d"})
        if "t2d" not in found:  # SGLang ignores t2d; rebuilt from d2t, which it reads
            model.t2d.index_fill_(0, model.hot_token_ids(), True)
        return model

    def hot_token_ids(self) -> Tensor:
        """Target id of each draft-vocabulary id."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def step(
        self,
        embeds: Tensor,
        hidden: Tensor,
        positions: Tensor,
        cache: list[tuple[Tensor, Tensor]],
    ) -> tuple[Tensor, Tensor]:
        """One draft step over [b, s] rows: (draft-vocabulary logits, the pre-norm features the
        next step reads). `hidden`: the target's concatenated features (step 0) or the previous
        step's output; `cache`: the keys of earlier steps, appended to."""
        layer = self.midlayer
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)
        x = torch.cat((layer.input_layernorm(embeds), layer.hidden_norm(hidden)), dim=-1)
        x = layer.self_attn(x, positions, cache)
        normed, residual = layer.post_attention_layernorm(x, hidden)
        to_logits, to_next = self.norm(layer.mlp(normed), residual)
        return self.lm_head(to_logits), to_next

    def hf_named_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every checkpoint tensor under its own name (without the engine's `draft.` prefix)."""
        yield from self.state_dict().items()

    def save_pretrained(self, path: str, like: str) -> None:
        """A checkpoint directory the engine loads: `like`'s config.json and these weights."""
        save_pretrained(self, path, like)


def _shift(x: Tensor, k: int) -> Tensor:
    """x moved k positions left along dim 1, zero-filled at the end (SpecForge's padding)."""
    if k == 0:
        return x
    return torch.cat((x[:, k:], torch.zeros_like(x[:, :k])), dim=1)


def ttt_loss(
    draft: Eagle3Draft,
    embed_weight: Tensor,
    tokens: Tensor,
    aux: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    length: int = TTT_LENGTH,
) -> tuple[Tensor, list[Tensor]]:
    """SpecForge's training-time-test loss: (sum over steps k of 0.8^k x step k's loss, the
    per-step losses). See the module docstring for the layout.

    Step 0 at position t reads the target's features at t and the embedding of token t + 1 and
    learns the target's distribution of token t + 2; step k reads step k - 1's output at t, the
    embedding of token t + 1 + k and rotary position t + k, and learns token t + 2 + k's. Each
    step's loss is the cross-entropy to the target's distribution restricted to the draft
    vocabulary, averaged over response positions where the target's argmax is in that vocabulary.
    Unlike SpecForge (a mean over every position, padding included) the mean is over scored
    positions, so a loss does not shrink with the batch's padding."""
    if not 1 <= length <= TTT_LENGTH:
        raise ValueError(
            f"the training-time-test length must be in [1, {TTT_LENGTH}], got {length}"
        )
    b, s = tokens.shape
    scored = torch.zeros(b, s, dtype=torch.float32, device=tokens.device)
    scored[:, : s - 2] = mask[:, 1:].float()  # position t predicts token t + 2
    with torch.no_grad():
        teacher = target_logits.detach().float()[..., draft.t2d]
        in_vocab = draft.t2d[target_logits.argmax(-1)].float()
    hidden = aux.detach()  # the target's features are constants of the draft's loss
    positions = torch.arange(s, device=tokens.device)
    cache: list[tuple[Tensor, Tensor]] = []
    total, per_step = None, []
    for k in range(length):
        embeds = F.embedding(_shift(tokens, k + 1), embed_weight.detach())  # token t + 1 + k
        logits, hidden = draft.step(embeds, hidden, positions + k, cache)
        with torch.no_grad():
            target_p = torch.softmax(_shift(teacher, k + 1), -1)
            weight = _shift(scored, k) * _shift(in_vocab, k + 1)
        ce = -(target_p * torch.log_softmax(logits.float(), -1)).sum(-1)
        loss = (ce * weight).sum() / _shift(scored, k).sum().clamp(min=1.0)
        per_step.append(loss)
        total = loss if total is None else total + STEP_DECAY**k * loss
    return total, per_step
