"""Batch-invariant building blocks for --enable-deterministic-inference.

A token's result must not depend on what else its forward computes. Two CPU kernels break that:
- GEMMs pick their kernel, and with it each output row's rounding, by the row count (MKL gives a
  row other bits at 1, 2-3 and 4+ rows; cuBLAS picks kernels by shape). `row_blocked` runs a
  matmul on blocks of exactly INVARIANT_ROWS rows, so every row meets the same kernel.
- ATen's vectorised sigmoid and SiLU round differently from their scalar loop, which computes the
  elements left over after the last full vector (and at each thread's chunk edge): a value's
  bits depend on where it sits in the tensor. Composed from exp, add and divide, whose vector and
  scalar paths agree, they do not.
Modules with a class attribute `batch_invariant` switch these on per instance.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

INVARIANT_ROWS = 16


def row_blocked(matmul: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`matmul` over the rows of `x` ([..., in]) in calls of exactly INVARIANT_ROWS rows (the
    last block zero-padded): each row's result is independent of how many rows `x` has."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = -n % INVARIANT_ROWS
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.cat([matmul(block) for block in rows.split(INVARIANT_ROWS)])
    return out[:n].view(*x.shape[:-1], out.shape[-1])


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, invariant: bool = True
) -> torch.Tensor:
    """F.linear; with `invariant`, on fixed-size row blocks."""
    if not invariant:
        return F.linear(x, weight, bias)
    return row_blocked(lambda rows: F.linear(rows, weight, bias), x)


def sigmoid(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x)) if invariant else torch.sigmoid(x)


def silu(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    return x / (1 + torch.exp(-x)) if invariant else F.silu(x)


def set_batch_invariant(model: nn.Module) -> None:
    """Switch every module of `model` that has a `batch_invariant` switch (Linear, MLPs, MoE
    routers and experts) to its batch-invariant computation."""
    for module in model.modules():
        if hasattr(type(module), "batch_invariant"):
            module.batch_invariant = True
