"""Tensor-parallel sharding and gathering of megatron GPTModel tensors, by parameter kind.

column-parallel (split along output rows): linear_qkv (whole query groups per rank, since the
fused rows are grouped), MLA's projections, MTP eh_proj, and the vocab-parallel word embedding and
output layer, whose rows are first padded to `padded_vocab_size(vocab, tp, divisor)`; linear_fc1
splits gate and up separately and concatenates each rank's parts; row-parallel (split along input
columns): linear_proj, linear_fc2 (dense, routed-expert and shared-expert MLPs alike); everything
else (norms, the MoE router and its expert bias, MLA's key/value down projection) is replicated.
Routed experts split over the expert tensor parallel size `expert_tp` (default: tp, a divisor of
it): TP rank r holds slice r % expert_tp, as megatron lays the expert tensor parallel ranks out; at
1 (--expert-tensor-parallel-size 1) every rank holds them whole, as a replicated tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Optional

import torch
from torch import Tensor
from torch.nn import functional as F

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.model.provider import (
    DEFAULT_VOCAB_DIVISOR,
    check_tensor_parallel,
    padded_vocab_size,
)
from trainer_bridge.parallel.expert import check_expert_parallel

_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_COLUMN = (
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "eh_proj.weight",
    # multi-latent attention (DeepSeek-V3): up projections by whole heads; megatron gathers the
    # query down projection's output again before its norm (the key/value down projection is
    # replicated: trainer_bridge.parallel.sequence)
    "linear_q_proj.weight",
    "linear_q_down_proj.weight",
    "linear_q_up_proj.weight",
    "linear_kv_up_proj.weight",
)
# MLP suffixes cover the dense MLP, each routed expert (at expert tensor parallel size > 1, in
# that many slices) and the shared experts.
_GATED = "linear_fc1.weight"
_ROW = ("self_attention.linear_proj.weight", "linear_fc2.weight")
_ROUTED = ".mlp.experts.local_experts."


def _kind(name: str, expert_tp: Optional[int]) -> str:
    if expert_tp == 1 and _ROUTED in name:
        return "replicated"
    if name in _VOCAB:
        return "vocab"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_GATED):
        return "gated"
    if name.endswith(_ROW):
        return "row"
    return "replicated"


def _parts(name: str, tp: int, expert_tp: Optional[int]) -> int:
    """How many pieces the `tp` ranks hold of tensor `name`: `expert_tp` for a routed expert."""
    return expert_tp if expert_tp is not None and _ROUTED in name else tp


def is_sharded(name: str, expert_tp: Optional[int] = None) -> bool:
    """Whether tensor-parallel ranks hold different pieces of megatron tensor `name` at expert
    tensor parallel size `expert_tp` (default: the TP size)."""
    return _kind(name, expert_tp) != "replicated"


def pad_vocab(tensor: Tensor, padded_rows: int) -> Tensor:
    """Zero rows appended up to `padded_rows` (megatron's padded vocabulary)."""
    return F.pad(tensor, (0, 0, 0, padded_rows - tensor.shape[0]))


def shard_tensor(
    name: str, tensor: Tensor, tp: int, padded_vocab: int, expert_tp: Optional[int] = None
) -> list[Tensor]:
    """The `tp` per-rank pieces of whole megatron tensor `name` (vocab tensors padded to
    `padded_vocab` rows; routed experts in `expert_tp` slices, rank r holding r % expert_tp)."""
    kind, parts = _kind(name, expert_tp), _parts(name, tp, expert_tp)
    if kind == "vocab":
        pieces = pad_vocab(tensor, padded_vocab).chunk(parts, dim=0)
    elif kind == "column":
        pieces = tensor.chunk(parts, dim=0)
    elif kind == "gated":
        gate, up = tensor.chunk(2, dim=0)
        pieces = [torch.cat(p, dim=0) for p in zip(gate.chunk(parts), up.chunk(parts))]
    elif kind == "row":
        pieces = tensor.chunk(parts, dim=1)
    else:
        pieces = [tensor]
    return [pieces[rank % len(pieces)] for rank in range(tp)]


def gather_tensor(name: str, shards: Sequence[Tensor], expert_tp: Optional[int] = None) -> Tensor:
    """Whole megatron tensor `name` from its per-rank pieces (vocab padding kept; `to_hf` drops
    it; a routed expert is in the first `expert_tp` ranks' pieces: at 1 every rank's whole copy)."""
    kind = _kind(name, expert_tp)
    shards = shards[: _parts(name, len(shards), expert_tp)]
    if kind in ("vocab", "column"):
        return torch.cat(list(shards), dim=0)
    if kind == "gated":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == "row":
        return torch.cat(list(shards), dim=1)
    return shards[0]


def shard_state_dict(
    state: Mapping[str, Tensor],
    arch: ModelConfig,
    tp: int,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    expert_tp: Optional[int] = None,
) -> list[dict[str, Tensor]]:
    """Per-rank state dicts (rank order) of a whole megatron state dict (routed experts split at
    expert tensor parallel size `expert_tp`, default `tp`: a divisor of it).

    Every piece is a compact copy: a view would drag its whole parent storage into torch.save.
    """
    check_tensor_parallel(arch, tp)
    check_expert_parallel(arch, 1, tp, expert_tp=expert_tp)
    padded = padded_vocab_size(arch.vocab_size, tp, make_vocab_size_divisible_by)
    ranks: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        for rank, piece in zip(ranks, shard_tensor(name, tensor, tp, padded, expert_tp)):
            rank[name] = piece.clone(memory_format=torch.contiguous_format)
    return ranks


def gather_state_dicts(
    shards: Sequence[Mapping[str, Tensor]], expert_tp: Optional[int] = None
) -> dict[str, Tensor]:
    """The whole megatron state dict from per-rank state dicts (rank order; routed experts at
    expert tensor parallel size `expert_tp`, default the TP size)."""
    return {name: gather_tensor(name, [s[name] for s in shards], expert_tp) for name in shards[0]}
