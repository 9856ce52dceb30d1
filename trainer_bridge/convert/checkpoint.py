"""Checkpoint directories on disk: Hugging Face (safetensors) and specrl's megatron format.

The megatron format (Megatron's legacy torch layout, without iteration directories):

    <dir>/specrl_mcore.json                      {"format", "tensor_model_parallel_size",
                                                  "expert_model_parallel_size",
                                                  "expert_tensor_parallel_size",
                                                  "make_vocab_size_divisible_by",
                                                  "padded_vocab_size",
                                                  "hf_config": the source config.json}
    <dir>/mp_rank_{t:02d}/model_optim_rng.pt     torch.save({"model": TP rank t's GPTModel state
                                                 dict}), at expert-parallel size 1
    <dir>/mp_rank_{t:02d}_{e:03d}/model_optim_rng.pt   at EP > 1 (Megatron-LM's names): TP rank t's
                                                 of expert-parallel rank e, its experts numbered
                                                 from 0 as that rank's model names them
                                                 (whole at expert tensor parallel size 1, split
                                                 over the TP ranks at the default, TP)

Each rank's state dict holds exactly the tensors of that rank's `model.state_dict()` (no
`_extra_state`), so `model.load_state_dict(ckpt["model"], strict=False)` restores it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import torch
from safetensors.torch import save_file
from torch import Tensor

from spec_engine.weights.loader import iterate_checkpoint
from trainer_bridge.convert.state_dict import hf_to_mcore_state_dict, mcore_to_hf_items
from trainer_bridge.convert.tp import gather_state_dicts, shard_state_dict
from trainer_bridge.model.provider import (
    DEFAULT_VOCAB_DIVISOR,
    padded_vocab_size,
    read_model_config,
)
from trainer_bridge.parallel.expert import check_expert_parallel, merge_experts, split_experts

FORMAT = "specrl-mcore-v1"
META_FILE = "specrl_mcore.json"
RANK_FILE = "model_optim_rng.pt"
# Files of a Hugging Face directory that hold weights; every other file (config, tokenizer,
# generation config, chat template) is copied as is on export.
_WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
)


def read_hf_weights(path: str) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face checkpoint directory (the engine's reader: shard index
    first)."""
    return dict(iterate_checkpoint(path))


def save_hf_checkpoint(named_tensors: Iterable[tuple[str, Tensor]], save: str, like: str) -> None:
    """Write `save/model.safetensors` and copy every non-weight file (config, tokenizer) of
    `like`."""
    os.makedirs(save, exist_ok=True)
    weights = {
        os.path.basename(p)
        for pattern in _WEIGHT_PATTERNS
        for p in glob.glob(os.path.join(like, pattern))
    }
    for entry in sorted(os.listdir(like)):
        source = os.path.join(like, entry)
        if entry not in weights and os.path.isfile(source):
            shutil.copy2(source, os.path.join(save, entry))
    save_file(
        dict(named_tensors), os.path.join(save, "model.safetensors"), metadata={"format": "pt"}
    )


def _rank_path(load: str, rank: int, ep_rank: int, ep: int) -> str:
    """Megatron-LM's file of (tensor-parallel rank, expert-parallel rank of `ep`)."""
    folder = f"mp_rank_{rank:02d}" if ep == 1 else f"mp_rank_{rank:02d}_{ep_rank:03d}"
    return os.path.join(load, folder, RANK_FILE)


