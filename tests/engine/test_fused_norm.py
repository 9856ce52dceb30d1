"""The fused RMSNorm path (flashinfer's kernel on CUDA), checked on CPU with a stand-in kernel of
flashinfer's documented semantics: float32 statistics, the weight applied before one rounding."""

from __future__ import annotations

import torch

from spec_engine.layers.norm import RMSNorm


def flashinfer_like_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.dim() == 2 and x.is_contiguous() and x.dtype == weight.dtype, "kernel contract"
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def test_fused_kernel_agrees_with_the_reference_to_bfloat16_precision():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    residual = torch.randn(3, 5, 64, dtype=torch.bfloat16)
    ref_out, ref_res = norm(x, residual)
    norm.kernel = flashinfer_like_rmsnorm
    out, res = norm(x, residual)
    assert out.shape == ref_out.shape and out.dtype == torch.bfloat16
    assert torch.equal(res, ref_res)  # the residual sum is the same tensor math
    # One rounding instead of two: within a bfloat16 ulp of the reference, and not always equal.
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2**-7, atol=1e-2)
    assert not torch.equal(out, ref_out)


def test_fused_kernel_is_skipped_where_its_contract_does_not_hold():
    calls = []

    def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        calls.append(x.shape)
        return flashinfer_like_rmsnorm(x, weight, eps)

    norm = RMSNorm(8)
    norm.kernel = kernel
    x = torch.randn(4, 8)
    norm(x)
    assert calls == [(4, 8)]
    norm(torch.randn(8, 4).t())  # a non-contiguous view (per-head q/k norms): the reference
    norm(x.to(torch.bfloat16))  # a dtype other than the weight's: the reference
    assert calls == [(4, 8)]
