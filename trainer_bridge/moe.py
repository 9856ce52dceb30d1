"""Mixture-of-experts on the trainer side: megatron-core's MoE options for a GLM-4.5 style
checkpoint (spec_engine's MoEConfig), and megatron's auxiliary-loss tracker read for logging.

The router megatron builds from these options is the checkpoint's: sigmoid scores, expert
selection on scores + `expert_bias` (Hugging Face's `e_score_correction_bias`), groups ranked by
the sum of their two best biased scores, the chosen experts' unbiased scores renormalised and
scaled by `routed_scaling_factor`; shared experts always run; the first
`first_k_dense_replace` layers keep a dense MLP. Only the allgather token dispatcher runs on CPU
(alltoall and flex need expert-parallel CUDA collectives). `expert_bias` is a buffer megatron
moves only in finalize_model_grads, which the TrainActor does not call: it stays the checkpoint's,
which the engine routes with.
"""

from __future__ import annotations

from typing import Any

from spec_engine.models.hf_config import ModelConfig


def check_moe(arch: ModelConfig) -> None:
    """Raise unless megatron's router reproduces the checkpoint's routing, naming the config key
    it cannot follow."""
    moe = arch.moe
    if moe is None:
        return
    if not moe.norm_topk_prob or moe.top_k < 2:
        # Megatron's sigmoid router always renormalises the top-k weights, and never a single one.
        raise ValueError(
            f"{arch.architecture} with norm_topk_prob={moe.norm_topk_prob} and "
            f"num_experts_per_tok={moe.top_k} is not supported for training: megatron's sigmoid "
            "router renormalises the chosen experts' weights (needs norm_topk_prob=true and "
            "num_experts_per_tok >= 2)"
        )
    if moe.topk_group < moe.n_group and moe.top_k // moe.topk_group != 2:
        # Megatron scores a group by its top (top_k // topk_group) experts, transformers by its 2.
        raise ValueError(
            f"num_experts_per_tok={moe.top_k} // topk_group={moe.topk_group} must be 2 for "
            "grouped routing: megatron ranks groups by their best top_k // topk_group experts, "
            "the checkpoint by its best 2"
        )


def moe_config_fields(arch: ModelConfig) -> dict[str, Any]:
    """TransformerConfig fields of `arch`'s MoE layers ({} for a dense model)."""
    moe = arch.moe
    if moe is None:
        return {}
    grouped = moe.topk_group < moe.n_group  # selecting every group is plain top-k
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.intermediate_size,
        moe_router_topk=moe.top_k,
        moe_router_num_groups=moe.n_group if grouped else None,
        moe_router_group_topk=moe.topk_group if grouped else None,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=moe.routed_scaling_factor,
        moe_router_dtype="fp32",  # transformers routes in float32 whatever the model dtype
        moe_shared_expert_intermediate_size=moe.num_shared_experts * moe.intermediate_size or None,
        moe_layer_freq=[int(moe.is_moe_layer(i)) for i in range(arch.num_hidden_layers)],
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        # DeepSeek-V3's sequence-level balance loss, off by default as in its RL recipes;
        # `moe_aux_loss_coeff=...` in the model overrides turns it on (see moe_aux_losses).
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.0,
    )


def moe_aux_losses(clear: bool = True) -> dict[str, float]:
    """Megatron's auxiliary losses since the last clear (its layer-wise tracker, summed over
    layers), as `{"train/moe_<name>": value}`; empty when no aux loss is on."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    losses = {f"train/moe_{name}": float(entry["values"].sum()) for name, entry in tracker.items()}
    if clear:
        clear_aux_losses_tracker()
    return losses
