"""Block-FP8 checkpoints, as DeepSeek-V3/R1 are released: read by dequantizing at load.

config.json carries `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`. Each quantized linear stores
`X.weight` as float8_e4m3fn and `X.weight_scale_inv` as float32 of shape
[ceil(out / block[0]), ceil(in / block[1])]: the weight of block (i, j) is its FP8 values times
`weight_scale_inv[i, j]`; a block cut short by the tensor's edge is scaled as if zero-padded
(DeepSeek-V3's weights README). Embeddings, heads, norms, routers and the next-n layer's eh_proj
stay BF16 (the correction bias float32); which tensors are quantized is read off their dtypes.

`dequantize` is DeepSeek's reference `weight_dequant` (inference/kernel.py): each FP8 value
widened to float32 and multiplied by its block's float32 scale, the product kept in float32 (the
kernel's own float32 product, so casting it to BF16 gives fp8_cast_bf16.py's output bit for
bit). This runs on the CPU as the checkpoint is read: the engine then runs ordinary GEMMs in its
dtype (BF16 on CUDA, float32 on CPU); block-FP8 GEMMs (SGLang's CUDA path) are not implemented.
The loader (weights/loader.py) runs every tensor of such a checkpoint through
`dequantized_tensors` and its metadata through `dequantized_metadata`, so models, the engine's
weight checks and the trainer see an ordinary checkpoint under the same names. `quantize` is the
blockwise cast that writes the format (DeepSeek's `weight_quant`).

An FP8 engine (`--quantization fp8`, or any block-FP8 checkpoint) serves the weights such a
release holds: `is_quantized_linear` names them (the linears of attention and of the MLPs, as
DeepSeek's release and SGLang's Fp8LinearMethod/Fp8MoEMethod quantize them: not embeddings,
heads, norms, routers or a next-n layer's eh_proj), and `fake_quantized` puts every such weight
that arrives unquantized (a BF16/float32 checkpoint, a trainer's update) through `quantize` and
`dequantize`, so the engine holds the values an FP8 GEMM computes with (up to its accumulation).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.nn import functional as F

from spec_engine.weights.shard import Shard

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
# safetensors' name for float8_e4m3fn, and torch's (pytorch_model.bin metadata), upper-cased.
_FP8_DTYPE_NAMES = ("F8_E4M3", "FLOAT8_E4M3FN")
_OTHER_FP8 = ("F8_E5M2", "FLOAT8_E5M2", "FLOAT8_E4M3FNUZ", "FLOAT8_E5M2FNUZ")
# What --quantization fp8 quantizes a BF16/float32 checkpoint with: DeepSeek-V3's release block.
DEFAULT_BLOCK = (128, 128)
# The linears the FP8 releases quantize: attention (Llama-style and MLA) and MLP projections
# (dense, routed and shared experts alike).
QUANTIZED_LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_AS_BF16 = "dequantize the checkpoint to BF16 first (DeepSeek's inference/fp8_cast_bf16.py)"


@dataclass(frozen=True)
class BlockFP8:
    """A checkpoint's block-FP8 format: the (rows, columns) of one scale's block."""

    block: tuple[int, int]

    def to_config(self) -> dict[str, Any]:
        """The quantization_config that describes this format (DeepSeek-V3's keys)."""
        return {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": list(self.block),
        }


def block_fp8(config: Mapping[str, Any]) -> Optional[BlockFP8]:
    """The block-FP8 format a config.json declares (None without a quantization_config); any other
    quantization is refused, naming it."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, Mapping):
        raise ValueError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"quantization_config quant_method {method!r} is not supported: specrl reads "
            f"block-FP8 checkpoints (quant_method 'fp8' with weight_block_size, DeepSeek-V3's "
            f"release format); {_AS_BF16}, or use the BF16 release"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"FP8 fmt {q['fmt']!r} is not supported; only 'e4m3' (float8_e4m3fn) is")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"FP8 activation_scheme {q['activation_scheme']!r} is not supported: its activation "
            "scales are not read; only 'dynamic' is"
        )
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError(
            "quant_method 'fp8' without weight_block_size (per-tensor FP8) is not supported; "
            f"specrl reads block-quantized FP8 (weight_block_size [128, 128]); {_AS_BF16}"
        )
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"weight_block_size must be two positive integers, got {block!r}")
    return BlockFP8((block[0], block[1]))


def read_block_fp8(model_path: str) -> Optional[BlockFP8]:
    """The format `model_path/config.json` declares; None without a config.json (a bare weights
    directory) or a quantization_config."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        try:
            config = json.load(f)
        except ValueError as e:
            raise ValueError(f"{path!r} is not JSON: {e}") from None
    return block_fp8(config) if isinstance(config, Mapping) else None


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def is_scale_name(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX)


def weight_name(scale: str) -> str:
    """X.weight of X.weight_scale_inv."""
    return scale.removesuffix(SCALE_SUFFIX)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [rows, columns] weight: one scale per block, edge blocks included."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def scale_shard(name: str, shard: Shard, shape: tuple[int, ...], block: tuple[int, int]) -> Shard:
    """The part of FP8 weight `name`'s scale grid that scales a tensor-parallel rank's block
    `shard` of the [rows, columns] weight of `shape`: the same cut, counted in blocks. A rank's
    block must hold whole FP8 blocks, as SGLang requires (validate_fp8_block_shape for linears,
    Fp8MoEMethod for experts: a per-rank partition divisible by the block); a cut inside a block
    raises ValueError naming the weight, the per-rank size and the block."""
    size, whole = block[shard.dim], shape[shard.dim]
    if shard.start == 0 and shard.length == whole:  # not split (a KV head on every rank)
        return Shard(shard.dim, 0, math.ceil(whole / size))
    if shard.length % size or shard.start % size:
        side, letter = ("rows", "n") if shard.dim == 0 else ("columns", "k")
        raise ValueError(
            f"FP8 weight {name!r} of shape {tuple(shape)} is split over the tensor-parallel "
            f"ranks into {shard.length} {side} per rank, which is not divisible by the FP8 block's "
            f"{size} (weight_block_size {list(block)}): a rank's part would cut blocks that share "
            f"one scale (SGLang refuses it too: 'not divisible by weight quantization "
            f"block_{letter} = {size}'); pick a --tp-size that leaves every rank a multiple of "
            f"{size} {side}, or serve the BF16 weights without --quantization fp8"
        )
    return Shard(shard.dim, shard.start // size, shard.length // size)


def with_scale_shards(
    shards: Mapping[str, Shard], shapes: Mapping[str, tuple[int, ...]], block: tuple[int, int]
) -> dict[str, Shard]:
    """A tensor-parallel rank's blocks (`shards`, by weight name) and, for each FP8 weight among
    them that has a scale grid (`shapes`: every tensor's whole shape, scales included), the
    matching block of its `*_scale_inv` (scale_shard): what the rank takes of a block-FP8
    checkpoint or update before dequantizing it."""
    cuts = dict(shards)
    for name, shard in shards.items():
        if scale_name(name) in shapes and name in shapes:
            cuts[scale_name(name)] = scale_shard(name, shard, shapes[name], block)
    return cuts


def _is_fp8(dtype: str) -> bool:
    return str(dtype).removeprefix("torch.").upper() in _FP8_DTYPE_NAMES


def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 weight of an FP8 one: each value times its block's scale (DeepSeek's
    weight_dequant with float32 output)."""
    rows, cols = weight.shape
    grid = scale_shape((rows, cols), block)
    w = weight.to(torch.float32)
    padded = (grid[0] * block[0], grid[1] * block[1])
    if padded != (rows, cols):
        w = F.pad(w, (0, padded[1] - cols, 0, padded[0] - rows))
    w = w.view(grid[0], block[0], grid[1], block[1]) * scale_inv.to(torch.float32).view(
        grid[0], 1, grid[1], 1
    )
    return w.view(padded)[:rows, :cols].contiguous()


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 weight_scale_inv) of a 2-D weight, blockwise, as DeepSeek's
    `weight_quant` (inference/kernel.py) casts it: each block's scale is its largest magnitude
    over 448 in float32, an edge block's over its real elements only, and the values are divided
    by it. Unlike that kernel, an all-zero block gets scale 1 (not 0 and NaN values) and the
    quotients are clamped to the FP8 range."""
    if weight.dim() != 2:
        raise ValueError(f"block-FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    grid = scale_shape((rows, cols), block)
    padded = (grid[0] * block[0], grid[1] * block[1])
    w = F.pad(weight.to(torch.float32), (0, padded[1] - cols, 0, padded[0] - rows))
    blocks = w.view(grid[0], block[0], grid[1], block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale.view(grid[0], 1, grid[1], 1)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE).view(padded)[:rows, :cols].contiguous(), scale


def is_quantized_linear(name: str) -> bool:
    """Whether an FP8 release stores Hugging Face tensor `name` in FP8 (a quantized linear's
    weight, not its bias)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS


def fake_quantize(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float32 values of `weight` after a blockwise FP8 round trip: what an FP8 engine holds."""
    return dequantize(*quantize(weight, block), block)


def served(name: str, tensor: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Tensor `name` as an FP8 engine holds it: a quantized linear's weight (is_quantized_linear)
    through `fake_quantize`, anything else as given."""
    return fake_quantize(tensor, block) if quantized_weight(name, tensor) else tensor


def quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether an FP8 engine holds tensor `name` quantized (a quantized linear's 2-D weight)."""
    return is_quantized_linear(name) and tensor.is_floating_point() and tensor.dim() == 2


def fake_quantized(
    tensors: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`tensors` as an FP8 engine takes them (see `served`)."""
    for name, tensor in tensors:
        yield name, served(name, tensor, block)


def update_metadata(
    entries: Iterable[tuple[str, tuple[int, ...], str]], block: Optional[tuple[int, int]]
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, whole shape, dtype) of a weight update's tensors as the engine takes them: FP8
    weights sent with their `*_scale_inv` (a trainer that quantizes before sending, as slime
    does) as F32, their scales checked against them (dequantized_metadata) and left out. An
    engine without FP8 weights (`block` None) is refused them."""
    entries = list(entries)
    if not any(is_scale_name(n) or _is_fp8(d) for n, _, d in entries):
        return entries
    if block is None:
        raise ValueError(
            "FP8 weights or block scales were sent to an engine that serves unquantized weights; "
            "send BF16/float32 weights, or start the engine with --quantization fp8"
        )
    return list(dequantized_metadata(entries, BlockFP8(block)))


def dequantized_update(
    tensors: list[tuple[str, torch.Tensor]], block: Optional[tuple[int, int]]
) -> tuple[list[tuple[str, torch.Tensor]], set[str]]:
    """A weight update's tensors (checked by update_metadata; under tensor parallelism the
    rank's blocks, each FP8 weight's with the same block of its scale grid) with FP8 weights
    dequantized by their scales; and the names of those, whose values are FP8 values already."""
    if block is None or not any(is_scale_name(n) or t.dtype == FP8_DTYPE for n, t in tensors):
        return tensors, set()
    scales = {n: t for n, t in tensors if is_scale_name(n)}
    out = list(dequantized_tensors(tensors, scales, BlockFP8(block)))
    return out, {n for n, t in tensors if t.dtype == FP8_DTYPE}


def dequantized_metadata(
    entries: Iterable[tuple[str, tuple[int, ...], str]], fmt: BlockFP8
) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of the checkpoint as it reads dequantized: each FP8 weight as F32, its
    scale consumed. Raises ValueError naming a weight without its scale, a scale without its
    weight, or a scale whose grid does not fit its weight and the block size."""
    entries = list(entries)
    stored = {name: (tuple(shape), dtype) for name, shape, dtype in entries}
    for name, shape, dtype in entries:
        if is_scale_name(name):
            weight = stored.get(weight_name(name))
            if weight is None or not _is_fp8(weight[1]):
                raise ValueError(
                    f"checkpoint tensor {name!r} is a block scale without an FP8 weight "
                    f"{weight_name(name)!r}"
                )
            continue
        if not _is_fp8(dtype):
            _refuse_other_fp8(name, dtype)
            yield name, tuple(shape), dtype
            continue
        scale = stored.get(scale_name(name))
        if scale is None:
            raise ValueError(
                f"FP8 weight {name!r} has no {scale_name(name)!r} in the checkpoint; every "
                "float8_e4m3fn weight of a block-FP8 checkpoint needs its block scales"
            )
        want = scale_shape(tuple(shape), fmt.block) if len(shape) == 2 else None
        if want is None or scale[0] != want:
            raise ValueError(
                f"{scale_name(name)!r} has shape {scale[0]}, expected {want} for weight shape "
                f"{tuple(shape)} in blocks of {list(fmt.block)} (config.json weight_block_size)"
            )
        yield name, tuple(shape), "F32"


def dequantized_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], scales: Mapping[str, torch.Tensor], fmt: BlockFP8
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP8 weight dequantized to float32 by its scale (from
    `scales`, every `*_scale_inv` tensor of the checkpoint, whichever file holds it) and the
    scales themselves left out; other tensors as stored."""
    for name, tensor in tensors:
        if is_scale_name(name):
            continue
        if tensor.dtype != FP8_DTYPE:
            _refuse_other_fp8(name, str(tensor.dtype))
            yield name, tensor
            continue
        scale = scales.get(scale_name(name))
        if scale is None:
            raise ValueError(f"FP8 weight {name!r} has no {scale_name(name)!r} in the checkpoint")
        if tensor.dim() != 2 or tuple(scale.shape) != scale_shape(tuple(tensor.shape), fmt.block):
            raise ValueError(
                f"{scale_name(name)!r} has shape {tuple(scale.shape)}, which does not fit weight "
                f"shape {tuple(tensor.shape)} in blocks of {list(fmt.block)}"
            )
        yield name, dequantize(tensor, scale, fmt.block)


def refuse_unquantized_fp8(name: str, dtype: str) -> None:
    """A checkpoint whose config.json declares no quantization may not hold FP8 tensors or block
    scales: read as plain weights, their values would be wrong."""
    if _is_fp8(dtype) or is_scale_name(name):
        raise ValueError(
            f"checkpoint tensor {name!r} ({dtype}) is FP8 data, but config.json has no "
            "quantization_config; a block-FP8 checkpoint declares quant_method 'fp8' with "
            "weight_block_size"
        )
    _refuse_other_fp8(name, dtype)


def _refuse_other_fp8(name: str, dtype: str) -> None:
    if str(dtype).removeprefix("torch.").upper() in _OTHER_FP8:
        raise ValueError(
            f"checkpoint tensor {name!r} has dtype {dtype}; of the FP8 dtypes only float8_e4m3fn "
            "is read"
        )
