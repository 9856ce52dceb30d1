"""Linear layer: the weight in Hugging Face layout ([out, in]), and on CPU a oneDNN-packed copy.

Keeping the Hugging Face layout makes loading, weight updates and checksums plain contiguous
copies. On CPU in float32 the forward uses a oneDNN-packed copy of the weight (what
torch.compile uses on CPU): 1.3-3x faster than MKL's F.linear for 1-64 rows here, most for
large LM heads. It is derived state, rebuilt by `refresh_derived` whenever the weight changes
(weights.copy_weights calls it), and it is a torch-internal op, used only where this torch
build has it.

With `batch_invariant` set (--enable-deterministic-inference) the matmul runs on fixed-size row
blocks (layers/batch_invariant.py).

Tensor parallelism (SGLang's and nano-vllm's layers/linear.py): a column-parallel linear holds a
block of the output features (fused QKV and gate/up hold their block of each part: the loader
puts each checkpoint tensor's rows where they belong, weights.shard), a row-parallel one a
block of the input features and sums the ranks' partial outputs with an all-reduce. The group
is the one in effect when the layer is built (distributed.parallel_state.use_tp_group); at one
rank these are plain Linears.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.distributed.parallel_state import get_tp_group
from spec_engine.distributed.partition import attention_heads, divide
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
        return self._linear(x, self.bias)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.batch_invariant:
            return row_blocked(lambda rows: self._matmul(rows, bias), x)
        return self._matmul(x, bias)

    def _matmul(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


class MergedColumnParallelLinear(Linear):
    """Column-parallel outputs, fused (gate and up; one part: a plain column-parallel linear):
    rank r holds features [r * n / tp, (r + 1) * n / tp) of each part n, one after the other.
    Its output stays split: the next layer is row-parallel."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, what: str = "features"
    ) -> None:
        self.tp = get_tp_group()
        self.output_sizes = [divide(n, self.tp.size, what) for n in output_sizes]
        super().__init__(in_features, sum(self.output_sizes), bias)


class QKVParallelLinear(Linear):
    """Fused q, k, v projections of this rank's heads (KV heads replicated past their count):
    local output [q_size | kv_size | kv_size]."""

    def __init__(
        self, in_features: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        self.tp = get_tp_group()
        self.heads = attention_heads(num_heads, num_kv_heads, self.tp.rank, self.tp.size)
        self.q_size, self.kv_size = self.heads.q * head_dim, self.heads.kv * head_dim
        super().__init__(in_features, self.q_size + 2 * self.kv_size, bias)


class RowParallelLinear(Linear):
    """Rank r holds input features [r * in / tp, (r + 1) * in / tp) and reads that block of its
    input; the partial outputs are summed over the ranks (the bias added once, by rank 0)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, what: str = "in_features"
    ) -> None:
        self.tp = get_tp_group()
        super().__init__(divide(in_features, self.tp.size, what), out_features, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._linear(x, self.bias)
        return self.tp.all_reduce(self._linear(x, self.bias if self.tp.rank == 0 else None))
