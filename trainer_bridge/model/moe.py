"""Mixture-of-experts on the trainer side: megatron-core's MoE options for a GLM-4.5 style
checkpoint (spec_engine's MoEConfig), its balance loss (--moe-aux-loss-coeff) and expert-bias
update (--moe-router-bias-update-rate), and megatron's auxiliary-loss tracker read for logging.

The router megatron builds from these options is the checkpoint's: sigmoid scores, expert
selection on scores + `expert_bias` (Hugging Face's `e_score_correction_bias`), groups ranked by
the sum of their two best biased scores, the chosen experts' unbiased scores renormalised and
scaled by `routed_scaling_factor`; shared experts always run; the first
`first_k_dense_replace` layers keep a dense MLP. Only the allgather token dispatcher runs on CPU
(alltoall and flex need expert-parallel CUDA collectives). `expert_bias` is a buffer megatron
moves only in finalize_model_grads, which the TrainActor does not call: it stays the checkpoint's
unless --moe-router-bias-update-rate moves it (update_expert_bias); the engines route with it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from spec_engine.models.hf_config import ModelConfig

# The tracker name of megatron's seq_aux_loss (the only load-balancing type configured here).
BALANCE_LOSS = "seq_load_balancing_loss"


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
        # DeepSeek-V3's sequence-level balance loss, off by default as in slime's MoE recipes;
        # --moe-aux-loss-coeff turns it on (balance_config; logged by moe_aux_losses).
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.0,
        moe_router_bias_update_rate=0.0,  # --moe-router-bias-update-rate (update_expert_bias)
    )


def balance_config(args: Any, arch: ModelConfig) -> dict[str, Any]:
    """TransformerConfig overrides of --moe-aux-loss-coeff (megatron's sequence-level balance
    loss, DeepSeek-V3's, with this weight) and --moe-router-bias-update-rate (the expert bias's
    step, see update_expert_bias); {} when both are 0; refused for a dense model. `args`: the
    TrainerArgs or the launcher's namespace."""
    given = {
        "--moe-aux-loss-coeff": ("moe_aux_loss_coeff", args.moe_aux_loss_coeff),
        "--moe-router-bias-update-rate": (
            "moe_router_bias_update_rate",
            args.moe_router_bias_update_rate,
        ),
    }
    overrides = {field: value for field, value in given.values() if value}
    if overrides and arch.moe is None:
        flag = next(flag for flag, (_, value) in given.items() if value)
        raise ValueError(
            f"{flag} acts on MoE routers, and {args.hf_checkpoint} ({arch.architecture}) is a "
            "dense model with no router; drop the flag"
        )
    return overrides


def count_real_tokens_only() -> None:
    """Megatron-core 0.16.1's TopKRouter counts a step's routed tokens for the expert-bias update
    with `routing_map & ~padding_mask`, which fails to broadcast ([tokens, experts] against
    [tokens]) whenever a padding mask is given; this replaces that method with the same count,
    padding left out. Idempotent."""
    from megatron.core.transformer.moe.router import TopKRouter

    def apply_expert_bias(self: Any, routing_map: Tensor, padding_mask: Optional[Tensor] = None):
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask[:, None]
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = apply_expert_bias


def update_expert_bias(model: torch.nn.Module, rate: float) -> None:
    """After an optimizer step: DeepSeek-V3's auxiliary-loss-free balancing, as megatron's
    finalize_model_grads runs it (the TrainActor steps its optimizer without that function):
    each router's `expert_bias` moves by `rate` towards the mean load of the real tokens it
    routed since the last call (counts summed over tensor- and data-parallel ranks, so every
    rank moves the same way; expert parallelism changes nothing here: every rank's router counts
    its own tokens for all experts), then the counts restart. Nothing moves at rate 0."""
    from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    if rate and routers:
        counts = torch.stack([r.local_tokens_per_expert for r in routers])
        biases = torch.stack([r.expert_bias for r in routers])
        for router, bias in zip(routers, get_updated_expert_bias(counts, biases, rate)):
            router.expert_bias.copy_(bias)
    for router in routers:
        router.local_tokens_per_expert.zero_()


def scale_balance_loss(num_micro_batches: int, device: torch.device) -> None:
    """Make the balance loss's gradient that of its mean over the step's `num_micro_batches`, as
    megatron's schedule does (MoEAuxLossAutoScaler's scale 1 / num_micro_batches; DDP then
    averages over the data-parallel ranks), matching the value moe_aux_losses logs. Megatron's
    default scale 1 counts every micro batch's loss whole, so the gradient would depend on how a
    step's sequences split into micro batches and data-parallel ranks."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / num_micro_batches, device=device))


def num_moe_layers(arch: ModelConfig, with_mtp: bool) -> int:
    """MoE layers that run in a train step: the trunk's, plus the MTP layers (always MoE, as
    SGLang's next-n layers) when they train."""
    assert arch.moe is not None
    trunk = sum(arch.moe.is_moe_layer(i) for i in range(arch.num_hidden_layers))
    return trunk + (arch.num_mtp_layers if with_mtp else 0)


def track_aux_losses(arch: ModelConfig, device: torch.device) -> None:
    """Size megatron's aux-loss tracker for the trunk and MTP layers now: megatron sizes it from
    the config at its first entry, and the TrainActor's trunk forward hides the MTP layers from
    the config (mtp_num_layers None), so an MTP layer's entry would fall past the end. The
    tracker is process-wide: entries an earlier model left (another loss type) are dropped, so
    moe_aux_losses reports this model's loss alone."""
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    tracker = get_moe_layer_wise_logging_tracker()
    tracker.clear()
    tracker[BALANCE_LOSS] = {
        "values": torch.zeros(
            arch.num_hidden_layers + arch.num_mtp_layers, dtype=torch.float32, device=device
        ),
        "reduce_group": None,
        "avg_group": None,
        "reduce_group_has_dp": False,
    }


def moe_aux_losses(
    num_layers: int = 1, num_micro_batches: int = 1, clear: bool = True
) -> dict[str, float]:
    """Megatron's auxiliary losses since the last clear, as its track_moe_metrics reports them:
    each (divided by its coefficient) summed over layers, then divided by `num_layers` (the MoE
    layers that ran) and `num_micro_batches`, summed over the TP ranks that each computed a share
    of it; `{"moe_<name>": value}` (a train step's metric, logged as train/moe_<name>), empty when
    no aux loss is on. A collective over the TP group: every rank of it calls this."""
    from megatron.core.transformer.moe.moe_utils import (
        clear_aux_losses_tracker,
        get_moe_layer_wise_logging_tracker,
    )

    tracker = get_moe_layer_wise_logging_tracker()
    scale = num_layers * num_micro_batches
    losses = {}
    for name, entry in tracker.items():
        values = entry["values"]
        group = entry.get("reduce_group")
        if group is not None and group.size() > 1:
            # Under sequence parallelism each TP rank holds its tokens' share of the loss (megatron
            # sums it over this group, the TP group, in reduce_aux_losses_tracker_across_ranks).
            values = values.clone()
            torch.distributed.all_reduce(values, group=group)
        losses[f"moe_{name}"] = float(values.sum()) / scale
    if clear:
        clear_aux_losses_tracker()
    return losses
