"""Which part of a checkpoint tensor a tensor-parallel rank takes.

A `WeightSlot` (weights.loader) names the parameter a Hugging Face tensor lands in and, inside a
fused parameter, the rows it fills; under tensor parallelism its `shard` also says which block
of the checkpoint tensor this rank copies there: rows of a column-parallel weight (a block of
q, k, v, gate or up; a vocabulary block), columns of a row-parallel one. The slot's shape stays
the checkpoint's, so a checkpoint or an update is checked against the whole tensor. Loading
from disk reads only the rank's block (`read`: a safetensors slice, SGLang's loader does the
same); a tensor that arrives whole (an update, a pytorch_model.bin) is narrowed before the copy.
Reading weights back (`assemble`), the ranks' blocks are put together again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class Shard:
    """`length` entries of dimension `dim` from `start`."""

    dim: int
    start: int
    length: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This block of a whole tensor; a tensor that is the block already (read by `read`)
        comes back as it is (a whole tensor as long as the block starts at 0: the same)."""
        if tensor.shape[self.dim] == self.length:
            return tensor
        return tensor.narrow(self.dim, self.start, self.length)

    def read(self, tensor_slice: Any) -> torch.Tensor:
        """This block of a safetensors slice (`safe_open(...).get_slice(name)`), read alone."""
        index = (slice(None),) * self.dim + (slice(self.start, self.start + self.length),)
        return tensor_slice[index]


def block(dim: int, index: int, length: int) -> Shard:
    """Block `index` of size `length` along `dim` (rank `index`'s part of an even split)."""
    return Shard(dim, index * length, length)


def assemble(
    parts: list[tuple[Optional[Shard], tuple[int, ...], torch.Tensor]],
) -> torch.Tensor:
    """A whole tensor of shape `parts[0][1]` from ranks' (shard, shape, block) parts; a part
    without a shard is the whole tensor already (one rank's whole expert)."""
    shard, shape, first = parts[0]
    if shard is None:
        return first
    whole = torch.empty(shape, dtype=first.dtype, device="cpu")
    for shard, _, part in parts:
        whole.narrow(shard.dim, shard.start, shard.length).copy_(part)
    return whole
