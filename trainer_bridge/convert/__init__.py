"""Hugging Face <-> megatron-core GPTModel weights (Llama, Qwen2, Qwen3, MiMo with MTP layers,
GLM-4.5 MoE).

In memory:
    hf_to_mcore_state_dict(hf_tensors, hf_config)      whole (TP=1) megatron state dict
    shard_state_dict / gather_state_dicts              whole <-> per-TP-rank state dicts
    shard_tensor / gather_tensor                       the same for one tensor (stream a TP>1 model)
    mcore_to_hf_tensors(model_or_state_dict, hf_config) (HF name, tensor) pairs, one at a time
                                                       (a TP>1 model is gathered per tensor, an
                                                       EP>1 model's experts fetched from their
                                                       ranks: parallel/expert.py)
    load_hf_weights(model, hf_checkpoint)              a Hugging Face directory (or an hf-to-mcore
    checkpoint) into this rank's model (its own experts under expert parallelism)
On disk (see checkpoint.py for the megatron format) and on the command line:
    python -m trainer_bridge.convert hf-to-mcore --hf-checkpoint A --save B [--tp N] [--ep N]
        [--etp 1]
    python -m trainer_bridge.convert mcore-to-hf --load B --hf-checkpoint A --save C
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from spec_engine.models.hf_config import ConfigSource
from trainer_bridge.convert.checkpoint import (
    META_FILE,
    hf_to_mcore,
    load_mcore_rank,
    mcore_to_hf,
    read_hf_weights,
    read_mcore_as_hf,
    read_mcore_meta,
    save_hf_checkpoint,
    save_mcore_checkpoint,
)
from trainer_bridge.convert.state_dict import hf_to_mcore_state_dict as _hf_to_mcore
from trainer_bridge.convert.state_dict import mcore_to_hf_items, name_map
from trainer_bridge.convert.tp import (
    gather_state_dicts,
    gather_tensor,
    is_sharded,
    shard_state_dict,
    shard_tensor,
)
from trainer_bridge.model.provider import (
    DEFAULT_VOCAB_DIVISOR,
    check_tensor_parallel,
    padded_vocab_size,
    read_model_config,
)
from trainer_bridge.parallel.expert import GatheredOverEP, local_state_dict

__all__ = [
    "gather_state_dicts",
    "gather_tensor",
    "hf_to_mcore",
    "hf_to_mcore_state_dict",
    "load_hf_weights",
    "load_mcore_rank",
    "load_mcore_state_dict",
    "mcore_to_hf",
    "mcore_to_hf_tensors",
    "name_map",
    "read_hf_weights",
    "read_mcore_as_hf",
    "read_mcore_meta",
    "save_hf_checkpoint",
    "save_mcore_checkpoint",
    "shard_state_dict",
    "shard_tensor",
]


def hf_to_mcore_state_dict(
    hf_tensors: Mapping[str, Tensor], hf_config: ConfigSource
) -> dict[str, Tensor]:
    """The whole (TP=1) megatron state dict of Hugging Face tensors; vocab unpadded (sharding pads
    it)."""
    return _hf_to_mcore(hf_tensors, read_model_config(hf_config))


class _GatheredOverTP(Mapping[str, Tensor]):
    """A tensor-parallel rank's state dict whose sharded values are all-gathered when read
    (routed experts only where the expert tensor parallel size splits them: at 1 each rank's
    are whole)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        from megatron.core import parallel_state

        self._state = state
        self._group = parallel_state.get_tensor_model_parallel_group()
        self._size = parallel_state.get_tensor_model_parallel_world_size()
        self._expert_tp = parallel_state.get_expert_tensor_parallel_world_size()

    def __getitem__(self, name: str) -> Tensor:
        local = self._state[name]
        if self._size == 1 or not is_sharded(name, self._expert_tp):
            return local
        shards = [torch.empty_like(local) for _ in range(self._size)]
        dist.all_gather(shards, local.contiguous(), group=self._group)
        return gather_tensor(name, shards, self._expert_tp)

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def mcore_to_hf_tensors(
    model_or_state_dict: Union[nn.Module, Mapping[str, Any]], hf_config: ConfigSource
) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face (name, tensor) pairs of this rank's GPTModel or of a whole (TP=1) megatron
    state dict.

    Lazy: each megatron tensor is gathered (a model under tensor or expert parallelism: every rank
    of its TP and expert groups must iterate, in step; every expert comes once, under its global
    number), split (q/k/v, gate/up) or trimmed (vocab padding) when reached, so callers
    can bucket the stream. Tensors keep the model's dtype and may be views of its parameters
    (copy what you keep across an optimizer step); a tied head is not repeated as lm_head.
    """
    arch = read_model_config(hf_config)
    if isinstance(model_or_state_dict, nn.Module):
        # an expert-parallel rank's experts under their global numbers, then whole over TP
        local = GatheredOverEP(model_or_state_dict.state_dict(), arch)
        state: Mapping[str, Any] = _GatheredOverTP(local)
    else:
        state = model_or_state_dict
    return mcore_to_hf_items(state, arch)


def load_mcore_state_dict(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """`model.load_state_dict(state)` that tolerates only the absent `_extra_state` entries."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("._extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"state dict does not fit the model: missing {missing[:5]} ({len(missing)} in all), "
            f"unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )


def load_hf_weights(
    model: nn.Module, hf_checkpoint: str, make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR
) -> None:
    """Load a Hugging Face directory, or a megatron checkpoint `hf-to-mcore` wrote (any TP, EP
    and expert TP size: re-sharded here), into this tensor- and expert-parallel rank's GPTModel
    (megatron parallel state set up): its TP shard of every tensor, of its own experts only
    (whole at expert tensor parallel size 1)."""
    from megatron.core import parallel_state

    if os.path.isfile(os.path.join(hf_checkpoint, META_FILE)):
        hf_config, tensors = read_mcore_as_hf(hf_checkpoint)
    else:
        hf_config, tensors = hf_checkpoint, read_hf_weights(hf_checkpoint)
    arch = read_model_config(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    check_tensor_parallel(arch, tp)
    padded = padded_vocab_size(arch.vocab_size, tp, make_vocab_size_divisible_by)
    whole = local_state_dict(_hf_to_mcore(tensors, arch), arch)
    load_mcore_state_dict(
        model, {name: shard_tensor(name, t, tp, padded, etp)[rank] for name, t in whole.items()}
    )
