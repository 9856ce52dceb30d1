"""Causal core attention over packed sequences (THD) for megatron's local layer spec, and the
layer-spec swap that puts a THD-capable core attention in place when the trainer packs
(--qkv-format thd).

Megatron-core's local DotProductAttention asserts `packed_seq_params is None` ("use
TEDotProductAttention"). Where Transformer Engine is installed (a CUDA machine) and the model
runs in bfloat16/float16, the swap takes megatron's TEDotProductAttention, whose fused
variable-length kernels read `cu_seqlens` directly (unverified here: no machine with TE ran it);
otherwise (CPU, float32, a GPU without TE) it takes PackedDotProductAttention below: each
sequence of the pack attends causally to itself only, through torch's
scaled_dot_product_attention.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

from trainer_bridge.micro_batches.thd_ops import sequence_layout
from trainer_bridge.spec_rewrite import swap_in_spec


class PackedDotProductAttention(DotProductAttention):
    """megatron's local DotProductAttention that also takes THD input: query [t, heads, d],
    key/value [t, query groups, d], `cu_seqlens_q` splitting the t tokens into sequences.
    Without packed_seq_params it is megatron's own forward."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        # The features megatron's local path has and this one does not compute: refuse them at
        # build time rather than attend differently from the padded model.
        unsupported = [
            name
            for name, on in (
                ("a softmax offset (softmax_type != vanilla)", config.softmax_type != "vanilla"),
                ("sliding-window attention", config.window_size is not None),
                ("apply_query_key_layer_scaling", config.apply_query_key_layer_scaling),
                ("a mask type other than causal", self.attn_mask_type != AttnMaskType.causal),
            )
            if on
        ]
        if unsupported:
            raise ValueError(
                f"packed (THD) attention without Transformer Engine does not implement "
                f"{', '.join(unsupported)}; use --qkv-format bshd"
            )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        if packed_seq_params is None:
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, None
            )
        if attention_bias is not None or packed_seq_params.cu_seqlens_q_padded is not None:
            raise ValueError(
                "packed attention takes one segment per sequence (no cu_seqlens_q_padded) and no "
                "attention bias"
            )
        segment, offset = sequence_layout(packed_seq_params.cu_seqlens_q)
        batch = (packed_seq_params.cu_seqlens_q.numel() - 1, packed_seq_params.max_seqlen_q)
        # Each sequence right-padded into its own row: causal attention then reaches only that
        # sequence's earlier tokens (a pad key sits after every real query), so one batched call
        # does all sequences; pad rows are computed and dropped.
        q, k, v = (_rows(x, segment, offset, batch) for x in (query, key, value))
        dropout = self.attention_dropout.p if self.training else 0.0
        # megatron draws attention dropout from the tensor-parallel RNG state (sequence parallel
        # aside); so does this path, only when there is dropout to draw (swapping RNG states
        # costs more than a small layer's attention).
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        with rng:
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                dropout_p=dropout,
                is_causal=True,
                scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        # [sequences, heads, width, d] -> [t, heads * d], the tokens back in pack order.
        return out.transpose(1, 2)[segment, offset].reshape(query.shape[0], -1)


def _rows(x: Tensor, segment: Tensor, offset: Tensor, batch: tuple[int, int]) -> Tensor:
    """[t, heads, d] -> [sequences, heads, max_seqlen, d], zero past each sequence's end (on x's
    device; differentiable: index_put_ passes gradients back to x)."""
    rows = x.new_zeros(*batch, *x.shape[1:])
    rows[segment, offset] = x
    return rows.transpose(1, 2)


def packed_core_attention(config: Any) -> type:
    """The core attention of a packed model: Transformer Engine's where it is installed and the
    model runs in bfloat16 or float16 (its fused THD kernels on the GPU), else
    PackedDotProductAttention (CPU, or float32, which TE's fused kernels do not take)."""
    from megatron.core.extensions import transformer_engine

    if transformer_engine.HAVE_TE and (config.bf16 or config.fp16):
        return transformer_engine.TEDotProductAttention
    return PackedDotProductAttention


def with_packed_attention(spec: Any, config: Any) -> Any:
    """A copy of a layer spec (a ModuleSpec, or TransformerBlockSubmodules with one spec per
    layer) whose local core attentions (DotProductAttention, in dense, MoE and MLA layers alike)
    are packed_core_attention(config); every other submodule is kept."""
    core = packed_core_attention(config)

    def rule(field: str, value: Any) -> Any:
        return core if field == "core_attention" and value is DotProductAttention else value

    return swap_in_spec(spec, rule)
