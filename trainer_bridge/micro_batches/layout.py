"""One micro batch as the model takes it: padded (bshd, [b, S] right-padded rows) or packed (thd:
the sequences concatenated into one row of T tokens, --qkv-format thd), and the way back from the
model's per-token outputs to the padded layout [b, S - shift] every loss is written for.

Packing follows slime (backends/megatron_utils/data.py): `cu_seqlens` int32 over the
sequences, the pack padded to a multiple of the tensor-parallel size with the padding as one more
sequence, PackedSeqParams(qkv_format="thd"), batch dimension 1. Megatron restarts rotary
positions at every cu_seqlens boundary, its MTP block rolls tokens within each sequence, and the
core attention keeps each sequence to itself (trainer_bridge.micro_batches.packed_attention).
"""

from __future__ import annotations

import itertools
from typing import Optional, Union

import torch
from torch import Tensor

from trainer_bridge.micro_batches.thd_ops import positions_in_sequence


class PaddedMicroBatch:
    """bshd: `tokens` [b, S] as pad_batch lays them out, widened with padding columns to
    [b, S'], S' a multiple of `pad_multiple` (under sequence parallelism each tensor-parallel rank
    takes S'/tp positions), or `length` when given, positions 0..S'-1 on every row."""

    packed_seq_params = None

    def __init__(
        self,
        tokens: Tensor,
        lengths: Optional[list[int]] = None,
        pad_multiple: int = 1,
        length: Optional[int] = None,
    ) -> None:
        self._width = tokens.shape[1]
        self._pad = _padding(self._width, pad_multiple, length)
        self.tokens = self.pack(tokens)
        width = self.tokens.shape[1]
        columns = torch.arange(width, device=tokens.device)
        self.position_ids = columns.expand_as(self.tokens)
        self.rotary_seq_len = width
        # True at padding (rows are full when `lengths` is not given; the columns added for
        # `pad_multiple` always pad): megatron's MoE routers leave it out of their token counts
        # and balance losses.
        full = [self._width] * tokens.shape[0] if lengths is None else lengths
        lengths_t = torch.tensor(full, dtype=torch.long, device=tokens.device)
        self.padding_mask = columns >= lengths_t[:, None]

    def pack(self, values: Tensor) -> Tensor:
        """Per-token `values` [b, S, ...] in the model's layout [b, S', ...]: the padding columns
        repeat the last column (any valid token ids or routed experts do: causal attention, and
        no loss reads them)."""
        if not self._pad:
            return values
        last = values[:, -1:]
        return torch.cat([values, last.expand(-1, self._pad, *last.shape[2:])], dim=1)

    def unpack(self, values: Tensor, shift: int) -> Tensor:
        """Per-token `values` [b, S' - shift] computed at positions t predicting token t + shift,
        in the padded layout [b, S - shift] (the padding columns dropped)."""
        return values[:, : self._width - shift]


class PackedMicroBatch:
    """thd: the sequences of padded `tokens` [b, S] (row i holding lengths[i] tokens)
    concatenated into `tokens` [1, T], T the total length rounded up to `pad_multiple`, or
    `length` when given."""

    def __init__(
        self, tokens: Tensor, lengths: list[int], pad_multiple: int, length: Optional[int] = None
    ) -> None:
        from megatron.core.packed_seq_params import PackedSeqParams

        device = tokens.device
        width = tokens.shape[1]
        total = sum(lengths)
        self._pad = _padding(total, pad_multiple, length)
        seqlens = lengths + ([self._pad] if self._pad else [])
        columns = torch.arange(width, device=device)
        self._lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self._valid = columns < self._lengths[:, None]  # [b, S]: a token of row i
        # int32 on the model's device, as TE's fused THD kernels take them.
        cu_seqlens = torch.tensor(
            [0, *itertools.accumulate(seqlens)], dtype=torch.int32, device=device
        )
        starts = cu_seqlens[: len(lengths)].long()
        self._index = starts[:, None] + columns  # [b, S]: where (row, column) lands in the pack
        self.tokens = self.pack(tokens)
        self.padding_mask = torch.arange(total + self._pad, device=device)[None] >= total
        # Megatron's rope and MTP roll read cu_seqlens; positions restart per sequence as well
        # for any module that reads position_ids.
        self.position_ids = positions_in_sequence(cu_seqlens)[None]
        self.rotary_seq_len = max(seqlens)
        self.packed_seq_params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_kv=cu_seqlens,
            max_seqlen_q=self.rotary_seq_len,
            max_seqlen_kv=self.rotary_seq_len,
        )

    def pack(self, values: Tensor) -> Tensor:
        """Per-token `values` [b, S, ...] of the padded rows -> [1, T, ...]; the padding
        sequence repeats the last token's row (any valid token ids or routed experts do: no
        loss reads it)."""
        rows = values[self._valid]
        if self._pad:
            rows = torch.cat([rows, rows[-1:].expand(self._pad, *rows.shape[1:])])
        return rows[None]

    def unpack(self, values: Tensor, shift: int) -> Tensor:
        """Per-token `values` [1, T - shift] computed at pack positions p predicting token
        p + shift -> the padded layout [b, S - shift], zero where the predicted token is not in
        the same sequence (past its end, or in the next sequence of the pack)."""
        width = self._index.shape[1] - shift
        inside = torch.arange(width, device=values.device) + shift < self._lengths[:, None]
        picked = values[0][self._index[:, :width].clamp(max=values.shape[1] - 1)]
        return torch.where(inside, picked, 0.0)


MicroBatch = Union[PaddedMicroBatch, PackedMicroBatch]


def _padding(natural: int, pad_multiple: int, length: Optional[int]) -> int:
    """Padding positions taking a sequence dimension of `natural` to `length` (default: the next
    multiple of `pad_multiple`)."""
    if length is None:
        return -natural % pad_multiple
    if length < natural or length % pad_multiple:
        raise ValueError(
            f"a micro batch of {natural} positions cannot be padded to {length}: the length must "
            f"be at least {natural} and a multiple of {pad_multiple}"
        )
    return length - natural


def micro_batch(
    tokens: Tensor,
    lengths: list[int],
    qkv_format: str,
    pad_multiple: int = 1,
    length: Optional[int] = None,
) -> MicroBatch:
    """The micro batch of padded `tokens` [b, S] (row i holding lengths[i] tokens) in
    --qkv-format's layout; its sequence dimension (a pack's length, as slime pads, or the padded
    width) is padded to a multiple of `pad_multiple` (the tensor-parallel size, which sequence
    parallelism splits it by), or to `length` (the expert group's common length:
    trainer_bridge.parallel.expert.aligned_micro_batch)."""
    if qkv_format == "thd":
        return PackedMicroBatch(tokens, lengths, pad_multiple, length)
    return PaddedMicroBatch(tokens, lengths, pad_multiple, length)
