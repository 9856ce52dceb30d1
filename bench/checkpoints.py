"""The random checkpoints the benchmarks run on: real models' shapes, and a directory per shape
where a checkpoint is built once and found again by a later run."""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable

# Model shapes to benchmark at (random weights): Llama-3.1-8B's config.
PRESETS = {
    "llama-3.1-8b": dict(
        hidden_size=4096,
        num_layers=32,
        intermediate_size=14336,
        num_heads=32,
        num_kv_heads=8,
        vocab_size=128256,
    )
}


def apply_preset(args: argparse.Namespace) -> None:
    """--preset's shape over the shape flags (nothing without one)."""
    for key, value in PRESETS.get(args.preset, {}).items():
        setattr(args, key, value)


def work_dir(base: str | None, prefix: str, args: argparse.Namespace) -> str:
    """A directory for this shape's random checkpoints: under `base` (kept, found again by the
    same shape and dtype), else a fresh temporary one."""
    if base is None:
        return tempfile.mkdtemp(prefix=prefix)
    shape = (
        args.hidden_size,
        args.num_layers,
        args.intermediate_size,
        args.num_heads,
        args.num_kv_heads,
        args.vocab_size,
        getattr(args, "context_length", 0),
        args.dtype,
    )
    path = os.path.join(base, prefix + "-".join(map(str, shape)))
    os.makedirs(path, exist_ok=True)
    return path


def cached(path: str, build: Callable[[str], str]) -> str:
    """`build(path)` unless a checkpoint is there already (from an earlier run)."""
    return path if os.path.exists(os.path.join(path, "config.json")) else build(path)


def perturbed_copy(src: str, dst: str, noise: float, seed: int = 0) -> str:
    """A copy of checkpoint `src` at `dst` whose weight matrices each have Gaussian noise of
    `noise` times their own standard deviation added: a draft that imitates its target, agreeing
    on most tokens but not all (the more noise, the fewer)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator(device="cpu").manual_seed(seed)
    for name in sorted(os.listdir(dst)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(dst, name)
        tensors = load_file(path)
        for key, t in tensors.items():
            if t.is_floating_point() and t.dim() >= 2:
                jitter = torch.randn(t.shape, generator=g, device="cpu", dtype=torch.float32)
                tensors[key] = (t.float() + noise * t.float().std() * jitter).to(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst
