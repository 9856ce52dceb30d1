"""Sequence parallelism for MoE models under tensor parallelism, on megatron's local layer spec.

Megatron's MoE layer refuses to train split over tensor-parallel ranks without sequence
parallelism, and the local (non-Transformer-Engine) spec builds its norms with WrappedTorchNorm,
which refuses `sequence_parallel`. With sequence parallelism each TP rank normalises, routes and
adds residuals for its own 1/tp of the sequence ([s/tp, b, h]); the column-parallel linears
gather the sequence, the row-parallel ones reduce-scatter it back. A norm's weight then gets only
its rank's tokens' gradient: SequenceParallelRMSNorm marks it `sequence_parallel`, as apex's
FusedLayerNorm does, so that `allreduce_norm_grads` (megatron's own TP all-reduce of
finalize_model_grads) sums it over the TP group. Dense models keep plain TP (no change in
results, and their existing layouts stay as they were).
"""

from __future__ import annotations

from typing import Any

import torch

from spec_engine.models.hf_config import ModelConfig
from trainer_bridge.spec_rewrite import swap_in_spec


def uses_sequence_parallel(arch: ModelConfig, tp: int) -> bool:
    """Whether `arch` at tensor-parallel size `tp` runs sequence parallel: MoE models at tp > 1
    (megatron requires it to train them), and MLA models (their replicated key/value down
    projection needs it: see replicated_kv_down_proj)."""
    return (arch.moe is not None or arch.mla is not None) and tp > 1


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built from megatron's norm arguments (WrappedTorchNorm's signature) that
    also runs under sequence parallelism: its weight carries `sequence_parallel` (the config's),
    the attribute megatron reads to all-reduce a replicated parameter's gradient over TP."""

    def __init__(
        self,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> None:
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(
                f"SequenceParallelRMSNorm is a plain RMSNorm; the config asks for "
                f"normalization={config.normalization!r}, zero_centered_gamma="
                f"{config.layernorm_zero_centered_gamma}: build it with megatron's own norm"
            )
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def sequence_parallel_spec(spec: Any) -> Any:
    """A copy of a layer/block/MTP spec for sequence parallelism: its WrappedTorchNorm norms
    (megatron's local norm, wherever it appears: layer, q/k/kv, final and MTP norms) become
    SequenceParallelRMSNorm."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return swap_in_spec(
        spec, lambda _, value: SequenceParallelRMSNorm if value is WrappedTorchNorm else value
    )


def replicated_kv_down_proj(spec: Any) -> Any:
    """A copy of a layer/block/MTP spec whose MLA key/value down projection is megatron's
    replicated Linear, as Transformer Engine's MLA spec has it ("duplicated"), at every TP size.
    Column-parallel under sequence parallelism, that projection would hand each rank the shared
    rope key gathered whole, yet each rank's heads give only their part of its gradient, which
    megatron's gather does not sum (a wrong gradient); replicated, the rope key is gathered from
    the sequence-parallel region, whose backward sums it over the TP ranks, and the weight (marked
    `sequence_parallel`) is all-reduced as norms are. At TP 1 it computes the same as the
    column-parallel one, and one module at every TP size keeps one layout (it gets TE's
    `_extra_state`: model.checkpoint_names.te_extra_states)."""
    from megatron.core.post_training.modelopt.layers import Linear
    from megatron.core.tensor_parallel import ColumnParallelLinear

    def rule(field: str, value: Any) -> Any:
        return Linear if field == "linear_kv_down_proj" and value is ColumnParallelLinear else value

    return swap_in_spec(spec, rule)


def allreduce_norm_grads(ddp_model: Any) -> None:
    """Sum over the TP group the gradients megatron's finalize_model_grads sums there: the
    weights marked `sequence_parallel` (norms, MoE routers under sequence parallelism) and
    q/k layernorms (each TP rank holds different heads). The rest of finalize_model_grads is
    left out on purpose: it would move the routers' expert_bias at megatron's rate (the actor
    moves it at --moe-router-bias-update-rate: trainer_bridge.model.moe.update_expert_bias)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import (
        _allreduce_non_tensor_model_parallel_grads,
    )

    tp_group = parallel_state.get_tensor_model_parallel_group()
    _allreduce_non_tensor_model_parallel_grads([ddp_model], ddp_model.config, tp_group)


def local_tokens(model: Any, values: torch.Tensor) -> torch.Tensor:
    """Per-token `values` [b, s, ...] of a whole micro batch -> the [b, s/tp, ...] this TP rank's
    layers see under sequence parallelism (the embedding scatters the sequence in tp contiguous
    chunks); all of them without it."""
    if not model.config.sequence_parallel:
        return values
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return values.chunk(tp, dim=1)[rank]
