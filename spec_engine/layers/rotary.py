"""Rotary position embeddings (neox layout) with default, linear, llama3 and YaRN frequency
scaling, on the whole head or on its leading `rotary_dim` dims (partial rotary, GLM-4.5)."""

from __future__ import annotations

import math
from collections.abc import Callable
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
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, factor, scaling)
    raise ValueError(f"rope type {kind!r} is not supported")


def _yarn_inv_freq(
    inv_freq: torch.Tensor, dim: int, theta: float, factor: float, scaling: dict[str, Any]
) -> torch.Tensor:
    # transformers' _compute_yarn_parameters: interpolated frequencies below the correction
    # range, extrapolated ones above it, a linear ramp between.
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    old_ctx = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp
    return (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation


def rope_attention_factor(scaling: Optional[dict[str, Any]]) -> float:
    """The factor YaRN multiplies cos and sin by (transformers' attention_factor): given, else
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else
    mscale(factor); 1 for every other rope type."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale()


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
        # FlashInfer's apply_rope_with_cos_sin_cache_inplace, installed by layers/fused.install:
        # rotates q and k in place from one float32 [positions, rotary_dim] table of cos | sin.
        self.kernel: Optional[Callable[..., None]] = None
        self._cos_sin_cache: Optional[torch.Tensor] = None

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None or self._cos_sin[0].device != device:
            inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
            positions = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
            freqs = torch.outer(positions, inv_freq)
            factor = rope_attention_factor(self.scaling)
            self._cos_sin = ((freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device))
        return self._cos_sin

    def _cache(self, device: torch.device) -> torch.Tensor:
        """The fused kernel's table: cos then sin of each position, float32 (the same values)."""
        if self._cos_sin_cache is None or self._cos_sin_cache.device != device:
            self._cos_sin_cache = torch.cat(self._tables(device), dim=-1).contiguous()
        return self._cos_sin_cache

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]. With the fused kernel q and k
        are rotated in place (where each is a [T, heads * head_dim] row-major view)."""
        if self.kernel is not None and _flat_heads(q) and _flat_heads(k):
            self.kernel(
                positions,
                q.view(q.shape[0], -1),
                k.view(k.shape[0], -1),
                self.head_dim,
                self._cache(positions.device),
                True,
            )
            return q, k
        cos, sin = self._tables(positions.device)
        cos = cos.index_select(0, positions).unsqueeze(1)
        sin = sin.index_select(0, positions).unsqueeze(1)
        if self.rotary_dim == self.head_dim:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        return _rotate_partial(q, cos, sin, self.rotary_dim), _rotate_partial(
            k, cos, sin, self.rotary_dim
        )


def _flat_heads(x: torch.Tensor) -> bool:
    # [T, heads, head_dim] whose heads sit side by side in each row (a q/k split of the fused
    # projection is; MLA's rope part of each head is not, and takes the reference).
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rotate_partial(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int
) -> torch.Tensor:
    # transformers' partial rotary: neox rotation of the leading dims, the rest passed through.
    return torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1)