def save_mcore_checkpoint(
    save: str,
    shards: list[dict[str, Tensor]],
    hf_config: Mapping[str, Any],
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    ep: int = 1,
    expert_tp: Optional[int] = None,
) -> None:
    """Write per-TP-rank state dicts (rank order, every expert under its global number, split
    at expert tensor parallel size `expert_tp`, default the TP size), each split over `ep`
    expert-parallel ranks, and the metadata file."""
    arch = read_model_config(hf_config)
    tp = len(shards)
    for rank, state in enumerate(shards):
        for ep_rank, part in enumerate(split_experts(state, arch, ep)):
            path = _rank_path(save, rank, ep_rank, ep)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"model": part}, path)
    meta = {
        "format": FORMAT,
        "tensor_model_parallel_size": tp,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": tp if expert_tp is None else expert_tp,
        "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
        "padded_vocab_size": padded_vocab_size(arch.vocab_size, tp, make_vocab_size_divisible_by),
        "hf_config": dict(hf_config),
    }
    with open(os.path.join(save, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def read_mcore_meta(load: str) -> dict[str, Any]:
    """The metadata of a checkpoint written by `save_mcore_checkpoint`."""
    path = os.path.join(load, META_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{load!r} is not a specrl megatron checkpoint (no {META_FILE}); "
            "write one with `python -m trainer_bridge.convert hf-to-mcore`"
        )
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{path} has format {meta.get('format')!r}; this reader understands {FORMAT!r}"
        )
    return meta


def load_mcore_rank(load: str, rank: int, ep_rank: int = 0) -> dict[str, Tensor]:
    """The state dict (on CPU) of tensor-parallel rank `rank` and expert-parallel rank `ep_rank`,
    as that rank's model names its tensors."""
    meta = read_mcore_meta(load)
    # checkpoints from before expert parallelism: 1
    tp, ep = meta["tensor_model_parallel_size"], meta.get("expert_model_parallel_size", 1)
    if not (0 <= rank < tp and 0 <= ep_rank < ep):
        raise ValueError(
            f"rank {rank}, expert-parallel rank {ep_rank} is outside the checkpoint's tensor "
            f"parallel size {tp} and expert-parallel size {ep} ({load!r})"
        )
    return torch.load(_rank_path(load, rank, ep_rank, ep), map_location="cpu", weights_only=True)[
        "model"
    ]


def hf_to_mcore(
    hf_checkpoint: str,
    save: str,
    tp: int = 1,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
    ep: int = 1,
    expert_tp: Optional[int] = None,
) -> None:
    """Convert a Hugging Face directory into a megatron checkpoint for `tp` tensor-parallel and
    `ep` expert-parallel ranks, routed experts split at `expert_tp` (1 or `tp`, the default)."""
    arch = read_model_config(hf_checkpoint)
    # before any work: the error names the flag
    check_expert_parallel(arch, ep, tp, expert_tp=expert_tp)
    whole = hf_to_mcore_state_dict(read_hf_weights(hf_checkpoint), arch)
    shards = shard_state_dict(whole, arch, tp, make_vocab_size_divisible_by, expert_tp)
    save_mcore_checkpoint(save, shards, arch.hf_config, make_vocab_size_divisible_by, ep, expert_tp)


def read_mcore_as_hf(load: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """The Hugging Face config and tensors of a megatron checkpoint written by
    `save_mcore_checkpoint` (any TP, EP and expert TP size)."""
    meta = read_mcore_meta(load)
    arch = read_model_config(meta["hf_config"])
    tp, ep = meta["tensor_model_parallel_size"], meta.get("expert_model_parallel_size", 1)
    shards = [
        merge_experts([load_mcore_rank(load, r, e) for e in range(ep)], arch) for r in range(tp)
    ]
    # checkpoints from before --expert-tensor-parallel-size split experts over the TP ranks
    whole = gather_state_dicts(shards, meta.get("expert_tensor_parallel_size", tp))
    return meta["hf_config"], dict(mcore_to_hf_items(whole, arch))


def mcore_to_hf(load: str, hf_checkpoint: str, save: str) -> None:
    """Convert a megatron checkpoint (any TP, EP and expert TP size) back into a Hugging Face
    directory shaped like `hf_checkpoint`."""
    meta = read_mcore_meta(load)
    arch = read_model_config(hf_checkpoint)
    if read_model_config(meta["hf_config"]) != arch:
        raise ValueError(
            f"{load!r} was converted from a different architecture than {hf_checkpoint!r}: "
            f"{read_model_config(meta['hf_config'])} vs {arch}; pass the checkpoint it came from"
        )
    _, tensors = read_mcore_as_hf(load)
    save_hf_checkpoint(tensors.items(), save, like=hf_checkpoint)
