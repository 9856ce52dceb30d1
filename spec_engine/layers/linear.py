"""Linear layer: the weight stored transposed, and on CPU a oneDNN-packed copy for batches."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# oneDNN's packed-weight GEMM (what torch.compile uses on CPU) is 1.3-1.9x faster than MKL
# at 8-64 rows on our CPU, but slower for a single row; it is a torch-internal op, so it is
# used only when this torch build has it.
_CPU_PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
PACKED_MIN_ROWS = 4


class Linear(nn.Module):
    """y = x @ W^T + b, keeping W^T contiguous.

    Streaming a row-major [in, out] weight is markedly faster than F.linear's [out, in] for
    single-row decoding on CPU (about 2x for a large LM head); on CUDA both layouts are one
    GEMM. Weight loading maps Hugging Face [out, in] tensors onto it and then calls
    `refresh_derived`, which rebuilds the packed CPU copy.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: Optional[torch.Tensor] = None

    def refresh_derived(self) -> None:
        """Rebuild state derived from the weights (call after they change)."""
        w = self.weight_t
        if _CPU_PACKING and w.device.type == "cpu" and w.dtype == torch.float32:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach().t().contiguous())
        else:
            self._packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.shape[0] >= PACKED_MIN_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        if self.bias is None:
            return x @ self.weight_t
        return torch.addmm(self.bias, x, self.weight_t)
