"""Checkpoint directories on disk: Hugging Face (safetensors) and specrl's megatron format.

The megatron format (Megatron's legacy torch layout, without iteration directories):

    <dir>/specrl_mcore.json                      {"format", "tensor_model_parallel_size",
                                                  "make_vocab_size_divisible_by",
                                                  "padded_vocab_size",
                                                  "hf_config": the source config.json}
    <dir>/mp_rank_{r:02d}/model_optim_rng.pt     torch.save({"model": rank r's GPTModel state dict})

Each rank's state dict holds exactly the tensors of that rank's `model.state_dict()` (no
`_extra_state`), so `model.load_state_dict(ckpt["model"], strict=False)` restores it.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor

from spec_engine.weights.loader import iterate_checkpoint
from trainer_bridge.convert.state_dict import hf_to_mcore_state_dict, mcore_to_hf_items
from trainer_bridge.convert.tp import gather_state_dicts, shard_state_dict
from trainer_bridge.model_provider import (
    DEFAULT_VOCAB_DIVISOR,
    padded_vocab_size,
    read_model_config,
)

FORMAT = "specrl-mcore-v1"
META_FILE = "specrl_mcore.json"
RANK_FILE = os.path.join("mp_rank_{rank:02d}", "model_optim_rng.pt")
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


def save_mcore_checkpoint(
    save: str,
    shards: list[dict[str, Tensor]],
    hf_config: Mapping[str, Any],
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
) -> None:
    """Write per-rank state dicts (rank order) and the metadata file."""
    arch = read_model_config(hf_config)
    tp = len(shards)
    for rank, state in enumerate(shards):
        path = os.path.join(save, RANK_FILE.format(rank=rank))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"model": state}, path)
    meta = {
        "format": FORMAT,
        "tensor_model_parallel_size": tp,
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


def load_mcore_rank(load: str, rank: int) -> dict[str, Tensor]:
    """Tensor-parallel rank `rank`'s state dict (on CPU)."""
    tp = read_mcore_meta(load)["tensor_model_parallel_size"]
    if not 0 <= rank < tp:
        raise ValueError(
            f"rank {rank} is outside the checkpoint's tensor parallel size {tp} ({load!r})"
        )
    return torch.load(
        os.path.join(load, RANK_FILE.format(rank=rank)), map_location="cpu", weights_only=True
    )["model"]


def hf_to_mcore(
    hf_checkpoint: str,
    save: str,
    tp: int = 1,
    make_vocab_size_divisible_by: int = DEFAULT_VOCAB_DIVISOR,
) -> None:
    """Convert a Hugging Face directory into a megatron checkpoint sharded for `tp` ranks."""
    arch = read_model_config(hf_checkpoint)
    whole = hf_to_mcore_state_dict(read_hf_weights(hf_checkpoint), arch)
    shards = shard_state_dict(whole, arch, tp, make_vocab_size_divisible_by)
    save_mcore_checkpoint(save, shards, arch.hf_config, make_vocab_size_divisible_by)


def mcore_to_hf(load: str, hf_checkpoint: str, save: str) -> None:
    """Convert a megatron checkpoint back into a Hugging Face directory shaped like
    `hf_checkpoint`."""
    meta = read_mcore_meta(load)
    arch = read_model_config(hf_checkpoint)
    if read_model_config(meta["hf_config"]) != arch:
        raise ValueError(
            f"{load!r} was converted from a different architecture than {hf_checkpoint!r}: "
            f"{read_model_config(meta['hf_config'])} vs {arch}; pass the checkpoint it came from"
        )
    shards = [load_mcore_rank(load, r) for r in range(meta["tensor_model_parallel_size"])]
    save_hf_checkpoint(
        mcore_to_hf_items(gather_state_dicts(shards), arch), save, like=hf_checkpoint
    )
