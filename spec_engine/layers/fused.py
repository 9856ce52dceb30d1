"""Fused decoder kernels: FlashInfer's on CUDA, and CPU stand-ins with the same semantics.

A decoder layer written with torch ops launches many small kernels: on an H200 an 8B model at
batch 1 spent about a third of a decode step in them (docs/benchmarks/gpu_NVIDIA_H200.md). Each
kernel here replaces several, in every layer:

* `rmsnorm(x, weight, eps) -> out`: the norm of a layer's input (one kernel for eight);
* `add_rmsnorm(x, residual, weight, eps)`, **in place**: `residual += x`, then
  `x = rmsnorm(residual)` (the add, the statistics and the scaling in one pass);
* `rope(positions, q, k, head_size, cos_sin_cache, is_neox)`, **in place** on q `[T, Hq * D]`
  and k `[T, Hk * D]`, reading a float32 `[max_positions, rotary_dim]` table of cos then sin
  (no index_select, split or cat per layer);
* `silu_and_mul(gate_up) -> silu(gate) * up` over the fused `[T, 2 * I]` projection;
* `append_kv(k, v, batch_indices, positions, (k_pages, v_pages), indices, indptr,
  last_page_len, layout)`: FlashInfer's `append_paged_kv_cache`, one kernel for K and V.

Each computes in float32 and rounds once where the torch reference rounds between ops, so in
bfloat16 outputs agree to its precision, not bitwise: batch-invariant engines
(`--enable-deterministic-inference`) keep the reference. The stand-ins (`reference_kernels`)
implement the documented semantics with torch ops, in place where FlashInfer works in place, so
a CPU engine running them checks every call site: argument layout, and that no tensor a caller
still reads is overwritten (tests/engine/test_fused_kernels.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from spec_engine.layers.norm import RMSNorm
from spec_engine.layers.rotary import RotaryEmbedding


@dataclasses.dataclass(frozen=True)
class FusedKernels:
    """One implementation of each fused kernel (signatures in the module docstring)."""

    rmsnorm: Callable[..., torch.Tensor]
    add_rmsnorm: Callable[..., None]
    rope: Callable[..., None]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    append_kv: Callable[..., None]


def flashinfer_kernels() -> FusedKernels:
    """FlashInfer's kernels (CUDA; the [gpu] extra)."""
    from flashinfer.activation import silu_and_mul
    from flashinfer.norm import fused_add_rmsnorm, rmsnorm
    from flashinfer.page import append_paged_kv_cache
    from flashinfer.rope import apply_rope_with_cos_sin_cache_inplace

    return FusedKernels(
        rmsnorm=rmsnorm,
        add_rmsnorm=fused_add_rmsnorm,
        rope=apply_rope_with_cos_sin_cache_inplace,
        silu_and_mul=silu_and_mul,
        append_kv=append_paged_kv_cache,
    )


def kernels_for(device: torch.device, attention_backend: str, deterministic: bool):
    """The fused kernels an engine on `device` runs: FlashInfer's on CUDA with the flashinfer
    backend, none elsewhere or in batch-invariant mode (their reductions are not)."""
    if device.type == "cuda" and attention_backend == "flashinfer" and not deterministic:
        return flashinfer_kernels()
    return None


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    # FlashInfer normalizes the float32 sum, and stores the sum rounded as the new residual.
    total = x.float() + residual.float()
    residual.copy_(total)
    x.copy_((total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)) * weight.float())


def _rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    for x in (q, k):
        heads = x.view(x.shape[0], -1, head_size)[..., :dim]
        if is_neox:
            x1, x2 = heads.float().chunk(2, dim=-1)
            heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
        else:
            x1, x2 = heads[..., 0::2].float(), heads[..., 1::2].float()
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            heads.copy_(out.flatten(-2))


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def _append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    indices: torch.Tensor,
    indptr: torch.Tensor,
    last_page_len: torch.Tensor,
    layout: str = "NHD",
) -> None:
    # Token i goes to page indices[indptr[batch_indices[i]] + positions[i] // page_size], entry
    # positions[i] % page_size (FlashInfer's documented addressing; last_page_len bounds it).
    assert layout == "NHD" and indices.dtype == torch.int32, "kernel contract"
    k_pages, v_pages = cache
    page_size = k_pages.shape[1]
    page = indices[(indptr[batch_indices.long()] + positions // page_size).long()].long()
    entry = (positions % page_size).long()
    k_pages[page, entry] = k.to(k_pages.dtype)
    v_pages[page, entry] = v.to(v_pages.dtype)


def reference_kernels() -> FusedKernels:
    """Stand-ins with FlashInfer's semantics, for any device (tests run them on CPU)."""
    return FusedKernels(_rmsnorm, _add_rmsnorm, _rope, _silu_and_mul, _append_kv)


class KVAppend:
    """A KV pool's store through `append_kv`: the pool seen as pages of one slot, so token i's
    page is its slot, and the index vectors are constant slices of buffers grown on demand.
    FlashInfer takes int32 slots: the batch's are cast per call (a cast cached per forward would
    go stale where a graph's static slot buffer is rewritten in place between runs)."""

    def __init__(self, append_kv: Callable[..., None]) -> None:
        self.append_kv = append_kv
        self._counts = torch.empty(0, dtype=torch.int32, device="cpu")  # grown on loc.device

    def __call__(
        self,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        n = loc.shape[0]
        if self._counts.numel() < n + 1 or self._counts.device != loc.device:
            self._counts = torch.arange(max(n + 1, 256), dtype=torch.int32, device=loc.device)
            self._zeros = torch.zeros_like(self._counts)
            self._ones = torch.ones_like(self._counts)
        tokens = self._counts[:n]
        self.append_kv(
            k,
            v,
            tokens,
            self._zeros[:n],
            (k_buffer.unsqueeze(1), v_buffer.unsqueeze(1)),
            loc.to(torch.int32),
            self._counts[: n + 1],
            self._ones[:n],
            "NHD",
        )


def install(model: nn.Module, kv_pool, kernels: FusedKernels) -> dict[str, int]:
    """Give `model`'s layers and `kv_pool` the fused kernels; returns how many of each took them."""
    counts = {"rmsnorm": 0, "rope": 0, "silu_and_mul": 0, "append_kv": 0}
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.kernel, module.add_kernel = kernels.rmsnorm, kernels.add_rmsnorm
            counts["rmsnorm"] += 1
        elif isinstance(module, RotaryEmbedding):
            module.kernel = kernels.rope
            counts["rope"] += 1
        elif hasattr(module, "act_kernel"):  # the SwiGLU MLPs (models/llama.py, layers/moe.py)
            module.act_kernel = kernels.silu_and_mul
            counts["silu_and_mul"] += 1
    if kv_pool.appends_kv:
        kv_pool.store_kernel = KVAppend(kernels.append_kv)
        counts["append_kv"] = 1
    return counts
