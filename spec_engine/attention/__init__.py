"""Attention backends behind one interface (spec_engine.attention.base.AttentionBackend)."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from spec_engine.attention.base import AttentionBackend

if TYPE_CHECKING:
    from spec_engine.models.hf_config import ModelConfig


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def make_backend(
    name: str,
    device: torch.device,
    config: ModelConfig,
    dtype: torch.dtype,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """The `--attention-backend` for one model (FlashInfer plans need its head geometry);
    `batch_invariant` (--enable-deterministic-inference) exists in torch_native only."""
    if name == "flashinfer":
        if config.mla is not None:
            raise ValueError(
                f"{config.architecture} uses MLA attention, which specrl runs with "
                "--attention-backend torch_native only (its FlashInfer backend has no MLA kernels)"
            )
        from spec_engine.attention.flashinfer import FlashInferBackend  # CUDA-only dependency

        return FlashInferBackend(
            device,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            config.head_dim**-0.5,
            dtype,
        )
    from spec_engine.attention.torch_native import TorchNativeBackend

    return TorchNativeBackend(device, batch_invariant)
