"""Linear layer: the weight in Hugging Face layout ([out, in]), and on CPU a oneDNN-packed copy.

Keeping the Hugging Face layout makes loading, weight updates and checksums plain contiguous
copies. On CPU in float32 the forward uses a oneDNN-packed copy of the weight (what
torch.compile uses on CPU): 1.3-3x faster than MKL's F.linear for 1-64 rows here, most for
large LM heads. It is derived state, rebuilt by `refresh_derived` whenever the weight changes
(weights.copy_weights calls it), and it is a torch-internal op, used only where this torch
build has it.

With `batch_invariant` set (--enable-deterministic-inference) the matmul runs on fixed-size row
blocks (layers/batch_invariant.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.layers.batch_invariant import row_blocked

_CPU_PACKING = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_reorder_linear_weight"
)


class Linear(nn.Module):
    batch_invariant = False  # set per instance by batch_invariant.set_batch_invariant

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        """`device`/`dtype` as nn.Linear's; models are built under a `torch.device` context."""
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(out_features, **factory)) if bias else None
        self._packed: Optional[torch.Tensor] = None

    def refresh_derived(self) -> None:
        """Rebuild state derived from the weights (call after they change)."""
        w = self.weight
        if _CPU_PACKING and w.device.type == "cpu" and w.dtype == torch.float32 and w.numel():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach())
        else:
            self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return row_blocked(self._matmul, x)
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
