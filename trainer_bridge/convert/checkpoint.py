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

from spec_engine.weights.fp8 import BlockFP8, quantize, read_block_fp8, scale_name
from spec_engine.weights.loader import checkpoint_metadata, iterate_checkpoint
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

# safetensors' dtype names of the float dtypes a release stores unquantized.
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def read_hf_weights(path: str) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face checkpoint directory (the engine's reader: shard index
    first; a block-FP8 checkpoint's weights dequantized to float32 as DeepSeek's weight_dequant
    computes them, weights/fp8.py)."""
    return dict(iterate_checkpoint(path))


def save_hf_checkpoint(
    named_tensors: Iterable[tuple[str, Tensor]], save: str, like: str, keep_fp8: bool = False
) -> None:
    """Write `save/model.safetensors` and copy every non-weight file (config, tokenizer) of
    `like`.

    When `like` is a block-FP8 checkpoint (DeepSeek-V3's release), every tensor is written in the
    dtype the release's BF16 form has: BF16 for the weights it stores in FP8, its own dtype for
    the rest, and config.json without its quantization_config (what DeepSeek's fp8_cast_bf16.py
    makes of the release). `keep_fp8` writes those weights back in the release's layout instead
    (float8_e4m3fn + float32 weight_scale_inv per block of its weight_block_size, blockwise as
    weights/fp8.quantize casts them) and keeps the config: a weight read from the release and
    not trained comes back with its FP8 values (its scale recomputed from them).
    """
    fmt = read_block_fp8(like)
    if keep_fp8 and fmt is None:
        raise ValueError(
            f"--keep-fp8 writes the FP8 layout of the checkpoint converted from, and {like!r} is "
            "not block-FP8 (its config.json has no quantization_config)"
        )
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
    if fmt is None:
        tensors = dict(named_tensors)
    else:
        tensors = _from_fp8_release(named_tensors, like, fmt, keep_fp8)
    if fmt is not None and not keep_fp8:
        with open(os.path.join(like, "config.json")) as f:
            config = json.load(f)
        del config["quantization_config"]
        with open(os.path.join(save, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(save, "model.safetensors"), metadata={"format": "pt"})


def _from_fp8_release(
    named_tensors: Iterable[tuple[str, Tensor]], like: str, fmt: BlockFP8, keep_fp8: bool
) -> dict[str, Tensor]:
    """The tensors in the BF16 form of the FP8 release `like` (or, `keep_fp8`, its FP8 form)."""
    stored = {name: dtype for name, _, dtype in checkpoint_metadata(like, as_stored=True)}
    out: dict[str, Tensor] = {}
    for name, tensor in named_tensors:
        if scale_name(name) not in stored:
            out[name] = tensor.to(_SAFETENSORS_DTYPES.get(stored.get(name), tensor.dtype))
        elif keep_fp8:
            out[name], out[scale_name(name)] = quantize(tensor, fmt.block)
        else:
            out[name] = tensor.to(torch.bfloat16)
    return out


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


def mcore_to_hf(load: str, hf_checkpoint: str, save: str, keep_fp8: bool = False) -> None:
    """Convert a megatron checkpoint (any TP, EP and expert TP size) back into a Hugging Face
    directory shaped like `hf_checkpoint` (a block-FP8 one: in BF16, or `keep_fp8` in its FP8
    layout; see save_hf_checkpoint)."""
    meta = read_mcore_meta(load)
    arch = read_model_config(hf_checkpoint)
    if read_model_config(meta["hf_config"]) != arch:
        raise ValueError(
            f"{load!r} was converted from a different architecture than {hf_checkpoint!r}: "
            f"{read_model_config(meta['hf_config'])} vs {arch}; pass the checkpoint it came from"
        )
    _, tensors = read_mcore_as_hf(load)
    save_hf_checkpoint(tensors.items(), save, like=hf_checkpoint, keep_fp8=keep_fp8)
