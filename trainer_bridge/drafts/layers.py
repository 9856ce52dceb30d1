"""What the trainer-side external drafts (trainer_bridge.drafts.eagle2 and .eagle3) share:
attention and SwiGLU MLP in Hugging Face's layout (q/k/v/o and gate/up/down projections,
as the engine's checkpoints name them), and reading and writing a draft whose parameter and
buffer names are its checkpoint's own.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from spec_engine.layers.rotary import RotaryEmbedding
from spec_engine.models.hf_config import ModelConfig
from spec_engine.weights.loader import iterate_checkpoint


class DraftAttention(nn.Module):
    """Grouped-query attention over `in_features` inputs, with SpecForge's training-time-test key
    cache: step 0 attends causally over its own keys; step k's query at position t attends to
    step 0's keys at positions <= t - k and, diagonally, to its own position's keys of steps
    1..k. With a fresh cache per forward (one step) it is plain causal attention."""

    def __init__(
        self,
        config: ModelConfig,
        rotary: RotaryEmbedding,
        device: torch.device,
        in_features: int,
    ) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d
        bias = config.qkv_bias
        self.q_proj = nn.Linear(in_features, self.heads * d, bias=bias, device=device)
        self.k_proj = nn.Linear(in_features, self.kv_heads * d, bias=bias, device=device)
        self.v_proj = nn.Linear(in_features, self.kv_heads * d, bias=bias, device=device)
        self.o_proj = nn.Linear(self.heads * d, h, bias=config.o_bias, device=device)
        self.rotary = rotary

    def forward(self, x: Tensor, positions: Tensor, cache: list[tuple[Tensor, Tensor]]) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b * s, self.heads, self.head_dim)
        k = self.k_proj(x).view(b * s, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = self.rotary(positions.repeat(b), q, k)
        group = self.heads // self.kv_heads

        def heads_first(t: Tensor) -> Tensor:  # [b, s, kv, d] -> [b, heads, s, d]
            return (
                t.view(b, s, self.kv_heads, self.head_dim)
                .repeat_interleave(group, 2)
                .transpose(1, 2)
            )

        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        cache.append((heads_first(k), heads_first(v)))
        step = len(cache) - 1
        scale = 1.0 / math.sqrt(self.head_dim)
        k0, v0 = cache[0]
        rows = torch.arange(s, device=x.device)
        visible = rows[None, :] <= rows[:, None] - step
        scores = (q @ k0.transpose(2, 3)) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        diagonal = [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]
        probs = torch.softmax(torch.cat([scores, *diagonal], -1).float(), -1).to(q.dtype)
        out = probs[..., :s] @ v0
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + probs[..., s + j, None] * vj
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DraftMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        h, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, inter, bias=bias, device=device)
        self.up_proj = nn.Linear(h, inter, bias=bias, device=device)
        self.down_proj = nn.Linear(inter, h, bias=bias, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def draft_config(path: str, positions: int = 0) -> ModelConfig:
    """The draft's config, its rotary tables raised to `positions` (the policy's
    max_position_embeddings) where its own max_position_embeddings is shorter: EAGLE drafts are
    published with 2048 positions for targets of far longer contexts, and run at the target's
    (as the engine and SGLang run them)."""
    config = ModelConfig.from_pretrained(path)
    if positions > config.max_position_embeddings:
        config = dataclasses.replace(config, rope_max_positions=positions)
    return config


def load_checkpoint(
    model: nn.Module,
    path: str,
    kind: str,
    unused: Iterable[str] = (),
    optional: Iterable[str] = (),
) -> set[str]:
    """Copy the checkpoint at `path` into `model`'s state (names, shapes checked; float32 or the
    buffer's dtype). `unused`: checkpoint tensors skipped (frozen copies of the target's);
    `optional`: state entries the checkpoint may lack. Returns the names found."""
    own = model.state_dict()
    unused, found = set(unused), set()
    for name, tensor in iterate_checkpoint(path):
        if name in unused:
            continue
        if name not in own:
            raise ValueError(f"{path}: unexpected {kind} draft tensor {name!r}")
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, the config gives "
                f"{tuple(own[name].shape)}"
            )
        with torch.no_grad():
            own[name].copy_(tensor.to(own[name].dtype))
        found.add(name)
    missing = sorted(set(own) - found - set(optional))
    if missing:
        raise ValueError(f"{path}: the {kind} draft checkpoint lacks {missing}")
    return found


def save_pretrained(model: nn.Module, path: str, like: str) -> None:
    """A checkpoint directory the engine loads: `like`'s config.json and `model`'s state."""
    os.makedirs(path, exist_ok=True)
    shutil.copy(os.path.join(like, "config.json"), os.path.join(path, "config.json"))
    tensors = {n: t.detach().contiguous().cpu() for n, t in model.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
