"""Rotary position embeddings (neox layout) with default, linear and llama3 frequency scaling,
on the whole head or on its leading `rotary_dim` dims (partial rotary, GLM-4.5)."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict[str, Any]]) -> torch.Tensor:
    # Computed on the host in float32 (as transformers does), then moved: one table everywhere.
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to q and k given flat token positions.

    The cos/sin tables are plain attributes built on first use on the positions' device: they
    derive from the config, so they are neither weights to load nor state to move around.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: Optional[dict[str, Any]],
        rotary_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self._cos_sin: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None or self._cos_sin[0].device != device:
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
            positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
            freqs = torch.outer(positions, inv_freq)
            self._cos_sin = (freqs.cos().to(device), freqs.sin().to(device))
        return self._cos_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]."""
        cos, sin = self._tables(positions.device)
        cos = cos.index_select(0, positions).unsqueeze(1)
        sin = sin.index_select(0, positions).unsqueeze(1)
        if self.rotary_dim == self.head_dim:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        return _rotate_partial(q, cos, sin, self.rotary_dim), _rotate_partial(
            k, cos, sin, self.rotary_dim
        )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rotate_partial(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int
) -> torch.Tensor:
    # transformers' partial rotary: neox rotation of the leading dims, the rest passed through.
    return torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
