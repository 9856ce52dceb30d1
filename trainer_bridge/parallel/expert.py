"""Expert parallelism (--expert-model-parallel-size) for MoE models: each expert-parallel rank
holds num_experts / ep of every MoE layer's routed experts, megatron's allgather token dispatcher
gathers the tokens of the ep ranks (and of the etp ranks splitting each expert, under sequence
parallelism) to them and scatters their outputs back.

Megatron lays the expert ranks out as the attention ranks, in its "tp-cp-ep-dp-pp" order, with
the expert tensor parallel size etp (--expert-tensor-parallel-size) in place of tp: trainer rank
r has data-parallel rank r // tp, expert-parallel rank (r // etp) % ep and expert-data-parallel
rank r // (etp * ep). At etp = tp (the default) the ep ranks are carved out of data parallelism
and each expert is split over the TP ranks; at etp = 1 every rank holds whole experts, and the
expert group spans the TP ranks first (slime's TP 4, EP 8, ETP 1 runs one expert group over two
TP groups); at a divisor etp of tp in between, each expert is split over etp ranks and TP rank t
holds slice t % etp of it (TP 4, ETP 2: ranks 0 and 2 the first half). Rank k of an expert group
holds global experts k * (E / ep) .. (k + 1) * (E / ep) - 1 as its `local_experts.0 ..`.
Megatron's DDP sums the experts' gradients over the expert-data-parallel group (its
`allreduce=False` parameters; at etp < tp that group holds TP ranks, each of which ran the experts
on its own part of the sequence), the router and shared experts over the whole data-parallel
group, as before.

This module renumbers experts between the whole (global) state dict the converter speaks and a
rank's local one (or every rank's, for a converted checkpoint), fetches another rank's experts
when the model is exported, and pads the micro batches of an expert group to one length: the
dispatcher's all-gather takes equal token counts from every rank, while each data-parallel rank
packs its own sequences.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.micro_batches.layout import MicroBatch, micro_batch
from trainer_bridge.options import TrainerArgs

# A routed expert's tensor in megatron's GPTModel (trunk and MTP layers alike).
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")


def check_expert_parallel(
    arch: ModelConfig,
    ep: int,
    tp: int = 1,
    world_size: Optional[int] = None,
    expert_tp: Optional[int] = None,
) -> None:
    """Raise unless `arch` splits over `ep` expert-parallel ranks of expert tensor parallel size
    `expert_tp` (--expert-tensor-parallel-size: a divisor of tp, its default) and, given
    `world_size` trainer ranks, those ranks hold whole TP and expert groups, naming the values to
    change."""
    etp = tp if expert_tp is None else expert_tp
    if ep < 1:
        raise ValueError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if etp < 1 or tp % etp:
        # Megatron would also split experts over more ranks than TP (data-parallel ones), which
        # no TP rank's state dict describes: the converter lays experts out per TP rank.
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp} is not "
            f"implemented: specrl splits each routed expert over a divisor of the tensor-parallel "
            f"ranks ({tp}, megatron's default, splits it like a dense MLP; 1 gives every rank "
            "whole experts, as slime's MoE recipes), not over data-parallel ranks; give a "
            f"divisor of {tp}"
        )
    if ep > 1 and arch.moe is None:
        raise ValueError(
            f"--expert-model-parallel-size {ep} splits MoE experts, and {arch.architecture} is a "
            "dense model with none; use 1"
        )
    if arch.moe is not None and arch.moe.num_experts % ep:
        raise ValueError(
            f"--expert-model-parallel-size {ep} does not divide the {arch.moe.num_experts} "
            f"routed experts (n_routed_experts) of {arch.architecture}; pick a divisor of it"
        )
    if world_size is not None and (world_size % tp or world_size % (etp * ep)):
        raise ValueError(
            f"{world_size} trainer ranks (--actor-num-nodes x --actor-num-gpus-per-node) are not "
            f"a multiple of --tensor-model-parallel-size {tp} and of "
            f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size {ep} (megatron "
            "builds whole tensor-parallel and expert groups); launch a multiple of both"
        )


def reduce_experts_over_expert_data_parallel(model: torch.nn.Module) -> None:
    """Mark `model`'s routed-expert parameters as megatron's DDP expects for experts whose
    expert-data-parallel group is not the data-parallel one (`allreduce=False`: summed over the
    expert-data-parallel group, scaled by 1 / DP). Megatron-core 0.16.1's linears mark them only
    at EP > 1 (tensor_parallel/layers.py: `not (self.is_expert and self.expert_parallel)`), so at
    --expert-tensor-parallel-size 1 with EP 1 and TP > 1 DDP would reduce them over the
    data-parallel group alone: each TP rank's whole experts would keep the gradient of its own
    part of the sequence, and the ranks' copies would drift apart."""
    from megatron.core import parallel_state

    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if etp == parallel_state.get_tensor_model_parallel_world_size():
        return
    for name, param in model.named_parameters():
        if expert_index(name) is not None:
            param.allreduce = False


def expert_index(name: str) -> Optional[int]:
    """The expert number in megatron tensor `name` (a routed expert's), else None."""
    match = _EXPERT.match(name)
    return None if match is None else int(match.group(2))


def renumbered(name: str, index: int) -> str:
    """Routed-expert tensor `name` with its expert number replaced by `index`."""
    match = _EXPERT.match(name)
    if match is None:
        raise ValueError(f"{name} is not a routed expert's tensor")
    return f"{match.group(1)}{index}{match.group(3)}"


