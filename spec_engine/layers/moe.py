"""Mixture-of-experts MLP (GLM-4.5 / DeepSeek-V3 style): router, routed experts, shared experts.

Router: sigmoid scores; experts are *selected* by score + e_score_correction_bias, within the
`topk_group` best of `n_group` groups (a group's score: the sum of its two best biased scores),
and *weighted* by the unbiased scores, renormalised when `norm_topk_prob`, times
`routed_scaling_factor` — transformers' Glm4MoeTopkRouter step by step. The router's weight and
bias stay float32 in any model dtype, as transformers keeps them (`_keep_in_fp32_modules_strict`):
routing is a discrete choice that bfloat16 logits would flip.

Experts are plain tensors (no fused kernel): eagerly, a loop over the experts that received
tokens; while a graph is being captured (a CUDA graph, or the CPU emulation's capture guard), a
loop over every expert with the routing weights as a dense [tokens, experts] matrix, so nothing
reads values back to the host and every shape is static. Both give the same sums per token.
With `batch_invariant` set (--enable-deterministic-inference) the matmuls and activations are
layers/batch_invariant.py's.

Tensor parallelism, as SGLang places a MoE at --ep-size 1 (models/deepseek_v2.py's
DeepseekV2MoE over FusedMoE): the router is replicated (every rank routes every token, the same
way: its input is the same bits on every rank); every rank holds every expert's block of the
intermediate features (gate/up rows, down columns), and the shared experts are a column- then
row-parallel MLP likewise; the routed and shared partial outputs are summed on each rank, then
once over the ranks (one all-reduce per MoE layer). At --ep-size > 1 (expert parallelism,
SGLang's moe_ep x moe_tp groups without an all-to-all backend) the experts are split into
--ep-size groups of E / ep, and the tp / ep consecutive ranks of group g hold experts
[g * E / ep, (g + 1) * E / ep), each its block of their features (whole at --ep-size equal to
--tp-size: distributed/partition.expert_place), and add only theirs; the router, the TP-split
shared experts and the one all-reduce over all the ranks stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from spec_engine.distributed.parallel_state import SINGLE, TPGroup, get_tp_group
from spec_engine.distributed.partition import divide, expert_place
from spec_engine.layers import batch_invariant as bi
from spec_engine.layers.linear import Linear
from spec_engine.weights.loader import WeightSlot
from spec_engine.weights.shard import block


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up fused (the shared experts): this rank's block of the
    intermediate features, its output a partial sum (SparseMoE all-reduces it)."""

    batch_invariant = False
    act_kernel: Optional[Callable[[torch.Tensor], torch.Tensor]] = None  # layers/fused.py

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act_kernel is not None:
            return self.down_proj(self.act_kernel(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(bi.silu(gate, self.batch_invariant) * up)


class MoEGate(nn.Module):
    """Sigmoid router with grouped top-k and a selection-only correction bias."""

    batch_invariant = False

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202  (nn.Module's signature)
        # model.to(bfloat16) must not reach the router: keep its parameters float32 (the cast
        # happens on the meta device at build time, before any value exists).
        super()._apply(fn, recurse)
        for p in self._parameters.values():
            if p is not None and p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (top-k weights [T, k] float32, expert ids [T, k] int64)."""
        invariant = self.batch_invariant
        scores = bi.sigmoid(bi.linear(x.float(), self.weight, invariant=invariant), invariant)
        choice = scores + self.e_score_correction_bias
        per_group = self.num_experts // self.n_group
        if self.topk_group < self.n_group:
            grouped = choice.view(-1, self.n_group, per_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view_as(choice)
        ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class Experts(nn.Module):
    """Routed SwiGLU experts. Each expert's gate/up rows and down rows are contiguous blocks of
    two 2-D parameters ([E * 2I, H] and [E * H, I]), so every Hugging Face per-expert tensor is a
    row range (weights/loader.py copies and updates it in place). I is this rank's block of the
    intermediate features, and the rank holds experts [first, first + num_experts) of `total`
    (all of them without expert parallelism); the output is then a partial sum (SparseMoE
    all-reduces it)."""

    batch_invariant = False

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        intermediate_size: int,
        first: int = 0,
        total: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.first, self.total = first, total or num_experts
        self.intermediate_size = intermediate_size
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts * 2 * intermediate_size, hidden_size)
        )
        self.w2_weight = nn.Parameter(torch.empty(num_experts * hidden_size, intermediate_size))

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        inter, h = self.intermediate_size, self.hidden_size
        invariant = self.batch_invariant
        w13 = self.w13_weight[e * 2 * inter : (e + 1) * 2 * inter]
        gate, up = bi.linear(x, w13, invariant=invariant).split(inter, dim=-1)
        return bi.linear(
            bi.silu(gate, invariant) * up, self.w2_weight[e * h : (e + 1) * h], invariant=invariant
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; weights, ids: [T, k] -> the weighted sum of each token's experts [T, H]."""
        out = torch.zeros_like(x)
        if _capturing(x):
            dense = torch.zeros(
                x.shape[0], self.total, dtype=weights.dtype, device=x.device
            ).scatter_(1, ids, weights)[:, self.first : self.first + self.num_experts]
            for e in range(self.num_experts):
                out += (self._expert(e, x) * dense[:, e : e + 1]).to(x.dtype)
            return out
        hit = torch.bincount(ids.flatten(), minlength=self.total).nonzero().flatten()
        for e in hit.tolist():
            if not self.first <= e < self.first + self.num_experts:
                continue  # another rank's expert
            token, slot = torch.where(ids == e)
            y = self._expert(e - self.first, x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


def _capturing(x: torch.Tensor) -> bool:
    """Whether a graph is being captured: a CUDA stream capture, or a dispatch mode on CPU (the
    emulation's capture guard), where host reads and value-dependent shapes are refused."""
    if x.is_cuda:
        return torch.cuda.is_current_stream_capturing()
    return _get_current_dispatch_mode() is not None


class SparseMoE(nn.Module):
    """Routed experts plus always-on shared experts, over flat tokens [T, hidden]."""

    # Given each forward's expert ids [T, k] when routed experts are returned
    # (layers/routing_capture.py sets it on the target's trunk layers).
    routing_sink: Optional[Callable[[torch.Tensor], None]] = None

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        num_shared_experts: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.gate = MoEGate(
            hidden_size,
            num_experts,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        )
        self.tp = tp = get_tp_group()
        local = divide(intermediate_size, tp.size, "moe_intermediate_size")
        place = expert_place(num_experts, tp.rank, tp.size, tp.ep_size)
        self.experts = Experts(
            hidden_size,
            place.count,
            divide(intermediate_size, place.blocks, "moe_intermediate_size"),
            place.first,
            num_experts,
        )
        self.shared_experts = (
            GatedMLP(hidden_size, local * num_shared_experts) if num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.routing_sink is not None:
            self.routing_sink(ids)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


def moe_weight_spec(
    src: str,
    dst: str,
    hidden_size: int,
    num_experts: int,
    intermediate_size: int,
    num_shared_experts: int,
    tp: TPGroup = SINGLE,
) -> dict[str, WeightSlot]:
    """Slots of a SparseMoE: Hugging Face names under `src` (`...mlp.`: gate, experts.{e},
    shared_experts), parameters under `dst`; rank `tp.rank`'s block of each expert's
    intermediate features under tensor parallelism (the router whole); at --ep-size > 1 only
    its expert group's experts, their features split over the group's ranks (whole at
    --ep-size equal to --tp-size; the others' experts accepted and skipped)."""
    h, full = hidden_size, intermediate_size
    shared_inter = full // tp.size  # SparseMoE refuses a size that does not divide
    place = expert_place(num_experts, tp.rank, tp.size, tp.ep_size)
    split = place.blocks > 1
    inter = full // place.blocks
    rows = block(0, place.block, inter) if split else None  # gate/up: a block of rows
    cols = block(1, place.block, inter) if split else None  # down: a block of columns
    per_rank, first = place.count, place.first
    spec = {
        f"{src}gate.weight": WeightSlot(dst + "gate.weight", (num_experts, h)),
        f"{src}gate.e_score_correction_bias": WeightSlot(
            dst + "gate.e_score_correction_bias", (num_experts,)
        ),
    }
    for e in range(num_experts):
        name, i = f"{src}experts.{e}.", e - first  # i: the expert's index on this rank
        if not 0 <= i < per_rank:  # another rank's expert (it requires and checks it)
            for proj, shape in (("gate_proj", (full, h)), ("up_proj", (full, h))):
                spec[f"{name}{proj}.weight"] = WeightSlot(None, shape, optional=True)
            spec[f"{name}down_proj.weight"] = WeightSlot(None, (h, full), optional=True)
            continue
        base = 2 * inter * i
        for proj, start in (("gate_proj", base), ("up_proj", base + inter)):
            spec[f"{name}{proj}.weight"] = WeightSlot(
                dst + "experts.w13_weight", (full, h), (start, start + inter), shard=rows
            )
        spec[f"{name}down_proj.weight"] = WeightSlot(
            dst + "experts.w2_weight", (h, full), (h * i, h * (i + 1)), shard=cols
        )
    if num_shared_experts:
        shared, width = f"{src}shared_experts.", shared_inter * num_shared_experts
        whole = full * num_shared_experts
        rows = block(0, tp.rank, width) if tp.size > 1 else None
        cols = block(1, tp.rank, width) if tp.size > 1 else None
        for proj, fused in (("gate_proj", (0, width)), ("up_proj", (width, 2 * width))):
            spec[f"{shared}{proj}.weight"] = WeightSlot(
                dst + "shared_experts.gate_up_proj.weight", (whole, h), fused, shard=rows
            )
        spec[f"{shared}down_proj.weight"] = WeightSlot(
            dst + "shared_experts.down_proj.weight", (h, whole), shard=cols
        )
    return spec
