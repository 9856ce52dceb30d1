"""megatron-core's two per-sequence Python loops over a packed (THD) batch, as single tensor
operations: rotary embedding (rope_utils._apply_rotary_pos_emb_thd, once per attention layer for
queries and for keys) and the MTP block's roll of tokens within each sequence
(multi_token_prediction._roll_tensor_packed_seq). Their loops cost a few small kernels per
sequence, which on small models outweighs what packing saves; the replacements compute the same
values (the same rows of the same frequency table, the same zeroed positions).

`use_vectorized_thd_ops()` installs them once; context parallelism (not used by specrl) keeps
megatron's own.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

_installed = False


def use_vectorized_thd_ops() -> None:
    """Replace megatron's per-sequence THD rope and MTP roll with the functions below, once."""
    global _installed
    if _installed:
        return
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import multi_token_prediction

    rope, roll = (
        rope_utils._apply_rotary_pos_emb_thd,
        multi_token_prediction._roll_tensor_packed_seq,
    )

    def rope_thd(
        t: Tensor,
        cu_seqlens: Tensor,
        freqs: Tensor,
        rotary_interleaved: bool = False,
        multi_latent_attention: bool = False,
        mscale: float = 1.0,
        cp_group: Optional[Any] = None,
    ) -> Tensor:
        if cp_group is None or cp_group.size() > 1:
            return rope(
                t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group
            )
        return rope_utils._apply_rotary_pos_emb_bshd(
            t.unsqueeze(1),
            _token_freqs(freqs, cu_seqlens),
            rotary_interleaved=rotary_interleaved,
            multi_latent_attention=multi_latent_attention,
            mscale=mscale,
        ).squeeze(1)

    def roll_thd(
        tensor: Tensor, shifts: int, dims: int, packed_seq_params: Any, cp_group: Any = None
    ) -> tuple[Tensor, Tensor]:
        if cp_group is not None and cp_group.size() > 1:
            return roll(tensor, shifts, dims, packed_seq_params, cp_group)
        if shifts != -1 or dims not in (-1, tensor.dim() - 1):
            raise ValueError("a packed roll moves one token left along the last dim only")
        # One token left within each sequence; each sequence's last position becomes 0.
        rolled = torch.roll(tensor, shifts=-1, dims=-1)
        rolled[..., packed_seq_params.cu_seqlens_q[1:].long() - 1] = 0
        return rolled, rolled.sum()

    rope_utils._apply_rotary_pos_emb_thd = rope_thd
    multi_token_prediction._roll_tensor_packed_seq = roll_thd
    _installed = True


def positions_in_sequence(cu_seqlens: Tensor) -> Tensor:
    """Each packed token's position within its own sequence, on cu_seqlens' device."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    return torch.arange(starts.numel(), device=cu_seqlens.device) - starts


# The attention layers of one forward share the pack's cu_seqlens and (except MLA, whose layers
# each build their own) the rotary table, so what they derive is computed once per table and
# pack, not once per layer, query and key: the latest pack's layout, and the latest rotary table
# read per token.
_layout: Optional[tuple[Tensor, tuple[Tensor, Tensor]]] = None
_freqs: Optional[tuple[Tensor, Tensor, Tensor]] = None


def sequence_layout(cu_seqlens: Tensor) -> tuple[Tensor, Tensor]:
    """(sequence, position in it) of every packed token, on cu_seqlens' device."""
    global _layout
    if _layout is None or _layout[0] is not cu_seqlens:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        ids = torch.arange(lengths.numel(), device=cu_seqlens.device)
        _layout = (
            cu_seqlens,
            (torch.repeat_interleave(ids, lengths), positions_in_sequence(cu_seqlens)),
        )
    return _layout[1]


def _token_freqs(freqs: Tensor, cu_seqlens: Tensor) -> Tensor:
    """The rotary table's row for each packed token, [t, 1, 1, d]: as megatron reads it, at the
    token's own index when the table holds every packed position, else at its position in its
    sequence."""
    global _freqs
    if _freqs is None or _freqs[0] is not freqs or _freqs[1] is not cu_seqlens:
        if freqs.size(0) == int(cu_seqlens[-1]):
            rows = torch.arange(freqs.size(0), device=freqs.device)
        else:
            rows = sequence_layout(cu_seqlens)[1]
        _freqs = (freqs, cu_seqlens, freqs[rows])
    return _freqs[2]
