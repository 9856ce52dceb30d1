"""RMSNorm, computed in float32 like the Hugging Face reference (or by fused CUDA kernels,
layers/fused.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # FlashInfer's rmsnorm(x, weight, eps) and fused_add_rmsnorm(x, residual, weight, eps),
        # installed by layers/fused.install: one kernel where the reference takes eight.
        self.kernel: Optional[Callable[..., torch.Tensor]] = None
        self.add_kernel: Optional[Callable[..., None]] = None

    def owned(self, residual: torch.Tensor) -> torch.Tensor:
        """The residual to pass to this norm where the caller still reads `residual` itself: a
        copy when the fused kernel overwrites its residual in place (a layer's first one is its
        input: the embedding, a captured feature, a graph's static buffer)."""
        return residual.clone() if self.add_kernel is not None else residual

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Normalize x; with `residual`, first add it and also return the sum (the new residual).
        With the fused kernel x and residual are overwritten: both must be the caller's own."""
        if residual is not None:
            if self.add_kernel is not None and self._fits(x) and self._fits(residual):
                self.add_kernel(
                    x.view(-1, x.shape[-1]), residual.view(-1, x.shape[-1]), self.weight, self.eps
                )
                return x, residual
            x = x + residual
            residual = x
        if self.kernel is not None and self._fits(x):
            out = self.kernel(x.view(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        else:
            dtype = x.dtype
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def _fits(self, x: torch.Tensor) -> bool:
        # The kernels' contract: rows contiguous, in the weight's dtype (per-head q/k norms get
        # strided views, and some callers pass float32 into a bfloat16 norm: the reference).
        return x.is_contiguous() and x.dtype == self.weight.dtype