def _layout(arch: ModelConfig) -> tuple[int, int, int]:
    """(this rank's expert-parallel rank, ep size, experts per rank) of the current megatron
    parallel state."""
    from megatron.core import parallel_state

    ep = parallel_state.get_expert_model_parallel_world_size()
    per_rank = arch.moe.num_experts // ep if arch.moe is not None else 0
    return parallel_state.get_expert_model_parallel_rank(), ep, per_rank


def owner(index: int, per_rank: int) -> int:
    """The expert-parallel rank holding global expert `index` (megatron's MoELayer gives rank k
    experts k * per_rank ..)."""
    return index // per_rank


def _rank_state_dict(state: Mapping[str, Tensor], rank: int, per_rank: int) -> dict[str, Tensor]:
    """Expert-parallel rank `rank`'s part of a whole megatron state dict: its own experts,
    renumbered from 0; every other tensor as it is."""
    out = {}
    for name, tensor in state.items():
        index = expert_index(name)
        if index is None:
            out[name] = tensor
        elif owner(index, per_rank) == rank:
            out[renumbered(name, index % per_rank)] = tensor
    return out


def local_state_dict(state: Mapping[str, Tensor], arch: ModelConfig) -> dict[str, Tensor]:
    """A whole megatron state dict (global expert numbers) -> this expert-parallel rank's: its
    own experts, renumbered from 0; every other tensor as it is."""
    rank, ep, per_rank = _layout(arch)
    return dict(state) if ep == 1 else _rank_state_dict(state, rank, per_rank)


def split_experts(
    state: Mapping[str, Tensor], arch: ModelConfig, ep: int
) -> list[dict[str, Tensor]]:
    """A whole megatron state dict -> each of `ep` expert-parallel ranks' (rank order), as
    `local_state_dict` gives that rank."""
    check_expert_parallel(arch, ep)
    per_rank = arch.moe.num_experts // ep if arch.moe is not None else 0
    return [_rank_state_dict(state, rank, per_rank) for rank in range(ep)]


def merge_experts(ranks: Sequence[Mapping[str, Tensor]], arch: ModelConfig) -> dict[str, Tensor]:
    """Expert-parallel ranks' state dicts (rank order) -> the whole one, each rank's experts
    under their global numbers; every other tensor from rank 0 (all ranks hold it alike)."""
    check_expert_parallel(arch, len(ranks))
    per_rank = arch.moe.num_experts // len(ranks) if arch.moe is not None else 0
    whole = {name: t for name, t in ranks[0].items() if expert_index(name) is None}
    for rank, state in enumerate(ranks):
        for name, tensor in state.items():
            index = expert_index(name)
            if index is not None:
                whole[renumbered(name, rank * per_rank + index)] = tensor
    return whole


class GatheredOverEP(Mapping[str, Tensor]):
    """A rank's (local) megatron state dict read under global expert numbers: each routed
    expert's tensor is broadcast by the rank holding it to its expert group, so every rank of
    the group reads every expert. Reading is a collective: every rank of the group reads the same
    names in the same order."""

    def __init__(self, state: Mapping[str, Tensor], arch: ModelConfig) -> None:
        from megatron.core import parallel_state

        self._state = state
        self._rank, self._ep, self._per_rank = _layout(arch)
        self._group = parallel_state.get_expert_model_parallel_group()
        self._names = {}  # global name -> local name
        for name in state:
            index = expert_index(name)
            if index is None:
                self._names[name] = name
                continue
            for rank in range(self._ep):
                self._names[renumbered(name, rank * self._per_rank + index)] = name

    def __getitem__(self, name: str) -> Tensor:
        local = self._state[self._names[name]]
        index = expert_index(name)
        if self._ep == 1 or index is None:
            return local
        src = owner(index, self._per_rank)
        tensor = local.detach().contiguous() if src == self._rank else torch.empty_like(local)
        dist.broadcast(tensor, dist.get_global_rank(self._group, src), group=self._group)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def exports_with_rank0(dp_rank: int, args: TrainerArgs) -> bool:
    """Whether data-parallel rank `dp_rank` takes part in rank 0's export gathers: rank 0's
    expert group (global ranks 0, etp, .. (ep - 1) * etp) and their tensor-parallel groups,
    the first ceil(ep * etp / tp) data-parallel ranks; the other replicas hold the same weights."""
    ep, tp = args.expert_model_parallel_size, args.tensor_model_parallel_size
    return dp_rank < -(-ep * args.expert_tp // tp)


def aligned_micro_batch(tokens: Tensor, lengths: list[int], args: TrainerArgs) -> MicroBatch:
    """`micro_batch` in `args`' --qkv-format, its sequence dimension (padded width, or pack
    length) a multiple of the TP size and the longest of the expert group's micro batches: the
    allgather dispatcher gathers equally many tokens from each expert-parallel rank (each with
    its own data-parallel sequences). A collective over the expert group at EP > 1."""
    tp, ep = args.tensor_model_parallel_size, args.expert_model_parallel_size
    if ep == 1:
        return micro_batch(tokens, lengths, args.qkv_format, tp)
    from megatron.core import parallel_state

    natural = sum(lengths) if args.qkv_format == "thd" else tokens.shape[1]
    length = torch.tensor([-(-natural // tp) * tp], device=tokens.device)
    dist.all_reduce(
        length, dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group()
    )
    return micro_batch(tokens, lengths, args.qkv_format, tp, length=int(length))
