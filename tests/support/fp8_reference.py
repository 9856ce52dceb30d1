"""The oracles for block-FP8 checkpoints, written from DeepSeek's own code rather than ours.

`weight_dequant` and `weight_quant` are DeepSeek-V3's inference/kernel.py functions (their
Triton kernels) in plain torch, block by block. In `weight_dequant` program (pid_m, pid_n) loads its
block of the FP8 weight widened to float32 (masked at the tensor's edges), loads the one
float32 scale `s[pid_m, pid_n]` and stores `x * s` in the output dtype (fp8_cast_bf16.py runs it
with torch's default dtype set to bfloat16). `dequantized_copy` is fp8_cast_bf16.py's job:
every FP8 weight dequantized with the `*_scale_inv` of the same name, whichever shard holds it,
the scales dropped, the rest copied (that script leaves config.json as it is; here its
quantization_config is dropped so that transformers loads the result as an ordinary
checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import shutil

import torch
from safetensors.torch import load_file, save_file


def weight_dequant(
    x: torch.Tensor, s: torch.Tensor, block_size: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """DeepSeek's weight_dequant(x, s, block_size) with torch's default dtype `dtype`."""
    assert x.dim() == 2 and s.dim() == 2
    m, n = x.shape
    y = torch.empty(m, n, dtype=dtype, device="cpu")
    for pid_m in range(math.ceil(m / block_size)):
        for pid_n in range(math.ceil(n / block_size)):
            rows = slice(pid_m * block_size, (pid_m + 1) * block_size)
            cols = slice(pid_n * block_size, (pid_n + 1) * block_size)
            y[rows, cols] = (x[rows, cols].to(torch.float32) * s[pid_m, pid_n]).to(dtype)
    return y


def weight_quant(x: torch.Tensor, block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's weight_quant(x, block_size) (its `weight_quant_kernel`), block by block: the
    block's elements widened to float32, s = max|x| / 448, the block stored as x / s in
    float8_e4m3fn and s in float32."""
    assert x.dim() == 2
    m, n = x.shape
    y = torch.empty(m, n, dtype=torch.float8_e4m3fn, device="cpu")
    s = torch.empty(math.ceil(m / block_size), math.ceil(n / block_size), device="cpu")
    for pid_m in range(s.shape[0]):
        for pid_n in range(s.shape[1]):
            rows = slice(pid_m * block_size, (pid_m + 1) * block_size)
            cols = slice(pid_n * block_size, (pid_n + 1) * block_size)
            block = x[rows, cols].to(torch.float32)
            s[pid_m, pid_n] = block.abs().max() / 448.0
            y[rows, cols] = (block / s[pid_m, pid_n]).to(torch.float8_e4m3fn)
    return y, s


def read_shards(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's shards, by the index's weight map (safetensors' own
    reader)."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(os.path.join(path, file)))
    return tensors


def dequantized_tensors(path: str, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """fp8_cast_bf16.py's tensors of the FP8 checkpoint at `path` (dequantized in `dtype`)."""
    with open(os.path.join(path, "config.json")) as f:
        block = json.load(f)["quantization_config"]["weight_block_size"]
    assert block[0] == block[1], "DeepSeek's kernel takes one square block size"
    stored = read_shards(path)
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        if t.element_size() == 1:  # FP8 weight, as fp8_cast_bf16.py tells them apart
            out[name] = weight_dequant(t, stored[f"{name}_scale_inv"], block[0], dtype)
        else:
            out[name] = t
    return out


def dequantized_copy(path: str, out: str, dtype: torch.dtype = torch.float32) -> str:
    """The FP8 checkpoint at `path` dequantized into `out` (one safetensors file, float32 FP8
    weights, other tensors as stored), a directory transformers loads."""
    os.makedirs(out, exist_ok=True)
    for entry in os.listdir(path):
        weights = entry.endswith((".safetensors", ".safetensors.index.json"))
        if not weights and entry != "config.json":
            shutil.copy2(os.path.join(path, entry), os.path.join(out, entry))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    tensors = dequantized_tensors(path, dtype)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out
