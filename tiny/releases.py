"""Tiny checkpoints in the layouts the big releases are published in (no hub access).

`to_fp8_release` rewrites any tiny checkpoint as DeepSeek-V3/R1 are published: every linear of
attention and of the MLPs (dense, routed and shared experts; the next-n layer's decoder too) as
float8_e4m3fn with a float32 `weight_scale_inv` per block, the rest BF16 (embeddings, heads,
norms, routers, the next-n layer's eh_proj and its embedding and head copies) except the
router's `e_score_correction_bias` (float32), config.json with DeepSeek's
`quantization_config` and `torch_dtype: bfloat16`, the tensors split over
`model-0000k-of-0000n.safetensors` files with `model.safetensors.index.json`, a weight's scale
in the next file wherever a file boundary falls between them (as the release's shard boundaries
do). The block size is the config's `weight_block_size`: 128 x 128 in the release, smaller for
tiny shapes so that tensors hold several blocks and blocks cut short at their edges.

`to_sharded_release` only splits a checkpoint over files with an index (GLM-4.5's, Qwen3's
release layout). `tiny.checkpoints.build_checkpoint` writes the GLM-4.5 and DeepSeek-V3 next-n
layers with their `embed_tokens` and `shared_head.head` copies, as both releases carry them.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from typing import Any

# Tensors the release keeps in float32 (DeepSeek-V3's router correction bias).
FLOAT32_SUFFIXES = ("e_score_correction_bias",)
_WEIGHT_FILES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def to_fp8_release(src: str, out: str, block: tuple[int, int] = (128, 128), shards: int = 2) -> str:
    """Write `src` (a Hugging Face directory, any family) to `out` in DeepSeek-V3's FP8 release
    layout with `weight_block_size` `block`; tokenizer and other files copied."""
    import torch

    from spec_engine.weights.fp8 import BlockFP8, is_quantized_linear, quantize, scale_name
    from spec_engine.weights.loader import iterate_checkpoint

    tensors: dict[str, Any] = {}
    for name, t in iterate_checkpoint(src):
        if is_quantized_linear(name):
            tensors[name], tensors[scale_name(name)] = quantize(t, block)
        elif t.is_floating_point():
            keep = name.endswith(FLOAT32_SUFFIXES)
            tensors[name] = t.to(torch.float32 if keep else torch.bfloat16)
        else:
            tensors[name] = t
    config = _read_config(src)
    config.pop("dtype", None)
    config.update(torch_dtype="bfloat16", quantization_config=BlockFP8(tuple(block)).to_config())
    _copy_other_files(src, out)
    _write_config(out, config)
    write_shards(out, tensors, shards)
    return out


def to_sharded_release(src: str, out: str, shards: int = 3) -> str:
    """`src` split over `shards` files with a shard index (tensors and config unchanged)."""
    from spec_engine.weights.loader import iterate_checkpoint

    tensors = dict(iterate_checkpoint(src))
    _copy_other_files(src, out)
    shutil.copy2(os.path.join(src, "config.json"), os.path.join(out, "config.json"))
    write_shards(out, tensors, shards)
    return out


def write_shards(out: str, tensors: Mapping[str, Any], shards: int) -> None:
    """Split `tensors` (in their order) over `model-0000k-of-0000n.safetensors` with the index
    the releases carry; a boundary goes between an FP8 weight and its scale where one exists."""
    from safetensors.torch import save_file

    names = list(tensors)
    cuts = _cuts(names, shards)
    index: dict[str, Any] = {"metadata": {"total_size": 0}, "weight_map": {}}
    for k, (start, end) in enumerate(zip([0, *cuts], [*cuts, len(names)])):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[start:end]}
        save_file(part, os.path.join(out, file), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(part, file))
        index["metadata"]["total_size"] += sum(t.numel() * t.element_size() for t in part.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2)


def _cuts(names: list[str], shards: int) -> list[int]:
    """Where each file after the first starts: near an even split, moved forward to fall
    between an FP8 weight and its scale when one follows."""
    if not 1 <= shards <= len(names):
        raise ValueError(f"cannot split {len(names)} tensors over {shards} files")
    cuts = []
    for k in range(1, shards):
        cut = max(k * len(names) // shards, cuts[-1] + 1 if cuts else 1)
        split = next(
            (i for i in range(cut, len(names)) if names[i] == names[i - 1] + "_scale_inv"), cut
        )
        cuts.append(min(split, len(names) - (shards - k)))
    return cuts


def _read_config(src: str) -> dict[str, Any]:
    with open(os.path.join(src, "config.json")) as f:
        return json.load(f)


def _write_config(out: str, config: dict[str, Any]) -> None:
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _copy_other_files(src: str, out: str) -> None:
    """Tokenizer, generation config and the rest: every file but the weights and config.json."""
    os.makedirs(out, exist_ok=True)
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if os.path.isfile(path) and entry != "config.json" and not entry.endswith(_WEIGHT_FILES):
            shutil.copy2(path, os.path.join(out, entry))
